"""LayerNorm as one op (issue 11): `layer_norm` runs one row kernel forward (Welford statistics in a
fixed lane order, ops/norm_ops.py) and `layer_norm_backward` one row kernel for dx; a residual add
that would be a kernel of its own runs inside them (`add_layer_norm`, and the residual gradient
added to dx). Eager equals PyTorch; graphs equal eager bit for bit on the cpu target and with the
GPU's block-per-row kernels (run on the emulator), which NVRTC compiles for sm_80 and sm_90."""
import copy

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
import flowgen.nn.functional as F
from flowgen.passes.fusion import SIBLING_MAX_REDUCTIONS
from flowgen.runtime import cuda_driver, nvrtc
from graphs import InferGraph
from torch_oracle import get_torch

RNG = np.random.default_rng(11)


def _affine(normalized_shape, which):
    w = RNG.uniform(0.5, 1.5, normalized_shape).astype(np.float32) if "w" in which else None
    b = RNG.standard_normal(normalized_shape).astype(np.float32) if "b" in which else None
    return w, b


@pytest.mark.parametrize("shape, normalized_shape", [((4, 5, 64), (64,)), ((2, 6, 4, 3), (4, 3)),
                                                     ((3, 300), (300,)), ((2, 3, 4, 5), (3, 4, 5)), ((7,), (7,))])
@pytest.mark.parametrize("which", ["wb", "w", "b", ""])
def test_eager_forward_and_backward_equal_pytorch(shape, normalized_shape, which):
    torch = get_torch()
    x = (RNG.standard_normal(shape) * 3 + 1).astype(np.float32)
    g = RNG.standard_normal(shape).astype(np.float32)
    w, b = _affine(normalized_shape, which)
    ours = [flow.tensor(a, requires_grad=True) if a is not None else None for a in (x, w, b)]
    theirs = [torch.tensor(a, requires_grad=True) if a is not None else None for a in (x, w, b)]
    y = F.layer_norm(ours[0], normalized_shape, ours[1], ours[2], eps=1e-5)
    want = torch.nn.functional.layer_norm(theirs[0], normalized_shape, theirs[1], theirs[2], eps=1e-5)
    np.testing.assert_allclose(y.numpy(), want.detach().numpy(), rtol=1e-5, atol=2e-6)
    (y * flow.tensor(g)).sum().backward()
    (want * torch.tensor(g)).sum().backward()
    for o, t in zip(ours, theirs):
        if o is not None:
            np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_eps_is_pytorchs_and_rows_may_be_empty():
    """rstd = 1 / sqrt(biased var + eps): rows of variance 1e-6 show it (eps 1e-2 scales them 30 times
    less than 1e-5); x - mean is taken in float32, as PyTorch does, so the rounding of the mean (half
    an ulp of 1.0) moves y by up to 6e-8 * rstd. 0 rows give empty results."""
    torch = get_torch()
    x = (1 + 1e-3 * RNG.standard_normal((6, 16))).astype(np.float32)
    exact = x.astype(np.float64)
    for eps in (1e-5, 1e-2):
        got = F.layer_norm(flow.tensor(x), 16, eps=eps).numpy()
        want = (exact - exact.mean(1, keepdims=True)) / np.sqrt(exact.var(1, keepdims=True) + eps)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=6e-8 / np.sqrt(1e-6 + eps))
        np.testing.assert_allclose(got, torch.nn.functional.layer_norm(torch.tensor(x), (16,), eps=eps).numpy(),
                                   rtol=1e-5, atol=2 * 6e-8 / np.sqrt(1e-6 + eps))
    empty = flow.tensor(np.zeros((0, 8), np.float32), requires_grad=True)
    weight = flow.tensor(np.ones(8, np.float32), requires_grad=True)
    y = F.layer_norm(empty, 8, weight)
    y.sum().backward()
    assert y.shape == (0, 8) and empty.grad.shape == (0, 8) and (weight.grad.numpy() == 0).all()


def test_constant_rows_normalize_to_exactly_zero():
    x = np.repeat(np.array([[0.1], [-3.7], [1e6], [0.0]], np.float32), 48, axis=1)
    assert (F.layer_norm(flow.tensor(x), 48).numpy() == 0).all()
    assert (InferGraph(nn.LayerNorm(48, elementwise_affine=False))(flow.tensor(x)).numpy() == 0).all()


def test_refusals_name_the_op():
    x = flow.randn(2, 4)
    with pytest.raises(ValueError, match=r"layer_norm: expected a floating weight of shape \[4\]"):
        F.layer_norm(x, 4, flow.ones(3))
    with pytest.raises(RuntimeError, match="layer_norm: given normalized_shape"):
        F.layer_norm(x, 5)


