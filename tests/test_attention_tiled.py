"""The tiled attention kernels (templates/attention_tiled.cu.j2) that a program rendered for a GPU
runs: a block per tile of 64 query rows (forward, dQ) or key rows (dK/dV), K/V (resp. Q/dO) tiles in
shared memory, an online softmax across key tiles, causal tiles above the diagonal skipped.
float32/float64 on scalar loops ("SIMT"), float16/bfloat16 on tensor cores (mma.sync m16n8k16 with
fp32 accumulation and softmax statistics). Graphs on 'cuda' run them on the GPU (marked `gpu`), or on
the CPU emulator when there is none (FLOWGEN_EMULATE_CUDA=1): the `cuda_graph_target` fixture; the
cpu target keeps a thread per row.

Each case is a training step (SGD with lr 1 on q, k, v: the step's change is the gradient)
against eager flowgen and a float64 NumPy reference: ragged L and S (not multiples of the tile),
L != S both ways, causal or not, bool and additive masks (broadcast, with a fully masked row),
dropout (F.dropout's Philox mask), head dims 16 to 128 (and 17 to 20: narrower copies). Half-precision bounds are stated in units
of the format's roundoff u (2^-8 bfloat16, 2^-11 float16) times the magnitude of each sum.
"""
import re

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ops.registry import apply, get_op
from flowgen.runtime import nvrtc
from first_contact_cases import U_HALF, AttentionCase, attention_reference
from test_attention import WeightedSumStep, _mask   # attention * w summed, one SGD step with lr 1; masks

RNG = np.random.default_rng(11)


class QKV(nn.Module):
    """float32 q, k, v parameters cast to `dtype` for the attention (the gradient flows back
    through the casts); SGD with lr 1 turns a step into the float32 gradients."""

    def __init__(self, q, k, v, dtype, **sdpa):
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(flow.tensor(a)) for a in (q, k, v))
        self.dtype, self.sdpa = dtype, sdpa

    def forward(self, *mask):
        q, k, v = (p.to(self.dtype) for p in (self.q, self.k, self.v))
        return nn.functional.scaled_dot_product_attention(q, k, v, *mask, **self.sdpa).to(flow.float32)


CASES = [  # (id, dtype, (B, H, L, S, E, Ev), sdpa keywords, mask kind, mask shape)
    ("f32_causal_e64_ragged", "float32", (1, 2, 70, 70, 64, 64), dict(is_causal=True), None, None),
    ("f32_L_lt_S_e16", "float32", (2, 1, 20, 90, 16, 16), {}, None, None),
    ("f32_causal_L_gt_S_ev8", "float32", (1, 2, 90, 40, 16, 8), dict(is_causal=True, scale=0.3), None, None),
    ("f32_bool_mask_masked_row", "float32", (2, 2, 33, 70, 16, 16), {}, "bool_row", (2, 1, 33, 70)),
    ("f32_float_mask_e80", "float32", (1, 3, 40, 66, 80, 80), {}, "float_row", (3, 40, 66)),
    ("f32_causal_e128", "float32", (1, 1, 65, 65, 128, 128), dict(is_causal=True), None, None),
    ("f32_dropout_causal", "float32", (1, 2, 70, 70, 16, 16), dict(is_causal=True, dropout_p=0.2), None, None),
    ("f64_bool_mask", "float64", (1, 2, 40, 70, 32, 24), dict(scale=0.2), "bool", (40, 70)),
    ("bf16_causal_e64_ragged", "bfloat16", (1, 2, 70, 70, 64, 64), dict(is_causal=True), None, None),
    ("f16_bool_mask_masked_row", "float16", (2, 1, 33, 70, 16, 16), {}, "bool_row", (2, 1, 33, 70)),
    ("bf16_float_mask_e80", "bfloat16", (1, 2, 40, 66, 80, 48), {}, "float", (40, 66)),
    ("bf16_dropout_causal_e128", "bfloat16", (1, 1, 70, 70, 128, 128), dict(is_causal=True, dropout_p=0.2),
     None, None),
    # head dims that are not multiples of 8: 8-byte (E 20) and 4-byte (Ev 18) cp.async, plain stores (E 17)
    ("bf16_e20_ev18_L_gt_S", "bfloat16", (1, 2, 70, 45, 20, 18), {}, None, None),
    ("f16_causal_e17", "float16", (1, 1, 40, 70, 17, 17), dict(is_causal=True), None, None),
    # causal with L < S: the dK/dV blocks of keys past the last query tile have no query tile at all
    ("bf16_causal_L_lt_S", "bfloat16", (1, 1, 40, 200, 32, 32), dict(is_causal=True), None, None),
    ("bf16_dropout_e64", "bfloat16", (1, 2, 70, 70, 64, 64), dict(dropout_p=0.2), None, None),   # 32-row dK/dV tiles
]


