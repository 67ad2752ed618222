"""Mixed precision with PyTorch's autocast semantics (flowgen/mixed_precision.py): under
`graph.config.enable_amp(True, dtype=...)` and `flow.autocast(...)` GEMM/conv/attention results stay
16-bit, float32-listed ops (softmax, cross entropy, layer_norm, sums...) upcast, parameters and
their gradients stay float32. The oracle is `torch.autocast("cpu", dtype=torch.bfloat16)` on the
same model and weights.

Tolerances. bf16 keeps 8 significant bits: one rounding is off by at most u = 2^-8 relative. Each
16-bit activation is rounded once where it is stored; torch rounds at the same places (its CPU
kernels also compute in float32 and store bf16), but flowgen keeps a fused chain (GEMM + bias +
activation) in float32 registers and rounds once at the store, where torch rounds after the GEMM and
again after the bias and the activation, and the two sum in different orders. So values differ by a
few u: forward outputs and losses are compared at rtol 4u..8u (depth of the network), parameters
after k SGD steps at k * lr * (a few u of the gradient's size). Float32 AMP would agree to 1e-6.
"""
import copy
import os
import sys

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ops.registry import REGISTRY
from torch_oracle import get_torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt_char  # noqa: E402

U_BF16 = 2.0 ** -8


def test_autocast_classes_are_pytorchs_lists_in_flowgens_op_names():
    """Each op declares its class with its defop (autocast=); together they are PyTorch's CUDA lists."""
    def declaring(autocast):
        return {name for name, op in REGISTRY.items() if op.extra["autocast"] == autocast}
    assert declaring("lower_precision") == {"matmul", "conv2d", "conv2d_grad_input", "attention", "attention_dropout"}
    assert declaring("float32") == {
        "softmax", "log_softmax", "cross_entropy_rows", "binary_cross_entropy", "layer_norm", "exp", "expm1", "log",
        "log1p", "log2", "log10", "pow", "reciprocal", "rsqrt", "erfinv", "tan", "asin", "acos", "sinh", "cosh", "sum",
        "mean", "cumsum", "cumprod"}


def test_autocast_refuses_other_dtypes_and_devices():
    with pytest.raises(ValueError, match="float16 or flow.bfloat16"):
        flow.autocast("cpu", dtype=flow.float64)
    with pytest.raises(ValueError, match="device_type"):
        flow.amp.autocast("tpu")


def test_eager_autocast_dtypes_follow_the_lists():
    lin = nn.Linear(8, 4)
    x = flow.randn(3, 8, requires_grad=True)
    with flow.autocast("cpu", dtype=flow.bfloat16):
        y = lin(x)                                   # lower precision: weight, bias and input cast
        p = nn.functional.softmax(y, dim=-1)         # float32 list
        z = y * 2.0                                  # runs in its input's dtype
        w = y + flow.ones(3, 4)                      # bf16 + float32 promotes to float32
        loss = p.sum() + z.sum()
    assert (y.dtype, p.dtype, z.dtype, w.dtype, loss.dtype) == (
        flow.bfloat16, flow.float32, flow.bfloat16, flow.float32, flow.float32)
    loss.backward()
    assert lin.weight.grad.dtype == lin.bias.grad.dtype == x.grad.dtype == flow.float32
    outside = lin(x)
    assert outside.dtype == flow.float32


class TrainGraph(nn.Graph):
    def __init__(self, model, loss_fn, optimizer, dtype):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, dtype=dtype)

    def build(self, x, y):
        out = self.model(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        return out, loss


def torch_copy(torch, model_flow, model_torch):
    model_torch.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in model_flow.state_dict().items()})
    return model_torch


