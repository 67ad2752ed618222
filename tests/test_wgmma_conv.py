"""Hopper warpgroup MMA beyond bf16/fp16 GEMMs: implicit-GEMM convolutions (forward, grad_input,
grad_weight; templates/conv2d.cu.j2 on templates/_wgmma.j2) and TF32 (float32 GEMMs and convs under
`allow_tf32`: wgmma m64nNk8 .tf32 from K-major tiles, inputs rounded by cvt.rna on the way in),
rendered for sm_90 and run on the emulator and, marked `gpu` (pytest -m gpu), on an sm_90 GPU; their
sm_90a machine code (HGMMA, no spills).

Accumulation order: the emulator adds each output's products in increasing k, one k16 (k8 for
tf32) instruction after the other, on both mma.sync and wgmma, and both paths round tf32 inputs
with cvt.rna: on the emulator an sm_90 program gives the sm_80 program's bits wherever both reduce
all of k in one block (everything but split-k grad_weight, whose splits follow the tile's k step:
32 vs 64; with 16-bit outputs the two may then round to neighbouring values). The PTX ISA leaves
the tensor cores' accumulation order and intermediate rounding open, so on a GPU the two programs
agree within fp32 summation error instead.
"""

import re

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen import dtype as dt
from flowgen.ops.registry import get_op
from flowgen.runtime import nvrtc
from first_contact_cases import (KINDS, U_BF16, U_FP32, U_OUT, U_TF32, ConvCase, GemmCase, conv_node, make_launch,
                                 render_for, tf32_round)
from graphs import InferGraph, TrainGraph
from test_tensor_cores import (CUOBJDUMP, NVDISASM, RESNET_WGRAD, SPLIT_GEOMETRY, assert_no_spills,
                               build_with_ptxas_report, disassemble, split_k_bound, split_k_grid_checks,
                               split_k_layout)


class WgmmaConv(ConvCase):
    """One conv op (conv2d / conv2d_grad_input / conv2d_grad_weight) rendered for sm_90 and, for
    comparison, for any sm_80 or newer (`sm80_kernels`)."""

    def __init__(self, kind, op, geometry, blocks=None):
        super().__init__(kind, op, geometry, arch="sm_90", blocks=blocks, prefix="wgc")
        self.sm80_kernels = render_for(self.node, f"mmac_{self.id}", kind, blocks=blocks)