def _run_case(case):
    """(graph results, eager results, float64 reference, magnitudes, graph): output then the q, k,
    v gradients."""
    _, dtype, (B, H, L, S, E, Ev), sdpa, kind, mask_shape = case
    fdtype = getattr(flow, dtype)
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, Ev)))
    q, k, v = (flow.tensor(a).to(fdtype).to(flow.float32).numpy() for a in (q, k, v))   # representable
    w = flow.tensor(RNG.standard_normal((B, H, L, Ev)).astype(np.float32)).to(fdtype).to(flow.float32).numpy()
    mask = None if kind is None else _mask(kind, mask_shape, RNG)
    masks = () if mask is None else (flow.tensor(mask if kind.startswith("bool") else mask.astype(fdtype.np_dtype)),)

    flow.manual_seed(7)
    graph = WeightedSumStep(QKV(q, k, v, fdtype, **sdpa).to("cuda"))
    g_out = graph(flow.tensor(w).to("cuda"), *(m.to("cuda") for m in masks)).numpy()
    graph_results = [g_out] + [a - p.numpy() for a, p in zip((q, k, v), (graph.model.q, graph.model.k, graph.model.v))]

    flow.manual_seed(7)
    eager = QKV(q, k, v, fdtype, **sdpa)
    e_out = eager(*masks)
    (e_out * flow.tensor(w)).sum().backward()
    eager_results = [e_out.numpy()] + [p.grad.numpy() for p in (eager.q, eager.k, eager.v)]

    p = sdpa.get("dropout_p", 0.0)
    keep = np.ones((B, H, L, S), bool)
    if p:   # F.dropout's mask of the same (seed, offset) as the graph's first step draws
        flow.manual_seed(7)
        keep = nn.functional.dropout(flow.ones(B, H, L, S), p).numpy() > 0
    f64 = [a.astype(np.float64) for a in (q, k, v, w)]
    ref_mask = None if mask is None else (mask if kind.startswith("bool") else
                                          flow.tensor(mask).to(fdtype).to(flow.float64).numpy())
    reference, magnitudes = attention_reference(*f64, ref_mask, sdpa.get("is_causal", False),
                                       sdpa.get("scale", 1 / np.sqrt(E)), keep, float(np.float32(1 - np.float32(p))))
    return graph_results, eager_results, reference, magnitudes, graph


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tiled_attention_training_step(case, cuda_graph_target):
    dtype = case[1]
    graph_results, eager_results, reference, magnitudes, graph = _run_case(case)
    kernels = [k for k in graph.compiled.program.kernels if any(op.startswith("attention") for op in k.ops)]
    assert len(kernels) == 3 and all(k.block == (128, 1, 1) and k.smem > 0 for k in kernels)
    assert all(("tensor cores" in k.comment) == (dtype in U_HALF) for k in kernels)
    for name, g, e, r, mag in zip(("out", "dq", "dk", "dv"), graph_results, eager_results, reference, magnitudes):
        if dtype in U_HALF:
            # inputs exact; P and dS rounded to the input type before their products (u each), the
            # output and gradients rounded once more (u), fp32 sums: within 4u of each sum's magnitude
            bound = 4 * U_HALF[dtype] * mag + 2.0 ** -20
        else:
            # sums in the compute type (E or S terms), the float32 result (the model casts back) and
            # the SGD step's p - (p - g) rounding at |p| ~ 4
            u = 2.0 ** -24 if dtype == "float32" else 2.0 ** -53
            bound = 4 * (max(r.shape[-1], 64) + 70) * u * mag + 2.0 ** -23 * (np.abs(r) + 4)
            np.testing.assert_allclose(g, e, rtol=0, atol=np.max(bound) + 1e-30, err_msg=name)
        np.testing.assert_array_less(np.abs(g - r), bound + 1e-30, err_msg=name)
    if case[4] and case[4].endswith("_row"):   # a fully masked query row: output 0, no gradient
        assert np.all(graph_results[0][..., 1, :] == 0) and np.all(graph_results[1][..., 1, :] == 0)


def test_fully_masked_rows_have_minus_inf_logsumexp(cuda_graph_target):
    """The forward's lse output of a fully masked row is -inf and its output row 0."""
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((1, 2, 70, 16), (1, 2, 90, 16), (1, 2, 90, 16)))
    mask = RNG.random((70, 90)) < 0.5
    mask[3] = False
    mask[69] = False

    class Forward(nn.Graph):
        def build(self, q, k, v, mask):
            return apply("attention", q, k, v, mask, scale=0.25, causal=False)

    out, lse = Forward()(*(flow.tensor(a).to("cuda") for a in (q, k, v, mask)))
    want_out, want_lse = get_op("attention").ref(q, k, v, mask, scale=0.25, causal=False)
    assert np.all(lse.numpy()[..., [3, 69]] == -np.inf) and np.all(out.numpy()[..., [3, 69], :] == 0)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------
# the GPU's machine code: NVRTC for sm_80 and sm_90, tensor-core instructions, no spills

