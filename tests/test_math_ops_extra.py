"""Elementwise math beyond the basics (tan, asin/acos/atan, sinh/cosh, asinh/acosh/atanh, log2/log10/exp2,
sinc, logit, deg2rad/rad2deg, xlogy, hypot, logaddexp, copysign): eager forward and gradients against
PyTorch in float64 and float32 on edge values (0, -0, +-1, tiny, huge, +-inf, NaN, values outside the
domain), NaN-aware; one nn.Graph training step (CPU emulator) using all of them against eager flowgen,
whose kernels also compile with NVRTC."""

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen import mixed_precision
from flowgen.runtime import nvrtc
from torch_oracle import get_torch

torch = get_torch()
# NumPy warns where the edge values make inf * 0 or inf - inf inside gradient formulas (PyTorch: NaN, silently).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

INF, NAN = float("inf"), float("nan")
# Every unary function sees all of these: each domain's edges (+-1 for asin/acos/atanh, 1 for acosh,
# 0 and 1 for logit) and values outside it.
VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 0.25, 0.999, 1.001, 1.5, 2.0, -3.0, 10.0, 88.5, -100.0, 1e-7, -1e-6,
          1e-30, 1e20, -1e20, INF, -INF, NAN]
# Binary functions: every pair of these.
PAIR_VALUES = [0.0, -0.0, 1.0, -1.0, 2.5, -3.0, 1e-20, 1e20, 40.0, INF, -INF, NAN]

# name -> (flowgen function, torch function); the Tensor method of the same name is checked too.
UNARY = {
    "tan": (flow.tan, torch.tan), "asin": (flow.asin, torch.asin), "acos": (flow.acos, torch.acos),
    "atan": (flow.atan, torch.atan), "sinh": (flow.sinh, torch.sinh), "cosh": (flow.cosh, torch.cosh),
    "asinh": (flow.asinh, torch.asinh), "acosh": (flow.acosh, torch.acosh), "atanh": (flow.atanh, torch.atanh),
    "log2": (flow.log2, torch.log2), "log10": (flow.log10, torch.log10), "exp2": (flow.exp2, torch.exp2),
    "sinc": (flow.sinc, torch.sinc), "deg2rad": (flow.deg2rad, torch.deg2rad),
    "rad2deg": (flow.rad2deg, torch.rad2deg), "logit": (flow.logit, torch.logit),
    "logit_eps": (lambda x: flow.logit(x, eps=1e-6), lambda x: torch.logit(x, eps=1e-6)),
    "logit_eps_wide": (lambda x: x.logit(0.2), lambda x: x.logit(0.2)),
}
BINARY = {
    "xlogy": (flow.xlogy, torch.xlogy), "hypot": (flow.hypot, torch.hypot),
    "logaddexp": (flow.logaddexp, torch.logaddexp), "copysign": (flow.copysign, torch.copysign),
}
DTYPES = {"float64": (np.float64, 1e-13), "float32": (np.float32, 2e-6)}   # dtype, rtol (a few float32 ulps)


def _upstream(n, seed=0):
    """A fixed upstream gradient with some zeros (0 * inf at a pole is NaN in PyTorch)."""
    g = np.random.default_rng(seed).standard_normal(n)
    g[3::5] = 0.0
    return g


def _same(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN at {np.isnan(got)} vs torch {np.isnan(want)}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0.0, equal_nan=True, err_msg=what)


def _against_torch(flow_fn, torch_fn, arrays, dtype, rtol):
    arrays = [np.asarray(a, dtype) for a in arrays]
    f_in = [flow.tensor(a, requires_grad=True) for a in arrays]
    t_in = [torch.from_numpy(a.copy()).requires_grad_(True) for a in arrays]
    f_out, t_out = flow_fn(*f_in), torch_fn(*t_in)
    assert f_out.dtype.name == str(t_out.dtype).replace("torch.", "")
    _same(f_out.numpy(), t_out.detach().numpy(), rtol, "forward")
    g = _upstream(t_out.numel()).reshape(tuple(t_out.shape)).astype(dtype)
    (f_out * flow.tensor(g)).sum().backward()
    t_out.backward(torch.from_numpy(g))
    for k, (fi, ti) in enumerate(zip(f_in, t_in)):
        want = ti.grad.numpy() if ti.grad is not None else np.zeros_like(arrays[k])
        got = fi.grad.numpy() if fi.grad is not None else np.zeros_like(arrays[k])
        _same(got, want, rtol, f"gradient of input {k}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", UNARY)
def test_unary_like_torch(name, dtype):
    flow_fn, torch_fn = UNARY[name]
    _against_torch(flow_fn, torch_fn, [VALUES], *DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BINARY)
def test_binary_like_torch(name, dtype):
    a, b = (v.ravel() for v in np.meshgrid(PAIR_VALUES, PAIR_VALUES))
    flow_fn, torch_fn = BINARY[name]
    _against_torch(flow_fn, torch_fn, [a, b], *DTYPES[dtype])


@pytest.mark.parametrize("name", BINARY)
def test_binary_broadcasts_and_reduces_gradients_like_torch(name):
    rng = np.random.default_rng(3)
    a, b = np.abs(rng.standard_normal((3, 1))) + 0.1, rng.standard_normal(4) * 2
    a[0, 0] = 0.0
    _against_torch(*BINARY[name], [a, b], *DTYPES["float64"])