def train_against_torch(model, model_t, loss_fn, loss_t, xs, ys, lr):
    """(max |out diff| / max |out|, max loss rel diff, [param max abs diff]) after len(xs) SGD steps of
    a bf16-AMP graph and torch autocast."""
    torch = get_torch()
    graph = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=lr), flow.bfloat16)
    opt_t = torch.optim.SGD(model_t.parameters(), lr=lr)
    out_err = loss_err = 0.0
    for x, y in zip(xs, ys):
        out, loss = graph(flow.tensor(x), flow.tensor(y))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_t = model_t(torch.from_numpy(x))
            l_t = loss_t(out_t, torch.from_numpy(y))
        opt_t.zero_grad()
        l_t.backward()
        opt_t.step()
        assert out.dtype == flow.bfloat16 and str(out_t.dtype) == "torch.bfloat16"
        assert loss.dtype == flow.float32 and str(l_t.dtype) == "torch.float32"
        o, ot = out.numpy().astype(np.float64), out_t.detach().float().numpy().astype(np.float64)
        out_err = max(out_err, np.abs(o - ot).max() / np.abs(ot).max())
        loss_err = max(loss_err, abs(float(loss) - l_t.item()) / abs(l_t.item()))
    param_err = [np.abs(p.numpy() - q.detach().numpy()).max() for p, q in zip(model.parameters(), model_t.parameters())]
    assert all(p.dtype == flow.float32 for p in model.parameters())
    return graph, out_err, loss_err, param_err


def stored_dtypes(graph) -> dict:
    """Bytes of the program's intermediate buffers (IR values made by kernels) per dtype name."""
    out = {}
    for node in graph.compiled.ir.nodes:
        for v in node.outputs:
            out[v.dtype.name] = out.get(v.dtype.name, 0) + v.numel * v.dtype.itemsize
    return out


def test_mlp_bf16_amp_graph_matches_torch_autocast():
    torch = get_torch()
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model_t = torch_copy(torch, model, torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3)]
    ys = [rng.standard_normal((16, 10)).astype(np.float32) for _ in range(3)]
    graph, out_err, loss_err, param_err = train_against_torch(model, model_t, nn.MSELoss(), torch.nn.MSELoss(),
                                                              xs, ys, lr=0.1)
    # three bf16 layers: each output a few u off, relative to the largest output (measured 1.4u);
    # the loss, a mean of squares, averages the roundings out (measured 1.2e-4)
    assert out_err <= 4 * U_BF16
    assert loss_err <= U_BF16
    # 3 steps of lr 0.1 on gradients of size <= ~0.5, each within u (measured 3e-5)
    assert max(param_err) <= 3 * 0.1 * 0.5 * U_BF16
    stored = stored_dtypes(graph)
    assert stored["bfloat16"] > 0
    ir = str(graph.compiled.ir)
    assert "bf16[16,64]" in ir and "bf16[16,10]" in ir          # hidden activations and the output


def test_conv_batchnorm_bf16_amp_graph_matches_torch_autocast():
    torch = get_torch()
    flow.manual_seed(0)

    def net(m):
        return m.Sequential(m.Conv2d(3, 8, 3, padding=1), m.BatchNorm2d(8), m.ReLU(),
                            m.Conv2d(8, 8, 3, padding=1, bias=False), m.BatchNorm2d(8), m.ReLU(),
                            m.AdaptiveAvgPool2d(1), m.Flatten(), m.Linear(8, 4))

    model = net(nn)
    model_t = torch_copy(torch, model, net(torch.nn))
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((4, 3, 8, 8)).astype(np.float32) for _ in range(2)]
    ys = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2)]
    graph, out_err, loss_err, param_err = train_against_torch(model, model_t, nn.MSELoss(), torch.nn.MSELoss(),
                                                              xs, ys, lr=0.05)
    # BatchNorm divides by the batch's deviation: a few u of the bf16 conv output stay a few u
    # (measured 1.2u; loss 2.9e-4; parameters 3.7e-4 after 2 steps of lr 0.05)
    assert out_err <= 4 * U_BF16
    assert loss_err <= U_BF16
    assert max(param_err) <= 2 * 0.05 * 2 * U_BF16
    for (name, buf), buf_t in zip(model.named_buffers(), model_t.buffers()):   # running statistics: float32
        assert buf.dtype in (flow.float32, flow.int64), name
        np.testing.assert_allclose(buf.numpy(), buf_t.numpy(), rtol=0, atol=4 * U_BF16, err_msg=name)
    ir = str(graph.compiled.ir)
    assert "bf16[4,8,8,8]" in ir        # the conv and BatchNorm outputs


