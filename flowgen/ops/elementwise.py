"""Elementwise ops: unary, binary (broadcasting) and ternary.

Each definition gives the NumPy reference, the gradient in flowgen ops and
the C++ expression the fused elementwise kernel evaluates.

Expression conventions (see `flowgen.ops.lowering.Elementwise`):

* ``{0}``, ``{1}``, ``{2}`` are the input values, already loaded (broadcast
  indexing done by the kernel) and converted to the compute type: ``float``
  for float32/float16/bfloat16 outputs (``double`` for float64), the input's
  own C++ type otherwise. Comparisons and logical ops produce ``bool``.
* Attributes appear by name (``{min}``, ``{max}``) rendered with
  `lowering.cpp_literal`; ``{idx}`` is the linear output index.
* Ops that may see integer inputs (abs, sign, relu, clamp, maximum, ...) use
  type-generic ternaries rather than float-only math functions; float-only
  functions (``expf``...) appear only in ops whose output is floating (the
  functional layer casts integer inputs to float32 first).
* The expression's value is converted to the output storage type by the kernel.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Elementwise
from flowgen.ops.registry import TensorMeta, ViewOf, broadcast_shapes, defop


def _needs(t) -> bool:
    """Whether a gradient for input `t` can be used (lazy tensors: always — autodiff decides)."""
    return t.requires_grad or t._value is not None


def _quiet(fn):
    """Run a NumPy reference with floating-point warnings silenced (log(0) = -inf, as torch)."""
    def ref(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    ref.__name__ = getattr(fn, "__name__", "ref")
    return ref


def _same_type(a, b):
    """Bring two arrays to one NumPy dtype when their dtypes differ (bf16 with f16, ...)."""
    if a.dtype == b.dtype:
        return a, b
    target = dt.promote(dt.from_numpy(a.dtype), dt.from_numpy(b.dtype)).np_dtype
    return a.astype(target, copy=False), b.astype(target, copy=False)


def _binary_ref(fn):
    def ref(a, b):
        if a.dtype != b.dtype:
            a, b = _same_type(a, b)
        return fn(a, b)
    ref.__name__ = getattr(fn, "__name__", "ref")
    return ref


def _bshape(a, b, name):
    """Broadcast two shapes (a fast path for the common cases; registry.broadcast_shapes words errors)."""
    if a == b:
        return a
    pa, pb = a, b
    if len(a) < len(b):
        pa = (1,) * (len(b) - len(a)) + tuple(a)
    elif len(b) < len(a):
        pb = (1,) * (len(a) - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return broadcast_shapes(a, b, op=name)  # raises the readable error
    return tuple(out)


def _binary_infer(name):
    def infer(a, b):
        shape = _bshape(a.shape, b.shape, name)
        return TensorMeta(shape, a.dtype if a.dtype == b.dtype else dt.promote(a.dtype, b.dtype))
    return infer


def _float_binary_infer(name):
    def infer(a, b):
        shape = _bshape(a.shape, b.shape, name)
        out = a.dtype if a.dtype == b.dtype else dt.promote(a.dtype, b.dtype)
        return TensorMeta(shape, out if out.is_floating else dt.float32)
    return infer


def _unary_infer(a):
    return a


def _float_unary_infer(a):
    return a if a.dtype.is_floating else TensorMeta(a.shape, dt.float32)


def _bool_unary_infer(a):
    return TensorMeta(a.shape, dt.bool_)


def _compare_infer(name):
    def infer(a, b):
        shape = _bshape(a.shape, b.shape, name)
        return TensorMeta(shape, dt.bool_)
    return infer


def _float_ref(fn):
    """A unary float reference; integer/bool inputs are computed in float32."""
    def ref(a):
        if a.dtype.kind in "iub":
            a = a.astype(np.float32)
        with np.errstate(all="ignore"):
            return fn(a)
    return ref


# ======================================================================== unary
def _unary(name, ref, expr, grad=None, infer=_float_unary_infer, doc="", **properties):
    defop(name, infer=infer, ref=ref, grad=grad, lowering=Elementwise(expr), doc=doc, **properties)


_unary("neg", np.negative, "(-({0}))", infer=_unary_infer,
       grad=lambda ctx, g: (F.neg(g),), linear_in=(0,))
_unary("abs", np.abs, "(({0}) < 0 ? -({0}) : ({0}))", infer=_unary_infer,
       grad=lambda ctx, g: (g * F.sign(ctx.inputs[0]),))
_unary("exp", _float_ref(np.exp), "expf({0})",
       grad=lambda ctx, g: (g * ctx.outputs[0],), autocast="float32")
_unary("log", _float_ref(np.log), "logf({0})",
       grad=lambda ctx, g: (g / ctx.inputs[0],), autocast="float32")
_unary("sqrt", _float_ref(np.sqrt), "sqrtf({0})",
       grad=lambda ctx, g: (g / (ctx.outputs[0] * 2),))
_unary("rsqrt", _float_ref(lambda a: 1 / np.sqrt(a)), "rsqrtf({0})",
       grad=lambda ctx, g: (g * F.pow(ctx.outputs[0], 3) * -0.5,), autocast="float32")
_unary("sin", _float_ref(np.sin), "sinf({0})",
       grad=lambda ctx, g: (g * F.cos(ctx.inputs[0]),))
_unary("cos", _float_ref(np.cos), "cosf({0})",
       grad=lambda ctx, g: (-(g * F.sin(ctx.inputs[0])),))
_unary("tanh", _float_ref(np.tanh), "tanhf({0})",
       grad=lambda ctx, g: (g * (1 - ctx.outputs[0] * ctx.outputs[0]),))


def _sigmoid_ref(a):
    # exp(-|a|) never overflows; both branches are the exact logistic function.
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1 / (1 + e), e / (1 + e)).astype(a.dtype, copy=False)


_unary("sigmoid", _float_ref(_sigmoid_ref), "(1.0f / (1.0f + expf(-({0}))))",
       grad=lambda ctx, g: (g * ctx.outputs[0] * (1 - ctx.outputs[0]),))


def _relu_ref(a):
    return np.where(a < 0, np.zeros((), a.dtype), a)


_unary("relu", _relu_ref, "(({0}) < 0 ? 0 : ({0}))", infer=_unary_infer,
       grad=lambda ctx, g: (F.where(ctx.outputs[0] > 0, g, 0),))

# ---- erf/erfc in float64 (math.erf, math.erfc: exact): the gelu references and erfinv's Newton steps.
_erf_exact = np.frompyfunc(math.erf, 1, 1)
_erfc_exact = np.frompyfunc(math.erfc, 1, 1)


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc of a float64 array (no cancellation for large arguments, unlike 1 - erf)."""
    return np.asarray(_erfc_exact(x), dtype=np.float64)   # frompyfunc gives a Python float for 0-d input