def test_exact_values_and_methods():
    x = flow.tensor([8.0, 1000.0, 0.001])
    assert flow.log2(x)[0].item() == 3.0 and flow.log10(x)[1].item() == 3.0 and flow.log10(x)[2].item() == -3.0
    assert flow.exp2(flow.tensor([10.0, -3.0])).numpy().tolist() == [1024.0, 0.125]
    tiny = flow.tensor([1e-30, 1e-8], dtype=flow.float64)
    for name in ("sinh", "asinh", "tan", "asin", "atan", "atanh"):   # x + O(x^3): no loss of precision near 0
        np.testing.assert_allclose(getattr(tiny, name)().numpy(), [1e-30, 1e-8], rtol=1e-15)
    assert flow.xlogy(0.0, flow.tensor([0.0, NAN, -1.0])).numpy().tolist()[::2] == [0.0, 0.0]
    assert np.isnan(flow.xlogy(0.0, flow.tensor([NAN])).item())
    ints = flow.tensor([1, 2, 4])
    assert ints.log2().dtype == flow.float32 and ints.log2().numpy().tolist() == [0.0, 1.0, 2.0]
    assert flow.arcsin is flow.asin and flow.arctanh is flow.atanh
    np.testing.assert_allclose(flow.tensor([180.0]).deg2rad().item(), np.pi, rtol=1e-7)


def test_autocast_runs_pytorchs_float32_list_in_float32():
    x = flow.tensor([0.5, 0.25])
    with flow.autocast("cpu", dtype=flow.bfloat16):
        h = x.to(flow.bfloat16)
        upcast = [flow.acos(h), flow.asin(h), flow.cosh(h), flow.sinh(h), flow.tan(h), flow.log2(h), flow.log10(h)]
        kept = [flow.atan(h), flow.exp2(h), flow.tanh(h)]
    assert all(y.dtype == flow.float32 for y in upcast)
    assert all(y.dtype == flow.bfloat16 for y in kept)
    assert {"acos", "asin", "cosh", "sinh", "tan", "log2", "log10"} <= mixed_precision.FLOAT32


# ---------------------------------------------------------------- one graph using all of them
GRAPH_UNARY = ["tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2",
               "sinc", "deg2rad", "rad2deg", "logit", "logit_eps", "logit_eps_wide"]


class AllFunctions(nn.Module):
    """Row i of x through unary function i, row j of (a, b) through binary function j, each plus a
    zero parameter: after one SGD step with lr 1 a parameter is minus its gradient, exactly (NaN and
    inf included), so the graph's gradients at the edge values can be read back."""

    def __init__(self, dtype, n_values, n_pairs):
        super().__init__()
        self.du = nn.Parameter(flow.zeros(len(GRAPH_UNARY), n_values, dtype=dtype))
        self.da = nn.Parameter(flow.zeros(len(BINARY), n_pairs, dtype=dtype))
        self.db = nn.Parameter(flow.zeros(len(BINARY), n_pairs, dtype=dtype))

    def forward(self, x, a, b):
        u, pa, pb = x + self.du, a + self.da, b + self.db
        outs = [UNARY[name][0](u[i]) for i, name in enumerate(GRAPH_UNARY)]
        outs += [fn(pa[j], pb[j]) for j, (fn, _) in enumerate(BINARY.values())]
        return flow.cat(outs)


class Step(nn.Graph):
    def __init__(self, model, weights):
        super().__init__()
        self.model, self.weights = model, weights
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1.0))

    def build(self, x, a, b):
        out = self.model(x, a, b)
        (out * self.weights).sum().backward()
        return out


def _eager_step(model, weights, x, a, b):
    out = model(x, a, b)
    (out * weights).sum().backward()
    return out, [-p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_step_with_all_functions_equals_eager(dtype):
    np_dtype, rtol = DTYPES[dtype]
    fdtype = getattr(flow, dtype)
    a, b = (v.ravel() for v in np.meshgrid(PAIR_VALUES, PAIR_VALUES))
    x = flow.tensor(np.tile(np.asarray(VALUES, np_dtype), (len(GRAPH_UNARY), 1)))
    a = flow.tensor(np.tile(a.astype(np_dtype), (len(BINARY), 1)))
    b = flow.tensor(np.tile(b.astype(np_dtype), (len(BINARY), 1)))
    model = AllFunctions(fdtype, len(VALUES), a.shape[1])
    n_out = len(GRAPH_UNARY) * len(VALUES) + len(BINARY) * a.shape[1]
    weights = flow.tensor(_upstream(n_out, seed=1).astype(np_dtype))
    eager_out, eager_steps = _eager_step(AllFunctions(fdtype, len(VALUES), a.shape[1]), weights, x, a, b)
    graph = Step(model, weights)
    got = graph(x, a, b)
    _same(got.numpy(), eager_out.numpy(), rtol, "graph forward")
    for p, want in zip(model.parameters(), eager_steps):
        _same(p.numpy(), want, rtol, "graph gradient")
    source = graph.compiled.sources["kernels.cu"]
    for fn in ("log2", "exp2", "asinh", "hypot", "copysign"):   # the double functions in float64 kernels
        assert (f"{fn}f(" in source) == (dtype == "float32"), fn
    assert len(nvrtc.compile_cuda(source, "sm_80")) > 0
