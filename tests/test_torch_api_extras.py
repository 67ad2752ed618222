"""PyTorch APIs a model file may use (activations, RMSNorm, PReLU, padding layers, adaptive max
pooling, prod, tensordot, index_add, scatter_add, isclose, %, //, mT, sum_to_size): eager forward
and gradients against PyTorch in float64, and a representative set trained in one nn.Graph
(emulator) against eager flowgen."""
import copy

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
import flowgen.nn.functional as F
from torch_oracle import get_torch

torch = get_torch()
TF = torch.nn.functional


def _rng(seed=0):
    return np.random.default_rng(seed)


def _compare(flow_fn, torch_fn, *arrays, atol=1e-10, rtol=1e-9):
    """Forward outputs and the gradient of every floating input for the same random upstream
    gradient, float64 throughout."""
    f_in = [flow.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    t_in = [torch.from_numpy(a.copy()).requires_grad_(a.dtype.kind == "f") for a in arrays]
    f_out, t_out = flow_fn(*f_in), torch_fn(*t_in)
    f_outs = list(f_out) if isinstance(f_out, tuple) else [f_out]
    t_outs = list(t_out) if isinstance(t_out, tuple) else [t_out]
    for fo, to in zip(f_outs, t_outs, strict=True):
        np.testing.assert_allclose(fo.numpy(), to.detach().numpy(), atol=atol, rtol=rtol)
        assert fo.dtype.name == str(to.dtype).replace("torch.", ""), (fo.dtype, to.dtype)
    f_total = t_total = 0
    for k, (fo, to) in enumerate(zip(f_outs, t_outs)):
        if to.requires_grad:
            r = _rng(k + 1).standard_normal(tuple(to.shape))
            f_total = f_total + (fo * flow.tensor(r)).sum()
            t_total = t_total + (to * torch.from_numpy(r)).sum()
    if isinstance(t_total, int):
        return
    f_total.backward()
    t_total.backward()
    for i, (fi, ti) in enumerate(zip(f_in, t_in)):
        if ti.requires_grad:
            expected = ti.grad.numpy() if ti.grad is not None else np.zeros(ti.shape)
            got = fi.grad.numpy() if fi.grad is not None else np.zeros(fi.shape)
            np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol, err_msg=f"gradient of input {i}")


def _x(*shape, seed=0):
    """Random float64 values with exact zeros and +-0.5 (the kinks of shrink/threshold functions)."""
    x = _rng(seed).standard_normal(shape) * 2
    flat = x.reshape(-1)
    flat[::7] = 0.0
    flat[3::11] = 0.5
    flat[5::13] = -0.5
    return x


ELEMENTWISE = [
    ("logsigmoid", F.logsigmoid, TF.logsigmoid),
    ("softsign", F.softsign, TF.softsign),
    ("celu", lambda x: F.celu(x, 0.7), lambda x: TF.celu(x, 0.7)),
    ("celu_default", F.celu, TF.celu),
    ("selu", F.selu, TF.selu),
    ("tanhshrink", F.tanhshrink, TF.tanhshrink),
    ("softshrink", F.softshrink, TF.softshrink),
    ("softshrink_lambd", lambda x: F.softshrink(x, lambd=1.0), lambda x: TF.softshrink(x, lambd=1.0)),
    ("hardshrink", F.hardshrink, TF.hardshrink),
    ("hardshrink_lambd", lambda x: F.hardshrink(x, lambd=0.0), lambda x: TF.hardshrink(x, lambd=0.0)),
    ("threshold", lambda x: F.threshold(x, 0.5, -2.0), lambda x: TF.threshold(x, 0.5, -2.0)),
    ("glu", F.glu, TF.glu),
    ("glu_dim1", lambda x: F.glu(x, dim=1), lambda x: TF.glu(x, dim=1)),
    ("softmin", lambda x: F.softmin(x, dim=1), lambda x: TF.softmin(x, dim=1)),
    ("softmin_legacy_dim", F.softmin, lambda x: TF.softmin(x, dim=0)),      # 3-D: PyTorch's legacy dim 0
    ("rms_norm", lambda x: F.rms_norm(x, (6,)), lambda x: TF.rms_norm(x, (6,))),
    ("rms_norm_eps", lambda x: F.rms_norm(x, (4, 6), eps=1e-3), lambda x: TF.rms_norm(x, (4, 6), eps=1e-3)),
    ("prod_all", flow.prod, torch.prod),
    ("prod_dim", lambda x: flow.prod(x, 1), lambda x: torch.prod(x, 1)),
    ("prod_keepdim", lambda x: x.prod(dim=-1, keepdim=True), lambda x: x.prod(dim=-1, keepdim=True)),
    ("mod_scalar", lambda x: x % 1.5, lambda x: x % 1.5),
    ("mod_negative_divisor", lambda x: x % -0.75, lambda x: x % -0.75),
    ("mT", lambda x: x.mT, lambda x: x.mT),
    ("sum_to_size", lambda x: x.sum_to_size(1, 4, 1), lambda x: x.sum_to_size(1, 4, 1)),
    ("sum_to_size_tuple", lambda x: x.sum_to_size((4, 6)), lambda x: x.sum_to_size((4, 6))),
]