def gpt_pair(torch):
    """(config, corpus, flowgen GPT, torch GPT with the same weights) of the small GPT."""
    config = gpt_char.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    corpus = gpt_char.Corpus()
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(0)
    ours = gpt_char.define(flow)(config)
    return config, corpus, ours, torch_copy(torch, ours, gpt_char.define(torch)(config))


@pytest.mark.slow
def test_gpt_bf16_amp_graph_matches_torch_autocast():
    torch = get_torch()
    config, corpus, ours, theirs = gpt_pair(torch)
    # SGD: a parameter's difference is lr times its gradients' (AdamW would turn the rounding noise
    # of near-zero gradients into whole lr-sized steps, hiding the comparison)
    opt_f = flow.optim.SGD(ours.parameters(), lr=0.5)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.5)

    class Step(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = ours
            self.add_optimizer(opt_f)
            self.config.enable_amp(True, dtype=flow.bfloat16)

        def build(self, x, y):
            logits, loss = self.model(x, y)
            loss.backward()
            return logits, loss

    step = Step()
    for x, y in corpus.batches(3, 4, config.block_size):
        logits, loss = step(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_t, loss_t = theirs(torch.from_numpy(x.numpy()), torch.from_numpy(y.numpy()))
        opt_t.zero_grad()
        loss_t.backward()
        opt_t.step()
        assert logits.dtype == flow.bfloat16 and loss.dtype == flow.float32
        # cross entropy from bf16 logits a few u apart: the mean over 64 rows averages the roundings
        # (measured 1.7e-4 relative; logits 2u of the largest)
        assert abs(float(loss) - loss_t.item()) <= U_BF16 * loss_t.item()
        diff = np.abs(logits.numpy().astype(np.float64) - logits_t.detach().float().numpy())
        assert diff.max() <= 8 * U_BF16 * np.abs(logits_t.detach().float().numpy()).max()
    # 3 steps of lr 0.5: gradients within u of the largest gradient (~0.3) apart (measured: 9e-4,
    # the tied embedding / lm_head weight; the bound is 1.8e-3)
    worst = {}
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.dtype == flow.float32
        worst[name] = np.abs(p.numpy() - q.detach().numpy()).max()
    assert max(worst.values()) <= 3 * 0.5 * 0.3 * U_BF16, worst
    stored = stored_dtypes(step)
    assert stored["bfloat16"] > 0


def test_fp16_amp_graph_with_grad_scaler_equals_eager_autocast():
    """The same op lists eagerly (flow.autocast) and in a graph (enable_amp), fp16 with the
    GradScaler inside the step: losses and parameters agree to fp16 rounding (u = 2^-11; fused
    chains round once where eager rounds after every op)."""
    u_fp16 = 2.0 ** -11
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.1), flow.float16)
    graph.set_grad_scaler(flow.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2))
    opt = flow.optim.SGD(eager.parameters(), lr=0.1)
    scaler = flow.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    rng = np.random.default_rng(2)
    for _ in range(3):
        x = flow.tensor(rng.standard_normal((8, 16)).astype(np.float32))
        y = flow.tensor(rng.standard_normal((8, 4)).astype(np.float32))
        out, loss = graph(x, y)
        with flow.autocast("cuda", dtype=flow.float16):
            out_e = eager(x)
            loss_e = loss_fn(out_e, y)
        opt.zero_grad()
        scaler.scale(loss_e).backward()
        scaler.step(opt)
        scaler.update()
        assert out.dtype == out_e.dtype == flow.float16 and loss.dtype == loss_e.dtype == flow.float32
        assert abs(float(loss) - float(loss_e)) <= 4 * u_fp16 * float(loss_e)
    assert graph._grad_scaler.get_scale() == scaler.get_scale() == 2.0 ** 11
    for p, q in zip(model.parameters(), eager.parameters()):
        assert p.grad is None or p.grad.dtype == flow.float32
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=0, atol=3 * 0.1 * 4 * u_fp16)


