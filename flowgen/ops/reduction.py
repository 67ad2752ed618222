"""Reductions: sum / max / min over explicit dims, sum_to (undo broadcasting), argmax / argmin.

Attributes are always explicit (the functional layer normalises them):

* ``sum(x, dims=tuple[int], keepdim=bool)`` — ``dims`` sorted, non-negative; ``()``
  reduces nothing (identity). Integer and bool inputs sum to int64.
* ``max/min(x, dims, keepdim, split_ties)`` — values only. Gradient: split evenly among
  ties with ``split_ties`` (``amax/amin``, as ``torch.amax``) or over several or all dims
  (as ``torch.max(x)``); otherwise (``max(x, dim)``: a single dim of a tensor with 2+ dims)
  routed to the first extremum along that dim, the index argmax picks (as ``torch.max(x, dim)``).
* ``mean(x, dims, keepdim)`` — floating inputs; the float64 (float32 for f16/bf16) sum divided
  by the count before the one rounding, so the mean of n equal values is that value exactly.
* ``sum_to(x, shape)`` — sum the broadcast dims away so the result has ``shape``
  (leading dims of x beyond len(shape), and dims where shape has 1 and x does not).
* ``argmax/argmin(x, dim=int, keepdim)`` — int64, first occurrence on ties.

Reduction identities are C++ literals for floating types; for integer types the
kernel uses ``std::numeric_limits<T>::lowest()/max()`` (max/min) and 0 (sum).
Float16/bfloat16 sums accumulate in float32, as the kernels do.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Reduction, Template
from flowgen.ops.registry import TensorMeta, defop, normalize_dim, normalize_dims
from flowgen.tensor import Tensor

_LOW_PRECISION = {dt.float16.np_dtype, dt.bfloat16.np_dtype}


def _float_sum(a, axes, keepdim, count=1):
    """A float sum rounded once to `a`'s dtype: float16/bfloat16 accumulate in float32, float32
    in float64 (the graph's reduction kernels too, codegen/fused.sum_accumulator), so the result
    does not depend on the summation order and graph equals eager. Summed in float32, a mean
    over nearly-constant values is an ulp off in an order-dependent way, and a norm after it
    turns that ulp into ~1e-5 (fuzz seeds 11358, 11802)."""
    acc = np.float32 if a.dtype in _LOW_PRECISION else np.float64 if a.dtype == np.float32 else None
    total = a.sum(axis=axes, keepdims=keepdim, dtype=acc)
    return (total if count == 1 else total / count).astype(a.dtype, copy=False)


def _reduced_shape(shape, dims, keepdim):
    if keepdim:
        return tuple(1 if i in dims else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in dims)


def _check_dims(name, a, dims):
    dims = tuple(dims)
    norm = normalize_dims(dims, len(a.shape), op=name)
    if len(norm) != len(dims):
        raise ValueError(f"{name}: dims {dims} repeat a dimension (tensor of shape {tuple(a.shape)})")
    return norm


def _keep_shape(x_shape, dims):
    return tuple(1 if i in dims else s for i, s in enumerate(x_shape))


# ---------------------------------------------------------------------- sum
def _sum_infer(a, dims, keepdim=False):
    dims = _check_dims("sum", a, dims)
    out = a.dtype if a.dtype.is_floating else dt.int64
    return TensorMeta(_reduced_shape(a.shape, dims, keepdim), out)


def _sum_ref(a, dims, keepdim=False):
    dims = tuple(dims)
    if a.dtype.kind in "biu":
        return a.sum(axis=dims, keepdims=keepdim, dtype=np.int64)
    return _float_sum(a, dims, keepdim)


def _sum_grad(ctx, g):
    x = ctx.inputs[0]
    dims = tuple(ctx.attrs["dims"])
    if not ctx.attrs.get("keepdim", False) and dims and dims != tuple(range(len(dims))):
        # (reducing only leading dims leaves g right-aligned already: expand adds them back)
        g = F.reshape(g, _keep_shape(x.shape, dims))
    return (F.expand(g, x.shape),)


defop("sum", infer=_sum_infer, ref=_sum_ref, grad=_sum_grad, lowering=Reduction("sum", "0"),
      doc="sum(x, dims, keepdim)", grad_reads_inputs=False, autocast="float32")


# ---------------------------------------------------------------------- mean
def _count(shape, dims) -> int:
    return int(np.prod([shape[d] for d in dims], dtype=np.int64))


def _mean_infer(a, dims, keepdim=False):
    if not a.dtype.is_floating:
        raise TypeError(f"mean: expected a floating tensor, got {a.dtype.name} (cast it first)")
    dims = _check_dims("mean", a, dims)
    return TensorMeta(_reduced_shape(a.shape, dims, keepdim), a.dtype)


def _mean_ref(a, dims, keepdim=False):
    dims = tuple(dims)
    return _float_sum(a, dims, keepdim, count=_count(a.shape, dims))


def _mean_grad(ctx, g):
    (grad,) = _sum_grad(ctx, g)
    return (grad / float(_count(ctx.inputs[0].shape, tuple(ctx.attrs["dims"]))),)


defop("mean", infer=_mean_infer, ref=_mean_ref, grad=_mean_grad, lowering=Reduction("sum", "0", average=True),
      doc="mean(x, dims, keepdim): the sum over dims divided by their count, rounded once", grad_reads_inputs=False,
      autocast="float32")


# ---------------------------------------------------------------------- max / min
def _extremum_infer(name):
    def infer(a, dims, keepdim=False, split_ties=False):
        dims = _check_dims(name, a, dims)
        for d in dims:
            if a.shape[d] == 0:
                raise ValueError(f"{name}: cannot reduce over dim {d} of size 0 (shape {tuple(a.shape)})")
        return TensorMeta(_reduced_shape(a.shape, dims, keepdim), a.dtype)
    return infer


def _extremum_grad(arg_name):
    def grad(ctx, g):
        x, out = ctx.inputs[0], ctx.outputs[0]
        dims = tuple(ctx.attrs["dims"])
        keep = _keep_shape(x.shape, dims)
        if not ctx.attrs.get("keepdim", False):
            g = F.reshape(g, keep)
            out = F.reshape(out, keep)
        if len(dims) == 1 and len(x.shape) >= 2 and not ctx.attrs.get("split_ties", False):
            # Route to the index argmax/argmin selects (first occurrence), like torch.max(x, dim).
            d = dims[0]
            idx = F.apply(arg_name, x, dim=d, keepdim=True)
            positions = np.arange(x.shape[d], dtype=np.int64).reshape(
                tuple(x.shape[d] if i == d else 1 for i in range(len(x.shape))))
            mask = F.eq(idx, Tensor(positions, device=x.device))
            return (F.where(mask, g, 0),)
        # Split evenly among ties, like torch.max(x) / torch.amax(x, dim).
        mask = F.eq(x, out)
        count = F.sum(F.cast(mask, g.dtype), dims, keepdim=True)
        return (F.where(mask, g / count, 0),)
    return grad


defop("max", infer=_extremum_infer("max"),
      ref=lambda a, dims, keepdim=False, split_ties=False: np.max(a, axis=tuple(dims), keepdims=keepdim),
      grad=_extremum_grad("argmax"), lowering=Reduction("max", "-INFINITY"),
      doc="max(x, dims, keepdim, split_ties): values")
defop("min", infer=_extremum_infer("min"),
      ref=lambda a, dims, keepdim=False, split_ties=False: np.min(a, axis=tuple(dims), keepdims=keepdim),
      grad=_extremum_grad("argmin"), lowering=Reduction("min", "INFINITY"),
      doc="min(x, dims, keepdim, split_ties): values")


# ---------------------------------------------------------------------- sum_to
def _sum_to_axes(in_shape, shape):
    lead = len(in_shape) - len(shape)
    return tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape)
                                      if s == 1 and in_shape[lead + i] != 1)


def _sum_to_infer(a, shape):
    shape = tuple(shape)
    lead = len(a.shape) - len(shape)
    ok = lead >= 0 and all(s == 1 or s == a.shape[lead + i] for i, s in enumerate(shape))
    if not ok:
        raise ValueError(f"sum_to: a tensor of shape {tuple(a.shape)} cannot be summed to shape {shape} "
                         f"(shape must broadcast to the input shape)")
    return TensorMeta(shape, a.dtype)


def _sum_to_ref(a, shape):
    axes = _sum_to_axes(a.shape, tuple(shape))
    if not axes:
        return a.reshape(shape)
    if a.dtype.kind in "biu":
        return a.sum(axis=axes).astype(a.dtype, copy=False).reshape(shape)
    return _float_sum(a, axes, False).reshape(shape)


defop("sum_to", infer=_sum_to_infer, ref=_sum_to_ref,
      grad=lambda ctx, g: (F.expand(g, ctx.inputs[0].shape),),
      lowering=Reduction("sum", "0"),
      doc="sum_to(x, shape): reduce the dims broadcasting added (leading dims, and dims where "
          "shape has 1 but x does not)", grad_reads_inputs=False, sbp="sum_to")


# ---------------------------------------------------------------------- argmax / argmin
def _arg_infer(name):
    def infer(a, dim, keepdim=False):
        d = normalize_dim(dim, len(a.shape), op=name)
        if len(a.shape) and a.shape[d] == 0:
            raise ValueError(f"{name}: cannot reduce over dim {dim} of size 0 (shape {tuple(a.shape)})")
        shape = _reduced_shape(a.shape, (d,), keepdim) if len(a.shape) else ()
        return TensorMeta(shape, dt.int64)
    return infer


def _arg_ref(fn):
    def ref(a, dim, keepdim=False):
        if a.ndim == 0:
            return np.zeros((), np.int64)
        return fn(a, axis=dim, keepdims=keepdim)
    return ref


defop("argmax", infer=_arg_infer("argmax"), ref=_arg_ref(np.argmax), lowering=Template("argreduce"),
      doc="argmax(x, dim, keepdim) -> int64, first occurrence")
defop("argmin", infer=_arg_infer("argmin"), ref=_arg_ref(np.argmin), lowering=Template("argreduce"),
      doc="argmin(x, dim, keepdim) -> int64, first occurrence")


# --------------------------------------------------------------------------
# nonfinite_flag(*tensors): int32 scalar, 1 when any element of any input is inf or NaN.
# A GradScaler's skip test over every gradient in one launch (Template "nonfinite": the
# inputs are segments of one grid, a thread that finds one sets the flag).

def _nonfinite_infer(*xs):
    if not xs:
        raise ValueError("nonfinite_flag: needs at least one tensor")
    for x in xs:
        if not x.dtype.is_floating:
            raise TypeError(f"nonfinite_flag: expected floating point tensors, got {x.dtype!r}")
    return TensorMeta((), dt.int32)


def _nonfinite_ref(*xs):
    bad = any(not np.isfinite(x.astype(np.float32 if x.dtype in _LOW_PRECISION else x.dtype)).all() for x in xs)
    return np.array(int(bad), np.int32)


defop("nonfinite_flag", infer=_nonfinite_infer, ref=_nonfinite_ref, grad=None, lowering=Template("nonfinite"),
      doc="nonfinite_flag(*tensors): int32 1 if any element is inf or NaN, else 0 (no gradient)")