@pytest.mark.parametrize("name,flow_fn,torch_fn", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_elementwise_like_torch(name, flow_fn, torch_fn):
    # torch's celu backward takes 1 / alpha in float32 (derivatives.yaml: 1.0 / alpha.toFloat()), so
    # with alpha = 0.7 its float64 gradient is off by ~5e-8 relative; flowgen's is exact.
    _compare(flow_fn, torch_fn, _x(3, 4, 6), rtol=1e-7 if name == "celu" else 1e-9)


def test_prod_gradient_with_zeros():
    x = _rng(1).standard_normal((4, 5))
    x[0, 1] = 0.0                       # one zero in a row
    x[1, 0] = x[1, 3] = 0.0             # two zeros in a row
    x[2, 4] = 0.0                       # a zero last
    _compare(lambda t: flow.prod(t, 1), lambda t: torch.prod(t, 1), x)
    _compare(lambda t: flow.prod(t, 0), lambda t: torch.prod(t, 0), x)
    _compare(flow.prod, torch.prod, x)


def test_prod_integer_and_empty():
    a = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    got = flow.prod(flow.tensor(a), 1)
    assert got.dtype == flow.int64 and got.numpy().tolist() == [6, 120]
    empty = flow.prod(flow.zeros(2, 0, dtype=flow.float64), 1)
    np.testing.assert_array_equal(empty.numpy(), torch.prod(torch.zeros(2, 0, dtype=torch.float64), 1).numpy())


def test_prelu_functional_and_module():
    x, w = _x(2, 3, 4, 5), np.array([0.25, -0.5, 1.5])
    _compare(F.prelu, TF.prelu, x, w)
    _compare(F.prelu, TF.prelu, x, np.array([0.1]))
    _compare(F.prelu, TF.prelu, _x(7), np.array([0.3]))
    with pytest.raises(RuntimeError, match="prelu"):
        F.prelu(flow.tensor(x), flow.tensor(np.ones(4)))
    m = nn.PReLU(3, init=0.1).to(flow.float64)
    assert m.weight.shape == (3,) and np.allclose(m.weight.numpy(), 0.1)
    tm = torch.nn.PReLU(3, init=0.1).double()
    _compare(lambda t: m(t), lambda t: tm(t), x)
    np.testing.assert_allclose(m.weight.grad.numpy(), tm.weight.grad.numpy(), rtol=1e-9, atol=1e-10)


def test_rms_norm_module():
    x = _x(3, 4, 6)
    m, tm = nn.RMSNorm(6), torch.nn.RMSNorm(6)
    assert m.eps is None and tm.eps is None
    m = m.to(flow.float64)
    with flow.no_grad():
        m.weight.copy_(flow.tensor(np.linspace(0.5, 1.5, 6)))
    tm = tm.double()
    with torch.no_grad():
        tm.weight.copy_(torch.from_numpy(np.linspace(0.5, 1.5, 6)))
    _compare(lambda t: m(t), lambda t: tm(t), x)
    np.testing.assert_allclose(m.weight.grad.numpy(), tm.weight.grad.numpy(), rtol=1e-9, atol=1e-10)
    plain = nn.RMSNorm([4, 6], eps=1e-4, elementwise_affine=False)
    assert plain.weight is None
    _compare(lambda t: plain(t), lambda t: torch.nn.RMSNorm([4, 6], eps=1e-4, elementwise_affine=False)(t), x)
    # eps None: float32 input uses float32's epsilon
    x32 = np.full((2, 3), 1e-4, np.float32)
    np.testing.assert_allclose(nn.RMSNorm(3)(flow.tensor(x32)).numpy(),
                               torch.nn.RMSNorm(3)(torch.from_numpy(x32)).detach().numpy(), rtol=1e-6)


MODULES = [
    ("LogSigmoid", lambda m: m.LogSigmoid()),
    ("Softsign", lambda m: m.Softsign()),
    ("CELU", lambda m: m.CELU(alpha=0.5)),          # 1 / 0.5 is exact in float32 (see the celu test)
    ("SELU", lambda m: m.SELU()),
    ("Tanhshrink", lambda m: m.Tanhshrink()),
    ("Softshrink", lambda m: m.Softshrink(0.3)),
    ("Hardshrink", lambda m: m.Hardshrink(0.3)),
    ("Threshold", lambda m: m.Threshold(0.1, 20.0)),
    ("GLU", lambda m: m.GLU(dim=1)),
    ("Softmin", lambda m: m.Softmin(dim=-1)),
    ("Softmax2d", lambda m: m.Softmax2d()),
    ("ZeroPad2d", lambda m: m.ZeroPad2d((1, 2, 0, 3))),
    ("ConstantPad2d", lambda m: m.ConstantPad2d(2, 3.5)),
    ("ReflectionPad2d", lambda m: m.ReflectionPad2d((2, 1, 1, 2))),
    ("ReplicationPad2d", lambda m: m.ReplicationPad2d(3)),
    ("AdaptiveMaxPool2d_even", lambda m: m.AdaptiveMaxPool2d((3, 2))),
    ("AdaptiveMaxPool2d_uneven", lambda m: m.AdaptiveMaxPool2d((4, 5))),
    ("AdaptiveMaxPool2d_none", lambda m: m.AdaptiveMaxPool2d((None, 4))),
    ("AdaptiveMaxPool2d_indices", lambda m: m.AdaptiveMaxPool2d(4, return_indices=True)),
    ("AdaptiveMaxPool2d_even_indices", lambda m: m.AdaptiveMaxPool2d((2, 3), return_indices=True)),
]


@pytest.mark.parametrize("name,make", MODULES, ids=[c[0] for c in MODULES])
def test_modules_like_torch(name, make):
    x = _x(2, 4, 6, 6, seed=3)
    _compare(make(nn), make(torch.nn), x)
    _compare(make(nn), make(torch.nn), x[0])        # unbatched (C, H, W)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("dims, kwargs", [(1, dict(padding=2, dilation=2)), (1, dict(padding="same", kernel_size=4)),
                                          (2, dict(padding=(1, 2), stride=2)), (2, dict(padding="same", dilation=2)),
                                          (2, dict(padding="valid")), (3, dict(padding=1, groups=2))])
