"""Hopper warpgroup MMA (wgmma.mma_async): the primitives as the emulator runs them, checked
independently of any GEMM template, then the GEMM family built on them (gemm_wgmma.cu.j2).

Primitives: the host lays A and B out in shared memory by the PTX ISA's canonical layouts
(K-major and M/N-major; 128B, 64B and 32B swizzles and the unswizzled interleave), a kernel
copies the bytes in unchanged, describes them with matrix descriptors and multiplies; the
result is compared with NumPy. The same kernels compile with NVRTC for sm_90a.

The primitive and GEMM kernels run on the emulator, and with an sm_90 GPU (pytest -m gpu) on it
too against the same NumPy products: the hardware check of the emulator's layouts and of the
inline PTX. The graph tests run on an sm_90 GPU, or without a GPU on the emulator.

Values are small integers, so every sum is exact in fp32 and only a layout mistake (a wrong
swizzle, offset or fragment position) changes a result.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen import aot
from flowgen.runtime import cuda_driver, nvrtc
from first_contact_cases import U_BF16, GemmCase, make_launch
from graphs import InferGraph, TrainGraph
from test_tensor_cores import CUOBJDUMP, NVDISASM, assert_no_spills, build_with_ptxas_report, disassemble

K = 64            # four k16 slices per test (tf32: four k8 of K / 2), each read through its own descriptor
A_BYTES, B_BYTES = 8192, 32768

WGMMA_KERNELS = r"""
// One warpgroup computes D (64 x N) = A (64 x K) * B (K x N) + (scale_d ? C : 0) with four
// wgmma.mma_async, one per k slice (K = 64 for 16-bit operands, 32 for tf32). The host lays the
// operands out: `a_bytes` / `b_bytes` are copied unchanged to a 1024-byte aligned shared-window
// address (A there, B 8192 bytes later). cfg: a_leading, a_stride, a_swizzle, b_leading,
// b_stride, b_swizzle, scale_d, then the byte offset of each k slice of A (4), of B (4).
// `d` receives the accumulators after the wait. On the emulator only, `before` receives them
// after the commit and before the wait: the emulator's MMAs complete at the wait, so they still
// hold C there. On a GPU that read is undefined (the registers are being written asynchronously),
// so the GPU build leaves it out.
template <int N, int TransA, int TransB, class MMA>
__device__ void wgmma_tile(MMA mma, const unsigned char* a_bytes, const unsigned char* b_bytes, const int* cfg,
                           const float* c, float* before, float* d) {
  FLOWGEN_DYN_SHARED(unsigned char, smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < 8192; i += 128) smem[i] = a_bytes[i];
  for (int i = tid; i < 32768; i += 128) smem[8192 + i] = b_bytes[i];
  fence_proxy_async_shared();
  __syncthreads();
  float acc[N / 2];
  for (int r = 0; r < N / 2; ++r) {   // accumulator register r <-> D(row, col), PTX ISA m64nNk16
    const int row = 16 * warp + lane / 4 + 8 * (r / 2 % 2), col = 8 * (r / 4) + 2 * (lane % 4) + r % 2;
    acc[r] = c[row * N + col];
  }
  wgmma_fence();
  for (int s = 0; s < 4; ++s) {
    const unsigned long long a_desc = wgmma_descriptor(smem + cfg[7 + s], cfg[0], cfg[1], cfg[2]);
    const unsigned long long b_desc = wgmma_descriptor(smem + 8192 + cfg[11 + s], cfg[3], cfg[4], cfg[5]);
    mma(acc, a_desc, b_desc, s > 0 || cfg[6]);
  }
  wgmma_commit_group();
#if defined(FLOWGEN_EMULATOR)
  for (int r = 0; r < N / 2; ++r) before[tid * (N / 2) + r] = acc[r];
#endif
  wgmma_wait_group<0>();
  for (int r = 0; r < N / 2; ++r) {
    const int row = 16 * warp + lane / 4 + 8 * (r / 2 % 2), col = 8 * (r / 4) + 2 * (lane % 4) + r % 2;
    d[row * N + col] = acc[r];
  }
}