# --------------------------------------------------------------------------- graphs


class _Residual(nn.Module):
    """h = ln_0(p * x); x = h + ln_1(h); out = ln_f(x). The residual add reads two row kernels'
    results, so no other kernel takes it: it runs inside ln_f's kernel, and the backward's (ln_f's
    dx plus ln_1's) inside ln_1's dx kernel."""

    def __init__(self, width, dtype=flow.float32):
        super().__init__()
        self.p = nn.Parameter((flow.rand(width) + 0.5).to(dtype))
        self.ln_0, self.ln_1, self.ln_f = (nn.LayerNorm(width, dtype=dtype) for _ in range(3))
        with flow.no_grad():
            for ln in (self.ln_0, self.ln_1, self.ln_f):
                ln.weight.copy_(flow.rand(width).to(dtype) + 0.5)
                ln.bias.copy_(flow.randn(width).to(dtype))

    def forward(self, x):
        h = self.ln_0(self.p * x)
        return self.ln_f(h + self.ln_1(h))


class _Step(nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, target):
        loss = ((self.model(x) - target) ** 2).sum()
        loss.backward()
        return loss


def _train_graph_and_eager(width, dtype, device, steps=3):
    """`steps` SGD steps as a graph and eagerly: the model's output, losses and parameters equal
    bit for bit. In float64 the loss's sum and the weight/bias gradients' column sums are the
    generic reductions, whose float64 sums depend on their order: equal to 1e-12 there."""
    flow.manual_seed(3)
    model = _Residual(width, dtype)
    eager = copy.deepcopy(model)
    x = flow.randn(2, 5, width).to(dtype)
    target = flow.randn(2, 5, width).to(dtype)
    assert np.array_equal(InferGraph(copy.deepcopy(model).to(device))(x.to(device)).numpy(), eager(x).numpy())
    same = np.testing.assert_array_equal if dtype == flow.float32 else \
        (lambda a, b, err_msg="": np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=err_msg))
    graph = _Step(model.to(device), flow.optim.SGD(model.parameters(), lr=0.0078125))
    opt = flow.optim.SGD(eager.parameters(), lr=0.0078125)
    for _ in range(steps):
        got = graph(x.to(device), target.to(device)).numpy()
        loss = ((eager(x) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        same(got, loss.numpy())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        same(p.numpy(), q.detach().numpy(), err_msg=name)
    return graph


def _layer_norm_nodes(graph):
    return [n for n in graph.compiled.ir.nodes if "layer_norm" in n.op]


def _assert_residuals_fused(graph):
    nodes = _layer_norm_nodes(graph)
    assert [n.op for n in nodes if n.op != "layer_norm_backward"] == ["layer_norm", "layer_norm", "add_layer_norm"]
    backward = [n for n in nodes if n.op == "layer_norm_backward"]
    assert sorted(n.attrs["has_residual"] for n in backward) == [False, False, True]
    # one kernel per LayerNorm forward and one (dx) per backward; no add kernel is left
    kernels = graph.compiled.program.kernels
    assert sorted(k.ops[0] for k in kernels if "layer_norm" in k.ops[0]) == \
        ["add_layer_norm", "layer_norm", "layer_norm", "layer_norm_backward", "layer_norm_backward",
         "layer_norm_backward"]
    assert not any(k.ops == ["add"] for k in kernels)
    # Template.in_place: some row kernel writes its output over a dying input (and the numbers still equal)
    plan = graph.compiled.program.plan
    assert any(a.value in plan.inplace for k in kernels if "layer_norm" in k.ops[0] for a in k.args
               if not a.ctype.startswith("const"))


@pytest.mark.parametrize("width, dtype", [(48, flow.float32), (300, flow.float32), (48, flow.float64)])
def test_training_graph_equals_eager_bit_for_bit_on_the_cpu(width, dtype):
    _assert_residuals_fused(_train_graph_and_eager(width, dtype, "cpu"))


def test_gpu_kernels_equal_eager_on_the_emulator_and_compile_with_nvrtc(monkeypatch):
    """The cuda program, a block of threads per row (float64 rows of 300: 64 lanes; float32 rows of
    8200: 256 lanes of 33 steps, more than a thread keeps in registers, so it reads them again):
    equal to eager on the emulator (or the GPU), and NVRTC compiles it for sm_80 and sm_90."""
    from flowgen.runtime import nvrtc

    if not cuda_driver.available():
        monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    for width, dtype, lanes in ((300, flow.float64, 64), (8200, flow.float32, 256)):
        graph = _train_graph_and_eager(width, dtype, "cuda", steps=1)
        _assert_residuals_fused(graph)
        assert {k.block[0] for k in graph.compiled.program.kernels if "layer_norm" in k.ops[0]} == {lanes}
        for arch in ("sm_80", "sm_90"):
            assert len(nvrtc.compile_cuda(graph.compiled.sources["kernels.cu"], arch)) > 0


def test_layer_norm_forward_is_one_kernel_and_low_precision_inputs_work():
    """A LayerNorm module in an inference graph is one kernel; bfloat16/float16 inputs (float32
    statistics, stored in the input's dtype) equal eager."""
    for dtype in (flow.float32, flow.bfloat16, flow.float16):
        flow.manual_seed(0)
        model = nn.LayerNorm(40, dtype=dtype)
        x = (flow.randn(3, 7, 40) * 2).to(dtype)
        graph = InferGraph(model)
        got = graph(x)
        assert got.dtype == dtype and np.array_equal(got.numpy(), model(x).numpy())
        assert [k.ops for k in graph.compiled.program.kernels] == [["layer_norm"]]


def test_residual_add_joins_a_gemm_epilogue_unless_switched_off():
    """x + fc(y) runs in the GEMM's epilogue (the add stays there, fewer bytes than reading both
    addends in the row kernel); with allow_fuse_add_to_output(False) it runs in the LayerNorm's."""
    flow.manual_seed(0)
    fc, ln = nn.Linear(32, 32), nn.LayerNorm(32)

    class Block(nn.Graph):
        def __init__(self, fuse_add):
            super().__init__()
            self.fc, self.ln = fc, ln
            self.config.allow_fuse_add_to_output(fuse_add)

        def build(self, x):
            return self.ln(x + self.fc(x))

    x = flow.randn(6, 32)
    want = ln(x + fc(x)).numpy()
    for fuse_add, op in ((True, "layer_norm"), (False, "add_layer_norm")):
        graph = Block(fuse_add)
        assert np.array_equal(graph(x).numpy(), want)
        assert [n.op for n in _layer_norm_nodes(graph)] == [op]


def test_layer_norm_in_an_amp_graph_stays_float32():
    """Autocast runs matmul/conv2d in bfloat16; LayerNorm is on autocast's float32 list, so the
    LayerNorm between them upcasts their bfloat16 results and stays the float32 row kernels. The AMP step trains like the float32 graph (within bfloat16's
    rounding)."""
    from graphs import TrainGraph

    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    amp = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.0625))
    amp.config.enable_amp(True, dtype=flow.bfloat16)
    fp32 = TrainGraph(reference, nn.MSELoss(), flow.optim.SGD(reference.parameters(), lr=0.0625))
    x, y = flow.randn(8, 16), flow.randn(8, 4)
    for _ in range(3):
        la, lf = float(amp(x, y)), float(fp32(x, y))
        assert abs(la - lf) < 2e-2 * max(1.0, abs(lf))
    nodes = _layer_norm_nodes(amp)
    assert {n.op for n in nodes} == {"layer_norm", "layer_norm_backward"}
    assert all(v.dtype == flow.float32 for n in nodes for v in n.inputs + n.outputs)
    assert "bf16[" in str(amp.compiled.ir)


