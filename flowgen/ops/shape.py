"""Shape ops: reshape (a view), permute, slice, slice_backward, cat (copy kernels).

Attributes are explicit and normalised by the functional layer:

* ``reshape(x, shape)`` — the full target shape (no -1). View: no kernel.
* ``permute(x, dims)`` — a permutation of range(ndim); out.shape[i] = x.shape[dims[i]].
* ``slice(x, starts, stops, steps)`` — one entry per dim, 0 <= start <= stop <= size,
  step >= 1; out.shape[d] = ceil((stop - start) / step).
* ``slice_backward(g, shape, starts, stops, steps)`` — zeros of ``shape`` with ``g``
  written at the sliced positions (the gradient of slice).
* ``cat(*xs, dim)`` — concatenation along ``dim`` (non-negative); dtypes promote.
"""
from __future__ import annotations

from functools import reduce

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Template, View
from flowgen.ops.registry import TensorMeta, ViewOf, defop, normalize_dim


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------- reshape
def _reshape_infer(a, shape):
    shape = tuple(shape)
    if any((not isinstance(s, (int, np.integer))) or s < 0 for s in shape):
        raise ValueError(f"reshape: invalid target shape {shape} (sizes must be non-negative ints; "
                         f"-1 is resolved by flowgen.reshape)")
    if _numel(shape) != _numel(a.shape):
        raise ValueError(f"reshape: shape {shape} is invalid for input of shape {tuple(a.shape)} "
                         f"({_numel(a.shape)} elements)")
    return TensorMeta(shape, a.dtype)


def _reshape_strides(old_shape: tuple, old_strides: tuple, attrs: dict, new_shape: tuple) -> tuple | None:
    """The strides of `new_shape` viewing memory laid out as `old_shape` with `old_strides`, or
    None when no view can (PyTorch's computeStride: dims are split or merged only within runs of
    dims contiguous with each other; size-1 dims go anywhere)."""
    if not old_shape or 0 in old_shape:
        return tuple(int(np.prod(new_shape[i + 1:], dtype=np.int64)) for i in range(len(new_shape)))
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in reversed(range(len(old_shape))):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (old_shape[tensor_d - 1] != 1
                             and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_strides) if view_d == -1 else None


defop("reshape", infer=_reshape_infer, ref=lambda a, shape: a.reshape(shape),
      grad=lambda ctx, g: (F.reshape(g, ctx.inputs[0].shape),),
      lowering=View(), view=ViewOf(_reshape_strides, in_order=True),
      doc="reshape(x, shape): explicit target shape; a view of contiguous memory", grad_reads_inputs=False,
      sbp="reshape")


# ---------------------------------------------------------------------- depend
defop("depend", infer=lambda a, *deps: TensorMeta(a.shape, a.dtype), ref=lambda a, *deps: a,
      grad=lambda ctx, g: (g,) + (None,) * (len(ctx.inputs) - 1),
      lowering=View(), doc="depend(x, *deps): x itself, ordered after the kernels computing deps (graph mode)",
      fusion=None)


# ---------------------------------------------------------------------- permute
def _permute_infer(a, dims):
    dims = tuple(dims)
    if sorted(dims) != list(range(len(a.shape))):
        raise ValueError(f"permute: dims {dims} are not a permutation of the {len(a.shape)} dims "
                         f"of a tensor of shape {tuple(a.shape)}")
    return TensorMeta(tuple(a.shape[d] for d in dims), a.dtype)


def _permute_grad(ctx, g):
    dims = tuple(ctx.attrs["dims"])
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return (F.apply("permute", g, dims=tuple(inverse)),)


def _permute_strides(shape: tuple, strides: tuple, attrs: dict, out_shape: tuple) -> tuple:
    return tuple(strides[d] for d in attrs["dims"])


defop("permute", infer=_permute_infer, ref=lambda a, dims: np.transpose(a, tuple(dims)),
      grad=_permute_grad, lowering=Template("copy"), view=ViewOf(_permute_strides), doc="permute(x, dims)", grad_reads_inputs=False,
      fusion="transpose", sbp="permute")