def test_conv_padding_modes_like_torch(mode, dims, kwargs):
    kwargs = dict(kwargs)
    kernel = kwargs.pop("kernel_size", 3)
    name = f"Conv{dims}d"
    torch.manual_seed(0)
    theirs = getattr(torch.nn, name)(4, 2, kernel, padding_mode=mode, **kwargs).double()
    ours = getattr(nn, name)(4, 2, kernel, padding_mode=mode, **kwargs)
    ours.load_state_dict({k: flow.tensor(v.detach().numpy()) for k, v in theirs.state_dict().items()})
    _compare(lambda x, w, b: _with_params(ours, w, b)(x), lambda x, w, b: _with_params(theirs, w, b)(x),
             _x(2, 4, *[5, 6, 4][:dims]), theirs.weight.detach().numpy(), theirs.bias.detach().numpy())


def _with_params(conv, weight, bias):
    """`conv` whose weight and bias are the given tensors (so their gradients are compared too)."""
    del conv.weight, conv.bias
    conv.weight, conv.bias = weight, bias
    return conv


def test_conv_padding_mode_errors():
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        nn.Conv2d(2, 2, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="ConvTranspose2d: only 'zeros' padding mode"):
        nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")


def test_adaptive_max_pool_ties_follow_torch():
    """Plateaus of equal values: the gradient goes to the first maximum in row-major order."""
    x = np.zeros((1, 2, 5, 7))
    x[0, 1, 1:4, 2:6] = 1.0
    _compare(lambda t: F.adaptive_max_pool2d(t, (3, 4), return_indices=True),
             lambda t: TF.adaptive_max_pool2d(t, (3, 4), return_indices=True), x)