_SQRT1_2 = 0.70710678118654752
_INV_SQRT_2PI = 0.39894228040143268
_GELU_K = 0.79788456080286536  # sqrt(2/pi)
_GELU_C = 0.044715


def _gelu_ref(a, approximate="none"):
    x = a.astype(np.float64) if a.dtype != np.float64 else a
    with np.errstate(over="ignore"):
        if approximate == "tanh":       # x * 0.5 * (1 + tanh(u)) = x * sigmoid(2u): no cancellation for x << 0
            y = x / (1 + np.exp(-2 * _GELU_K * (x + _GELU_C * x ** 3)))
        else:                           # 0.5 * (1 + erf(z)) = 0.5 * erfc(-z), likewise
            y = 0.5 * x * _erfc(-x * _SQRT1_2)
    return y.astype(a.dtype if a.dtype.kind == "f" or a.dtype.kind == "V" else np.float32)


def _gelu_grad_ref(g, a, approximate="none"):
    x = a.astype(np.float64)
    with np.errstate(over="ignore"):
        if approximate == "tanh":       # s = sigmoid(2u) = (1 + tanh u) / 2, 1 - s = (1 - tanh u) / 2
            u2 = 2 * _GELU_K * (x + _GELU_C * x ** 3)
            s, s_minus = 1 / (1 + np.exp(-u2)), 1 / (1 + np.exp(u2))
            d = s + 2 * _GELU_K * x * s * s_minus * (1 + 3 * _GELU_C * x * x)
        else:
            d = 0.5 * _erfc(-x * _SQRT1_2) + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)
    return g.astype(np.float64) * d


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def _gelu_infer(a, approximate="none"):
    _check_approximate(approximate)
    return _float_unary_infer(a)


def _gelu_grad_infer(g, a, approximate="none"):
    _check_approximate(approximate)
    out = dt.promote(g.dtype, a.dtype)
    return TensorMeta(broadcast_shapes(g.shape, a.shape, op="gelu_grad"), out if out.is_floating else dt.float32)


# gelu's 0.5 * (1 + erf(z)) and 0.5 * (1 + tanh(u)) written as 0.5 * erfc(-z) and sigmoid(2u):
# for x << 0 the sum with 1 cancels in float (gelu_tanh(-5) came out 0 or 2x off, and Adam turns
# the sign of such a gradient into a whole step); these forms keep float32's relative precision.
_GELU_ERF = "(0.5f * ({0}) * erfcf(-({0}) * 0.70710678118654752f))"
_GELU_U2 = "1.5957691216057308f * (({1}) + 0.044715f * ({1}) * ({1}) * ({1}))"   # 2u = 2 sqrt(2/pi) (x + c x^3)
_GELU_TANH = "(({0}) / (1.0f + expf(-" + _GELU_U2.replace("{1}", "{0}") + ")))"
_GELU_GRAD_ERF = ("(({0}) * (0.5f * erfcf(-({1}) * 0.70710678118654752f) + "
                  "({1}) * 0.39894228040143268f * expf(-0.5f * ({1}) * ({1}))))")
_SIGMOID_2U = f"(1.0f / (1.0f + expf(-{_GELU_U2})))"
_SIGMOID_MINUS_2U = f"(1.0f / (1.0f + expf({_GELU_U2})))"
_GELU_GRAD_TANH = (f"(({{0}}) * ({_SIGMOID_2U} + 1.5957691216057308f * ({{1}}) * {_SIGMOID_2U} * "
                   f"{_SIGMOID_MINUS_2U} * (1.0f + 0.134145f * ({{1}}) * ({{1}}))))")