#define WGMMA_TEST_KERNEL(kname, fname, N, TA, TB)                                                          \
  extern "C" __global__ void kname(const unsigned char* a, const unsigned char* b, const int* cfg,           \
                                   const float* c, float* before, float* d) {                                \
    wgmma_tile<N, TA, TB>([](float (&acc)[N / 2], unsigned long long ad, unsigned long long bd, int scale) { \
      fname<TA, TB>(acc, ad, bd, scale);                                                                     \
    }, a, b, cfg, c, before, d);                                                                             \
  }                                                                                                          \
  FLOWGEN_EMU_KERNEL(kname, true)
WGMMA_TEST_KERNEL(wgmma_bf16_n128_kk, wgmma_m64n128k16_bf16, 128, 0, 0)
WGMMA_TEST_KERNEL(wgmma_bf16_n128_mm, wgmma_m64n128k16_bf16, 128, 1, 1)
WGMMA_TEST_KERNEL(wgmma_f16_n64_km, wgmma_m64n64k16_f16, 64, 0, 1)
WGMMA_TEST_KERNEL(wgmma_bf16_n64_mk, wgmma_m64n64k16_bf16, 64, 1, 0)
WGMMA_TEST_KERNEL(wgmma_f16_n256_km, wgmma_m64n256k16_f16, 256, 0, 1)
WGMMA_TEST_KERNEL(wgmma_bf16_n256_kk, wgmma_m64n256k16_bf16, 256, 0, 0)
WGMMA_TEST_KERNEL(wgmma_tf32_n64_kk, wgmma_m64n64k8_tf32, 64, 0, 0)
WGMMA_TEST_KERNEL(wgmma_tf32_n128_kk, wgmma_m64n128k8_tf32, 128, 0, 0)
WGMMA_TEST_KERNEL(wgmma_tf32_n256_kk, wgmma_m64n256k8_tf32, 256, 0, 0)
"""

SWIZZLE_MODE = {"interleave": 0, "128B": 1, "64B": 2, "32B": 3}
CHUNKS = {"interleave": 1, "128B": 8, "64B": 4, "32B": 2}   # 16-byte chunks per swizzled row


def swizzle(offset: int, chunks: int) -> int:
    """The swizzle of a byte address (Swizzle<log2 W, 4, 3>): bits [4, 4 + log2 W) ^= bits [7, 7 + log2 W)."""
    return offset ^ ((offset >> 7) & (chunks - 1)) << 4


def lay_out(tile: np.ndarray, mn_major: bool, mode: str, size: int):
    """Bytes of `tile` (MN x K, 16-bit, or 32-bit tf32: K-major only) in the canonical layout, its
    (leading, stride) byte offsets and the byte offset of each k slice (32 bytes of k: k16, or k8
    for tf32), written from the PTX ISA's layout figures:
    * K-major, swizzled: rows of W 16-byte chunks (16W / e elements of k, e bytes each) per atom;
      8 rows make a pattern (stride offset = 8 x row bytes); atoms along k are separate regions.
    * K-major, interleave: core matrices of 8 rows of 16 bytes; leading offset steps k.
    * MN-major, swizzled: rows of 8W elements of mn per k; blocks of 8W along mn are the leading
      offset apart, groups of 8 k rows the stride offset apart.
    * MN-major, interleave: core matrices of 8 k rows of 8 mn elements; leading offset steps k,
      stride offset steps mn.
    """
    MN, KK = tile.shape
    W = CHUNKS[mode]
    e = tile.itemsize
    assert e == 2 or not mn_major, "tf32 tiles are K-major"
    bits = tile.view(np.uint16 if e == 2 else np.uint32)
    out = np.zeros(size // e, bits.dtype)
    row, T, kslice = W * 16, 16 // e, 32 // e      # row bytes, elements per 16 bytes, k per slice
    if not mn_major and mode != "interleave":
        atom_k = W * T
        leading, stride = 16, 8 * row           # leading: unused by swizzled K-major layouts
        where = lambda mn, k: (k // atom_k) * MN * row + mn * row + (k % atom_k) * e
        slices = [where(0, kslice * s) for s in range(KK // kslice)]
    elif not mn_major:
        leading, stride = 128, (KK // T) * 128
        where = lambda mn, k: (mn // 8) * stride + (k // T) * leading + (mn % 8) * 16 + (k % T) * e
        slices = [2 * s * leading for s in range(KK // kslice)]
    elif mode != "interleave":
        leading, stride = KK * row, 8 * row
        where = lambda mn, k: (mn // (8 * W)) * leading + k * row + (mn % (8 * W)) * 2
        slices = [2 * s * stride for s in range(KK // 16)]
    else:
        leading, stride = 128, (KK // 8) * 128
        where = lambda mn, k: (mn // 8) * stride + (k // 8) * leading + (k % 8) * 16 + (mn % 8) * 2
        slices = [2 * s * leading for s in range(KK // 16)]
    for mn in range(MN):
        for k in range(KK):
            offset = where(mn, k)
            out[(swizzle(offset, W) if mode != "interleave" else offset) // e] = bits[mn, k]
    return out.view(np.uint8), leading, stride, slices


def test_128B_swizzle_moves_chunk_c_of_row_r_to_chunk_c_xor_r():
    """The picture in the PTX ISA: an 8 x 64 K-major 16-bit atom, 16-byte chunk c of row r at c ^ r."""
    tile = np.arange(8 * 64, dtype=np.uint16).reshape(8, 64).view(ml_dtypes.bfloat16)
    data = lay_out(tile, False, "128B", 1024)[0].view(np.uint16).reshape(8, 8, 8)  # row, chunk, element
    for r in range(8):
        for c in range(8):
            np.testing.assert_array_equal(data[r, c ^ r], np.arange(8) + 64 * r + 8 * c)


@pytest.fixture(scope="module")
def wgmma_launch(sm90_kernel_target):
    return make_launch(WGMMA_KERNELS, "test_wgmma", sm90_kernel_target)


# (kernel, element type, N, A M-major?, B N-major?, A layout, B layout, scale_d)
CASES = [
    ("wgmma_bf16_n128_kk", ml_dtypes.bfloat16, 128, False, False, "128B", "128B", 1),
    ("wgmma_bf16_n128_kk", ml_dtypes.bfloat16, 128, False, False, "128B", "128B", 0),
    ("wgmma_bf16_n128_mm", ml_dtypes.bfloat16, 128, True, True, "128B", "128B", 1),
    ("wgmma_f16_n64_km", np.float16, 64, False, True, "64B", "32B", 1),
    ("wgmma_bf16_n64_mk", ml_dtypes.bfloat16, 64, True, False, "interleave", "interleave", 1),
    ("wgmma_bf16_n64_mk", ml_dtypes.bfloat16, 64, True, False, "32B", "64B", 1),
    ("wgmma_f16_n256_km", np.float16, 256, False, True, "128B", "128B", 1),
    ("wgmma_bf16_n256_kk", ml_dtypes.bfloat16, 256, False, False, "128B", "interleave", 0),
    ("wgmma_tf32_n128_kk", np.float32, 128, False, False, "128B", "128B", 1),
    ("wgmma_tf32_n64_kk", np.float32, 64, False, False, "32B", "interleave", 1),
    ("wgmma_tf32_n256_kk", np.float32, 256, False, False, "64B", "128B", 0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}_{c[5]}_{c[6]}_scale{c[7]}")
def test_wgmma_reads_canonical_layouts_through_descriptors(wgmma_launch, case):
    kernel, np_dtype, N, a_mn, b_mn, a_mode, b_mode, scale_d = case
    rng = np.random.default_rng(N + 3 * a_mn + b_mn)
    kk = K if np.dtype(np_dtype).itemsize == 2 else K // 2      # four k slices of 32 bytes
    a = rng.integers(-4, 5, size=(64, kk)).astype(np_dtype)
    b = rng.integers(-4, 5, size=(kk, N)).astype(np_dtype)
    c = rng.integers(-50, 50, size=(64, N)).astype(np.float32)
    a_bytes, a_lead, a_stride, a_slices = lay_out(a, a_mn, a_mode, A_BYTES)
    b_bytes, b_lead, b_stride, b_slices = lay_out(np.ascontiguousarray(b.T), b_mn, b_mode, B_BYTES)
    cfg = np.array([a_lead, a_stride, SWIZZLE_MODE[a_mode], b_lead, b_stride, SWIZZLE_MODE[b_mode], scale_d,
                    *a_slices, *b_slices], np.int32)
    before = np.zeros((128, N // 2), np.float32)
    d = np.zeros((64, N), np.float32)
    wgmma_launch(kernel, (1, 1, 1), (128, 1, 1), 1024 + A_BYTES + B_BYTES, [a_bytes, b_bytes, cfg, c, before, d])
    want = a.astype(np.float32) @ b.astype(np.float32) + (c if scale_d else 0)
    np.testing.assert_array_equal(d, want)
    if wgmma_launch.target == "emulator":
        # Asynchronous: until wgmma.wait_group the registers still hold C (a kernel that skips the
        # wait reads stale accumulators here, as it may on the GPU).
        assert sorted(before.ravel()) == sorted(c.ravel())


def test_wgmma_primitives_compile_with_nvrtc_for_sm_90a():
    cubin = nvrtc.compile_cuda(WGMMA_KERNELS, arch="sm_90a", tag="test_wgmma")
    assert cubin[:4] == b"\x7fELF"


# ---------------------------------------------------------------------------------------
# The GEMM family on warpgroup MMA (templates/gemm_wgmma.cu.j2), rendered for sm_90 the way the
# fused GEMM path calls it and run on the emulator: operands possibly transposed (read in place),
# an fp32 output written by the epilogue lines. The cases are rendered with a target of one
# block so that the tile choice follows the padded work alone and every tile shape is covered.

def wgmma_gemm(kind, M, N, K, a_trans=False, b_trans=False, a_batch=(), b_batch=(), tile=None) -> GemmCase:
    """A GEMM case rendered for sm_90 with a target of one block (the tile follows the work alone)."""
    return GemmCase(kind, M, N, K, a_trans, b_trans, a_batch, b_batch, arch="sm_90", blocks=1, prefix="wg", tile=tile)


# Every tile (2 warpgroups or 1, m64n256, m64n128 or m64n64), both majors of both operands, tails in every
# dim and k tails inside a k tile, each copy width (16-byte .cg, 8- and 4-byte .ca, plain loads
# for rows of odd length), more k tiles than stages (stages refilled while MMAs are in flight),
# a broadcast batch.
GEMM_CASES = [
    wgmma_gemm("bf16", 250, 250, 100, tile="128x256"), wgmma_gemm("f16", 250, 120, 100, True, True, tile="128x128"),
    wgmma_gemm("f16", 128, 64, 520, True, False, tile="128x64"),
    wgmma_gemm("bf16", 64, 128, 192, False, True, tile="64x128"),
    wgmma_gemm("bf16", 37, 45, 390, tile="64x64"), wgmma_gemm("bf16", 37, 45, 70, False, True, tile="64x64"),
    wgmma_gemm("bf16", 20, 24, 40, False, True, a_batch=(3, 1), b_batch=(2,), tile="64x64"),
]


@pytest.fixture(scope="module")
def gemm_launch(sm90_kernel_target):
    return make_launch("\n".join(c.kernel.source for c in GEMM_CASES), "test_wgmma_gemm", sm90_kernel_target)


def test_gemm_cases_cover_every_wgmma_tile():
    for case in GEMM_CASES:
        assert f"tensor-core GEMM {case.tile}, {case.kind} wgmma" in case.kernel.comment, case.kernel.comment
        assert "wgmma_m64n" in case.kernel.source and "mma_m16n8k16" not in case.kernel.source
    copies = {c.id: re.findall(r"cp_async_cg|cp_async_ca<\d+>|rows of odd length", c.kernel.source) for c in GEMM_CASES}
    assert {name for found in copies.values() for name in found} == {
        "cp_async_cg", "cp_async_ca<8>", "cp_async_ca<4>", "rows of odd length"}


@pytest.mark.parametrize("case", GEMM_CASES, ids=[c.id for c in GEMM_CASES])
def test_wgmma_gemm_is_exact_on_integers(case, gemm_launch):
    a, b = case.operands(lambda shape: np.random.default_rng(case.M * case.K).integers(-4, 5, size=shape))
    np.testing.assert_array_equal(case.run(gemm_launch, a, b), a.astype(np.float32) @ b.astype(np.float32))


@pytest.mark.parametrize("case", GEMM_CASES[:4], ids=[c.id for c in GEMM_CASES[:4]])
def test_wgmma_gemm_matches_the_reference_in_its_precision(case, gemm_launch):
    """Random values: inputs rounded to bf16/fp16, products summed in fp32 (the bound is fp32
    summation error over K terms; rounding the accumulator to 16 bits would miss it by far)."""
    rng = np.random.default_rng(case.N)
    a, b = case.operands(lambda shape: rng.standard_normal(shape))
    want = a.astype(np.float64) @ b.astype(np.float64)
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    np.testing.assert_array_less(np.abs(case.run(gemm_launch, a, b) - want), case.K * 2.0 ** -23 * magnitude + 1e-30)


# ---------------------------------------------------------------------------------------
# Through the public API: a 'cuda' graph rendered for sm_90 (the `sm90_graph_target` fixture). Without a
# GPU it runs on the emulator (FLOWGEN_EMULATE_CUDA=1, FLOWGEN_EMULATE_CUDA_ARCH=sm_90); on an sm_90
# GPU, on the GPU.

def amp_training_run(make_model, steps=3):
    """(losses, parameters) of `steps` SGD steps of a bf16-AMP graph on 'cuda', and the graph."""
    flow.manual_seed(0)
    model = make_model().to("cuda")
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.05))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    x, y = flow.randn(50, 72).to("cuda"), flow.randn(50, 40).to("cuda")
    losses = [float(graph(x, y)) for _ in range(steps)]
    return losses, [p.numpy() for p in model.parameters()], graph


def mlp():
    return nn.Sequential(nn.Linear(72, 136), nn.ReLU(), nn.Linear(136, 40))


def test_bf16_amp_linear_training_runs_on_warpgroup_mma(sm90_graph_target, monkeypatch):
    losses, params, graph = amp_training_run(mlp)
    gemms = [k for k in graph.compiled.program.kernels if "tensor-core GEMM" in k.comment]
    # Forward and both gradients of the second layer, forward and weight gradient of the first
    # (its input gradient is not needed); the first layer's bias and ReLU run in its epilogue.
    assert len(gemms) == 5 and all("bf16 wgmma" in k.comment for k in gemms)
    assert any({"add", "relu"} <= set(k.ops) for k in gemms)

    flow.manual_seed(0)
    reference = mlp()
    eager_opt = flow.optim.SGD(reference.parameters(), lr=0.05)
    x, y = flow.randn(50, 72), flow.randn(50, 40)
    for loss in losses:   # fp32 eager: two bf16 GEMMs in a row through a squared error
        eager_opt.zero_grad()
        eager_loss = nn.MSELoss()(reference(x), y)
        eager_loss.backward()
        eager_opt.step()
        assert abs(loss - float(eager_loss)) <= 12 * U_BF16 * abs(float(eager_loss))
    for p, q in zip(params, reference.parameters()):
        assert p.dtype == np.float32     # master weights stay float32
        np.testing.assert_allclose(p, q.numpy(), rtol=0, atol=3 * 0.05 * 12 * U_BF16)
    if sm90_graph_target == "emulator":
        # The emulator adds each output's products in increasing k on both paths: the sm_80
        # (mma.sync) program gives the same bits. (The PTX ISA leaves the hardware's accumulation
        # order open: on a GPU the two agree within the tolerance above, each with eager.)
        monkeypatch.delenv("FLOWGEN_EMULATE_CUDA_ARCH")
        sm80_losses, sm80_params, sm80_graph = amp_training_run(mlp)
        assert all("bf16 mma.sync" in k.comment for k in sm80_graph.compiled.program.kernels
                   if "tensor-core GEMM" in k.comment)
        assert sm80_losses == losses
        for p, q in zip(params, sm80_params):
            np.testing.assert_array_equal(p, q)


# ---------------------------------------------------------------------------------------
# Machine code for sm_90a: warpgroup MMA, asynchronous copies, no spills; full-size tiles
# (M, N, K = 4096, both majors of each operand) beside the test cases.

SASS_CASES = GEMM_CASES + [wgmma_gemm("bf16", 4096, 4096, 4096, False, True, tile="128x256"),
                           wgmma_gemm("f16", 4096, 4096, 4096, True, False, tile="128x256")]


@pytest.fixture(scope="module")
def sm_90a_build():
    return build_with_ptxas_report("\n".join(c.kernel.source for c in SASS_CASES), "sm_90a")


def test_graph_kernels_with_wgmma_compile_for_sm_90a_and_ptxas_reports_no_spills(sm_90a_build):
    assert_no_spills(sm_90a_build[1], {c.kernel.name for c in SASS_CASES})
    # ptxas's advisory when it cannot overlap the MMAs (e.g. "wgmma.mma_async instructions are
    # serialized due to insufficient register resources for the wgmma pipeline")
    assert "Potential Performance Loss" not in sm_90a_build[1]


@pytest.mark.skipif(CUOBJDUMP is None or NVDISASM is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_sm_90a_sass_has_warpgroup_mma_and_async_copies_and_no_local_memory(sm_90a_build, tmp_path):
    sass, usage = disassemble(sm_90a_build[0], tmp_path)
    for case in SASS_CASES:
        name, code = case.kernel.name, sass[case.kernel.name]
        width = case.tile.split("x")[1]
        assert f"HGMMA.64x{width}x16.F32{'.BF16' if case.kind == 'bf16' else ' '}" in code, name
        assert "WARPGROUP.ARRIVE" in code and "WARPGROUP.DEPBAR" in code, name     # wgmma fence / wait_group
        assert "HMMA" not in code, name
        if re.search(r"cp_async_c[ag]\b", case.kernel.source):
            assert "LDGSTS" in code and "DEPBAR" in code, name             # cp.async and wait_group
        assert "LDL" not in code and "STL" not in code, name               # no local memory (spills)
        assert re.search(r"\bSTACK:0 .*\bLOCAL:0\b", usage[name]), (name, usage[name])


def test_a_program_rendered_for_sm_90_compiles_as_the_executor_compiles_it(sm90_graph_target):
    """The whole training step's kernels.cu through nvrtc.compile_kernels for the GPU's "sm_90":
    sources calling wgmma get sm_90a, others keep sm_90."""
    source = amp_training_run(mlp, steps=1)[2].compiled.program.source
    assert nvrtc._arch_number_for(source, "sm_90") == "90a"
    assert nvrtc._arch_number_for(source.replace("wgmma_m64n", "gemm_m64n"), "sm_90") == "90"
    assert nvrtc._arch_number_for(source, "sm_80") == "80"
    build = nvrtc.compile_kernels(source, "sm_90")
    assert all(path.read_bytes()[:4] == b"\x7fELF" for path in build.artifacts)


def test_a_malformed_emulated_arch_is_refused_naming_the_variable(monkeypatch):
    if cuda_driver.available():
        pytest.skip("a GPU is present: its own architecture is used")
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA_ARCH", "hopper")
    with pytest.raises(ValueError, match="FLOWGEN_EMULATE_CUDA_ARCH='hopper'"):
        amp_training_run(mlp, steps=1)


# ---------------------------------------------------------------------------------------
# The standalone program (`flowgen build --target cuda --arch ...`): rendered for the GPU it names.

@pytest.fixture(scope="module")
def saved_amp_graph(tmp_path_factory):
    """A bf16-AMP conv + linear inference graph, saved."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 40))
    graph = InferGraph(model)
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    graph(flow.randn(16, 3, 6, 6))
    path = tmp_path_factory.mktemp("amp") / "saved"
    flow.save(graph, path)
    return path


def test_saved_graph_renders_warpgroup_mma_only_for_sm_90(saved_amp_graph):
    saved = flow.load(saved_amp_graph)
    for arch in ("sm_90", "sm_90a", "sm_80", "sm_89", "sm_100", None):
        source = saved.program("cuda", arch=arch).source
        hopper = arch in ("sm_90", "sm_90a")
        assert ("wgmma_m64n" in source) == hopper and ("mma_m16n8k16_bf16(" in source) != hopper, arch
        if arch:
            assert nvrtc.cubin_arch(source, arch) == ("sm_90a" if hopper else arch)


@pytest.mark.slow
def test_standalone_cuda_build_for_sm_90_embeds_an_sm_90a_cubin(saved_amp_graph, tmp_path):
    result = aot.build(saved_amp_graph, tmp_path / "out", target="cuda", arch="sm_90")
    assert result.manifest["arch"] == "sm_90"
    program = (tmp_path / "out" / "program.cu").read_text()
    assert "wgmma_m64n" in program and "--gpu-architecture=sm_90a" in program
    assert "compiled for sm_90a" in (tmp_path / "out" / "program_cubin.inc").read_text()
