"""Elementwise math beyond the basics (tan, asin/acos/atan, sinh/cosh, asinh/acosh/atanh, log2/log10/exp2,
sinc, logit, deg2rad/rad2deg, xlogy, hypot, logaddexp, copysign): eager forward and gradients against
PyTorch in float64 and float32 on edge values (0, -0, +-1, tiny, huge, +-inf, NaN, values outside the
domain), NaN-aware; one nn.Graph training step (CPU emulator) using all of them against eager flowgen,
whose kernels also compile with NVRTC."""

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ops.registry import REGISTRY
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


def _torch_one_at_a_time(torch_fn, arrays, g):
    """PyTorch's output and input gradients for same-shaped `arrays`, one element at a time. A
    one-element tensor always runs PyTorch's scalar CPU kernel; a longer one runs the vectorised
    kernel on whole blocks of twice the CPU's vector width (16 float32 on AVX2, 32 on AVX-512) and
    the scalar one on the rest, and the two differ at signed zeros (logit_backward at -0.0: g * inf
    in the scalar kernel, g / (x (1 - x)) in the vectorised one) and in last bits. Which elements
    PyTorch vectorises would then depend on the machine's CPU and the array's length."""
    outs, grads = [], [np.zeros_like(a) for a in arrays]
    for i in range(arrays[0].size):
        t_in = [torch.from_numpy(a.ravel()[i:i + 1].copy()).requires_grad_(True) for a in arrays]
        t_out = torch_fn(*t_in)
        t_out.backward(torch.from_numpy(g.ravel()[i:i + 1].copy()))
        outs.append(t_out.detach().numpy())
        for k, t in enumerate(t_in):
            if t.grad is not None:
                grads[k].ravel()[i] = t.grad.numpy()[0]
    return t_out.dtype, np.concatenate(outs).reshape(arrays[0].shape), grads


def _against_torch(flow_fn, torch_fn, arrays, dtype, rtol):
    """Forward and gradients against PyTorch, `rtol` allowing for the last bits of different math
    libraries (NumPy's SIMD functions depend on the CPU: float32 log10(1000) is 3.0000002 on AVX-512)."""
    arrays = [np.asarray(a, dtype) for a in arrays]
    f_in = [flow.tensor(a, requires_grad=True) for a in arrays]
    f_out = flow_fn(*f_in)
    g = _upstream(f_out.numel()).reshape(tuple(f_out.shape)).astype(dtype)
    if all(a.shape == arrays[0].shape for a in arrays):
        t_dtype, t_out, t_grads = _torch_one_at_a_time(torch_fn, arrays, g)
    else:   # broadcasting: the whole arrays (the values here are ordinary, no signed zeros or poles)
        t_in = [torch.from_numpy(a.copy()).requires_grad_(True) for a in arrays]
        out = torch_fn(*t_in)
        out.backward(torch.from_numpy(g))
        t_dtype, t_out = out.dtype, out.detach().numpy()
        t_grads = [t.grad.numpy() if t.grad is not None else np.zeros_like(a) for t, a in zip(t_in, arrays)]
    assert f_out.dtype.name == str(t_dtype).replace("torch.", "")
    _same(f_out.numpy(), t_out, rtol, "forward")
    (f_out * flow.tensor(g)).sum().backward()
    for k, (fi, want) in enumerate(zip(f_in, t_grads)):
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


# NumPy's vectorised math functions are not correctly rounded and differ between CPUs (float32
# log10(1000) is 3.0 with AVX2, 3.0000002 with AVX-512): results that are exact in real arithmetic
# are compared in units in the last place, as PyTorch's own tests allow a few.
MAX_ULPS = 2