@pytest.mark.parametrize("dtype", [flow.bfloat16, flow.float16])
def test_a_cast_to_16_bits_rounds_inside_a_fused_chain(dtype):
    """x.to(16 bits).to(float32) between float32 ops is one fused kernel: it rounds as eager does."""
    class Round(nn.Graph):
        def build(self, x):
            return (x * 3.0).to(dtype).to(flow.float32) * 2.0

    x = flow.tensor(np.linspace(0.1, 1.0, 37, dtype=np.float32))
    graph = Round()
    want = ((x * 3.0).to(dtype).to(flow.float32) * 2.0).numpy()
    assert not np.array_equal(want, (x * 6.0).numpy())
    assert np.array_equal(graph(x).numpy(), want)
    assert graph.compiled.num_launches == 1


def test_gpt_eager_autocast_matches_torch_autocast():
    """flow.autocast around the eager GPT (same weights) against torch.autocast: PyTorch's CPU kernels
    and flowgen's NumPy references both compute in float32 and round each op's result to bf16, so
    logits differ by about one rounding (u relative to the largest logit), losses by less."""
    torch = get_torch()
    config, corpus, ours, theirs = gpt_pair(torch)
    opt_f = flow.optim.SGD(ours.parameters(), lr=0.5)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.5)
    for x, y in corpus.batches(2, 2, config.block_size):
        with flow.autocast("cpu", dtype=flow.bfloat16):
            logits, loss = ours(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_t, loss_t = theirs(torch.from_numpy(x.numpy()), torch.from_numpy(y.numpy()))
        assert logits.dtype == flow.bfloat16 and loss.dtype == flow.float32
        want = logits_t.detach().float().numpy()
        assert np.abs(logits.numpy().astype(np.float32) - want).max() <= 2 * U_BF16 * np.abs(want).max()
        assert abs(float(loss) - loss_t.item()) <= U_BF16 * loss_t.item()
        for opt, lo in ((opt_f, loss), (opt_t, loss_t)):
            opt.zero_grad()
            lo.backward()
            opt.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.grad.dtype == flow.float32, name
        # 2 steps of lr 0.5, gradients within 2u of the largest (~0.3) apart (measured 1.05e-3)
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=0, atol=2 * 0.5 * 0.3 * 2 * U_BF16,
                                   err_msg=name)