def _by_approximate(erf_expr, tanh_expr):
    def expr(attrs):
        return tanh_expr if attrs.get("approximate", "none") == "tanh" else erf_expr
    return expr


defop("gelu", infer=_gelu_infer, ref=_gelu_ref,
      grad=lambda ctx, g: (F.gelu_grad(g, ctx.inputs[0], ctx.attrs.get("approximate", "none")),),
      lowering=Elementwise(_by_approximate(_GELU_ERF, _GELU_TANH)),
      doc="gelu(x, approximate='none'|'tanh'); the expression depends on `approximate` (callable expr)")
defop("gelu_grad", infer=_gelu_grad_infer, ref=_gelu_grad_ref,
      lowering=Elementwise(_by_approximate(_GELU_GRAD_ERF, _GELU_GRAD_TANH)),
      doc="gelu_grad(grad_out, x, approximate): grad_out * gelu'(x)")


def _silu_grad(ctx, g):
    x = ctx.inputs[0]
    s = F.sigmoid(x)
    return (g * s * (1 + x * (1 - s)),)


_unary("silu", _float_ref(lambda a: a * _sigmoid_ref(a)), "(({0}) / (1.0f + expf(-({0}))))", grad=_silu_grad)
_unary("sign", lambda a: np.sign(a) if a.dtype.kind != "f" else np.where(np.isnan(a), a.dtype.type(0), np.sign(a)),
       "((({0}) > 0) - (({0}) < 0))", infer=_unary_infer, grad=lambda ctx, g: (None,),
       doc="-1, 0 or 1; 0 for NaN (the kernel's comparisons, and PyTorch)")
_unary("floor", np.floor, "floorf({0})", infer=_unary_infer, grad=lambda ctx, g: (None,))
_unary("reciprocal", _float_ref(lambda a: 1 / a), "(1.0f / ({0}))",
       grad=lambda ctx, g: (-(g * ctx.outputs[0] * ctx.outputs[0]),), autocast="float32")
_unary("logical_not", np.logical_not, "(!({0}))", infer=_bool_unary_infer)


def _erf_ref(a):
    return np.vectorize(math.erf, otypes=[a.dtype])(a) if a.size else a.copy()


_unary("erf", _float_ref(_erf_ref), "erff({0})",
       grad=lambda ctx, g: (g * F.exp(-ctx.inputs[0] * ctx.inputs[0]) * (2.0 / math.sqrt(math.pi)),))


# ---- erfinv: Giles' single-precision approximation ("Approximating the erfinv function", 2010)
# evaluated in float64, then Newton steps on erf(y) = x with the exact erf; the emulator's
# erfinvf (runtime_cpp/flowgen_emu.h) takes the same steps, CUDA has erfinvf built in.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                   -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _erfinv_ref(a):
    x = a.astype(np.float64)
    inside = np.abs(x) < 1
    xs = np.where(inside, x, 0.0)
    w = -np.log((1.0 - xs) * (1.0 + xs))
    central, tail = w - 2.5, np.sqrt(w) - 3.0
    p = np.where(w < 5, _ERFINV_CENTRAL[0], _ERFINV_TAIL[0])
    for c, t in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:]):
        p = np.where(w < 5, c + p * central, t + p * tail)
    y = p * xs
    for _ in range(2):
        y = y - (np.asarray(_erf_exact(y), np.float64) - xs) / (2.0 / math.sqrt(math.pi) * np.exp(-y * y))
    y = np.where(inside, y, np.where(np.abs(x) == 1, np.copysign(np.inf, x), np.nan))
    return y.astype(a.dtype)


_unary("erfinv", _float_ref(_erfinv_ref), "erfinvf({0})",
       grad=lambda ctx, g: (g * F.exp(ctx.outputs[0] * ctx.outputs[0]) * (math.sqrt(math.pi) / 2.0),),
       doc="erfinv(x): the y with erf(y) = x; +-inf at +-1, NaN outside [-1, 1]", autocast="float32")
_unary("log1p", _float_ref(np.log1p), "log1pf({0})",
       grad=lambda ctx, g: (g / (ctx.inputs[0] + 1),), autocast="float32")
_unary("expm1", _float_ref(np.expm1), "expm1f({0})",
       grad=lambda ctx, g: (g * (ctx.outputs[0] + 1),), autocast="float32")
# ---- trigonometric and hyperbolic functions, log2/log10/exp2: each its own C function (log2f(8) is
# exactly 3, sinhf keeps its relative precision near 0), float32 list of autocast for the ones PyTorch
# lists. The gradients are PyTorch's formulas, op for op, so edge values agree (asin'(1) = inf,
# acosh'(x) = 0 where x * x overflows, NaN outside the domain).
_LN2 = 0.6931471805599453
_LN10 = 2.3025850929940456

_unary("tan", _float_ref(np.tan), "tanf({0})",
       grad=lambda ctx, g: (g * (ctx.outputs[0] * ctx.outputs[0] + 1),), autocast="float32")
_unary("asin", _float_ref(np.arcsin), "asinf({0})",
       grad=lambda ctx, g: (g * F.rsqrt(1 - ctx.inputs[0] * ctx.inputs[0]),), autocast="float32")
_unary("acos", _float_ref(np.arccos), "acosf({0})",
       grad=lambda ctx, g: (-(g * F.rsqrt(1 - ctx.inputs[0] * ctx.inputs[0])),), autocast="float32")
