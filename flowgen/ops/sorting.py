"""Order-dependent ops: sort, topk and the cumulative scans.

They run in eager mode (NumPy references, gradients in flowgen ops) and have no
kernel lowering yet: used inside `nn.Graph.build()` they are refused with a clear
error at trace time (see `registry.apply`), never evaluated once and frozen.

``sort``/``topk`` return (values, int64 indices); the values' gradient scatters the
incoming gradient back to the positions the indices name.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.registry import TensorMeta, apply, defop, normalize_dim


def _sort_infer(x, dim, descending):
    normalize_dim(dim, max(len(x.shape), 1), op="sort")
    return TensorMeta(x.shape, x.dtype), TensorMeta(x.shape, dt.int64)


def _sort_order(a, dim, descending):
    """Stable order along `dim` (as torch.sort(stable=True)). Descending sorts the reversed array
    ascending and reverses back, so equal elements keep their input order and NaN comes first."""
    if a.ndim == 0:
        return np.zeros((), np.int64)
    if not descending:
        return np.argsort(a, axis=dim, kind="stable").astype(np.int64)
    reversed_order = np.argsort(np.flip(a, axis=dim), axis=dim, kind="stable")
    return (a.shape[dim] - 1 - np.flip(reversed_order, axis=dim)).astype(np.int64)


def _sort_ref(x, dim, descending):
    order = _sort_order(x, dim, descending)
    values = x if x.ndim == 0 else np.take_along_axis(x, order, axis=dim)
    return np.ascontiguousarray(values), order


def _values_grad(ctx, g, _g_indices=None):
    x = ctx.inputs[0]
    indices = ctx.outputs[1]
    if x.ndim == 0:
        return (g,)
    return (apply("scatter_add", indices, g, shape=tuple(x.shape), dim=ctx.attrs["dim"]),)


defop("sort", infer=_sort_infer, ref=_sort_ref, grad=_values_grad, num_outputs=2,
      doc="sort(x, dim, descending) -> (values, indices); stable; eager only")


def _topk_infer(x, k, dim, largest):
    ndim = len(x.shape)
    d = normalize_dim(dim, max(ndim, 1), op="topk")
    size = x.shape[d] if ndim else 1
    if not 0 <= k <= size:
        raise IndexError(f"topk: k ({k}) is out of range for dimension {dim} of size {size}")
    shape = tuple(k if i == d else s for i, s in enumerate(x.shape))
    return TensorMeta(shape, x.dtype), TensorMeta(shape, dt.int64)


def _topk_ref(x, k, dim, largest):
    order = _sort_order(x, dim, descending=largest)
    if x.ndim == 0:
        return x.copy(), order
    order = np.ascontiguousarray(np.take(order, np.arange(k), axis=dim))
    return np.ascontiguousarray(np.take_along_axis(x, order, axis=dim)), order


defop("topk", infer=_topk_infer, ref=_topk_ref, grad=_values_grad, num_outputs=2,
      doc="topk(x, k, dim, largest) -> (values, indices), sorted; eager only")


def _scan_infer(x, dim):
    normalize_dim(dim, max(len(x.shape), 1), op="cumsum")
    return x


def _cumsum_grad(ctx, g):
    dim = ctx.attrs["dim"]
    # d/dx_j sum_{i >= j} g_i: a reversed cumulative sum.
    return (F.flip(apply("cumsum", F.flip(g, dim), dim=dim), dim),)


def _cumprod_grad(ctx, g):
    x, out, dim = ctx.inputs[0], ctx.outputs[0], ctx.attrs["dim"]
    if np.any(x.numpy() == 0):
        raise NotImplementedError("cumprod: the gradient through zero elements is not implemented")
    return (F.flip(apply("cumsum", F.flip(g * out, dim), dim=dim), dim) / x,)


defop("cumsum", infer=_scan_infer, ref=lambda x, dim: np.cumsum(x, axis=dim, dtype=x.dtype) if x.ndim else x.copy(),
      grad=_cumsum_grad, doc="cumsum(x, dim); eager only")
defop("cumprod", infer=_scan_infer, ref=lambda x, dim: np.cumprod(x, axis=dim, dtype=x.dtype) if x.ndim else x.copy(),
      grad=_cumprod_grad, doc="cumprod(x, dim); eager only")
