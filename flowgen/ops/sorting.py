"""Order-dependent ops: sort, topk and the cumulative scans.

Graph kernels: ``sort``/``topk`` are the `sort` family (templates/sort.cu.j2: each element's rank
counted in its row, or in runs of a long row that are then merged; topk of few from a long row by
radix select of the k-th key; long rows on the cpu target by radix sort), ``cumsum``/``cumprod`` the
`scan` family (templates/scan.cu.j2: one thread per row, sequential in the dtype), so graph
results equal these NumPy references bit for bit.

``sort``/``topk`` return (values, int64 indices), stable: equal keys keep their input order,
NaN sorts as the largest key (last ascending, first descending). The values' gradient scatters
the incoming gradient back to the positions the indices name. ``cumsum``/``cumprod`` with
``reverse`` run from the end of the dim to its start (the gradient of a forward cumsum).
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Template
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
    if x.ndim == 0:
        return x.copy(), order    # (np.ascontiguousarray would make it 1-d)
    return np.ascontiguousarray(np.take_along_axis(x, order, axis=dim)), order


def _values_grad(ctx, g, _g_indices=None):
    x = ctx.inputs[0]
    indices = ctx.outputs[1]
    if x.ndim == 0:
        return (g,)
    return (apply("scatter_add", indices, g, shape=tuple(x.shape), dim=ctx.attrs["dim"]),)


defop("sort", infer=_sort_infer, ref=_sort_ref, grad=_values_grad, num_outputs=2, lowering=Template("sort"),
      doc="sort(x, dim, descending) -> (values, indices); stable")


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


defop("topk", infer=_topk_infer, ref=_topk_ref, grad=_values_grad, num_outputs=2, lowering=Template("sort"),
      doc="topk(x, k, dim, largest) -> (values, indices), sorted, stable")


def _scan_infer(op):
    def infer(x, dim, reverse):
        normalize_dim(dim, max(len(x.shape), 1), op=op)
        return x
    return infer


def _scan_ref(scan):
    """NumPy's accumulate in the input's dtype: sequential, each partial result rounded to it."""
    def ref(x, dim, reverse):
        if x.ndim == 0:
            return x.copy()
        if not reverse:
            return scan(x, axis=dim, dtype=x.dtype)
        return np.ascontiguousarray(np.flip(scan(np.flip(x, axis=dim), axis=dim, dtype=x.dtype), axis=dim))
    return ref


def _reverse_cumsum(g, dim, reverse):
    """sum over the positions a cumsum in direction `reverse` fed from each position."""
    return apply("cumsum", g, dim=dim, reverse=not reverse)


def _cumsum_grad(ctx, g):
    # d/dx_j sum_{i >= j} g_i: a cumulative sum the other way.
    if ctx.inputs[0].ndim == 0:
        return (g,)
    return (_reverse_cumsum(g, ctx.attrs["dim"], ctx.attrs["reverse"]),)


def _cumprod_grad(ctx, g):
    """PyTorch's cumprod gradient, zeros included, in scan order along the dim: before the first
    zero x_z, dx_k = sum_{i >= k} g_i y_i / x_k; at x_z, sum_{i >= z} g_i * (the products y_i
    with x_z taken as 1); after it, 0 (every product through them holds x_z)."""
    x, y = ctx.inputs[0], ctx.outputs[0]
    dim, reverse = ctx.attrs["dim"], ctx.attrs["reverse"]
    if x.ndim == 0:
        return (g,)
    is_zero = F.eq(x, 0)
    zeros_so_far = apply("cumsum", F.cast(is_zero, dt.int64), dim=dim, reverse=reverse)
    before = F.eq(zeros_so_far, 0)
    first_zero = F.logical_and(is_zero, F.eq(zeros_so_far, 1))
    before_grad = _reverse_cumsum(g * y, dim, reverse) / F.where(before, x, 1)
    y_without_zero = apply("cumprod", F.where(first_zero, 1, x), dim=dim, reverse=reverse)
    zero_grad = _reverse_cumsum(g * y_without_zero, dim, reverse)
    return (F.where(before, before_grad, F.where(first_zero, zero_grad, 0)),)


defop("cumsum", infer=_scan_infer("cumsum"), ref=_scan_ref(np.cumsum), grad=_cumsum_grad, lowering=Template("scan"),
      doc="cumsum(x, dim, reverse); sequential in the dtype", autocast="float32")
defop("cumprod", infer=_scan_infer("cumprod"), ref=_scan_ref(np.cumprod), grad=_cumprod_grad,
      lowering=Template("scan"), doc="cumprod(x, dim, reverse); sequential in the dtype", autocast="float32")