_unary("atan", _float_ref(np.arctan), "atanf({0})",
       grad=lambda ctx, g: (g / (ctx.inputs[0] * ctx.inputs[0] + 1),))
_unary("sinh", _float_ref(np.sinh), "sinhf({0})",
       grad=lambda ctx, g: (g * F.cosh(ctx.inputs[0]),), autocast="float32")
_unary("cosh", _float_ref(np.cosh), "coshf({0})",
       grad=lambda ctx, g: (g * F.sinh(ctx.inputs[0]),), autocast="float32")
_unary("asinh", _float_ref(np.arcsinh), "asinhf({0})",
       grad=lambda ctx, g: (g * F.rsqrt(ctx.inputs[0] * ctx.inputs[0] + 1),))
_unary("acosh", _float_ref(np.arccosh), "acoshf({0})",
       grad=lambda ctx, g: (g * F.rsqrt(ctx.inputs[0] * ctx.inputs[0] - 1),))
_unary("atanh", _float_ref(np.arctanh), "atanhf({0})",
       grad=lambda ctx, g: (g / (1 - ctx.inputs[0] * ctx.inputs[0]),))
_unary("log2", _float_ref(np.log2), "log2f({0})",
       grad=lambda ctx, g: (g / (ctx.inputs[0] * _LN2),), autocast="float32")
_unary("log10", _float_ref(np.log10), "log10f({0})",
       grad=lambda ctx, g: (g / (ctx.inputs[0] * _LN10),), autocast="float32")
_unary("exp2", _float_ref(np.exp2), "exp2f({0})",
       grad=lambda ctx, g: (g * ctx.outputs[0] * _LN2,))


def _sinc_ref(a):
    """sin(pi x) / (pi x) with pi x rounded to x's dtype (as torch), 1 at 0."""
    product = a * a.dtype.type(math.pi)
    return np.where(a == 0, a.dtype.type(1), np.sin(product) / product).astype(a.dtype, copy=False)


def _sinc_grad(ctx, g):
    """PyTorch's sinc_backward: (pi x cos(pi x) - sin(pi x)) / (pi x^2), 0 where pi x^2 is 0."""
    x = ctx.inputs[0]
    x_pi = x * math.pi
    x_squared_pi = x * x * math.pi
    return (F.where(x_squared_pi == 0, 0, g * (x_pi * F.cos(x_pi) - F.sin(x_pi)) / x_squared_pi),)


_unary("sinc", _float_ref(_sinc_ref),
       "(({0}) == 0 ? 1.0f : sinf(3.14159265358979323846f * ({0})) / (3.14159265358979323846f * ({0})))",
       grad=_sinc_grad, doc="normalized sinc: sin(pi x) / (pi x), 1 at x = 0")


# ---- logit(x, eps): log(z / (1 - z)) with z = x clamped to [eps, 1 - eps] (eps None: z = x); its
# gradient is one op with PyTorch's logit_backward: 0 outside [eps, 1 - eps] (NaN outside [0, 1] with
# no eps), g / (x (1 - x)) inside; with no eps, g * inf at 0 and 1 (PyTorch's scalar kernel: the sign is
# g's, also at x = -0.0, where g / (x (1 - x)) would flip it; NaN where g is 0).
def _logit_clamped(x, eps):
    if eps is None:
        return x
    lo = x.dtype.type(eps)
    hi = x.dtype.type(1) - lo
    return np.where(x < lo, lo, np.where(x > hi, hi, x))


def _logit_ref(a, eps=None):
    z = _logit_clamped(a, eps)
    return np.log(z / (1 - z)).astype(a.dtype, copy=False)


def _logit_grad_ref(g, a, eps=None):
    g, x = _same_type(g, a)
    inside = g / (x * (1 - x))
    if eps is None:
        outside, fill = (x < 0) | (x > 1), np.nan
        inside = np.where((x == 0) | (x == 1), g * x.dtype.type(np.inf), inside)
    else:
        lo = x.dtype.type(eps)
        outside, fill = (x < lo) | (x > x.dtype.type(1) - lo), 0
    return np.where(outside, x.dtype.type(fill), inside).astype(x.dtype, copy=False)


def _logit_z(attrs) -> str:
    if attrs.get("eps") is None:
        return "({0})"
    return "(({0}) < {eps} ? {eps} : (({0}) > (1.0f - {eps}) ? (1.0f - {eps}) : ({0})))"


def _logit_expr(attrs) -> str:
    z = _logit_z(attrs)
    return f"logf({z} / (1.0f - {z}))"


def _logit_grad_expr(attrs) -> str:
    if attrs.get("eps") is None:
        return ("((({1}) < 0.0f || ({1}) > 1.0f) ? NAN : (({1}) == 0.0f || ({1}) == 1.0f) ? ({0}) * INFINITY"
                " : ({0}) / (({1}) * (1.0f - ({1}))))")
    return "((({1}) < {eps} || ({1}) > (1.0f - {eps})) ? 0.0f : ({0}) / (({1}) * (1.0f - ({1}))))"