GPU_KERNELS = [k for dtype in (flow.bfloat16, flow.float16) for E in (64, 128)
               for op in ("attention", "attention_backward")
               for k in AttentionCase(op, dtype, 2, 4, 200, 200, E, E, causal=True, prefix="sass").kernels] + [
    k for op in ("attention_dropout", "attention_dropout_backward")
    for k in AttentionCase(op, flow.bfloat16, 2, 4, 70, 90, 80, 48, mask=(90,), dropout_p=0.1, prefix="sass").kernels] + [
    k for E in (64, 128) for op in ("attention", "attention_backward")
    for k in AttentionCase(op, flow.float32, 2, 4, 200, 200, E, E, prefix="sass").kernels]
MMA_KERNELS = [k for k in GPU_KERNELS if "tensor cores" in k.comment]


def test_half_precision_kernels_use_mma_sync_and_the_others_do_not():
    assert len(MMA_KERNELS) == 3 * 4 + 3 and len(GPU_KERNELS) == len(MMA_KERNELS) + 6
    for k in GPU_KERNELS:
        assert ("mma_m16n8k16_" in k.source and "ldmatrix_x" in k.source) == (k in MMA_KERNELS), k.name
        assert k.block == (128, 1, 1) and k.needs_fibers and "__syncthreads" in k.source


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiled_kernels_compile_with_nvrtc(arch):
    build = nvrtc.compile_kernels("\n".join(k.source for k in GPU_KERNELS), arch)   # the GPU backend's path
    assert set(build.symbols) == {k.name for k in GPU_KERNELS}
    assert all(path.read_bytes()[:4] == b"\x7fELF" for path in build.artifacts)


@pytest.mark.slow   # ptxas --verbose on 15 kernels: about 30 s
def test_tensor_core_kernels_have_hmma_and_no_spills_on_sm_90(tmp_path):
    """ptxas: no stack frame or spills (head dims 64 and 128); the dropout kernels keep the Philox
    rounds' state too and may spill a few words (16 bytes for the forward at head dim 80)."""
    from test_tensor_cores import CUOBJDUMP, NVDISASM, build_with_ptxas_report, disassemble

    cubin, report = build_with_ptxas_report("\n".join(k.source for k in MMA_KERNELS), "sm_90")
    frames = dict(re.findall(r"Function properties for (\w+)\s*ptxas\s+\.\s+([^\n]*)", report))
    assert set(frames) == {k.name for k in MMA_KERNELS}
    for name, frame in frames.items():
        if "dropout" not in name:
            assert frame == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", (name, frame)
    if CUOBJDUMP is None or NVDISASM is None:
        pytest.skip("needs cuobjdump and nvdisasm for the SASS check")
    sass, _ = disassemble(cubin, tmp_path)
    for k in MMA_KERNELS:
        code = sass[k.name]
        assert "HMMA.16816.F32" in code and "LDSM.16.M" in code, k.name
        if "dropout" not in k.name:
            assert "LDL" not in code and "STL" not in code, k.name


def test_enable_amp_runs_attention_in_bfloat16_on_tensor_cores(cuda_graph_target):
    """Under enable_amp(bfloat16) the attention autocasts like matmul (PyTorch's SDPA under
    autocast): float32 q/k/v go in as bfloat16 (the bool mask stays bool), the kernels run on tensor
    cores, the output and gradients come back float32, near the float32 eager step."""
    B, H, L, S, E = 1, 2, 70, 70, 32
    q, k, v = (RNG.standard_normal((B, H, n, E)).astype(np.float32) for n in (L, S, S))
    w = RNG.standard_normal((B, H, L, E)).astype(np.float32)
    mask = RNG.random((L, S)) < 0.8
    graph = WeightedSumStep(QKV(q, k, v, flow.float32).to("cuda"))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    out = graph(flow.tensor(w).to("cuda"), flow.tensor(mask).to("cuda")).numpy()
    nodes = [n for n in graph.compiled.ir.nodes if n.op.startswith("attention")]
    assert [n.op for n in nodes] == ["attention", "attention_backward"]
    assert all(x.dtype == flow.bfloat16 for n in nodes for x in n.inputs[:3]) and nodes[0].inputs[3].dtype == flow.bool
    kernels = [k for k in graph.compiled.program.kernels if any(op.startswith("attention") for op in k.ops)]
    assert len(kernels) == 3 and all("tensor cores, bf16" in k.comment for k in kernels)
    eager = QKV(q, k, v, flow.float32)
    e_out = eager(flow.tensor(mask))
    (e_out * flow.tensor(w)).sum().backward()
    u = U_HALF["bfloat16"]   # inputs rounded (u each), P rounded (u), the output rounded (u)
    np.testing.assert_allclose(out, e_out.numpy(), rtol=0, atol=6 * u * np.abs(v).max())
    grads = [a - p.numpy() for a, p in zip((q, k, v), (graph.model.q, graph.model.k, graph.model.v))]
    for name, g, e in zip("qkv", grads, (eager.q, eager.k, eager.v)):
        scale = np.abs(e.grad.numpy()).max()
        np.testing.assert_allclose(g, e.grad.numpy(), rtol=0, atol=16 * u * scale, err_msg=name)