GEOMETRIES = [   # (name, N, C, H, W, O, kernel, stride, padding, dilation, groups): ragged channels and pixels
    ("3x3_s1_p1", 2, 8, 7, 7, 20, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ("3x2_s2_p10_g2", 2, 10, 9, 8, 12, (3, 2), (2, 2), (1, 0), (1, 1), 2),
    ("3x3_d2_p2", 1, 6, 9, 10, 7, (3, 3), (1, 1), (2, 2), (2, 2), 1),
    ("1x1", 2, 24, 5, 6, 18, (1, 1), (1, 1), (0, 0), (1, 1), 1),
    ("1x1_g2", 3, 16, 4, 6, 12, (1, 1), (1, 1), (0, 0), (1, 1), 2),
]
OPS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
# bf16: every op on every geometry; fp16 and tf32 every op on the first two; a 64-channel conv with
# one block's target so it takes the 128-row tiles (two warpgroups) and several k tiles; deep
# weight gradients (tf32, bf16, fp16) rendered for the GPU's block count, split-k (float32
# partials, then an ordered combine that rounds once to the output dtype).
CASES = [WgmmaConv("bf16", op, g) for g in GEOMETRIES for op in OPS] + [
    WgmmaConv(kind, op, g) for kind in ("f16", "tf32") for g in GEOMETRIES[:2] for op in OPS] + [
    WgmmaConv(kind, op, ("3x3_c64", 2, 64, 6, 6, 128, (3, 3), (1, 1), (1, 1), (1, 1), 1), blocks=1)
    for kind in ("bf16", "tf32") for op in OPS] + [
    WgmmaConv(kind, "conv2d_grad_weight", SPLIT_GEOMETRY) for kind in ("tf32", "bf16", "f16")]
SPLIT_K = [c for c in CASES if "split-k" in c.kernel.comment]
SPLIT_K_16BIT = [c for c in SPLIT_K if c.kind != "tf32"]


@pytest.fixture(scope="module")
def conv_launch(sm90_kernel_target):
    source = "\n".join(k.source for case in CASES for k in case.kernels + case.sm80_kernels)
    return make_launch(source, "test_wgmma_conv", sm90_kernel_target)


def test_cases_run_on_warpgroup_mma_with_every_tile_and_split_k():
    for case in CASES:
        assert f"on tensor cores, {case.kind} wgmma" in case.kernel.comment, case.kernel.comment
        assert "wgmma_m64n" in case.kernel.source and "mma_m16n8k" not in case.kernel.source
        assert f"on tensor cores, {case.kind} mma.sync" in case.sm80_kernels[0].comment
    # operands that are runs of memory (weights, output gradients, 1x1 convs' pixels) by cp.async of
    # every width; the others gathered; tf32 always gathered (rounded on the way in)
    copies = {name for c in CASES for name in re.findall(r"cp_async_cg|cp_async_ca<\d+>", c.kernel.source)}
    assert copies == {"cp_async_cg", "cp_async_ca<8>", "cp_async_ca<4>"}
    assert not any("cp_async_c" in c.kernel.source for c in CASES if c.kind == "tf32")
    assert any("gathered element" not in c.kernel.source for c in CASES)    # a 1x1 conv: both by cp.async
    tiles = {re.search(r"GEMM (\d+x\d+)", c.kernel.comment).group(1) for c in CASES}
    assert {"64x64", "64x128", "128x128", "128x64"} <= tiles, tiles
    assert [c.id for c in SPLIT_K] == [f"{kind}_conv2d_grad_weight_3x3_24x24" for kind in ("tf32", "bf16", "f16")]
    for case in SPLIT_K:
        assert [k.name for k in case.kernels] == [case.kernel.name, f"{case.kernel.name}_combine"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_wgmma_conv_is_exact_on_integers(case, conv_launch):
    """Values in {-1, 0, 1}: every sum (at most 576 terms) is exact in fp32 and in the 16-bit output."""
    rng = np.random.default_rng(len(case.id))
    arrays = [rng.integers(-1, 2, size=shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    np.testing.assert_array_equal(case.run(conv_launch, arrays).astype(np.float64), want)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_wgmma_conv_gives_the_sm_80_programs_bits(case, conv_launch):
    """Random values: on the emulator the same bits as the mma.sync kernel (same k order, same tf32
    rounding); split-k weight gradients split k at other points, so there within fp32 summation
    error (and 16-bit outputs within one rounding more). On a GPU, whose tensor cores may add in
    another order, within that bound everywhere."""
    rng = np.random.default_rng(7 + len(case.id))
    arrays = [rng.standard_normal(shape).astype(KINDS[case.kind]) for shape in case.shapes]
    got = case.run(conv_launch, arrays)
    sm80 = case.run(conv_launch, arrays, case.sm80_kernels)
    if case in SPLIT_K or conv_launch.target == "gpu":
        rounded = [tf32_round(a) if case.kind == "tf32" else a for a in arrays]
        magnitude = get_op(case.op).ref(*(np.abs(a.astype(np.float64)) for a in rounded), **case.attrs)
        terms = case.reduction_length
        rounding = 2 * U_OUT[case.kind] * np.abs(sm80.astype(np.float64)) if case.kind in U_OUT else 0
        np.testing.assert_array_less(np.abs(got.astype(np.float64) - sm80),
                                     2 * terms * U_FP32 * magnitude + rounding + 1e-30)
    else:
        np.testing.assert_array_equal(got, sm80)


def test_tf32_conv_rounds_its_inputs_to_nearest_ties_away(conv_launch):
    """Inputs with low mantissa bits set: the products are of the cvt.rna-rounded values (not the
    truncation the tensor core itself applies), so the result equals the fp64 conv of tf32_round's
    inputs up to fp32 summation, and differs from the fp32 conv."""
    case = next(c for c in CASES if c.id == "tf32_conv2d_3x3_s1_p1")
    rng = np.random.default_rng(3)
    arrays = [(rng.standard_normal(shape) * (1 + 2.0 ** -11 + 2.0 ** -12)).astype(np.float32) for shape in case.shapes]
    got = case.run(conv_launch, arrays).astype(np.float64)
    rounded = get_op(case.op).ref(*(tf32_round(a).astype(np.float64) for a in arrays), **case.attrs)
    magnitude = get_op(case.op).ref(*(np.abs(a.astype(np.float64)) for a in arrays), **case.attrs)
    np.testing.assert_array_less(np.abs(got - rounded), 72 * U_FP32 * magnitude + 1e-30)
    exact = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    assert (np.abs(got - exact) > 72 * U_FP32 * magnitude).any()


# ---------------------------------------------------------------------------------------
# TF32 GEMMs on warpgroup MMA (gemm_wgmma.cu.j2): both operands gathered into K-major tiles
# whatever their order in memory (4 elements a load where their contiguous dim is a multiple of 4),
# every tile width.

class Tf32Gemm:
    """A TF32 GEMM rendered for sm_90 (`wgmma`) and, for comparison, for any sm_80 or newer (`mma`)."""

    def __init__(self, M, N, K, a_trans=False, b_trans=False, blocks=1):
        self.wgmma, self.mma = (GemmCase("tf32", M, N, K, a_trans, b_trans, arch=arch, blocks=blocks, prefix=prefix)
                                for arch, prefix in (("sm_90", "wg"), (None, "mma")))
        self.id, self.kernel = self.wgmma.id, self.wgmma.kernel


TF32_GEMMS = [Tf32Gemm(250, 250, 100), Tf32Gemm(130, 120, 70, True, True), Tf32Gemm(37, 45, 90, False, True),
              Tf32Gemm(64, 64, 33, True, False, blocks=None),
              Tf32Gemm(72, 56, 44, False, True)]   # K % 4 == 0: both operands in 16-byte loads, k fastest


@pytest.fixture(scope="module")
def tf32_gemm_launch(sm90_kernel_target):
    source = "\n".join(g.kernel.source for case in TF32_GEMMS for g in (case.wgmma, case.mma))
    return make_launch(source, "test_wgmma_tf32_gemm", sm90_kernel_target)


def test_tf32_gemms_run_on_warpgroup_mma_k8():
    for case in TF32_GEMMS:
        assert "tf32 wgmma" in case.kernel.comment and "k8_tf32<0, 0>" in case.kernel.source
        assert "cp_async" not in case.kernel.source     # gathered: rounded on the way in
    assert {re.search(r"GEMM (\d+x\d+)", c.kernel.comment).group(1) for c in TF32_GEMMS} == {
        "128x256", "128x64", "64x128", "64x64"}


@pytest.mark.parametrize("case", TF32_GEMMS, ids=[c.id for c in TF32_GEMMS])
def test_tf32_wgmma_gemm_rounds_like_mma_sync(case, tf32_gemm_launch):
    """Both round the inputs by cvt.rna and sum in fp32: on the emulator (same k order) the same
    bits; on a GPU within fp32 summation error of each other."""
    rng = np.random.default_rng(case.id.__len__() + case.wgmma.M)
    a, b = case.wgmma.operands(lambda shape: rng.standard_normal(shape))
    got = case.wgmma.run(tf32_gemm_launch, a, b)
    mma = case.mma.run(tf32_gemm_launch, a, b)
    want, magnitude = case.wgmma.reference(a, b)
    if tf32_gemm_launch.target == "emulator":
        np.testing.assert_array_equal(got, mma)
    else:
        np.testing.assert_array_less(np.abs(got.astype(np.float64) - mma), case.wgmma.K * U_FP32 * 4 * magnitude + 1e-30)
    np.testing.assert_array_less(np.abs(got - want), case.wgmma.K * U_FP32 * 2 * magnitude + 1e-30)


# ---------------------------------------------------------------------------------------
# Through the public API: 'cuda' graphs rendered for sm_90 (the `sm90_graph_target` fixture: an sm_90
# GPU, or the emulator with FLOWGEN_EMULATE_CUDA=1, FLOWGEN_EMULATE_CUDA_ARCH=sm_90) against eager
# float32 and, on the emulator, against the sm_80 program's bits.

class Block(nn.Module):
    """conv -> BatchNorm -> ReLU, plus a residual 1x1 conv with bias: the fused conv epilogues."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 12, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(12)
        self.project = nn.Conv2d(6, 12, 1)
        self.head = nn.Conv2d(12, 5, 3, stride=2, dilation=2, padding=2, groups=1)

    def forward(self, x):
        return self.head(nn.functional.relu(self.bn(self.conv(x))) + self.project(x))


def rendered_for_sm_80(monkeypatch):
    """From here on the emulator renders 'cuda' graphs for any sm_80 or newer (mma.sync)."""
    monkeypatch.delenv("FLOWGEN_EMULATE_CUDA_ARCH")


def infer_run(precision):
    """(graph output, eager float32 output, graph) of an eval-mode Block on 'cuda'."""
    flow.manual_seed(0)
    model = Block().eval()
    with flow.no_grad():
        model.bn.running_mean.copy_(flow.randn(12) * 0.1)
        model.bn.running_var.copy_(flow.rand(12) + 0.5)
    x = flow.randn(2, 6, 11, 9)
    want = model(x).numpy().astype(np.float64)
    graph = InferGraph(model.to("cuda"))
    if precision == "bf16":
        graph.config.enable_amp(True, dtype=flow.bfloat16)
    else:
        graph.config.allow_tf32(True)
    return graph(x.to("cuda")).numpy().astype(np.float64), want, graph


@pytest.mark.parametrize("case", SPLIT_K_16BIT, ids=[c.id for c in SPLIT_K_16BIT])
def test_split_k_16bit_weight_gradient_on_wgmma_rounds_once(case, conv_launch):
    """Chunks of whole 64-wide k tiles (the sm_80 rendering: 32-wide), float32 partials; integers
    in [0, 4) whose sums are exact in fp32 but not in bf16: the exact sum rounded once."""
    splits, chunk = split_k_layout(case.kernels)
    assert splits > 1 and chunk % 64 == 0 and split_k_layout(case.sm80_kernels)[1] % 32 == 0
    assert {a.value.dtype for a in case.kernels[1].args} == {dt.float32, case.out.dtype}
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 4, size=shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    assert np.abs(want).max() > 1024
    np.testing.assert_array_equal(case.run(conv_launch, arrays), want.astype(KINDS[case.kind]))


@pytest.mark.parametrize("case", SPLIT_K_16BIT, ids=[c.id for c in SPLIT_K_16BIT])
def test_split_k_16bit_weight_gradient_on_wgmma_is_within_its_rounding_bound(case, conv_launch):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want = get_op(case.op).ref(*(a.astype(np.float64) for a in arrays), **case.attrs)
    got = case.run(conv_launch, arrays).astype(np.float64)
    np.testing.assert_array_less(np.abs(got - want), split_k_bound(case, arrays, want, case.kernels) + 1e-30)


@pytest.mark.parametrize("geometry", RESNET_WGRAD, ids=[g[0] for g in RESNET_WGRAD])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_resnet_sized_16bit_weight_gradient_on_wgmma_fills_the_gpu_with_split_k(kind, geometry):
    _, _, node = conv_node(kind, "conv2d_grad_weight", geometry, geometry[0])
    kernels = render_for(node, f"rnw_{kind}_{geometry[0]}", kind, arch="sm_90")
    assert f"{kind} wgmma" in kernels[0].comment
    assert split_k_grid_checks(kernels, geometry, 64) > 1


def conv_kernels(graph) -> list:
    return [k for k in graph.compiled.program.kernels if any(op.startswith("conv2d") for op in k.ops)]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_conv_graph_with_fused_epilogues_runs_on_warpgroup_mma(precision, sm90_graph_target, monkeypatch):
    got, want, graph = infer_run(precision)
    convs = conv_kernels(graph)
    assert len(convs) == 3 and all(f"{precision} wgmma" in k.comment for k in convs)
    assert any({"relu", "add"} <= set(k.ops) for k in convs)     # BatchNorm folded, ReLU and residual fused
    u = U_BF16 if precision == "bf16" else U_TF32
    # two convs in a row, each off by a few u relative to its magnitude; bf16 also rounds the
    # intermediate activations
    scale = np.abs(want).max()
    np.testing.assert_array_less(np.abs(got - want), 40 * u * scale)
    # kernels.cu as the executor compiles it on an sm_90 GPU: sources calling wgmma get sm_90a
    build = nvrtc.compile_kernels(graph.compiled.program.source, "sm_90")
    assert all(path.read_bytes()[:4] == b"\x7fELF" for path in build.artifacts)
    if sm90_graph_target == "emulator":
        rendered_for_sm_80(monkeypatch)
        sm80, _, sm80_graph = infer_run(precision)
        assert all(f"{precision} mma.sync" in k.comment for k in conv_kernels(sm80_graph))
        np.testing.assert_array_equal(got, sm80)


def tf32_linear_run():
    flow.manual_seed(0)
    model = nn.Linear(96, 40)
    x = flow.randn(24, 96)
    want = model(x).numpy().astype(np.float64)
    graph = InferGraph(model.to("cuda"))
    graph.config.allow_tf32(True)
    return graph(x.to("cuda")).numpy().astype(np.float64), want, graph, x.numpy(), model.weight.numpy()


@pytest.mark.slow
def test_allow_tf32_linear_runs_on_warpgroup_mma(sm90_graph_target, monkeypatch):
    got, want, graph, x, w = tf32_linear_run()
    (gemm,) = [k for k in graph.compiled.program.kernels if "tensor-core GEMM" in k.comment]
    assert "tf32 wgmma" in gemm.comment and "add" in gemm.ops            # the bias in its epilogue
    bound = (2 * U_TF32 + 96 * U_FP32) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    np.testing.assert_array_less(np.abs(got - want), bound + 2 * U_FP32 * np.abs(want))
    if sm90_graph_target == "emulator":
        rendered_for_sm_80(monkeypatch)
        np.testing.assert_array_equal(got, tf32_linear_run()[0])       # the sm_80 (mma.sync tf32) bits


def conv_net():
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2, groups=2),
                         nn.Flatten(), nn.Linear(6 * 4 * 4, 5))


def train_run(device="cuda"):
    """(losses, parameters, graph) of two SGD steps of a bf16-AMP graph on `device` (the
    graph is None for "cpu": eager float32)."""
    flow.manual_seed(0)
    model = conv_net().to(device)
    x, y = flow.randn(3, 4, 9, 9).to(device), flow.randn(3, 5).to(device)
    loss_fn, optimizer = nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.05)
    if device == "cpu":
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        return losses, [p.numpy() for p in model.parameters()], None
    graph = TrainGraph(model, loss_fn, optimizer)
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    losses = [float(graph(x, y)) for _ in range(2)]
    return losses, [p.numpy() for p in model.parameters()], graph


@pytest.mark.slow
def test_bf16_amp_conv_training_step_on_warpgroup_mma(sm90_graph_target, monkeypatch):
    """Forward, grad_input and grad_weight convs all on wgmma, near eager float32; on the emulator
    the same losses and parameters as the sm_80 (mma.sync) program, bit for bit (no split-k at
    these sizes)."""
    losses, params, graph = train_run()
    convs = conv_kernels(graph)
    assert {op for k in convs for op in k.ops} >= {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"}
    assert all("bf16 wgmma" in k.comment for k in convs if "tensor cores" in k.comment)
    assert not any("split-k" in k.comment for k in convs)
    eager_losses, eager_params, _ = train_run("cpu")
    # three bf16 GEMMs in a row, each off by a few u relative, through a squared error
    np.testing.assert_allclose(losses, eager_losses, rtol=16 * U_BF16)
    for p, q in zip(params, eager_params):
        np.testing.assert_allclose(p, q, rtol=0, atol=2 * 0.05 * 16 * U_BF16 * max(1.0, np.abs(q).max()))
    if sm90_graph_target == "emulator":
        rendered_for_sm_80(monkeypatch)
        sm80_losses, sm80_params, _ = train_run()
        assert losses == sm80_losses
        for p, q in zip(params, sm80_params):
            np.testing.assert_array_equal(p, q)


# ---------------------------------------------------------------------------------------
# Machine code for sm_90a: warpgroup MMA, no local memory; ResNet-sized convs (3x3 and 1x1, 64 ->
# 64 channels on 56 x 56, batch 32) and their gradients beside the test cases, and the tf32
# GEMMs. The sm_80 renderings (mma.sync) of the same cases still compile for sm_80.

SASS_CASES = CASES + [WgmmaConv(kind, op, ("resnet_3x3", 32, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1), 1))
                      for kind in ("bf16", "tf32") for op in OPS] + [
    WgmmaConv("bf16", op, ("resnet_1x1", 32, 64, 56, 56, 256, (1, 1), (1, 1), (0, 0), (1, 1), 1)) for op in OPS]
# (kind, main kernel) of each case, then every kernel (split-k combines too)
SASS_MAIN = [(c.kind, c.kernel) for c in SASS_CASES] + [("tf32", g.kernel) for g in TF32_GEMMS]
SASS_KERNELS = [k for c in SASS_CASES for k in c.kernels] + [g.kernel for g in TF32_GEMMS]
HGMMA = {"bf16": "HGMMA.64x{}x16.F32.BF16", "f16": "HGMMA.64x{}x16.F32 ", "tf32": "HGMMA.64x{}x8.F32.TF32"}


@pytest.fixture(scope="module")
def sm_90a_build():
    return build_with_ptxas_report("\n".join(k.source for k in SASS_KERNELS), "sm_90a")


@pytest.mark.slow
def test_kernels_compile_for_sm_90a_without_spills(sm_90a_build):
    assert_no_spills(sm_90a_build[1], {k.name for k in SASS_KERNELS})
    assert "Potential Performance Loss" not in sm_90a_build[1]


@pytest.mark.slow
@pytest.mark.skipif(CUOBJDUMP is None or NVDISASM is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_sm_90a_sass_has_warpgroup_mma_and_no_local_memory(sm_90a_build, tmp_path):
    sass, usage = disassemble(sm_90a_build[0], tmp_path)
    for kind, kernel in SASS_MAIN:
        code = sass[kernel.name]
        width = re.search(r"GEMM \d+x(\d+)", kernel.comment).group(1)
        assert HGMMA[kind].format(width) in code, kernel.name
        assert "WARPGROUP.ARRIVE" in code and "WARPGROUP.DEPBAR" in code and "HMMA" not in code, kernel.name
        if re.search(r"cp_async_c[ag]\b", kernel.source):
            assert "LDGSTS" in code and "DEPBAR" in code, kernel.name             # cp.async and wait_group
        assert "LDL" not in code and "STL" not in code, kernel.name
        assert re.search(r"\bSTACK:0 .*\bLOCAL:0\b", usage[kernel.name]), (kernel.name, usage[kernel.name])


@pytest.mark.slow
def test_sm_80_renderings_compile_for_sm_80():
    source = "\n".join(k.source for c in CASES for k in c.sm80_kernels) + \
        "\n".join(g.mma.kernel.source for g in TF32_GEMMS)
    assert "wgmma" not in source
    assert nvrtc.compile_cuda(source, arch="sm_80", tag="test_wgmma_conv_sm80")[:4] == b"\x7fELF"