def _logit_infer(a, eps=None):
    if eps is not None and not eps >= 0:
        raise ValueError(f"logit: eps must be None or a number >= 0 (the functional layer maps a negative eps "
                         f"to None, as PyTorch), got {eps!r}")
    return _float_unary_infer(a)


def _logit_grad_infer(g, a, eps=None):
    return _float_binary_infer("logit_grad")(g, a)


defop("logit", infer=_logit_infer, ref=_quiet(_logit_ref),
      grad=lambda ctx, g: (F.logit_grad(g, ctx.inputs[0], ctx.attrs.get("eps")),),
      lowering=Elementwise(_logit_expr),
      doc="logit(x, eps=None|float >= 0): log(z / (1 - z)), z = x clamped to [eps, 1 - eps] when eps is given")
defop("logit_grad", infer=_logit_grad_infer, ref=_quiet(_logit_grad_ref), lowering=Elementwise(_logit_grad_expr),
      doc="logit_grad(grad_out, x, eps): PyTorch's logit_backward")


# Rounding: piecewise constant, so no gradient flows (as torch: zeros).
_unary("ceil", np.ceil, "ceilf({0})", infer=_unary_infer, grad=lambda ctx, g: (None,))
_unary("trunc", np.trunc, "truncf({0})", infer=_unary_infer, grad=lambda ctx, g: (None,))
_unary("round", np.rint, "rintf({0})", infer=_unary_infer, grad=lambda ctx, g: (None,),
       doc="round half to even, as torch.round and np.rint")
_unary("isnan", np.isnan, "(({0}) != ({0}))", infer=_bool_unary_infer)
_unary("isinf", np.isinf, "isinf({0})", infer=_bool_unary_infer)
_unary("isfinite", np.isfinite, "isfinite({0})", infer=_bool_unary_infer)


def _cast_infer(a, dtype):
    return TensorMeta(a.shape, dt.get(dtype))


def _cast_ref(a, dtype):
    target = dt.get(dtype).np_dtype
    if a.dtype.kind == "f" and target.kind in "iu":
        with np.errstate(all="ignore"):
            return np.trunc(a).astype(target)
    return a.astype(target)


def _cast_grad(ctx, g):
    src = ctx.inputs[0].dtype
    return (F.cast(g, src) if src.is_floating else None,)


def _cast_expr(attrs) -> str:
    """Kernels hold 16-bit values in float between their load and store (codegen/fused.py), so a
    cast to float16/bfloat16 rounds there: x.to(bf16).to(float32) in one fused chain is the rounded
    value, as in eager (and autocast's casts of GEMM operands round once, wherever they fuse)."""
    target = dt.get(attrs["dtype"])
    if target == dt.float16:
        return "__half2float(__float2half({0}))"
    if target == dt.bfloat16:
        return "__bfloat162float(__float2bfloat16({0}))"
    return "({0})"


def _linear_cast(attrs) -> tuple:
    """A cast is linear only to a floating dtype: a cast to an integer truncates, and the truncated
    parts of a sum do not add up to the truncated sum."""
    return (0,) if attrs["dtype"].is_floating else ()


defop("cast", infer=_cast_infer, ref=_cast_ref, grad=_cast_grad, lowering=Elementwise(_cast_expr),
      doc="cast(x, dtype=DType); float -> int truncates toward zero", grad_reads_inputs=False,
      cast_scale="cast", linear_in=_linear_cast)

def _same_strides(shape: tuple, strides: tuple, attrs: dict, out_shape: tuple) -> tuple:
    return strides


defop("detach", infer=_unary_infer, ref=lambda a: a.copy(), lowering=Elementwise("({0})"),
      view=ViewOf(_same_strides, in_order=True, differentiable=False),
      doc="identity that stops gradients (Tensor.detach on lazy tensors)", grad_reads_inputs=False,
      linear_in=(0,))


def _with_value_infer(x, value):
    if tuple(value.shape) != tuple(x.shape) or value.dtype != x.dtype:
        raise ValueError(f"with_value: value of shape {tuple(value.shape)} and {value.dtype} for x of shape "
                         f"{tuple(x.shape)} and {x.dtype}")
    return x


defop("with_value", infer=_with_value_infer, ref=lambda x, value: value.copy(), grad=lambda ctx, g: (g, None),
      lowering=Elementwise("({1})"), grad_reads_inputs=False,
      doc="with_value(x, value): value's data with x's gradient (identity to x, none to value): a write through a "
          "detach()ed view, which PyTorch's autograd does not see")


def _clamp_infer(a, min=None, max=None, exclusive=False):
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    return a


def _clamp_ref(a, min=None, max=None, exclusive=False):
    """x < min ? min : x, then > max ? max : x, as the kernel and PyTorch (std::max/std::min): a value
    equal to a bound is kept, so clamp(-0.0, min=0) is -0.0 (np.maximum gave 0.0); NaN passes."""
    out = a
    if min is not None:
        out = np.where(out < min, np.asarray(min, dtype=a.dtype), out)
    if max is not None:
        out = np.where(out > max, np.asarray(max, dtype=a.dtype), out)
    return out


def _clamp_grad(ctx, g):
    x, lo, hi = ctx.inputs[0], ctx.attrs.get("min"), ctx.attrs.get("max")
    exclusive = ctx.attrs.get("exclusive", False)
    inside = None
    if lo is not None:
        inside = x > lo if exclusive else x >= lo
    if hi is not None:
        below = x < hi if exclusive else x <= hi
        inside = below if inside is None else F.logical_and(inside, below)
    return (F.where(inside, g, 0),)