def test_many_layer_norms_gradients_share_kernels_within_shared_memory(monkeypatch):
    """20 LayerNorms in a chain: their 40 weight and bias gradients are sibling column sums over the
    same rows, computed together, at most fusion.SIBLING_MAX_REDUCTIONS per kernel: each keeps a
    block-wide array of 8-byte accumulators in static shared memory, 48 KB at most per kernel on a
    GPU (GPT-2's 25 LayerNorms in one kernel needed 100 KB: ptxas refused it). One SGD step equals
    eager on the emulator (or the GPU), and NVRTC compiles the program for sm_90."""
    if not cuda_driver.available():
        monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    flow.manual_seed(0)
    model = nn.Sequential(*[nn.LayerNorm(32) for _ in range(20)])
    eager = copy.deepcopy(model)
    x = flow.randn(512, 32)   # rows enough for blocks of 64 threads (one warp needs no shared array)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model.to("cuda")
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.5))

        def build(self, x):
            loss = (self.model(x) * x).sum()
            loss.backward()
            return loss

    graph = Step()
    got = graph(x.to("cuda")).numpy()
    loss = (eager(x) * x).sum()
    loss.backward()
    flow.optim.SGD(eager.parameters(), lr=0.5).step()
    np.testing.assert_allclose(got, loss.numpy(), rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    source = graph.compiled.sources["kernels.cu"]
    shared = [k.source.count("__shared__ double partial") for k in graph.compiled.program.kernels]
    assert max(shared) == SIBLING_MAX_REDUCTIONS and sum(shared) >= 40, shared
    assert len(nvrtc.compile_cuda(source, "sm_90")) > 0
