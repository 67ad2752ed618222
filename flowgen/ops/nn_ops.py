"""Neural-network primitive ops: softmax, gather/scatter, conv2d, pooling,
upsampling and dropout.

Every definition follows the op contract (docs/op_contract.md): ``infer``
types the output, ``ref`` is the NumPy reference (fast enough to train small
nets eagerly: convolutions are im2col + BLAS through strided views), ``grad``
is written with flowgen ops only, and ``lowering`` names the kernel family.

Attribute conventions (what the kernel templates read from ``node.attrs``):

* 2-d geometry attributes (``kernel_size``, ``stride``, ``padding``,
  ``dilation``, ``size``) are tuples of two ints ``(h, w)``.
* ``scales`` (upsampling) is ``None`` or a tuple of two floats: the user's
  scale factors, which PyTorch uses (as ``1/scale``) instead of ``in/out``.
* Index inputs are int64 (or int32) tensors; they never get a gradient.
* ``padding_idx`` is an int, ``-1`` meaning "none".
* An index outside its range raises IndexError naming the op and the value (in a graph, the
  kernel reports it and the call raises after the step: see runtime/executor.py). Negative
  indices are out of range, except for ``index_select``/``index_add`` with ``wrap_negative``
  (what ``x[idx]`` lowers to), where they count from the end as in Python.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Elementwise, Template
from flowgen.ops.registry import TensorMeta, apply, broadcast_shapes, defop, normalize_dim, wants_grad
from flowgen.tensor import Tensor
from flowgen.random import philox_uniform


# --------------------------------------------------------------------------
# helpers

def _pair(v) -> tuple:
    if isinstance(v, (tuple, list)):
        if len(v) == 1:
            return (int(v[0]), int(v[0]))
        if len(v) != 2:
            raise ValueError(f"expected an int or a pair of ints, got {v!r}")
        return (int(v[0]), int(v[1]))
    return (int(v), int(v))


def _ctype(*arrays):
    """NumPy compute type: float64 stays float64, everything else computes in float32."""
    return np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32


def _f(a, ct):
    return a.astype(ct, copy=False)


def _require_float(meta, op, what="input"):
    if not meta.dtype.is_floating:
        raise TypeError(f"{op}: expected a floating point {what}, got {meta.dtype!r}")


def _require_index(meta, op, what="index"):
    if meta.dtype not in (dt.int64, dt.int32):
        raise TypeError(f"{op}: expected {what} to be an int64 (or int32) tensor, got {meta.dtype!r}")


def _check_range(index, size, op, dim=None, low=0):
    if index.size and (index.min() < low or index.max() >= size):
        bad = index[(index < low) | (index >= size)].flat[0]
        where = f" for dimension {dim}" if dim is not None else ""
        raise IndexError(f"{op}: index {int(bad)} is out of bounds{where} with size {size}")


def _window_view(xp, kernel, out_hw, stride, dilation):
    """(N, C, kh, kw, OH, OW) strided view of padded input `xp` (no copy)."""
    N, C = xp.shape[:2]
    s0, s1, s2, s3 = xp.strides
    (kh, kw), (OH, OW), (sh, sw), (dh, dw) = kernel, out_hw, stride, dilation
    return as_strided(xp, (N, C, kh, kw, OH, OW), (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw), writeable=False)


def _tap(k, d, s, n):
    """Slice of the padded axis touched by kernel tap `k` over `n` outputs."""
    start = k * d
    return slice(start, start + s * (n - 1) + 1, s)


# --------------------------------------------------------------------------
# softmax / log_softmax  (Template "softmax"; gradients composed)

def _softmax_rows(attrs) -> int:
    return attrs["dim"]


def _softmax_infer(x, dim):
    _require_float(x, "softmax")
    normalize_dim(dim, len(x.shape), "softmax")
    return x


def _softmax_ref(x, dim):
    ct = _ctype(x)
    x = _f(x, ct)
    if x.ndim == 0:
        return np.ones_like(x)
    m = x.max(axis=dim, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=dim, keepdims=True)


def _log_softmax_ref(x, dim):
    ct = _ctype(x)
    x = _f(x, ct)
    if x.ndim == 0:
        return np.zeros_like(x)
    shifted = x - x.max(axis=dim, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=dim, keepdims=True))


def _softmax_grad(ctx, g):
    y = ctx.outputs[0]
    dim = ctx.attrs["dim"]
    return (y * (g - F.sum(g * y, dim, keepdim=True)),)


def _log_softmax_grad(ctx, g):
    y = ctx.outputs[0]
    dim = ctx.attrs["dim"]
    return (g - F.exp(y) * F.sum(g, dim, keepdim=True),)


# In place: the row kernel reads x's row whole before a barrier, then each element again by the
# thread that writes y there (templates/softmax.cu.j2), so y may take over a dying x.
defop("softmax", infer=_softmax_infer, ref=_softmax_ref, grad=_softmax_grad,
      lowering=Template("softmax", in_place=(("y", "x"),)), doc="softmax(x, dim): exp(x - max) / sum(exp(x - max)) along `dim`",
      autocast="float32", row_dim=_softmax_rows)
defop("log_softmax", infer=_softmax_infer, ref=_log_softmax_ref, grad=_log_softmax_grad,
      lowering=Template("softmax", in_place=(("y", "x"),)), doc="log_softmax(x, dim): x - max - log(sum(exp(x - max))) along `dim`",
      autocast="float32", row_dim=_softmax_rows)


# --------------------------------------------------------------------------
# cross-entropy rows (Template "softmax": one row kernel each way)
#
# cross_entropy_rows(x (N, C), target (N,)) is -log_softmax(x)[n, target[n]] per row, 0 where
# target == ignore_index: log-softmax and the pick in one pass, so the (N, C) log-probabilities
# never reach memory. Its gradient is one kernel too: g[n] * (softmax(x)[n] - onehot(target[n])).
# ignore_index=None ignores no row (OneFlow's sparse_softmax_cross_entropy): every label must be a
# class, so no int64 value is set aside as "ignored".

def _ce_rows_check(x, target, op):
    _require_float(x, op)
    if len(x.shape) != 2:
        raise ValueError(f"{op}: expected (N, C) logits, got {tuple(x.shape)}")
    if target.dtype not in (dt.int64, dt.int32):
        raise RuntimeError(f"cross_entropy: expected an int64 class-index target, got {target.dtype!r}")
    if tuple(target.shape) != (x.shape[0],):
        raise ValueError(f"cross_entropy: expected target of shape {(x.shape[0],)}, got {tuple(target.shape)}")


def _class_rows(attrs) -> int:
    """The cross-entropy rows run along the classes (dim 1 of the (N, C) logits); their other
    operands (target, g) have one entry per row."""
    return 1


def _ce_rows_infer(x, target, ignore_index=-100):
    _ce_rows_check(x, target, "cross_entropy_rows")
    return TensorMeta((x.shape[0],), x.dtype)


def _ce_picked(x, target, ignore_index, op):
    valid = np.ones(target.shape, bool) if ignore_index is None else target != ignore_index
    safe = np.where(valid, target, 0)
    _check_range(safe, x.shape[1], op, dim=1)
    return valid, safe


def _ce_rows_ref(x, target, ignore_index=-100):
    valid, safe = _ce_picked(x, target, ignore_index, "cross_entropy")
    logp = _log_softmax_ref(x, 1)
    picked = np.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    return np.where(valid, -picked, np.zeros((), logp.dtype))


def _ce_rows_grad(ctx, g):
    x, target = ctx.inputs
    return apply("cross_entropy_rows_grad", g, x, target, ignore_index=ctx.attrs["ignore_index"]), None


def _ce_rows_grad_infer(g, x, target, ignore_index=-100):
    _ce_rows_check(x, target, "cross_entropy_rows_grad")
    if tuple(g.shape) != (x.shape[0],):
        raise ValueError(f"cross_entropy_rows_grad: grad shape {tuple(g.shape)} != ({x.shape[0]},)")
    return TensorMeta(tuple(x.shape), x.dtype)


def _ce_rows_grad_ref(g, x, target, ignore_index=-100):
    valid, safe = _ce_picked(x, target, ignore_index, "cross_entropy")
    d = _softmax_ref(x, 1)
    np.put_along_axis(d, safe[:, None], np.take_along_axis(d, safe[:, None], axis=1) - 1, axis=1)
    scale = np.where(valid, _f(g, d.dtype), np.zeros((), d.dtype))
    return d * scale[:, None]


def _ce_rows_grad_grad(ctx, gg):
    # out = g[:, None] * (s - onehot), s = softmax(x): linear in g, and ds = s * (dx - sum(dx * s)).
    g, x, target = ctx.inputs
    ignore_index = ctx.attrs["ignore_index"]
    s = F.softmax(x, 1)
    if ignore_index is None:   # every row counts
        safe, g_counted = target, g
    else:
        counted = F.ne(target, ignore_index)
        safe = target * F.cast(counted, target.dtype)
        g_counted = g * F.cast(counted, x.dtype)
    picked = F.squeeze(apply("gather", gg, F.unsqueeze(safe, 1), dim=1), 1)
    d_g = F.sum(gg * s, 1) - picked
    if ignore_index is not None:
        d_g = d_g * F.cast(counted, x.dtype)
    d_x = F.unsqueeze(g_counted, 1) * s * (gg - F.sum(gg * s, 1, keepdim=True))
    return d_g, d_x, None


# In place: only over the logits, read whole before the row's barrier (one class: the loss over
# x). Never over g or target: they have the output's size exactly when there is one class (or an
# int32 target beside float32 losses), and every thread of the row's block reads g[row] and
# target[row] after the barrier, when another thread may already have stored its output there.
defop("cross_entropy_rows", infer=_ce_rows_infer, ref=_ce_rows_ref, grad=_ce_rows_grad,
      lowering=Template("softmax", in_place=(("loss", "x"),)), autocast="float32", row_dim=_class_rows,
      doc="cross_entropy_rows(x (N, C), target (N,), ignore_index): -log_softmax(x)[n, target[n]], 0 if ignored "
          "(ignore_index=None: no row is)")
defop("cross_entropy_rows_grad", infer=_ce_rows_grad_infer, ref=_ce_rows_grad_ref, grad=_ce_rows_grad_grad,
      lowering=Template("softmax", in_place=(("dx", "x"),)), row_dim=_class_rows,
      doc="cross_entropy_rows_grad(g (N,), x, target, ignore_index): g[n] * (softmax(x)[n] - onehot(target[n]))")


# --------------------------------------------------------------------------
# binary cross-entropy on probabilities (elementwise): PyTorch's clamped logs forward, and its
# backward, which divides by max(x (1 - x), 1e-12) -- not the derivative of the clamped forward:
# where sigmoid saturates (x rounds to 1) that derivative is inf * 0 = nan and PyTorch's is finite.

_BCE_EPS = 1e-12


def _bce_infer(x, target):
    if not x.dtype.is_floating or x.dtype != target.dtype or tuple(x.shape) != tuple(target.shape):
        raise RuntimeError(f"binary_cross_entropy: input {x.dtype} {tuple(x.shape)} and target {target.dtype} "
                           f"{tuple(target.shape)} need the same floating dtype and shape")
    return x


def _bce_ref(x, target):
    ct = _ctype(x)
    x, t = _f(x, ct), _f(target, ct)
    with np.errstate(divide="ignore", invalid="ignore"):
        return ((t - 1) * np.maximum(np.log1p(-x), ct(-100)) - t * np.maximum(np.log(x), ct(-100))).astype(ct)


def _bce_grad(ctx, g):
    x, target = ctx.inputs
    d_x = apply("binary_cross_entropy_grad", g, x, target) if wants_grad(x) else None
    d_t = g * (F.log1p(-x) - F.log(x)) if wants_grad(target) else None     # -logit(x), unclamped as PyTorch
    return d_x, d_t


def _bce_grad_ref(g, x, target):
    ct = _ctype(g, x)
    x = _f(x, ct)
    return (_f(g, ct) * (x - _f(target, ct)) / np.maximum((1 - x) * x, ct(_BCE_EPS))).astype(ct)


def _bce_grad_grad(ctx, gg):
    """Derivatives of g (x - t) / d, d = max(x (1 - x), eps) (for a second derivative)."""
    g, x, target = ctx.inputs
    product = x * (1.0 - x)
    d = F.clamp(product, min=_BCE_EPS)
    diff = x - target
    # d/dx of (x - t) / d: (d - (x - t)(1 - 2x)) / d^2, and 1 / eps where d is clamped
    slope = F.where(product > _BCE_EPS, (d - diff * (1.0 - 2.0 * x)) / (d * d), 1.0 / _BCE_EPS)
    return gg * diff / d, gg * g * slope, -gg * g / d


defop("binary_cross_entropy", infer=_bce_infer, ref=_bce_ref, grad=_bce_grad,
      lowering=Elementwise("((({1}) - 1.0f) * fmaxf(log1pf(-({0})), -100.0f) - ({1}) * fmaxf(logf({0}), -100.0f))"),
      doc="binary_cross_entropy(x, target): elementwise (t - 1) max(log1p(-x), -100) - t max(log x, -100)",
      autocast="float32")
defop("binary_cross_entropy_grad", infer=lambda g, x, target: x, ref=_bce_grad_ref, grad=_bce_grad_grad,
      lowering=Elementwise("(({0}) * (({1}) - ({2})) / fmaxf((1.0f - ({1})) * ({1}), 1.0e-12f))"),
      doc="binary_cross_entropy_grad(g, x, target): g (x - t) / max(x (1 - x), 1e-12), PyTorch's backward")


# --------------------------------------------------------------------------
# gather family (Template "gather") and its scatter adjoints (Template "scatter")

def _gather_infer(x, index, dim):
    _require_index(index, "gather")
    nd = len(x.shape)
    d = normalize_dim(dim, max(nd, 1), "gather")
    if len(index.shape) != nd:
        raise RuntimeError(f"gather(): index tensor must have the same number of dimensions as input tensor "
                           f"(got {len(index.shape)} and {nd})")
    for i, (si, sx) in enumerate(zip(index.shape, x.shape)):
        if i != d and si > sx:
            raise RuntimeError(f"gather(): size of dimension {i} of index ({si}) is larger than that of input ({sx})")
    return TensorMeta(tuple(index.shape), x.dtype)


def _linear_index(index, shape, dim):
    """Linear offsets into an array of `shape` for scatter/gather along `dim` with `index`."""
    lin = np.zeros(index.shape, np.int64)
    for d, size in enumerate(shape):
        if d == dim:
            c = index.astype(np.int64)
        else:
            c = np.arange(index.shape[d], dtype=np.int64).reshape([-1 if k == d else 1 for k in range(index.ndim)])
        lin = lin * size + c
    return lin


def _gather_ref(x, index, dim):
    if x.ndim == 0:
        _check_range(index, 1, "gather")
        return x.reshape(index.shape).copy()
    dim = dim % x.ndim
    _check_range(index, x.shape[dim], "gather", dim)
    lin = _linear_index(index, x.shape, dim)
    return x.reshape(-1)[lin]


def _gather_grad(ctx, g):
    x, index = ctx.inputs
    return apply("scatter_add", index, g, shape=tuple(x.shape), dim=ctx.attrs["dim"]), None


def _scatter_add_infer(index, src, shape, dim):
    _require_index(index, "scatter_add")
    normalize_dim(dim, max(len(shape), 1), "scatter_add")
    if tuple(index.shape) != tuple(src.shape):
        raise RuntimeError(f"scatter_add: index shape {tuple(index.shape)} must equal src shape {tuple(src.shape)}")
    if len(index.shape) != len(shape):
        raise RuntimeError("scatter_add: index and output must have the same number of dimensions")
    return TensorMeta(tuple(shape), src.dtype)


def _accumulate(lin, src, total):
    """out.flat[lin] += src with repeated indices summed: floats in float64, each destination's
    sources added in order (np.bincount), as the scatter kernels do; integers wrap in their dtype."""
    if src.dtype.kind == "f" or src.dtype.kind == "V":
        return np.bincount(lin.reshape(-1), weights=src.reshape(-1).astype(np.float64), minlength=total)
    out = np.zeros(total, src.dtype)
    np.add.at(out, lin.reshape(-1), src.reshape(-1))
    return out


def _scatter_add_ref(index, src, shape, dim):
    shape = tuple(shape)
    if len(shape) == 0:                                     # a 0-d output: one element, index 0
        _check_range(index, 1, "scatter_add")
        return _accumulate(np.zeros(index.shape, np.int64), src, 1).reshape(())
    dim = dim % len(shape)
    _check_range(index, shape[dim], "scatter_add", dim)
    return _accumulate(_linear_index(index, shape, dim), src, int(np.prod(shape))).reshape(shape)


def _scatter_add_grad(ctx, g):
    index = ctx.inputs[0]
    return None, apply("gather", g, index, dim=ctx.attrs["dim"])


defop("gather", infer=_gather_infer, ref=_gather_ref, grad=_gather_grad, lowering=Template("gather"),
      doc="gather(input, index, dim): out[i..] = input[i.. with index[i..] at dim] (torch.gather)", grad_reads_inputs=False)
defop("scatter_add", infer=_scatter_add_infer, ref=_scatter_add_ref, grad=_scatter_add_grad,
      lowering=Template("scatter"),
      doc="scatter_add(index, src, shape, dim): zeros(shape) with src added at index along dim", grad_reads_inputs=False)


def _selected(index, size, op, dim, wrap_negative):
    """`index` checked against [0, size), or against [-size, size) with negatives counted from
    the end when `wrap_negative`; the indices to use."""
    _check_range(index, size, op, dim, low=-size if wrap_negative else 0)
    return np.where(index < 0, index + size, index) if wrap_negative else index


def _index_select_infer(x, index, dim, wrap_negative=False):
    _require_index(index, "index_select")
    if len(index.shape) > 1:
        raise RuntimeError(f"index_select(): index must be 0- or 1-dimensional, got shape {tuple(index.shape)}")
    nd = len(x.shape)
    d = normalize_dim(dim, max(nd, 1), "index_select")
    n = int(np.prod(index.shape, dtype=np.int64))
    if nd == 0:
        return TensorMeta((n,) if index.shape else (), x.dtype)
    return TensorMeta(tuple(x.shape[:d]) + (n,) + tuple(x.shape[d + 1:]), x.dtype)


def _index_select_ref(x, index, dim, wrap_negative=False):
    if x.ndim == 0:
        _selected(index, 1, "index_select", None, wrap_negative)
        return np.broadcast_to(x, index.shape).copy()
    dim = dim % x.ndim
    index = _selected(index, x.shape[dim], "index_select", dim, wrap_negative)
    return np.take(x, index.reshape(-1), axis=dim)


def _index_select_grad(ctx, g):
    x, index = ctx.inputs
    return apply("index_add", index, g, shape=tuple(x.shape), dim=ctx.attrs["dim"],
                 wrap_negative=ctx.attrs.get("wrap_negative", False)), None


def _index_add_infer(index, src, shape, dim, wrap_negative=False):
    _require_index(index, "index_add")
    shape = tuple(shape)
    nd = len(shape)
    d = normalize_dim(dim, max(nd, 1), "index_add")
    n = int(np.prod(index.shape, dtype=np.int64))
    expected = tuple(shape[:d]) + (n,) + tuple(shape[d + 1:]) if nd else tuple(src.shape)
    if tuple(src.shape) != expected:
        raise RuntimeError(f"index_add: source shape {tuple(src.shape)} does not match {expected}")
    return TensorMeta(shape, src.dtype)


def _index_add_ref(index, src, shape, dim, wrap_negative=False):
    shape = tuple(shape)
    if not shape:                                           # a 0-d output: one element, index 0 (or -1)
        _selected(index, 1, "index_add", None, wrap_negative)
        return _accumulate(np.zeros(index.shape, np.int64), src, 1).reshape(())
    dim = dim % len(shape)
    idx = _selected(index, shape[dim], "index_add", dim, wrap_negative).reshape(-1).astype(np.int64)
    bshape = [1] * len(shape)
    bshape[dim] = -1
    full_index = np.broadcast_to(idx.reshape(bshape), src.shape)
    return _accumulate(_linear_index(full_index, shape, dim), src, int(np.prod(shape))).reshape(shape)


def _index_add_grad(ctx, g):
    return None, apply("index_select", g, ctx.inputs[0], dim=ctx.attrs["dim"],
                       wrap_negative=ctx.attrs.get("wrap_negative", False))


defop("index_select", infer=_index_select_infer, ref=_index_select_ref, grad=_index_select_grad,
      lowering=Template("gather"),
      doc="index_select(input, index, dim, wrap_negative): input rows `index` along dim (negative indices "
          "count from the end if wrap_negative)", grad_reads_inputs=False)
defop("index_add", infer=_index_add_infer, ref=_index_add_ref, grad=_index_add_grad,
      lowering=Template("scatter"),
      doc="index_add(index, src, shape, dim, wrap_negative): zeros(shape) with src slices added at index along "
          "dim (negative indices count from the end if wrap_negative)", grad_reads_inputs=False)


def _embedding_infer(weight, indices, padding_idx=-1, scale_grad_by_freq=False):
    _require_index(indices, "embedding", "indices")
    if len(weight.shape) != 2:
        raise RuntimeError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got {tuple(weight.shape)}")
    return TensorMeta(tuple(indices.shape) + (weight.shape[1],), weight.dtype)


def _embedding_ref(weight, indices, padding_idx=-1, scale_grad_by_freq=False):
    _check_range(indices, weight.shape[0], "embedding")
    return weight[indices.astype(np.int64)]


def _embedding_grad(ctx, g):
    weight, indices = ctx.inputs
    num = int(weight.shape[0])
    if ctx.attrs.get("scale_grad_by_freq", False):
        # PyTorch: each lookup's gradient divided by how often its index occurs in the mini-batch
        # (padding lookups counted too); the counts are a scatter of ones, read back per lookup.
        ones = F.ones_like(F.unsqueeze(indices, -1), dtype=g.dtype)
        counts = apply("embedding_backward", ones, indices, num_weights=num, padding_idx=-1)
        g = g / apply("embedding", counts, indices, padding_idx=-1)
    return apply("embedding_backward", g, indices, num_weights=num,
                 padding_idx=ctx.attrs.get("padding_idx", -1)), None


def _embedding_backward_infer(grad, indices, num_weights, padding_idx=-1):
    _require_index(indices, "embedding_backward", "indices")
    if tuple(grad.shape[:-1]) != tuple(indices.shape):
        raise RuntimeError(f"embedding_backward: grad shape {tuple(grad.shape)} does not match indices "
                           f"shape {tuple(indices.shape)} + (embedding_dim,)")
    return TensorMeta((int(num_weights), grad.shape[-1]), grad.dtype)


def _embedding_backward_ref(grad, indices, num_weights, padding_idx=-1):
    D = grad.shape[-1]
    idx = indices.reshape(-1).astype(np.int64)
    _check_range(idx, num_weights, "embedding_backward")
    lin = idx[:, None] * D + np.arange(D, dtype=np.int64)[None, :]
    out = _accumulate(lin, grad.reshape(-1, D), int(num_weights) * D).reshape(int(num_weights), D)
    if padding_idx is not None and padding_idx >= 0:
        out[padding_idx] = 0
    return out


def _embedding_backward_grad(ctx, gg):
    grad, indices = ctx.inputs
    pad = ctx.attrs.get("padding_idx", -1)
    rows = apply("embedding", gg, indices, padding_idx=pad)
    if pad is not None and pad >= 0:
        rows = rows * F.cast(F.unsqueeze(F.ne(indices, pad), -1), rows.dtype)
    return rows, None


defop("embedding", infer=_embedding_infer, ref=_embedding_ref, grad=_embedding_grad, lowering=Template("gather"),
      doc="embedding(weight, indices, padding_idx, scale_grad_by_freq): weight[indices]; padding_idx (-1: none) "
          "and scale_grad_by_freq (each index's gradient divided by its count in indices) only affect grad", grad_reads_inputs=False)
defop("embedding_backward", infer=_embedding_backward_infer, ref=_embedding_backward_ref,
      grad=_embedding_backward_grad, lowering=Template("scatter"),
      doc="embedding_backward(grad, indices, num_weights, padding_idx): rows of grad summed per index; "
          "the padding_idx row stays zero")


# --------------------------------------------------------------------------
# conv2d (Template "conv2d"); NCHW, weight (O, C/groups, kh, kw), no bias

def conv2d_output_size(hw, kernel, stride, padding, dilation) -> tuple:
    return tuple((hw[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(2))


def _conv_check(x_shape, w_shape, stride, padding, dilation, groups, op="conv2d"):
    if len(x_shape) != 4:
        raise RuntimeError(f"{op}: expected a 4-D input (N, C, H, W), got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise RuntimeError(f"{op}: expected a 4-D weight (O, C/groups, kh, kw), got shape {tuple(w_shape)}")
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    if groups < 1 or x_shape[1] % groups or w_shape[0] % groups:
        raise RuntimeError(f"{op}: groups={groups} must divide both in_channels={x_shape[1]} "
                           f"and out_channels={w_shape[0]}")
    if w_shape[1] * groups != x_shape[1]:
        raise RuntimeError(f"{op}: expected input{list(x_shape)} to have {w_shape[1] * groups} channels, "
                           f"but got {x_shape[1]} channels instead (weight {list(w_shape)}, groups={groups})")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise RuntimeError(f"{op}: stride and dilation must be >= 1 and padding >= 0")
    oh, ow = conv2d_output_size(x_shape[2:], w_shape[2:], stride, padding, dilation)
    if oh < 1 or ow < 1:
        raise RuntimeError(f"{op}: input {tuple(x_shape[2:])} (padded by {padding}) is smaller than the "
                           f"dilated kernel {tuple(w_shape[2:])} (dilation {dilation})")
    return stride, padding, dilation, (oh, ow)


def _conv2d_infer(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    _require_float(x, "conv2d")
    _, _, _, (oh, ow) = _conv_check(x.shape, w.shape, stride, padding, dilation, groups)
    return TensorMeta((x.shape[0], w.shape[0], oh, ow), dt.promote(x.dtype, w.dtype))


def _pad_hw(x, padding):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _conv2d_ref(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    stride, padding, dilation, (OH, OW) = _conv_check(x.shape, w.shape, stride, padding, dilation, groups)
    ct = _ctype(x, w)
    x, w = _f(x, ct), _f(w, ct)
    N = x.shape[0]
    O, Cg, kh, kw = w.shape
    G = groups
    Og = O // G
    win = _window_view(_pad_hw(x, padding), (kh, kw), (OH, OW), stride, dilation)
    if Cg == 1:
        # One input channel per group (depthwise, channel multiplier Og): kh*kw fused multiply-adds.
        wm = w.reshape(G, Og, kh, kw)
        out = np.zeros((N, G, Og, OH, OW), ct)
        for i in range(kh):
            for j in range(kw):
                out += win[:, :, None, i, j] * wm[None, :, :, i, j, None, None]
        return out.reshape(N, O, OH, OW)
    # im2col in (group, K, batch*pixels) layout: one GEMM per group rather than one per
    # (image, group) — far fewer BLAS calls, which matters on small, busy machines.
    K, P = Cg * kh * kw, OH * OW
    cols = win.reshape(N, G, K, P).transpose(1, 2, 0, 3).reshape(G, K, N * P)
    out = np.matmul(w.reshape(G, Og, K), cols)                         # (G, Og, N*P)
    return out.reshape(O, N, OH, OW).transpose(1, 0, 2, 3)


def _conv2d_grad_input_ref(g, w, input_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    stride, padding, dilation, (OH, OW) = _conv_check(input_shape, w.shape, stride, padding, dilation, groups)
    ct = _ctype(g, w)
    g, w = _f(g, ct), _f(w, ct)
    N, C, H, W = input_shape
    O, Cg, kh, kw = w.shape
    G = groups
    Og = O // G
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    if Cg == 1:
        dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw), ct)
        gm = g.reshape(N, G, Og, OH, OW)
        wm = w.reshape(G, Og, kh, kw)
        for i in range(kh):
            for j in range(kw):
                contrib = (gm * wm[None, :, :, i, j, None, None]).sum(axis=2) if Og > 1 else \
                    gm[:, :, 0] * wm[None, :, 0, i, j, None, None]
                dxp[:, :, _tap(i, dh, sh, OH), _tap(j, dw, sw, OW)] += contrib
        return dxp[:, :, ph:ph + H, pw:pw + W]
    # GEMM per group into (C, kh, kw, N, OH, OW) columns, then col2im: one strided add per tap.
    K, P = Cg * kh * kw, OH * OW
    gt = g.reshape(N, G, Og, P).transpose(1, 2, 0, 3).reshape(G, Og, N * P)
    dcols = np.matmul(w.reshape(G, Og, K).transpose(0, 2, 1), gt).reshape(C, kh, kw, N, OH, OW)
    dxp = np.zeros((C, N, H + 2 * ph, W + 2 * pw), ct)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, _tap(i, dh, sh, OH), _tap(j, dw, sw, OW)] += dcols[:, i, j]
    return dxp[:, :, ph:ph + H, pw:pw + W].transpose(1, 0, 2, 3)


def _conv2d_grad_weight_ref(g, x, weight_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    stride, padding, dilation, (OH, OW) = _conv_check(x.shape, weight_shape, stride, padding, dilation, groups)
    ct = _ctype(g, x)
    g, x = _f(g, ct), _f(x, ct)
    N = x.shape[0]
    O, Cg, kh, kw = weight_shape
    G = groups
    Og = O // G
    win = _window_view(_pad_hw(x, padding), (kh, kw), (OH, OW), stride, dilation)
    if Cg == 1:
        gm = g.reshape(N, G, Og, OH, OW)
        dw = np.empty((G, Og, kh, kw), ct)
        for i in range(kh):
            for j in range(kw):
                dw[:, :, i, j] = np.einsum("nghw,ngmhw->gm", win[:, :, i, j], gm)
        return dw.reshape(O, 1, kh, kw)
    K = Cg * kh * kw
    P = OH * OW
    cols = win.reshape(N, G, K, P).transpose(1, 0, 3, 2).reshape(G, N * P, K)
    gp = g.reshape(N, G, Og, P).transpose(1, 2, 0, 3).reshape(G, Og, N * P)
    return np.matmul(gp, cols).reshape(O, Cg, kh, kw)


def _conv_attrs(attrs):
    return {k: attrs[k] for k in ("stride", "padding", "dilation", "groups") if k in attrs}


def _conv2d_grad(ctx, g):
    x, w = ctx.inputs
    a = _conv_attrs(ctx.attrs)
    # Eager mode skips gradients nobody asked for (the image fed to the first conv); lazy
    # tensors in graph autodiff carry no requires_grad, and dead-code elimination drops unused ones.
    gx = apply("conv2d_grad_input", g, w, input_shape=tuple(x.shape), **a) if wants_grad(x) else None
    gw = apply("conv2d_grad_weight", g, x, weight_shape=tuple(w.shape), **a) if wants_grad(w) else None
    return gx, gw


def _conv2d_grad_input_infer(g, w, input_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    _, _, _, out_hw = _conv_check(tuple(input_shape), w.shape, stride, padding, dilation, groups, "conv2d_grad_input")
    expected = (input_shape[0], w.shape[0]) + tuple(out_hw)
    if tuple(g.shape) != expected:
        raise RuntimeError(f"conv2d_grad_input: grad shape {tuple(g.shape)} != conv output shape {expected}")
    return TensorMeta(tuple(input_shape), dt.promote(g.dtype, w.dtype))


def _conv2d_grad_weight_infer(g, x, weight_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    _, _, _, out_hw = _conv_check(x.shape, tuple(weight_shape), stride, padding, dilation, groups, "conv2d_grad_weight")
    expected = (x.shape[0], weight_shape[0]) + tuple(out_hw)
    if tuple(g.shape) != expected:
        raise RuntimeError(f"conv2d_grad_weight: grad shape {tuple(g.shape)} != conv output shape {expected}")
    return TensorMeta(tuple(weight_shape), dt.promote(g.dtype, x.dtype))


def _conv2d_grad_input_grad(ctx, gg):
    # out = conv2d_grad_input(g, w) is bilinear: <gg, out> = <conv2d(gg, w), g>.
    g, w = ctx.inputs
    a = _conv_attrs(ctx.attrs)
    d_g = apply("conv2d", gg, w, **a)
    d_w = apply("conv2d_grad_weight", g, gg, weight_shape=tuple(w.shape), **a)
    return d_g, d_w


def _conv2d_grad_weight_grad(ctx, gg):
    # out = conv2d_grad_weight(g, x): <gg, out> = <conv2d(x, gg), g>.
    g, x = ctx.inputs
    a = _conv_attrs(ctx.attrs)
    d_g = apply("conv2d", x, gg, **a)
    d_x = apply("conv2d_grad_input", g, gg, input_shape=tuple(x.shape), **a)
    return d_g, d_x


defop("conv2d", infer=_conv2d_infer, ref=_conv2d_ref, grad=_conv2d_grad, lowering=Template("conv2d"),
      doc="conv2d(x, w, stride, padding, dilation, groups): NCHW cross-correlation, no bias",
      fusion="conv", autocast="lower_precision")
defop("conv2d_grad_input", infer=_conv2d_grad_input_infer, ref=_conv2d_grad_input_ref,
      grad=_conv2d_grad_input_grad, lowering=Template("conv2d"),
      doc="conv2d_grad_input(grad, w, input_shape, stride, padding, dilation, groups)", autocast="lower_precision")
defop("conv2d_grad_weight", infer=_conv2d_grad_weight_infer, ref=_conv2d_grad_weight_ref,
      grad=_conv2d_grad_weight_grad, lowering=Template("conv2d"),
      doc="conv2d_grad_weight(grad, x, weight_shape, stride, padding, dilation, groups)")


# --------------------------------------------------------------------------
# pooling (Template "pool2d")

def pool_output_size(L, k, s, p, d, ceil_mode) -> int:
    """PyTorch's pooling output length (the last window must start inside input + left padding)."""
    num = L + 2 * p - d * (k - 1) - 1 + ((s - 1) if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= L + p:
        out -= 1
    return out


def _pool_geometry(shape, kernel_size, stride, padding, dilation, ceil_mode, op):
    if len(shape) != 4:
        raise RuntimeError(f"{op}: expected a 4-D input (N, C, H, W), got shape {tuple(shape)}")
    k, s, p, d = _pair(kernel_size), _pair(stride), _pair(padding), _pair(dilation)
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0:
        raise RuntimeError(f"{op}: kernel_size, stride and dilation must be >= 1, padding >= 0")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:   # PyTorch's rule (on the undilated kernel size)
        raise RuntimeError(f"{op}: pad should be at most half of effective kernel size, "
                           f"but got pad={p} and kernel_size={k}")
    out = tuple(pool_output_size(shape[2 + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(2))
    if min(out) < 1:
        raise RuntimeError(f"{op}: output size {out} is too small for input {tuple(shape)}")
    return k, s, p, d, out


def _padded_for_pool(x, k, s, p, d, out, fill):
    """x padded by p on the top/left and enough on the bottom/right for every window (ceil_mode)."""
    N, C, H, W = x.shape
    Hp = max(H + 2 * p[0], (out[0] - 1) * s[0] + d[0] * (k[0] - 1) + 1)
    Wp = max(W + 2 * p[1], (out[1] - 1) * s[1] + d[1] * (k[1] - 1) + 1)
    xp = np.full((N, C, Hp, Wp), fill, x.dtype)
    xp[:, :, p[0]:p[0] + H, p[1]:p[1] + W] = x
    return xp


def _max_pool2d_infer(x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    _require_float(x, "max_pool2d")
    *_, out = _pool_geometry(x.shape, kernel_size, stride, padding, dilation, ceil_mode, "max_pool2d")
    return TensorMeta(tuple(x.shape[:2]) + out, x.dtype)


def _max_pool2d_ref(x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    k, s, p, d, out = _pool_geometry(x.shape, kernel_size, stride, padding, dilation, ceil_mode, "max_pool2d")
    x = _f(x, _ctype(x))
    win = _window_view(_padded_for_pool(x, k, s, p, d, out, -np.inf), k, out, s, d)
    return win.max(axis=(2, 3))


def _max_pool2d_grad_ref(g, x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    k, s, p, d, out = _pool_geometry(x.shape, kernel_size, stride, padding, dilation, ceil_mode, "max_pool2d_grad")
    ct = _ctype(x, g)
    N, C, H, W = x.shape
    xp = _padded_for_pool(_f(x, ct), k, s, p, d, out, -np.inf)
    Hp, Wp = xp.shape[2:]
    win = _window_view(xp, k, out, s, d).reshape(N, C, k[0] * k[1], out[0], out[1])
    am = win.argmax(axis=2)                       # first maximum in row-major window order (as PyTorch)
    ki, kj = np.divmod(am, k[1])
    rows = np.arange(out[0]).reshape(1, 1, -1, 1) * s[0] + ki * d[0]
    cols = np.arange(out[1]).reshape(1, 1, 1, -1) * s[1] + kj * d[1]
    plane = (np.arange(N).reshape(-1, 1, 1, 1) * C + np.arange(C).reshape(1, -1, 1, 1)) * (Hp * Wp)
    lin = plane + rows * Wp + cols
    dxp = np.bincount(lin.reshape(-1), weights=_f(g, np.float64).reshape(-1), minlength=N * C * Hp * Wp)
    return dxp.reshape(N, C, Hp, Wp)[:, :, p[0]:p[0] + H, p[1]:p[1] + W]


def _max_pool2d_indices_infer(x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    return TensorMeta(_max_pool2d_infer(x, kernel_size, stride, padding, dilation, ceil_mode).shape, dt.int64)


def _max_pool2d_indices_ref(x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    k, s, p, d, out = _pool_geometry(x.shape, kernel_size, stride, padding, dilation, ceil_mode, "max_pool2d")
    N, C, H, W = x.shape
    xp = _padded_for_pool(_f(x, _ctype(x)), k, s, p, d, out, -np.inf)
    win = _window_view(xp, k, out, s, d).reshape(N, C, k[0] * k[1], out[0], out[1])
    ki, kj = np.divmod(win.argmax(axis=2), k[1])  # first maximum (a NaN wins), as the gradient takes it
    rows = np.arange(out[0]).reshape(1, 1, -1, 1) * s[0] - p[0] + ki * d[0]
    cols = np.arange(out[1]).reshape(1, 1, 1, -1) * s[1] - p[1] + kj * d[1]
    return (rows * W + cols).astype(np.int64)


def _max_pool2d_grad(ctx, g):
    return (apply("max_pool2d_grad", g, ctx.inputs[0], **ctx.attrs),)


def _max_pool2d_grad_infer(g, x, kernel_size, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    expected = _max_pool2d_infer(x, kernel_size, stride, padding, dilation, ceil_mode)
    if tuple(g.shape) != tuple(expected.shape):
        raise RuntimeError(f"max_pool2d_grad: grad shape {tuple(g.shape)} != pooled shape {expected.shape}")
    return TensorMeta(tuple(x.shape), x.dtype)


defop("max_pool2d", infer=_max_pool2d_infer, ref=_max_pool2d_ref, grad=_max_pool2d_grad,
      lowering=Template("pool2d"),
      doc="max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode); padding counts as -inf")
defop("max_pool2d_indices", infer=_max_pool2d_indices_infer, ref=_max_pool2d_indices_ref, grad=None,
      lowering=Template("pool2d"),
      doc="max_pool2d_indices(x, <max_pool2d attrs>): int64 flat index (h * W + w) of each window's "
          "first maximum in its (n, c) plane: PyTorch's return_indices")
defop("max_pool2d_grad", infer=_max_pool2d_grad_infer, ref=_max_pool2d_grad_ref, grad=None,
      lowering=Template("pool2d"),
      doc="max_pool2d_grad(grad, x, <max_pool2d attrs>): grad routed to the first maximum of each window")


def _avg_divisors(L, OL, k, s, p, count_include_pad):
    start = np.arange(OL) * s - p
    end = np.minimum(start + k, L + p)
    if count_include_pad:
        return (end - start).astype(np.float64)
    return (np.minimum(end, L) - np.maximum(start, 0)).astype(np.float64)


def _avg_divisor_2d(shape, k, s, p, out, count_include_pad):
    dh = _avg_divisors(shape[2], out[0], k[0], s[0], p[0], count_include_pad)
    dw = _avg_divisors(shape[3], out[1], k[1], s[1], p[1], count_include_pad)
    return dh[:, None] * dw[None, :]


def _avg_pool2d_infer(x, kernel_size, stride, padding=(0, 0), ceil_mode=False, count_include_pad=True):
    _require_float(x, "avg_pool2d")
    *_, out = _pool_geometry(x.shape, kernel_size, stride, padding, 1, ceil_mode, "avg_pool2d")
    return TensorMeta(tuple(x.shape[:2]) + out, x.dtype)


def _avg_pool2d_ref(x, kernel_size, stride, padding=(0, 0), ceil_mode=False, count_include_pad=True):
    k, s, p, d, out = _pool_geometry(x.shape, kernel_size, stride, padding, 1, ceil_mode, "avg_pool2d")
    ct = _ctype(x)
    win = _window_view(_padded_for_pool(_f(x, ct), k, s, p, d, out, 0), k, out, s, d)
    return win.sum(axis=(2, 3)) / _avg_divisor_2d(x.shape, k, s, p, out, count_include_pad).astype(ct)


def _avg_pool2d_grad_ref(g, input_shape, kernel_size, stride, padding=(0, 0), ceil_mode=False,
                         count_include_pad=True):
    k, s, p, d, out = _pool_geometry(input_shape, kernel_size, stride, padding, 1, ceil_mode, "avg_pool2d_grad")
    ct = _ctype(g)
    N, C, H, W = input_shape
    gd = _f(g, ct) / _avg_divisor_2d(input_shape, k, s, p, out, count_include_pad).astype(ct)
    Hp = max(H + 2 * p[0], (out[0] - 1) * s[0] + k[0])
    Wp = max(W + 2 * p[1], (out[1] - 1) * s[1] + k[1])
    dxp = np.zeros((N, C, Hp, Wp), ct)
    for i in range(k[0]):
        for j in range(k[1]):
            dxp[:, :, _tap(i, 1, s[0], out[0]), _tap(j, 1, s[1], out[1])] += gd
    return dxp[:, :, p[0]:p[0] + H, p[1]:p[1] + W]


def _avg_pool2d_grad(ctx, g):
    return (apply("avg_pool2d_grad", g, input_shape=tuple(ctx.inputs[0].shape), **ctx.attrs),)


def _avg_pool2d_grad_infer(g, input_shape, kernel_size, stride, padding=(0, 0), ceil_mode=False,
                           count_include_pad=True):
    *_, out = _pool_geometry(tuple(input_shape), kernel_size, stride, padding, 1, ceil_mode, "avg_pool2d_grad")
    if tuple(g.shape) != tuple(input_shape[:2]) + out:
        raise RuntimeError(f"avg_pool2d_grad: grad shape {tuple(g.shape)} != pooled shape "
                           f"{tuple(input_shape[:2]) + out}")
    return TensorMeta(tuple(input_shape), g.dtype)


def _avg_pool2d_grad_grad(ctx, gg):
    attrs = {k: v for k, v in ctx.attrs.items() if k != "input_shape"}
    return (apply("avg_pool2d", gg, **attrs),)


defop("avg_pool2d", infer=_avg_pool2d_infer, ref=_avg_pool2d_ref, grad=_avg_pool2d_grad,
      lowering=Template("pool2d"),
      doc="avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad) (PyTorch divisors)")
defop("avg_pool2d_grad", infer=_avg_pool2d_grad_infer, ref=_avg_pool2d_grad_ref, grad=_avg_pool2d_grad_grad,
      lowering=Template("pool2d"),
      doc="avg_pool2d_grad(grad, input_shape, <avg_pool2d attrs>)")


def adaptive_bins(L, OL):
    """PyTorch's adaptive pooling bins: [floor(i*L/OL), ceil((i+1)*L/OL))."""
    starts = [(i * L) // OL for i in range(OL)]
    ends = [-((-(i + 1) * L) // OL) for i in range(OL)]
    return starts, ends


def _adaptive_infer(x, output_size):
    _require_float(x, "adaptive_avg_pool2d")
    if len(x.shape) != 4:
        raise RuntimeError(f"adaptive_avg_pool2d: expected a 4-D input, got shape {tuple(x.shape)}")
    oh, ow = _pair(output_size)
    if oh < 1 or ow < 1:
        raise RuntimeError(f"adaptive_avg_pool2d: output_size must be positive, got {(oh, ow)}")
    return TensorMeta(tuple(x.shape[:2]) + (oh, ow), x.dtype)


def _adaptive_ref(x, output_size):
    oh, ow = _pair(output_size)
    ct = _ctype(x)
    x = _f(x, ct)
    (hs, he), (ws, we) = adaptive_bins(x.shape[2], oh), adaptive_bins(x.shape[3], ow)
    out = np.empty(tuple(x.shape[:2]) + (oh, ow), ct)
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = x[:, :, hs[i]:he[i], ws[j]:we[j]].mean(axis=(2, 3))
    return out


def _adaptive_grad_ref(g, input_shape, output_size):
    oh, ow = _pair(output_size)
    ct = _ctype(g)
    g = _f(g, ct)
    (hs, he), (ws, we) = adaptive_bins(input_shape[2], oh), adaptive_bins(input_shape[3], ow)
    dx = np.zeros(tuple(input_shape), ct)
    for i in range(oh):
        for j in range(ow):
            area = ct((he[i] - hs[i]) * (we[j] - ws[j]))
            dx[:, :, hs[i]:he[i], ws[j]:we[j]] += (g[:, :, i, j] / area)[:, :, None, None]
    return dx


def _adaptive_grad_infer(g, input_shape, output_size):
    if tuple(g.shape) != tuple(input_shape[:2]) + _pair(output_size):
        raise RuntimeError(f"adaptive_avg_pool2d_grad: grad shape {tuple(g.shape)} does not match output_size")
    return TensorMeta(tuple(input_shape), g.dtype)


defop("adaptive_avg_pool2d", infer=_adaptive_infer, ref=_adaptive_ref,
      grad=lambda ctx, g: (apply("adaptive_avg_pool2d_grad", g, input_shape=tuple(ctx.inputs[0].shape),
                                 **ctx.attrs),),
      lowering=Template("pool2d"),
      doc="adaptive_avg_pool2d(x, output_size): PyTorch bins; only used when the size does not divide evenly")
defop("adaptive_avg_pool2d_grad", infer=_adaptive_grad_infer, ref=_adaptive_grad_ref,
      grad=lambda ctx, gg: (apply("adaptive_avg_pool2d", gg, output_size=ctx.attrs["output_size"]),),
      lowering=Template("pool2d"),
      doc="adaptive_avg_pool2d_grad(grad, input_shape, output_size)")


# --------------------------------------------------------------------------
# upsampling (Template "upsample"). Both are separable: out = A_h @ x @ A_w^T.

def nearest_source_index(in_size, out_size, scale):
    """PyTorch's nearest source index, computed in float32 exactly like ATen."""
    dst = np.arange(out_size)
    if out_size == in_size:
        return dst
    if out_size == 2 * in_size:
        return dst >> 1
    factor = np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(in_size) / np.float32(out_size)
    src = np.floor(dst.astype(np.float32) * factor).astype(np.int64)
    return np.minimum(src, in_size - 1)


def linear_source_weights(in_size, out_size, align_corners, scale, coord=np.float32):
    """(i0, i1, w0, w1) per output index for linear interpolation, in PyTorch's arithmetic: the
    source coordinates and weights in `coord`, the input's accumulation type (float32 for
    float32 and 16-bit inputs, float64 for float64)."""
    dst = np.arange(out_size).astype(coord)
    if align_corners:
        factor = coord(in_size - 1) / coord(out_size - 1) if out_size > 1 else coord(0)
        src = factor * dst
    else:
        factor = coord(1.0 / scale) if scale is not None and scale > 0 else coord(in_size) / coord(out_size)
        src = factor * (dst + coord(0.5)) - coord(0.5)
        src = np.maximum(src, coord(0))
    i0 = src.astype(np.int64)
    i1 = i0 + (i0 < in_size - 1)
    w1 = src - i0.astype(coord)
    w0 = coord(1) - w1
    return i0, i1, w0, w1


def _interp_matrix(in_size, out_size, mode, align_corners, scale, ct):
    A = np.zeros((out_size, in_size), ct)
    rows = np.arange(out_size)
    if mode == "nearest":
        A[rows, nearest_source_index(in_size, out_size, scale)] = 1
    else:
        i0, i1, w0, w1 = linear_source_weights(in_size, out_size, align_corners, scale, ct)
        np.add.at(A, (rows, i0), w0.astype(ct))
        np.add.at(A, (rows, i1), w1.astype(ct))
    return A


def _scales_pair(scales):
    if scales is None:
        return (None, None)
    return tuple(None if s is None else float(s) for s in scales)


def _upsample_infer(x, size, scales=None, align_corners=None):
    _require_float(x, "upsample")
    if len(x.shape) != 4:
        raise RuntimeError(f"upsample: expected a 4-D input (N, C, H, W), got shape {tuple(x.shape)}")
    oh, ow = _pair(size)
    if oh < 1 or ow < 1:
        raise RuntimeError(f"upsample: output size must be positive, got {(oh, ow)}")
    return TensorMeta(tuple(x.shape[:2]) + (oh, ow), x.dtype)


def _upsample_apply(x, size, mode, align_corners, scales):
    ct = _ctype(x)
    (oh, ow), (sh, sw) = _pair(size), _scales_pair(scales)
    Ah = _interp_matrix(x.shape[2], oh, mode, align_corners, sh, ct)
    Aw = _interp_matrix(x.shape[3], ow, mode, align_corners, sw, ct)
    return np.matmul(np.matmul(Ah, _f(x, ct)), Aw.T)


def _upsample_adjoint(g, input_shape, size, mode, align_corners, scales):
    ct = _ctype(g)
    (oh, ow), (sh, sw) = _pair(size), _scales_pair(scales)
    Ah = _interp_matrix(input_shape[2], oh, mode, align_corners, sh, ct)
    Aw = _interp_matrix(input_shape[3], ow, mode, align_corners, sw, ct)
    return np.matmul(np.matmul(Ah.T, _f(g, ct)), Aw)


def _upsample_grad_infer(g, input_shape, size, scales=None, align_corners=None):
    if tuple(g.shape) != tuple(input_shape[:2]) + _pair(size):
        raise RuntimeError(f"upsample grad: grad shape {tuple(g.shape)} does not match size {size}")
    return TensorMeta(tuple(input_shape), g.dtype)


defop("upsample_nearest2d", infer=_upsample_infer,
      ref=lambda x, size, scales=None: _upsample_apply(x, size, "nearest", False, scales),
      grad=lambda ctx, g: (apply("upsample_nearest2d_grad", g, input_shape=tuple(ctx.inputs[0].shape),
                                 **ctx.attrs),),
      lowering=Template("upsample"),
      doc="upsample_nearest2d(x, size, scales): src = min(floor(dst * f), in - 1), f = 1/scale or in/out "
          "(float32); identity when out == in, dst >> 1 when out == 2 * in")
defop("upsample_nearest2d_grad", infer=_upsample_grad_infer,
      ref=lambda g, input_shape, size, scales=None: _upsample_adjoint(g, input_shape, size, "nearest", False, scales),
      grad=lambda ctx, gg: (apply("upsample_nearest2d", gg, size=ctx.attrs["size"],
                                  scales=ctx.attrs.get("scales")),),
      lowering=Template("upsample"), doc="upsample_nearest2d_grad(grad, input_shape, size, scales)")
defop("upsample_bilinear2d", infer=_upsample_infer,
      ref=lambda x, size, align_corners=False, scales=None: _upsample_apply(x, size, "linear", align_corners, scales),
      grad=lambda ctx, g: (apply("upsample_bilinear2d_grad", g, input_shape=tuple(ctx.inputs[0].shape),
                                 **ctx.attrs),),
      lowering=Template("upsample"),
      doc="upsample_bilinear2d(x, size, align_corners, scales): PyTorch source-index rules, coordinates in "
          "the accumulation type (float64 for float64, float32 otherwise)")
defop("upsample_bilinear2d_grad", infer=_upsample_grad_infer,
      ref=lambda g, input_shape, size, align_corners=False, scales=None:
          _upsample_adjoint(g, input_shape, size, "linear", align_corners, scales),
      grad=lambda ctx, gg: (apply("upsample_bilinear2d", gg, size=ctx.attrs["size"],
                                  align_corners=ctx.attrs.get("align_corners", False),
                                  scales=ctx.attrs.get("scales")),),
      lowering=Template("upsample"), doc="upsample_bilinear2d_grad(grad, input_shape, size, align_corners, scales)")


# --------------------------------------------------------------------------
# dropout: elementwise, counter-based random numbers so eager == compiled

DROPOUT_EXPR = ("(flowgen_philox_uniform({seed}, {offset}, {idx}) >= (float)({p}) "
                "? {0} / (1.0f - (float)({p})) : 0.0f)")


def dropout_keep_mask(shape, p, seed, offset):
    """The keep mask of dropout(p, seed, offset) over a tensor of `shape` (element i uses stream value i)."""
    n = int(np.prod(shape, dtype=np.int64))
    u = np.asarray(philox_uniform(seed, offset, n), dtype=np.float32).reshape(shape)
    return u >= np.float32(p)


def _dropout_infer(x, p, seed, offset, stream=None):
    _require_float(x, "dropout")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return x


def _dropout_ref(x, p, seed, offset, stream=None):
    # `stream` names the graph state that supplies seed/offset per call in compiled graphs
    # (flowgen/passes/random_streams.py); the reference uses the attributes as given.
    keep = dropout_keep_mask(x.shape, p, seed, offset)
    ct = _ctype(x)
    scale = np.float32(1.0) - np.float32(p)          # (1.0f - (float)p), as the kernel computes it
    with np.errstate(divide="ignore", invalid="ignore"):
        kept = _f(x, ct) / ct(scale)
    return np.where(keep, kept, ct(0))


defop("dropout", infer=_dropout_infer, ref=_dropout_ref,
      grad=lambda ctx, g: (apply("dropout", g, **ctx.attrs),),
      lowering=Elementwise(DROPOUT_EXPR), random=True,
      doc="dropout(x, p, seed, offset): u = philox_uniform(seed, offset)[idx]; u >= p ? x / (1 - p) : 0")


# --------------------------------------------------------------------------
# attention (Template "attention": the [L, S] scores never reach memory, forward or backward)
#
# attention(q (..., L, E), k (..., S, E), v (..., S, Ev)[, mask], scale, causal) -> (o, lse) is
# softmax(q k^T * scale + mask) v and the per-row logsumexp of those scores. `mask` broadcasts
# to (..., L, S): bool (True = attend, False = score -inf) or an additive float of the query's
# dtype; `causal` keeps key j <= query i (top-left aligned: PyTorch's is_causal). A row whose
# scores are all -inf (fully masked) gives o = 0 and lse = -inf, and no gradient flows through
# it: PyTorch's SDPA (its "safe softmax"). The forward kernel runs an online softmax over the keys
# (across key tiles of a block of query rows on a GPU, templates/attention_tiled.cu.j2; a thread per
# query row on the cpu target, templates/attention.cu.j2). lse is float32 (float64 for float64 inputs) and is what the backward needs to rebuild any
# probability P_ij = exp(s_ij - lse_i) from q and k alone.
#
# attention_backward(q, k, v, o, do, lse[, mask], scale, causal) -> (dq, dk, dv), without the
# [L, S] matrices (FlashAttention's backward): D_i = rowsum(dO_i * O_i), then per (i, j)
# P = exp(s - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = scale dS K,
# dK = scale dS^T Q. Two kernels, no atomics: one over query rows (D and dQ, looping over keys),
# then one over key rows (dK and dV, looping over queries); tiles of rows per block on a GPU (on
# tensor cores for float16/bfloat16), a thread per row on the cpu target.
#
# attention_dropout / attention_dropout_backward: the same with dropout on P (softmax, then
# F.dropout, then @ v): element (..., i, j) of the [..., L, S] weights is kept where the Philox
# uniform of (seed, offset, its linear index) is >= dropout_p, exactly F.dropout's mask, so the
# fused op equals the composite drawing the same (seed, offset). O = dropout(P) V, and
# D = rowsum(dO * O) is still rowsum(P * dP) with dP = dropout(dO V^T).

def _attention_mask_infer(mask, q, k):
    if mask.dtype != dt.bool_ and mask.dtype != q.dtype:
        raise TypeError(f"attention: attn_mask must be bool or the query's dtype {q.dtype!r}, got {mask.dtype!r}")
    full = (*q.shape[:-1], k.shape[-2])
    if len(mask.shape) > len(full) or broadcast_shapes(mask.shape, full, op="attention") != full:
        raise ValueError(f"attention: attn_mask of shape {tuple(mask.shape)} does not broadcast to {full}")


def _attention_infer(q, k, v, mask=None, *, scale, causal=False, **dropout):
    for meta, what in ((q, "query"), (k, "key"), (v, "value")):
        _require_float(meta, "attention", what)
        if len(meta.shape) < 2:
            raise ValueError(f"attention: {what} needs at least 2 dims, got {tuple(meta.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"attention: query/key/value dtypes differ: {q.dtype!r}, {k.dtype!r}, {v.dtype!r}")
    lead = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != lead or tuple(v.shape[:-2]) != lead or len(k.shape) != len(q.shape) \
            or len(v.shape) != len(q.shape):
        raise ValueError(f"attention: query/key/value batch dims differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention: expected query (..., L, E), key (..., S, E), value (..., S, Ev), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if mask is not None:
        _attention_mask_infer(mask, q, k)
    if dropout and not 0.0 < dropout["dropout_p"] < 1.0:
        raise ValueError(f"attention: dropout_p must be in (0, 1), got {dropout['dropout_p']}")
    lse_dtype = dt.float64 if q.dtype == dt.float64 else dt.float32
    return TensorMeta((*lead, q.shape[-2], v.shape[-1]), q.dtype), TensorMeta((*lead, q.shape[-2]), lse_dtype)


def _attention_scores_ref(q, k, mask, scale, causal, ct):
    """scale * q k^T with the mask applied: -inf where a bool mask or `causal` drops a key."""
    s = np.matmul(_f(q, ct), np.swapaxes(_f(k, ct), -1, -2)) * ct(scale)
    if causal:
        s = np.where(np.tri(q.shape[-2], k.shape[-2], dtype=bool), s, ct(-np.inf))
    if mask is not None:
        s = np.where(mask, s, ct(-np.inf)) if mask.dtype == np.bool_ else s + _f(mask, ct)
    return s


def _attention_probs_ref(s, ct):
    """(P, lse) of scores `s`: softmax over the last dim and its logsumexp; a row of -inf scores
    (fully masked) gives P = 0 and lse = -inf."""
    m = s.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, ct(0), m)            # a fully masked row: every exp is 0
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(l > 0, e / l, ct(0)), (m + np.log(l))[..., 0]


def _attention_dropped(x, ct, dropout_p, seed, offset, stream=None):
    """x ([..., L, S]) through dropout(dropout_p, seed, offset): F.dropout's keep mask, kept
    elements divided by (1 - p) in float32 as its kernel does."""
    keep = dropout_keep_mask(x.shape, dropout_p, seed, offset)
    return np.where(keep, x / ct(np.float32(1.0) - np.float32(dropout_p)), ct(0))


def _attention_ref(q, k, v, mask=None, *, scale, causal=False, **dropout):
    ct = _ctype(q, k, v)
    p, lse = _attention_probs_ref(_attention_scores_ref(q, k, mask, scale, causal, ct), ct)
    if dropout:
        p = _attention_dropped(p, ct, **dropout)
    lse_ct = np.float64 if q.dtype == np.float64 else np.float32
    return np.matmul(p, _f(v, ct)).astype(q.dtype, copy=False), lse.astype(lse_ct, copy=False)


def _attention_grad(ctx, g, g_lse=None):
    if g_lse is not None:
        raise NotImplementedError("attention: the gradient of its logsumexp output is not implemented "
                                  "(it is the backward's input, not a result to differentiate)")
    q, k, v, *mask = ctx.inputs
    out, lse = ctx.outputs
    if mask and mask[0].requires_grad:
        raise NotImplementedError("attention: no gradient for a float attn_mask (scaled_dot_product_attention "
                                  "builds a mask that requires grad from matmul/softmax ops instead)")
    backward = "attention_dropout_backward" if "dropout_p" in ctx.attrs else "attention_backward"
    dq, dk, dv = apply(backward, q, k, v, out, g, lse, *mask, **ctx.attrs)
    return (dq, dk, dv, *(None for _ in mask))


def _attention_backward_infer(q, k, v, o, do, lse, mask=None, **attrs):
    out, lse_meta = _attention_infer(q, k, v, mask, **attrs)
    for meta, want, what in ((o, out, "output"), (do, out, "output gradient"), (lse, lse_meta, "logsumexp")):
        if tuple(meta.shape) != tuple(want.shape) or meta.dtype != want.dtype:
            raise ValueError(f"attention_backward: {what} is {meta}, expected {want}")
    return q, k, v


def _attention_backward_ref(q, k, v, o, do, lse, mask=None, *, scale, causal=False, **dropout):
    # P is the softmax of the recomputed scores (what the gradient means); the kernels rebuild it
    # as exp(s - lse), equal up to rounding, so `lse` is not read here
    ct = _ctype(q, k, v)
    p, _ = _attention_probs_ref(_attention_scores_ref(q, k, mask, scale, causal, ct), ct)
    do_ = _f(do, ct)
    d = (do_ * _f(o, ct)).sum(axis=-1, keepdims=True)
    dp = np.matmul(do_, np.swapaxes(_f(v, ct), -1, -2))
    kept_p = p
    if dropout:   # O = dropout(P) V: dV = dropout(P)^T dO, dP = dropout(dO V^T)
        dp, kept_p = (_attention_dropped(x, ct, **dropout) for x in (dp, p))
    ds = p * (dp - d)
    dv = np.matmul(np.swapaxes(kept_p, -1, -2), do_)
    dq = np.matmul(ds, _f(k, ct)) * ct(scale)
    dk = np.matmul(np.swapaxes(ds, -1, -2), _f(q, ct)) * ct(scale)
    return tuple(a.astype(q.dtype, copy=False) for a in (dq, dk, dv))


defop("attention", infer=_attention_infer, ref=_attention_ref, grad=_attention_grad, num_outputs=2,
      lowering=Template("attention"), autocast="lower_precision",
      doc="attention(q, k, v[, mask], scale, causal) -> (softmax(q k^T * scale + mask) v, logsumexp of the "
          "scores per row): an online softmax over the keys")
defop("attention_backward", infer=_attention_backward_infer, ref=_attention_backward_ref, num_outputs=3,
      lowering=Template("attention"),
      doc="attention_backward(q, k, v, o, do, lse[, mask], scale, causal) -> (dq, dk, dv): probabilities "
          "rebuilt from lse, a kernel over query rows (dq) then one over key rows (dk, dv)")
defop("attention_dropout", infer=_attention_infer, ref=_attention_ref, grad=_attention_grad, num_outputs=2,
      lowering=Template("attention"), random=True, autocast="lower_precision",
      doc="attention_dropout(q, k, v[, mask], scale, causal, dropout_p, seed, offset): attention with "
          "dropout(P) as F.dropout draws it over the [..., L, S] weights")
defop("attention_dropout_backward", infer=_attention_backward_infer, ref=_attention_backward_ref, num_outputs=3,
      lowering=Template("attention"), random=True,
      doc="attention_dropout_backward(q, k, v, o, do, lse[, mask], scale, causal, dropout_p, seed, offset)")