defop("clamp", infer=_clamp_infer, ref=_clamp_ref, grad=_clamp_grad,
      lowering=Elementwise("(((({0}) < ({min}) ? ({min}) : ({0})) > ({max})) ? ({max}) : "
                           "(({0}) < ({min}) ? ({min}) : ({0})))"),
      doc="clamp(x, min, max, exclusive) = minimum(maximum(x, min), max). The functional layer never passes "
          "None: a missing bound becomes -inf/+inf (float) or the dtype's limit (int). The gradient passes "
          "where min <= x <= max (torch.clamp), with exclusive where min < x < max (torch's hardtanh, relu6).")


def _expand_infer(a, shape):
    shape = tuple(shape)
    if len(shape) < len(a.shape):
        raise ValueError(f"expand: cannot expand a tensor of shape {tuple(a.shape)} to {shape}: "
                         f"the target has fewer dims")
    lead = len(shape) - len(a.shape)
    for i, s in enumerate(a.shape):
        if s != 1 and s != shape[lead + i]:
            raise ValueError(f"expand: cannot expand a tensor of shape {tuple(a.shape)} to {shape} "
                             f"(dim {i} has size {s}, expected 1 or {shape[lead + i]})")
    if any(s < 0 for s in shape):
        raise ValueError(f"expand: invalid target shape {shape}")
    return TensorMeta(shape, a.dtype)


def _expand_strides(shape: tuple, strides: tuple, attrs: dict, out_shape: tuple) -> tuple:
    """A broadcast dim (and a new leading one) reads the same element: stride 0."""
    lead = len(out_shape) - len(shape)
    return (0,) * lead + tuple(0 if size == 1 and new != 1 else stride
                               for size, new, stride in zip(shape, out_shape[lead:], strides))


defop("expand", infer=_expand_infer, ref=lambda a, shape: np.broadcast_to(a, shape),
      grad=lambda ctx, g: (F.sum_to(g, ctx.inputs[0].shape),),
      lowering=Elementwise("({0})"),
      view=ViewOf(_expand_strides), doc="expand(x, shape): broadcast to `shape` (explicit, no -1)",
      grad_reads_inputs=False,
      linear_in=(0,), local_shape_attr=True)


# ======================================================================== binary
def _add_grad(ctx, g):
    a, b = ctx.inputs
    return (F.sum_to(g, a.shape) if _needs(a) else None, F.sum_to(g, b.shape) if _needs(b) else None)


def _sub_grad(ctx, g):
    a, b = ctx.inputs
    return (F.sum_to(g, a.shape) if _needs(a) else None, F.sum_to(-g, b.shape) if _needs(b) else None)


def _mul_grad(ctx, g):
    a, b = ctx.inputs
    return (F.sum_to(g * b, a.shape) if _needs(a) else None,
            F.sum_to(g * a, b.shape) if _needs(b) else None)


def _div_grad(ctx, g):
    a, b = ctx.inputs
    ga = F.sum_to(g / b, a.shape) if _needs(a) else None
    gb = F.sum_to(-(g * ctx.outputs[0]) / b, b.shape) if _needs(b) else None
    return ga, gb


def _constant_scalar(t):
    """The Python value of a 0-d/1-element constant (eager, no grad), else None."""
    if t._value is None and not t.requires_grad and t.numel() == 1:
        return t.item()
    return None


def _pow_grad(ctx, g):
    a, b = ctx.inputs
    ga = gb = None
    if _needs(a):
        e = _constant_scalar(b)
        if e is None or e == 0:
            # PyTorch's pow_backward: 0 where the exponent is 0 (b * a^(b - 1) is NaN there at a = 0)
            ga = F.sum_to(F.where(b == 0, 0, g * b * F.pow(a, b - 1)), a.shape)
        elif e == 2:
            ga = F.sum_to(g * a * 2, a.shape)
        elif e == 1:
            ga = F.sum_to(g, a.shape)
        else:
            ga = F.sum_to(g * F.pow(a, e - 1) * e, a.shape)
    if _needs(b):
        # d/db a^b = a^b log a, taken as 0 where a == 0 (the limit torch uses for b >= 0).
        gb = F.sum_to(g * ctx.outputs[0] * F.log(F.where(a == 0, 1, a)), b.shape)
    return ga, gb


def _minmax_grad(pick):
    def grad(ctx, g):
        a, b = ctx.inputs
        # The winner gets the gradient; ties split it evenly (as torch.maximum/minimum).
        wins = pick(a, b)
        ga = F.where(wins, g, F.where(a == b, g * 0.5, 0))
        gb = g - ga
        return (F.sum_to(ga, a.shape) if _needs(a) else None, F.sum_to(gb, b.shape) if _needs(b) else None)
    return grad


defop("add", infer=_binary_infer("add"), ref=_binary_ref(np.add), grad=_add_grad,
      lowering=Elementwise("({0} + {1})"), grad_reads_inputs=False, residual_add=True, additive=True)