# ---------------------------------------------------------------------- slice
def _slice_shape(name, shape, starts, stops, steps):
    if not (len(starts) == len(stops) == len(steps) == len(shape)):
        raise ValueError(f"{name}: starts/stops/steps need one entry per dim of shape {tuple(shape)}, got "
                         f"{tuple(starts)}, {tuple(stops)}, {tuple(steps)}")
    out = []
    for d, (n, b, e, s) in enumerate(zip(shape, starts, stops, steps)):
        if s < 1:
            raise ValueError(f"{name}: step must be positive, got {s} for dim {d}")
        if not 0 <= b <= e <= n:
            raise ValueError(f"{name}: bad range [{b}:{e}] for dim {d} of shape {tuple(shape)}")
        out.append(-(-(e - b) // s))
    return tuple(out)


def _slices(starts, stops, steps):
    return tuple(slice(b, e, s) for b, e, s in zip(starts, stops, steps))


def _slice_strides(shape: tuple, strides: tuple, attrs: dict, out_shape: tuple) -> tuple:
    return tuple(stride * step for stride, step in zip(strides, attrs["steps"]))


def _slice_infer(a, starts, stops, steps):
    return TensorMeta(_slice_shape("slice", a.shape, starts, stops, steps), a.dtype)


defop("slice", infer=_slice_infer, ref=lambda a, starts, stops, steps: a[_slices(starts, stops, steps)],
      grad=lambda ctx, g: (F.apply("slice_backward", g, shape=tuple(ctx.inputs[0].shape), **ctx.attrs),),
      lowering=Template("copy"), view=ViewOf(_slice_strides), doc="slice(x, starts, stops, steps): one entry per dim",
      grad_reads_inputs=False)


def _slice_backward_infer(g, shape, starts, stops, steps):
    expected = _slice_shape("slice_backward", tuple(shape), starts, stops, steps)
    if tuple(g.shape) != expected:
        raise ValueError(f"slice_backward: gradient of shape {tuple(g.shape)} does not match the slice "
                         f"shape {expected} of {tuple(shape)}")
    return TensorMeta(tuple(shape), g.dtype)


def _slice_backward_ref(g, shape, starts, stops, steps):
    out = np.zeros(tuple(shape), g.dtype)
    out[_slices(starts, stops, steps)] = g
    return out


def _slice_backward_grad(ctx, gg):
    attrs = {k: v for k, v in ctx.attrs.items() if k != "shape"}
    return (F.apply("slice", gg, **attrs),)


defop("slice_backward", infer=_slice_backward_infer, ref=_slice_backward_ref, grad=_slice_backward_grad,
      lowering=Template("copy"), doc="slice_backward(g, shape, starts, stops, steps)", grad_reads_inputs=False)


# ---------------------------------------------------------------------- cat
def _cat_infer(*metas, dim):
    if not metas:
        raise ValueError("cat: expected a non-empty list of tensors")
    ndim = len(metas[0].shape)
    shapes = ", ".join(str(tuple(m.shape)) for m in metas)
    if ndim == 0:
        raise ValueError(f"cat: zero-dimensional tensors cannot be concatenated (shapes {shapes})")
    d = normalize_dim(dim, ndim, op="cat")
    for m in metas:
        if len(m.shape) != ndim or any(m.shape[i] != metas[0].shape[i] for i in range(ndim) if i != d):
            raise ValueError(f"cat: tensors must have the same shape except in dim {dim}; got shapes {shapes}")
    out = list(metas[0].shape)
    out[d] = sum(m.shape[d] for m in metas)
    dtype = reduce(dt.promote, (m.dtype for m in metas))
    return TensorMeta(tuple(out), dtype)


def _cat_ref(*arrays, dim):
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        target = reduce(dt.promote, (dt.from_numpy(a.dtype) for a in arrays)).np_dtype
        arrays = [a.astype(target, copy=False) for a in arrays]
    return np.concatenate(arrays, axis=dim)


def _cat_grad(ctx, g):
    d = normalize_dim(ctx.attrs["dim"], len(g.shape))
    out, start = [], 0
    for x in ctx.inputs:
        n = x.shape[d]
        if x.requires_grad or x.is_lazy:
            starts = tuple(start if i == d else 0 for i in range(len(g.shape)))
            stops = tuple(start + n if i == d else s for i, s in enumerate(g.shape))
            piece = F.apply("slice", g, starts=starts, stops=stops, steps=(1,) * len(g.shape))
            out.append(F.cast(piece, x.dtype) if x.dtype != g.dtype else piece)
        else:
            out.append(None)
        start += n
    return tuple(out)


defop("cat", infer=_cat_infer, ref=_cat_ref, grad=_cat_grad, lowering=Template("copy"),
      doc="cat(*xs, dim)", grad_reads_inputs=False)
