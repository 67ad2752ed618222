"""Hopper warpgroup MMA (wgmma.mma_async) as the emulator runs it, checked independently of any
GEMM template: the host lays A and B out in shared memory by the PTX ISA's canonical layouts
(K-major and M/N-major; 128B, 64B and 32B swizzles and the unswizzled interleave), a kernel
copies the bytes in unchanged, describes them with matrix descriptors and multiplies; the
result is compared with NumPy. The same kernels compile with NVRTC for sm_90a.

Values are small integers, so every sum is exact in fp32 and only a layout mistake (a wrong
swizzle, offset or fragment position) changes a result.
"""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from flowgen.runtime import nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library

K = 64            # four k16 slices per test: each wgmma reads its slice through its own descriptor
A_BYTES, B_BYTES = 8192, 16384

WGMMA_KERNELS = r"""
// One warpgroup computes D (64 x N) = A (64 x 64) * B (64 x N) + (scale_d ? C : 0) with four
// wgmma.mma_async, one per k16 slice. The host lays the operands out: `a_bytes` / `b_bytes` are
// copied unchanged to a 1024-byte aligned shared-window address (A there, B 8192 bytes later).
// cfg: a_leading, a_stride, a_swizzle, b_leading, b_stride, b_swizzle, scale_d, then the byte
// offset of each k16 slice of A (4), of B (4). `before` receives the accumulators after the
// commit and before the wait; `d` after the wait.
template <int N, int TransA, int TransB, class MMA>
__device__ void wgmma_tile(MMA mma, const unsigned char* a_bytes, const unsigned char* b_bytes, const int* cfg,
                           const float* c, float* before, float* d) {
  FLOWGEN_DYN_SHARED(unsigned char, smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < 8192; i += 128) smem[i] = a_bytes[i];
  for (int i = tid; i < 16384; i += 128) smem[8192 + i] = b_bytes[i];
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
  for (int r = 0; r < N / 2; ++r) before[tid * (N / 2) + r] = acc[r];
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
"""

SWIZZLE_MODE = {"interleave": 0, "128B": 1, "64B": 2, "32B": 3}
CHUNKS = {"interleave": 1, "128B": 8, "64B": 4, "32B": 2}   # 16-byte chunks per swizzled row


def swizzle(offset: int, chunks: int) -> int:
    """The swizzle of a byte address (Swizzle<log2 W, 4, 3>): bits [4, 4 + log2 W) ^= bits [7, 7 + log2 W)."""
    return offset ^ ((offset >> 7) & (chunks - 1)) << 4