def test_linear_algebra_like_torch():
    rng = _rng(2)
    a, v = rng.standard_normal((4, 5)), rng.standard_normal(5)
    _compare(flow.mv, torch.mv, a, v)
    _compare(lambda p, q: p.mv(q), lambda p, q: p.mv(q), a, v)
    x, y = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4, 5))
    _compare(flow.tensordot, torch.tensordot, x, y)
    _compare(lambda p, q: flow.tensordot(p, q, dims=1), lambda p, q: torch.tensordot(p, q, dims=1),
             rng.standard_normal((2, 3)), rng.standard_normal((3, 4)))
    _compare(lambda p, q: flow.tensordot(p, q, dims=([1, 0], [0, 2])),
             lambda p, q: torch.tensordot(p, q, dims=([1, 0], [0, 2])), x, rng.standard_normal((3, 5, 2)))
    _compare(lambda p, q: flow.tensordot(p, q, 0), lambda p, q: torch.tensordot(p, q, 0),
             rng.standard_normal(2), rng.standard_normal(3))


def test_index_add_and_scatter_add_like_torch():
    rng = _rng(4)
    x, src = rng.standard_normal((5, 3)), rng.standard_normal((4, 3))
    index = np.array([0, 4, 0, 2])
    _compare(lambda a, i, s: flow.index_add(a, 0, i, s), lambda a, i, s: torch.index_add(a, 0, i, s), x, index, src)
    _compare(lambda a, i, s: a.index_add(1, i, s, alpha=-2.0), lambda a, i, s: a.index_add(1, i, s, alpha=-2.0),
             x, np.array([2, 2, 0, 1]), rng.standard_normal((5, 4)))
    sidx = np.array([[0, 1, 0], [2, 0, 2]])
    _compare(lambda a, i, s: flow.scatter_add(a, 0, i, s), lambda a, i, s: torch.scatter_add(a, 0, i, s),
             rng.standard_normal((3, 4)), sidx, rng.standard_normal((2, 3)))
    # src larger than index: only its leading part is read (forward only: torch's backward refuses it)
    a, i, s = rng.standard_normal((2, 4)), np.array([[3, 3], [0, 1]]), rng.standard_normal((3, 5))
    np.testing.assert_allclose(flow.tensor(a).scatter_add(1, flow.tensor(i), flow.tensor(s)).numpy(),
                               torch.from_numpy(a).scatter_add(1, torch.from_numpy(i), torch.from_numpy(s)).numpy(),
                               rtol=1e-12)


def test_isclose_like_torch():
    a = np.array([1.0, 1.0 + 1e-6, np.nan, np.inf, -np.inf, np.inf, 0.0, 1e-9])
    b = np.array([1.0, 1.0, np.nan, np.inf, np.inf, 1e300, 1e-9, 0.0])
    for kwargs in ({}, {"equal_nan": True}, {"rtol": 0.0, "atol": 0.0}, {"rtol": 1e-3, "atol": 0.0}):
        got = flow.isclose(flow.tensor(a), flow.tensor(b), **kwargs)
        assert got.dtype == flow.bool
        np.testing.assert_array_equal(got.numpy(), torch.isclose(torch.from_numpy(a), torch.from_numpy(b),
                                                                 **kwargs).numpy())
    x = flow.tensor(a, requires_grad=True)
    assert not x.isclose(flow.tensor(b)).requires_grad
    ints = flow.tensor(np.array([1, 5, 9])), flow.tensor(np.array([2, 5, 7]))
    np.testing.assert_array_equal(flow.isclose(*ints, atol=1.0).numpy(),
                                  torch.isclose(torch.tensor([1, 5, 9]), torch.tensor([2, 5, 7]), atol=1.0).numpy())