FAMILIES = {
    "max_pool2d": lambda h: nn.functional.max_pool2d(h, 2),
    "avg_pool2d": lambda h: nn.functional.avg_pool2d(h, 2),
    "upsample_bilinear2d": lambda h: nn.functional.interpolate(h, scale_factor=2, mode="bilinear",
                                                               align_corners=False),
    "index_select": lambda h: flow.index_select(h, 1, flow.tensor([0, 2, 2, 3])),
    "gather": lambda h: flow.gather(h, 3, flow.tensor(np.tile([0, 5, 5, 2, 1, 0], (2, 4, 6, 1)))),
    "sort": lambda h: flow.sort(h.reshape(2, -1), dim=1)[0],
    "cat_slice": lambda h: flow.cat([h, h[:, 1:3]], 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_kernel_families_train_on_bf16_activations(name):
    """A bf16 conv output through each family (forward and its gradient kernel: pooling gradients,
    upsample's, the scatter kernels of index_select / gather / sort) trains like eager flow.autocast:
    outputs a bf16 rounding apart (the graph rounds conv + bias once, eager twice), one SGD step's
    weights within lr * that of the gradient."""
    fn = FAMILIES[name]
    flow.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    eager = copy.deepcopy(conv)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.conv = conv
            self.add_optimizer(flow.optim.SGD(conv.parameters(), lr=0.1))
            self.config.enable_amp(True, dtype=flow.bfloat16)

        def build(self, x):
            out = fn(self.conv(x))
            loss = (out.float() ** 2).mean()
            loss.backward()
            return out, loss

    x = flow.randn(2, 3, 6, 6)
    out, loss = Step()(x)
    with flow.autocast("cpu", dtype=flow.bfloat16):
        out_e = fn(eager(x))
        loss_e = (out_e.float() ** 2).mean()
    loss_e.backward()
    assert out.dtype == out_e.dtype == flow.bfloat16
    want = out_e.numpy().astype(np.float32)
    np.testing.assert_allclose(out.numpy().astype(np.float32), want, rtol=0, atol=2 * U_BF16 * np.abs(want).max())
    grad = eager.weight.grad.numpy()
    step = (eager.weight.numpy() - conv.weight.numpy()) / 0.1
    np.testing.assert_allclose(step, grad, rtol=0, atol=4 * U_BF16 * np.abs(grad).max())


def test_an_autocast_block_inside_build_applies_to_its_ops_only():
    lin = nn.Linear(4, 4)

    class Mixed(nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def build(self, x):
            with flow.autocast("cuda", dtype=flow.bfloat16):
                low = self.lin(x)
            return low, self.lin(x)

    x = flow.randn(2, 4)
    low, full = Mixed()(x)
    assert (low.dtype, full.dtype) == (flow.bfloat16, flow.float32)
    with flow.autocast("cuda", dtype=flow.bfloat16):
        want = lin(x)
    # the graph rounds the GEMM + bias once, eager after each: a bf16 rounding apart
    want = want.numpy().astype(np.float32)
    np.testing.assert_allclose(low.numpy().astype(np.float32), want, rtol=0, atol=U_BF16 * np.abs(want).max())
    np.testing.assert_allclose(full.numpy(), lin(x).numpy(), rtol=1e-6, atol=1e-6)


def test_autocast_as_a_decorator_and_disabled_inside():
    lin = nn.Linear(3, 3)

    @flow.amp.autocast("cpu")
    def forward(x):
        with flow.autocast("cpu", enabled=False):
            full = lin(x)
        return lin(x), full

    low, full = forward(flow.randn(2, 3))
    assert (low.dtype, full.dtype) == (flow.bfloat16, flow.float32)
    assert lin(flow.randn(2, 3)).dtype == flow.float32


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_a_bfloat16_parameter_trains_in_a_graph_and_keeps_its_dtype(optimizer):
    """The update of a bfloat16 parameter (its math promotes with the float32 gradient and
    hyper-parameters) is stored back in bfloat16, as eager's in-place step: it wrote float32 values
    over the 2-byte buffer before (wrong parameters and a corrupted heap)."""
    def model():
        flow.manual_seed(0)
        return nn.Linear(6, 3).to(flow.bfloat16)

    ours, eager = model(), model()
    make = {"SGD": lambda ps: flow.optim.SGD(ps, lr=0.1, momentum=0.9),
            "Adam": lambda ps: flow.optim.Adam(ps, lr=0.01)}[optimizer]

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = ours
            self.add_optimizer(make(ours.parameters()))

        def build(self, x):
            loss = (self.model(x).float() ** 2).mean()
            loss.backward()
            return loss

    step, opt = Step(), make(eager.parameters())
    x = flow.randn(4, 6).to(flow.bfloat16)
    for _ in range(2):
        step(x)
        loss = (eager(x).float() ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p, q in zip(ours.parameters(), eager.parameters()):
        assert p.dtype == q.dtype == flow.bfloat16
        # fused update math rounds once, eager's after each op: a bf16 rounding or two apart
        np.testing.assert_allclose(p.numpy().astype(np.float32), q.numpy().astype(np.float32), rtol=4 * U_BF16,
                                   atol=U_BF16 * 0.1)