def lay_out(tile: np.ndarray, mn_major: bool, mode: str, size: int):
    """Bytes of `tile` (MN x K, 16-bit) in the canonical layout, its (leading, stride) byte offsets
    and the byte offset of each k16 slice, written from the PTX ISA's layout figures:
    * K-major, swizzled: rows of W 16-byte chunks (8W elements of k) per atom; 8 rows make a
      pattern (stride offset = 8 x row bytes); atoms along k are separate regions.
    * K-major, interleave: 8 x 8 core matrices of 8 rows of 16 bytes; leading offset steps k.
    * MN-major, swizzled: rows of 8W elements of mn per k; blocks of 8W along mn are the leading
      offset apart, groups of 8 k rows the stride offset apart.
    * MN-major, interleave: core matrices of 8 k rows of 8 mn elements; leading offset steps k,
      stride offset steps mn.
    """
    MN, KK = tile.shape
    W = CHUNKS[mode]
    bits = tile.view(np.uint16)
    out = np.zeros(size // 2, np.uint16)
    row = W * 16
    if not mn_major and mode != "interleave":
        atom_k = 8 * W
        leading, stride = 16, 8 * row           # leading: unused by swizzled K-major layouts
        where = lambda mn, k: (k // atom_k) * MN * row + mn * row + (k % atom_k) * 2
        slices = [where(0, 16 * s) for s in range(KK // 16)]
    elif not mn_major:
        leading, stride = 128, (KK // 8) * 128
        where = lambda mn, k: (mn // 8) * stride + (k // 8) * leading + (mn % 8) * 16 + (k % 8) * 2
        slices = [2 * s * leading for s in range(KK // 16)]
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
            out[(swizzle(offset, W) if mode != "interleave" else offset) // 2] = bits[mn, k]
    return out.view(np.uint8), leading, stride, slices


def test_128B_swizzle_moves_chunk_c_of_row_r_to_chunk_c_xor_r():
    """The picture in the PTX ISA: an 8 x 64 K-major 16-bit atom, 16-byte chunk c of row r at c ^ r."""
    tile = np.arange(8 * 64, dtype=np.uint16).reshape(8, 64).view(ml_dtypes.bfloat16)
    data = lay_out(tile, False, "128B", 1024)[0].view(np.uint16).reshape(8, 8, 8)  # row, chunk, element
    for r in range(8):
        for c in range(8):
            np.testing.assert_array_equal(data[r, c ^ r], np.arange(8) + 64 * r + 8 * c)


@pytest.fixture(scope="module")
def wgmma_module():
    return CpuModule(build_cpu_library(WGMMA_KERNELS, "test_wgmma"))


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


# (kernel, element type, N, A M-major?, B N-major?, A layout, B layout, scale_d)
CASES = [
    ("wgmma_bf16_n128_kk", ml_dtypes.bfloat16, 128, False, False, "128B", "128B", 1),
    ("wgmma_bf16_n128_kk", ml_dtypes.bfloat16, 128, False, False, "128B", "128B", 0),
    ("wgmma_bf16_n128_mm", ml_dtypes.bfloat16, 128, True, True, "128B", "128B", 1),
    ("wgmma_f16_n64_km", np.float16, 64, False, True, "64B", "32B", 1),
    ("wgmma_bf16_n64_mk", ml_dtypes.bfloat16, 64, True, False, "interleave", "interleave", 1),
    ("wgmma_bf16_n64_mk", ml_dtypes.bfloat16, 64, True, False, "32B", "64B", 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}_{c[5]}_{c[6]}_scale{c[7]}")
def test_wgmma_reads_canonical_layouts_through_descriptors(wgmma_module, case):
    kernel, np_dtype, N, a_mn, b_mn, a_mode, b_mode, scale_d = case
    rng = np.random.default_rng(N + 3 * a_mn + b_mn)
    a = rng.integers(-4, 5, size=(64, K)).astype(np_dtype)
    b = rng.integers(-4, 5, size=(K, N)).astype(np_dtype)
    c = rng.integers(-50, 50, size=(64, N)).astype(np.float32)
    a_bytes, a_lead, a_stride, a_slices = lay_out(a, a_mn, a_mode, A_BYTES)
    b_bytes, b_lead, b_stride, b_slices = lay_out(np.ascontiguousarray(b.T), b_mn, b_mode, B_BYTES)
    cfg = np.array([a_lead, a_stride, SWIZZLE_MODE[a_mode], b_lead, b_stride, SWIZZLE_MODE[b_mode], scale_d,
                    *a_slices, *b_slices], np.int32)
    before = np.zeros((128, N // 2), np.float32)
    d = np.zeros((64, N), np.float32)
    wgmma_module.launch(kernel, (1, 1, 1), (128, 1, 1), 1024 + A_BYTES + B_BYTES,
                        [ptr(x) for x in (a_bytes, b_bytes, cfg, c, before, d)])
    want = a.astype(np.float32) @ b.astype(np.float32) + (c if scale_d else 0)
    np.testing.assert_array_equal(d, want)
    # Asynchronous: until wgmma.wait_group the registers still hold C (a kernel that skips the wait
    # reads stale accumulators here as it may on the GPU).
    assert sorted(before.ravel()) == sorted(c.ravel())


def test_wgmma_primitives_compile_with_nvrtc_for_sm_90a():
    cubin = nvrtc.compile_cuda(WGMMA_KERNELS, arch="sm_90a", tag="test_wgmma")
    assert cubin[:4] == b"\x7fELF"