def test_floor_divide_and_mod_like_torch():
    a, b = _x(3, 4), _rng(5).uniform(0.5, 2.0, (3, 4)) * np.where(_rng(6).random((3, 4)) < 0.5, -1, 1)
    _compare(lambda p, q: p % q, lambda p, q: p % q, a, b)
    # scalar % tensor: torch has no gradient for the divisor there, so forward only
    np.testing.assert_allclose((2.5 % flow.tensor(b)).numpy(), (2.5 % torch.from_numpy(b)).numpy(), rtol=1e-12)
    x = flow.tensor(a, requires_grad=True)
    np.testing.assert_array_equal((x // 0.75).numpy(), (torch.from_numpy(a) // 0.75).numpy())
    assert not (x // 0.75).requires_grad        # torch raises on a backward through floor_divide
    ints = np.array([-7, -1, 0, 5, 9])
    np.testing.assert_array_equal((flow.tensor(ints) // 4).numpy(), (torch.from_numpy(ints) // 4).numpy())


def test_errors_name_the_problem():
    x = flow.randn(2, 3)
    with pytest.raises(RuntimeError, match="Halving dimension must be even"):
        F.glu(x, dim=1)
    with pytest.raises(RuntimeError, match="lambda must be greater or equal to 0"):
        F.softshrink(x, -1.0)
    with pytest.raises(RuntimeError, match="mT"):
        flow.randn(3).mT
    with pytest.raises(ValueError, match="cannot be summed"):
        x.sum_to_size(3, 3)
    with pytest.raises(RuntimeError, match="contracted dimensions"):
        flow.tensordot(x, flow.randn(2, 3), dims=1)
    with pytest.raises(ValueError, match="mv"):
        flow.mv(x, x)
    with pytest.raises(TypeError, match="remainder"):
        flow.tensor(np.array([3, 4])) % 2


# ------------------------------------------------------------------ training in one graph

class _Extras(nn.Module):
    """One model through the additions: padding layers, a circular-padded conv, PReLU, CELU/SELU/logsigmoid/softshrink,
    GLU, RMSNorm, adaptive max pooling, index_add, prod (with zeros in its input) and %."""

    def __init__(self):
        super().__init__()
        self.pads = nn.Sequential(nn.ReflectionPad2d(1), nn.ReplicationPad2d((1, 0, 0, 1)), nn.ZeroPad2d(1),
                                  nn.ConstantPad2d((0, 1, 1, 0), 0.5))
        self.conv = nn.Conv2d(2, 4, 3, padding=(1, 2), padding_mode="circular")
        self.prelu = nn.PReLU(4, init=0.2)
        self.pool = nn.AdaptiveMaxPool2d((4, 3))        # uneven windows over 9 x 10
        self.norm = nn.RMSNorm(24)
        self.fc = nn.Linear(24, 8)
        self.glu = nn.GLU()
        self.table = nn.Parameter(flow.randn(6, 4) * 0.1)

    def forward(self, x):
        h = self.pool(self.conv(self.pads(x)))                                 # (N, 4, 10, 13) -> (N, 4, 4, 3)
        h = self.prelu(h - h.mean())                                           # negative inputs too
        h = F.celu(h, 0.8) + F.selu(h) * 0.5 + F.logsigmoid(h) + F.softshrink(h, 0.2)
        pooled = flow.reshape(h, (-1, 24)) % 2.5                               # (2N, 24)
        g = self.glu(self.fc(self.norm(pooled)))                               # (2N, 4)
        rows = flow.index_add(self.table, 0, flow.tensor(np.array([1, 4, 1, 5])), g) + 1.0    # (6, 4)
        # exact zeros (one or two in a row) whose gradient is 1, so prod's gradient at them counts
        zeroed = rows - flow.where(_ZEROS, rows.detach(), 0.0)
        return flow.prod(zeroed, 1)


_ZEROS = flow.tensor(np.array([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]],
                              dtype=bool))


def test_extras_train_in_graph_like_eager():
    flow.manual_seed(0)
    model = _Extras().to(flow.float64)
    eager = copy.deepcopy(model)
    opt_g = flow.optim.SGD(model.parameters(), lr=0.1)
    opt_e = flow.optim.SGD(eager.parameters(), lr=0.1)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt_g)

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    step = Step()
    rng = _rng(7)
    for _ in range(2):
        x = flow.tensor(rng.standard_normal((2, 2, 4, 5)))
        got = step(x)
        loss = eager(x).sum()
        opt_e.zero_grad()
        loss.backward()
        opt_e.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=1e-9, atol=1e-12)
    for name, value in eager.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