defop("sub", infer=_binary_infer("sub"), ref=_binary_ref(np.subtract), grad=_sub_grad,
      lowering=Elementwise("({0} - {1})"), grad_reads_inputs=False, additive=True)
defop("mul", infer=_binary_infer("mul"), ref=_binary_ref(np.multiply), grad=_mul_grad,
      lowering=Elementwise("({0} * {1})"), cast_scale="scale", linear_in=(0, 1))
defop("div", infer=_float_binary_infer("div"), ref=_quiet(_binary_ref(np.true_divide)), grad=_div_grad,
      lowering=Elementwise("({0} / {1})"),
      doc="true division; integer inputs give float32 (the functional layer casts them first)",
      cast_scale="scale", linear_in=(0,))
defop("pow", infer=_binary_infer("pow"), ref=_quiet(_binary_ref(np.power)), grad=_pow_grad,
      lowering=Elementwise("flowgen_pow({0}, {1})"),
      doc="a ** b; integers exactly, wrapping on overflow as PyTorch (runtime_cpp/flowgen_cuda_prelude.h)",
      autocast="float32")
defop("maximum", infer=_binary_infer("maximum"), ref=_binary_ref(np.maximum),
      grad=_minmax_grad(lambda a, b: a > b),
      lowering=Elementwise("(((({0}) != ({0})) || ({0}) > ({1})) ? ({0}) : ({1}))"))
defop("minimum", infer=_binary_infer("minimum"), ref=_binary_ref(np.minimum),
      grad=_minmax_grad(lambda a, b: a < b),
      lowering=Elementwise("(((({0}) != ({0})) || ({0}) < ({1})) ? ({0}) : ({1}))"))



def _atan2_grad(ctx, g):
    a, b = ctx.inputs
    denom = a * a + b * b
    return (F.sum_to(g * b / denom, a.shape) if _needs(a) else None,
            F.sum_to(-g * a / denom, b.shape) if _needs(b) else None)


def _modulo_grad(quotient: str):
    """d/da (a - q(a/b) * b) = 1, d/db = -q(a/b), q = trunc (fmod) or floor (remainder)."""
    def grad(ctx, g):
        a, b = ctx.inputs
        return (F.sum_to(g, a.shape) if _needs(a) else None,
                F.sum_to(-g * getattr(F, quotient)(a / b), b.shape) if _needs(b) else None)
    return grad


def _float_only_binary_infer(name):
    def infer(a, b):
        if not (a.dtype.is_floating and b.dtype.is_floating):
            raise TypeError(f"{name}: only floating-point tensors are supported, got {a.dtype} and {b.dtype} "
                            f"(cast with .float())")
        return _binary_infer(name)(a, b)
    return infer


defop("atan2", infer=_float_binary_infer("atan2"), ref=_quiet(_binary_ref(np.arctan2)), grad=_atan2_grad,
      lowering=Elementwise("atan2f({0}, {1})"))
defop("fmod", infer=_float_only_binary_infer("fmod"), ref=_quiet(_binary_ref(np.fmod)), grad=_modulo_grad("trunc"),
      lowering=Elementwise("fmodf({0}, {1})"),
      doc="C fmod: the result takes the sign of the dividend (torch.fmod); floating inputs")
# remainder from fmod, as PyTorch: a - floor(a / b) * b rounds a / b first (remainder(20, 0.7) was
# 10 float32 ulps off, remainder(-1e30, 0.7) in float64 -1.4e14)
_REMAINDER = "(fmodf({0}, {1}) != 0.0f && ((fmodf({0}, {1}) < 0.0f) != (({1}) < 0.0f)) ? fmodf({0}, {1}) + ({1}) : fmodf({0}, {1}))"
defop("remainder", infer=_float_only_binary_infer("remainder"), ref=_quiet(_binary_ref(np.remainder)),
      grad=_modulo_grad("floor"), lowering=Elementwise("(" + _REMAINDER + ")"),
      doc="Python modulo: the result takes the sign of the divisor (torch.remainder); floating inputs")
defop("floor_divide", infer=_float_only_binary_infer("floor_divide"), ref=_quiet(_binary_ref(np.floor_divide)),
      lowering=Elementwise("flowgen_floor_divide({0}, {1})"),
      doc="floor of the exact quotient a / b (torch.div(rounding_mode='floor'), Python //); floating inputs, "
          "no gradient")

def _xlogy_ref(a, b):
    """x * log(y), 0 where x == 0, NaN where y is NaN (torch.xlogy)."""
    out = np.where(a == 0, np.zeros((), a.dtype), a * np.log(b))
    return np.where(np.isnan(b), b, out)


def _xlogy_grad(ctx, g):
    """PyTorch's: d/dx = xlogy(g, y), 0 where x == 0 and y <= 0; d/dy = g x / y."""
    a, b = ctx.inputs
    return (F.sum_to(F.where(F.logical_and(a == 0, b <= 0), 0, F.xlogy(g, b)), a.shape) if _needs(a) else None,
            F.sum_to(g * a / b, b.shape) if _needs(b) else None)


def _hypot_grad(ctx, g):
    a, b = ctx.inputs
    out = ctx.outputs[0]
    return (F.sum_to(g * a / out, a.shape) if _needs(a) else None,
            F.sum_to(g * b / out, b.shape) if _needs(b) else None)