def test_values_exact_in_real_arithmetic_to_an_ulp_and_methods():
    x = flow.tensor([8.0, 1000.0, 0.001])
    np.testing.assert_array_max_ulp(flow.log2(x)[0].numpy(), np.float32(3.0), MAX_ULPS)
    np.testing.assert_array_max_ulp(flow.log10(x)[1:].numpy(), np.float32([3.0, -3.0]), MAX_ULPS)
    np.testing.assert_array_max_ulp(flow.exp2(flow.tensor([10.0, -3.0])).numpy(), np.float32([1024.0, 0.125]),
                                    MAX_ULPS)
    tiny = flow.tensor([1e-30, 1e-8], dtype=flow.float64)
    for name in ("sinh", "asinh", "tan", "asin", "atan", "atanh"):   # x + O(x^3): no loss of precision near 0
        np.testing.assert_allclose(getattr(tiny, name)().numpy(), [1e-30, 1e-8], rtol=1e-15)
    assert flow.xlogy(0.0, flow.tensor([0.0, NAN, -1.0])).numpy().tolist()[::2] == [0.0, 0.0]
    assert np.isnan(flow.xlogy(0.0, flow.tensor([NAN])).item())
    ints = flow.tensor([1, 2, 4])
    assert ints.log2().dtype == flow.float32
    np.testing.assert_array_max_ulp(ints.log2().numpy(), np.float32([0.0, 1.0, 2.0]), MAX_ULPS)
    assert flow.arcsin is flow.asin and flow.arctanh is flow.atanh
    np.testing.assert_allclose(flow.tensor([180.0]).deg2rad().item(), np.pi, rtol=1e-7)


SIGNED_ZERO_OPS = {
    "logit": (flow.logit, torch.logit), "log10": (flow.log10, torch.log10), "atanh": (flow.atanh, torch.atanh),
    "pow0": (lambda x: x ** 0, lambda x: x ** 0), "pow-1": (lambda x: x ** -1, lambda x: x ** -1),
    "pow_tensor0": (lambda x: flow.pow(x, x * 0), lambda x: torch.pow(x, x * 0)),
    "clamp": (lambda x: flow.clamp(x, 0.0, 1.0), lambda x: torch.clamp(x, 0.0, 1.0)),
    "elu": (nn.functional.elu, torch.nn.functional.elu), "selu": (nn.functional.selu, torch.nn.functional.selu),
    "celu": (lambda x: nn.functional.celu(x, 0.5), lambda x: torch.nn.functional.celu(x, 0.5)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SIGNED_ZERO_OPS)
def test_signed_zeros_in_values_and_gradients_follow_torch(name, dtype):
    """At +0.0 and -0.0 with upstream gradients +1 and -1 the value and the gradient have PyTorch's
    sign (logit'(-0.0) with g = -1 is -inf: g * inf, not g / (x (1 - x))), and 0 ** 0's gradient is 0
    (it was NaN: 0 * 0 ** -1)."""
    flow_fn, torch_fn = SIGNED_ZERO_OPS[name]
    x = np.array([0.0, -0.0, 0.0, -0.0], DTYPES[dtype][0])
    g = np.array([1.0, 1.0, -1.0, -1.0], x.dtype)
    _, want, (want_grad,) = _torch_one_at_a_time(torch_fn, [x], g)
    fx = flow.tensor(x, requires_grad=True)
    out = flow_fn(fx)
    out.backward(flow.tensor(g))
    for got, expected, what in ((out.numpy(), want, "value"), (fx.grad.numpy(), want_grad, "gradient")):
        assert np.array_equal(np.isnan(got), np.isnan(expected)), (what, got, expected)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(expected), err_msg=f"{what}: {got} vs {expected}")
        np.testing.assert_array_equal(got, expected, err_msg=what)


def test_elu_family_keeps_relative_precision_near_zero():
    """exp(x) - 1 is 0 in float32 for |x| < 3e-8: elu(-1e-8) was 0 instead of -1e-8 (expm1, as PyTorch)."""
    x = flow.tensor([-1e-8, -1e-30])
    for fn, scale in ((nn.functional.elu, 1.0), (nn.functional.selu, 1.0507009873554805 * 1.6732632423543772),
                      (lambda t: nn.functional.celu(t, 2.0), 1.0)):
        np.testing.assert_allclose(fn(x).numpy(), np.array([-1e-8, -1e-30]) * scale, rtol=1e-6)


def test_autocast_runs_pytorchs_float32_list_in_float32():
    x = flow.tensor([0.5, 0.25])
    with flow.autocast("cpu", dtype=flow.bfloat16):
        h = x.to(flow.bfloat16)
        upcast = [flow.acos(h), flow.asin(h), flow.cosh(h), flow.sinh(h), flow.tan(h), flow.log2(h), flow.log10(h)]
        kept = [flow.atan(h), flow.exp2(h), flow.tanh(h)]
    assert all(y.dtype == flow.float32 for y in upcast)
    assert all(y.dtype == flow.bfloat16 for y in kept)
    assert all(REGISTRY[name].extra["autocast"] == "float32"
               for name in ("acos", "asin", "cosh", "sinh", "tan", "log2", "log10"))


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