def _logaddexp_ref(a, b):
    """max(a, b) + log1p(exp(-|a - b|)), and a where a == b is infinite (torch.logaddexp)."""
    out = np.maximum(a, b) + np.log1p(np.exp(-np.abs(a - b)))
    return np.where(np.isinf(a) & (a == b), a, out)


def _logaddexp_grad(ctx, g):
    a, b = ctx.inputs
    return (F.sum_to(g / (F.exp(b - a) + 1), a.shape) if _needs(a) else None,
            F.sum_to(g / (F.exp(a - b) + 1), b.shape) if _needs(b) else None)


def _copysign_grad(ctx, g):
    """PyTorch's: g * out / x, 0 where x == 0; none for the sign's source."""
    a, b = ctx.inputs
    return (F.sum_to(g * F.where(a == 0, 0, ctx.outputs[0] / a), a.shape) if _needs(a) else None, None)


defop("xlogy", infer=_float_binary_infer("xlogy"), ref=_quiet(_binary_ref(_xlogy_ref)), grad=_xlogy_grad,
      lowering=Elementwise("((({1}) != ({1})) ? ({1}) : (({0}) == 0 ? 0.0f : ({0}) * logf({1})))"),
      doc="x * log(y); 0 where x == 0 unless y is NaN")
defop("hypot", infer=_float_binary_infer("hypot"), ref=_quiet(_binary_ref(np.hypot)), grad=_hypot_grad,
      lowering=Elementwise("hypotf({0}, {1})"))
defop("logaddexp", infer=_float_binary_infer("logaddexp"), ref=_quiet(_binary_ref(_logaddexp_ref)),
      grad=_logaddexp_grad,
      lowering=Elementwise("((isinf({0}) && ({0}) == ({1})) ? ({0}) : "
                           "((({0}) < ({1}) ? ({1}) : ({0})) + log1pf(expf(-fabsf(({0}) - ({1}))))))"),
      doc="log(exp(a) + exp(b)) without overflow; a where a == b = +-inf")
defop("copysign", infer=_float_binary_infer("copysign"), ref=_quiet(_binary_ref(np.copysign)), grad=_copysign_grad,
      lowering=Elementwise("copysignf({0}, {1})"),
      doc="|a| with the sign bit of b (-0.0 and NaN signs count)")


for _name, _fn, _sym in (("eq", np.equal, "=="), ("ne", np.not_equal, "!="), ("lt", np.less, "<"),
                         ("le", np.less_equal, "<="), ("gt", np.greater, ">"), ("ge", np.greater_equal, ">=")):
    defop(_name, infer=_compare_infer(_name), ref=_binary_ref(_fn),
          lowering=Elementwise(f"(({{0}}) {_sym} ({{1}}))"))

defop("logical_and", infer=_compare_infer("logical_and"), ref=np.logical_and,
      lowering=Elementwise("(({0}) && ({1}))"))
defop("logical_or", infer=_compare_infer("logical_or"), ref=np.logical_or,
      lowering=Elementwise("(({0}) || ({1}))"))


# Bitwise ops on integer and bool tensors (`&`, `|`, `^`, `~`, as PyTorch; on bools they are the
# logical ops). Floating operands raise, as in PyTorch.
def _bitwise_infer(name):
    def infer(*operands):
        for t in operands:
            if t.dtype.is_floating:
                raise TypeError(f"{name}: only integer and bool tensors are supported, got {t.dtype} "
                                f"(PyTorch refuses floating operands too)")
        return _binary_infer(name)(*operands) if len(operands) == 2 else operands[0]
    return infer


for _name, _fn, _sym in (("bitwise_and", np.bitwise_and, "&"), ("bitwise_or", np.bitwise_or, "|"),
                         ("bitwise_xor", np.bitwise_xor, "^")):
    defop(_name, infer=_bitwise_infer(_name), ref=_binary_ref(_fn), lowering=Elementwise(f"(({{0}}) {_sym} ({{1}}))"),
          doc=f"a {_sym} b on integer or bool tensors")
# ~ of a bool is `!` (C++'s ~true is -2, which is true again as a bool)
defop("bitwise_not", infer=_bitwise_infer("bitwise_not"), ref=np.invert, lowering=Elementwise("flowgen_bitwise_not({0})"),
      doc="~a: the bits inverted, for bools the logical not")


# ======================================================================== ternary
def _where_infer(c, a, b):
    shape = broadcast_shapes(c.shape, a.shape, b.shape, op="where")
    return TensorMeta(shape, a.dtype if a.dtype == b.dtype else dt.promote(a.dtype, b.dtype))


def _where_ref(c, a, b):
    if a.dtype != b.dtype:
        a, b = _same_type(a, b)
    return np.where(c, a, b)


def _where_grad(ctx, g):
    c, a, b = ctx.inputs
    ga = F.sum_to(F.where(c, g, 0), a.shape) if _needs(a) else None
    gb = F.sum_to(F.where(c, 0, g), b.shape) if _needs(b) else None
    return None, ga, gb


defop("where", infer=_where_infer, ref=_where_ref, grad=_where_grad,
      lowering=Elementwise("(({0}) ? ({1}) : ({2}))"),
      doc="where(cond, a, b); cond is any dtype (nonzero = true)", grad_reads_inputs=False)
