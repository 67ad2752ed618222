"""Normalisation ops with a closed-form gradient: BatchNorm's (below) and LayerNorm's (`layer_norm`,
`add_layer_norm`, `layer_norm_backward`: row kernels, further down).

``batch_norm_affine(x, mean, invstd, weight, bias)`` is ``(x - mean) * invstd * weight + bias``
where ``mean`` and ``invstd = rsqrt(biased var + eps)`` are *the batch statistics of x* over
every dim but the channel dim 1 (shape ``(1, C, 1, ...)``), as `nn.functional.batch_norm`
computes them in training. Its gradient is the textbook closed form, with the paths through
the statistics already folded in::

    xhat = (x - mean) * invstd
    dbias = sum(g),  dweight = sum(g * xhat)
    dx = invstd * weight * (g - (dbias + xhat * dweight) / n)

so ``mean`` and ``invstd`` take no gradient of their own. Autodiff of the composite would
produce about ten kernels per BatchNorm layer in a training graph's backward; this is two
channel reductions (``g`` and ``g * xhat`` read in one pass) and one elementwise kernel.

``sync_batch_norm_affine(x, mean, invstd, weight, bias, count, world_size)`` is the same map for
SyncBatchNorm on several ranks: ``mean`` and ``invstd`` are the statistics of the batch of all
ranks together and ``count`` (per channel, like ``mean``) its number of elements per channel.
Its gradient is the same closed form with the two channel sums all-reduced over the ranks (an
``all_reduce`` op, flowgen/distributed/collectives.py) before ``dx``; ``dweight`` and ``dbias``
stay this rank's sums, as any parameter's gradient (the data-parallel all-reduce combines them).
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Elementwise, Template
from flowgen.ops.nn_ops import _ctype
from flowgen.ops.registry import TensorMeta, apply, broadcast_shapes, defop, wants_grad


def _stat_dims(x):
    return (0,) + tuple(range(2, len(x.shape)))


def _bn_affine_infer(x, mean, invstd, weight, bias):
    if not x.dtype.is_floating:
        raise TypeError(f"batch_norm: expected a floating point input, got {x.dtype!r}")
    if len(x.shape) < 2:
        raise ValueError(f"batch_norm: expected an input with at least 2 dims (N, C, ...), got {tuple(x.shape)}")
    shape = broadcast_shapes(x.shape, mean.shape, invstd.shape, weight.shape, bias.shape, op="batch_norm")
    if shape != tuple(x.shape):
        raise ValueError(f"batch_norm: per-channel operands must broadcast to the input's shape {tuple(x.shape)}")
    # A 16-bit input with float32 statistics and parameters (mixed precision) keeps its dtype, as
    # PyTorch's batch_norm: computed in float32, stored in 16 bits.
    out = x.dtype if x.dtype in (dt.float16, dt.bfloat16) else dt.promote(x.dtype, weight.dtype)
    return TensorMeta(tuple(x.shape), out)


def _bn_affine_ref(x, mean, invstd, weight, bias):
    ct = _ctype(x)
    c = [a.astype(ct, copy=False) for a in (x, mean, invstd, weight, bias)]
    return (c[0] - c[1]) * c[2] * c[3] + c[4]


def _bn_affine_grad(ctx, g):
    x, mean, invstd, weight, bias = ctx.inputs
    dims = _stat_dims(x)
    n = 1
    for d in dims:
        n *= int(x.shape[d])
    xhat = (x - mean) * invstd
    g = F.cast(g, xhat.dtype)    # a 16-bit gradient: the channel sums and dx in float32, as the forward
    dbias = F.sum(g, dims, keepdim=True)
    dweight = F.sum(g * xhat, dims, keepdim=True)
    dx = None
    if wants_grad(x):
        # full-size products only, so the whole expression is one elementwise kernel
        dx = (g - (dbias + xhat * dweight) * (1.0 / n)) * invstd * weight
    return (dx, None, None,
            F.sum_to(dweight, tuple(weight.shape)) if wants_grad(weight) else None,
            F.sum_to(dbias, tuple(bias.shape)) if wants_grad(bias) else None)


defop("batch_norm_affine", infer=_bn_affine_infer, ref=_bn_affine_ref, grad=_bn_affine_grad,
      lowering=Elementwise("(((({0}) - ({1})) * ({2})) * ({3}) + ({4}))"),
      doc="batch_norm_affine(x, mean, invstd, weight, bias): training BatchNorm with x's own batch "
          "statistics; closed-form gradient (mean and invstd take none)")


def _sync_bn_affine_infer(x, mean, invstd, weight, bias, count, world_size: int):
    broadcast_shapes(mean.shape, count.shape, op="sync_batch_norm")
    return _bn_affine_infer(x, mean, invstd, weight, bias)


def _sync_bn_affine_ref(x, mean, invstd, weight, bias, count, world_size: int):
    return _bn_affine_ref(x, mean, invstd, weight, bias)


def _sync_bn_affine_grad(ctx, g):
    x, mean, invstd, weight, bias, count = ctx.inputs
    dims = _stat_dims(x)
    xhat = (x - mean) * invstd
    g = F.cast(g, xhat.dtype)    # a 16-bit gradient: the channel sums and dx in float32, as the forward
    dbias = F.sum(g, dims, keepdim=True)
    dweight = F.sum(g * xhat, dims, keepdim=True)
    dx = None
    if wants_grad(x):
        # the sums over every rank's part of the batch, as one process would take over the whole batch
        all_dbias, all_dweight = apply("all_reduce", dbias, dweight, op="sum", world_size=ctx.attrs["world_size"])
        dx = (g - (all_dbias + xhat * all_dweight) / count) * invstd * weight
    return (dx, None, None,
            F.sum_to(dweight, tuple(weight.shape)) if wants_grad(weight) else None,
            F.sum_to(dbias, tuple(bias.shape)) if wants_grad(bias) else None, None)


defop("sync_batch_norm_affine", infer=_sync_bn_affine_infer, ref=_sync_bn_affine_ref, grad=_sync_bn_affine_grad,
      lowering=Elementwise("(((({0}) - ({1})) * ({2})) * ({3}) + ({4}))"),
      doc="sync_batch_norm_affine(x, mean, invstd, weight, bias, count, world_size): SyncBatchNorm with the "
          "statistics of all ranks' batches; its closed-form gradient all-reduces the two channel sums")


# --------------------------------------------------------------------------
# layer_norm: one row kernel each way (Template "layer_norm")
#
# layer_norm(x[, weight][, bias], normalized_ndim, eps, has_weight, has_bias) -> (y, mean, rstd)
# normalizes each row of the trailing `normalized_ndim` dims (D elements): mean and biased variance
# by Welford's one-pass update in double, rstd = 1 / sqrt(var + eps) (PyTorch's eps), then
# y = (x - mean) * rstd * weight + bias in the compute type (float32; float64 for float64).
# `mean` and `rstd` (shape [*lead, 1, ...], compute type) are kept for the backward.
#
# The order of the statistics is part of the op: a row is split into `layer_norm_lanes(D)` lanes,
# lane l takes elements l, l + L, l + 2L, ... in order, and the lanes are merged in a fixed tree
# (lanes l + 32, l + 64, ... into lane l < 32, then lane l + d into lane l for d = 16, 8, 4, 2, 1):
# what a block of L threads does with its warp shuffles, and what the cpu target's one thread per
# row does with L accumulators. The NumPy reference below follows the same steps in float64, so
# graph numbers equal eager's bit for bit in float32 and float64 alike. A constant row has mean
# exactly its value and variance exactly 0 (Welford adds zeros), so it normalizes to exactly 0.
#
# add_layer_norm(a, b, ...) -> (a + b, y, mean, rstd) is layer_norm of the residual sum a + b that
# also writes the sum; passes/fusion.py makes it from an `add` kernel feeding a layer_norm.
#
# layer_norm_backward(g, x, mean, rstd[, weight][, residual]) -> dx is the closed form
#   xhat = (x - mean) * rstd, gw = g * weight,
#   dx = rstd * ((gw - sum(gw) / D) - xhat * (sum(gw * xhat) / D))  (+ residual)
# with both row sums taken in double in the lanes-and-tree order. `residual` (has_residual) is
# another gradient of x added in the same kernel (passes/fusion.py: the residual stream's).
# The weight and bias gradients are column sums over the rows: sum(g * xhat), sum(g).

WARP_LANES = 32
MAX_LANES = 256


def layer_norm_lanes(D: int) -> int:
    """Lanes a row of D elements is split into: a power of two in [32, 256], each lane taking at
    least 4 elements where the row is long enough."""
    lanes = WARP_LANES
    while lanes < MAX_LANES and lanes * 8 <= D:
        lanes *= 2
    return lanes


def _lane_steps(D: int):
    """(step, first element, elements) of each pass over the lanes: lane l of step s takes
    element s * L + l."""
    L = layer_norm_lanes(D)
    return [(s, s * L, min(L, D - s * L)) for s in range(-(-D // L))]


def _tree(lanes, merge):
    """Lane 0's value after the fixed merge tree over `lanes` (a tuple of arrays [rows, L])."""
    L = lanes[0].shape[1]
    acc = tuple(a[:, :WARP_LANES].copy() for a in lanes)
    for first in range(WARP_LANES, L, WARP_LANES):
        acc = merge(acc, tuple(a[:, first:first + WARP_LANES] for a in lanes))
    d = WARP_LANES // 2
    while d:
        low = merge(tuple(a[:, :d] for a in acc), tuple(a[:, d:2 * d] for a in acc))
        for a, v in zip(acc, low):
            a[:, :d] = v
        d //= 2
    return tuple(a[:, 0] for a in acc)


def _welford_merge(a, b):
    """Chan's merge of two (count, mean, m2) lane states, as templates/layer_norm.cu.j2's `welford_merge`."""
    na, ma, qa = a
    nb, mb, qb = b
    n = na + nb
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        delta = mb - ma
        mean = ma + delta * (nb / n)
        m2 = (qa + qb) + (delta * delta) * ((na * nb) / n)
    take_a, take_b = nb == 0, na == 0
    return (n, np.where(take_a, ma, np.where(take_b, mb, mean)), np.where(take_a, qa, np.where(take_b, qb, m2)))


def _row_stats(rows):
    """(mean, biased variance) of each row of `rows` ([R, D] float64): Welford per lane, then the tree."""
    R, D = rows.shape
    L = layer_norm_lanes(D)
    n, mean, m2 = (np.zeros((R, L)) for _ in range(3))
    for s, first, count in _lane_steps(D):
        value = rows[:, first:first + count]
        delta = value - mean[:, :count]
        mean[:, :count] = mean[:, :count] + delta / float(s + 1)
        m2[:, :count] = m2[:, :count] + delta * (value - mean[:, :count])
        n[:, :count] = float(s + 1)
    _, row_mean, row_m2 = _tree((n, mean, m2), _welford_merge)
    return row_mean, row_m2 / float(D)


def _row_sums(values):
    """Each row's sum of `values` ([R, D] float64) in the lanes-and-tree order."""
    R, D = values.shape
    lanes = np.zeros((R, layer_norm_lanes(D)))
    for _, first, count in _lane_steps(D):
        lanes[:, :count] = lanes[:, :count] + values[:, first:first + count]
    (total,) = _tree((lanes,), lambda a, b: (a[0] + b[0],))
    return total


def _ln_compute_type(*dtypes):
    """The compute (and mean/rstd) dtype: float64 if any operand is float64, else float32."""
    return dt.float64 if dt.float64 in dtypes else dt.float32


def _ln_affine_metas(affine, has_weight, has_bias, op):
    if len(affine) != int(has_weight) + int(has_bias):
        raise ValueError(f"{op}: expected {int(has_weight) + int(has_bias)} affine operands "
                         f"(has_weight={has_weight}, has_bias={has_bias}), got {len(affine)}")
    weight = affine[0] if has_weight else None
    bias = affine[-1] if has_bias else None
    return weight, bias


def _ln_check(x, weight, bias, normalized_ndim, op):
    if not x.dtype.is_floating:
        raise TypeError(f"{op}: expected a floating point input, got {x.dtype!r}")
    if not 1 <= normalized_ndim <= len(x.shape):
        raise ValueError(f"{op}: cannot normalize the last {normalized_ndim} dims of an input of shape "
                         f"{tuple(x.shape)}")
    shape = tuple(x.shape[len(x.shape) - normalized_ndim:])
    if 0 in shape:
        raise ValueError(f"{op}: normalized_shape {list(shape)} has no elements")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (tuple(t.shape) != shape or not t.dtype.is_floating):
            raise ValueError(f"{op}: expected a floating {name} of shape {list(shape)} (normalized_shape), "
                             f"got {t}")
    return shape


def _promote_all(dtypes):
    out = dtypes[0]
    for d in dtypes[1:]:
        out = dt.promote(out, d)
    return out


def _ln_out_metas(x, weight, bias, normalized_ndim, op):
    _ln_check(x, weight, bias, normalized_ndim, op)
    dtypes = [t.dtype for t in (x, weight, bias) if t is not None]
    out = _promote_all(dtypes)
    lead = tuple(x.shape[:len(x.shape) - normalized_ndim])
    stat = TensorMeta(lead + (1,) * normalized_ndim, _ln_compute_type(*dtypes))
    return TensorMeta(tuple(x.shape), out), stat, stat


def _ln_infer(x, *affine, normalized_ndim: int, eps: float, has_weight: bool, has_bias: bool):
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "layer_norm")
    return _ln_out_metas(x, weight, bias, normalized_ndim, "layer_norm")


def _ln_forward(x, weight, bias, normalized_ndim, eps):
    """(y, mean, rstd) as the forward kernel computes them."""
    dtypes = [dt.from_numpy(a.dtype) for a in (x, weight, bias) if a is not None]
    ct = _ln_compute_type(*dtypes).np_dtype
    out = _promote_all(dtypes).np_dtype
    lead = x.shape[:x.ndim - normalized_ndim]
    D = int(np.prod(x.shape[x.ndim - normalized_ndim:], dtype=np.int64))
    rows = x.reshape(-1, D)
    mean_d, var_d = _row_stats(rows.astype(np.float64))
    mean = mean_d.astype(ct)
    rstd = (1.0 / np.sqrt(var_d + float(eps))).astype(ct)
    y = (rows.astype(ct) - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.reshape(D).astype(ct)
    if bias is not None:
        y = y + bias.reshape(D).astype(ct)
    stat_shape = lead + (1,) * normalized_ndim
    return y.astype(out, copy=False).reshape(x.shape), mean.reshape(stat_shape), rstd.reshape(stat_shape)


def _ln_ref(x, *affine, normalized_ndim: int, eps: float, has_weight: bool, has_bias: bool):
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "layer_norm")
    return _ln_forward(x, weight, bias, normalized_ndim, eps)


def _ln_param_grads(g, x, mean, rstd, weight, bias, normalized_ndim):
    """sum over the rows of g * xhat and of g: column sums (reductions over the leading dims)."""
    dims = tuple(range(len(x.shape) - normalized_ndim))

    def column_sum(t, like):
        t = F.sum(t, dims) if dims else t   # x of the normalized shape alone: one row
        return t if t.dtype == like.dtype else F.cast(t, like.dtype)

    dweight = column_sum(g * ((x - mean) * rstd), weight) if weight is not None and wants_grad(weight) else None
    dbias = column_sum(g, bias) if bias is not None and wants_grad(bias) else None
    return dweight, dbias


def _ln_input_grad(g, x, mean, rstd, weight, normalized_ndim, residual=None):
    affine = [weight] if weight is not None else []
    extra = [residual] if residual is not None else []
    return apply("layer_norm_backward", g, x, mean, rstd, *affine, *extra, normalized_ndim=normalized_ndim,
                 has_weight=weight is not None, has_residual=residual is not None)


def _ln_refuse_stat_grads(op, *stat_grads):
    if any(s is not None for s in stat_grads):
        raise NotImplementedError(f"{op}: no gradient through its mean/rstd outputs (they are saved for the "
                                  f"backward, not results to differentiate)")


def _ln_grad(ctx, g, g_mean=None, g_rstd=None):
    _ln_refuse_stat_grads("layer_norm", g_mean, g_rstd)
    x, *affine = ctx.inputs
    _, mean, rstd = ctx.outputs
    k, has_weight, has_bias = ctx.attrs["normalized_ndim"], ctx.attrs["has_weight"], ctx.attrs["has_bias"]
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "layer_norm")
    dx = _ln_input_grad(g, x, mean, rstd, weight, k) if wants_grad(x) else None
    dweight, dbias = _ln_param_grads(g, x, mean, rstd, weight, bias, k)
    return (dx,) + ((dweight,) if has_weight else ()) + ((dbias,) if has_bias else ())


def _add_ln_check(a, b):
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype or a.dtype not in (dt.float32, dt.float64):
        raise ValueError(f"add_layer_norm: expected two float32 or float64 addends of one shape and dtype, "
                         f"got {a} and {b}")


def _add_ln_infer(a, b, *affine, normalized_ndim: int, eps: float, has_weight: bool, has_bias: bool):
    _add_ln_check(a, b)
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "add_layer_norm")
    return (a,) + _ln_out_metas(a, weight, bias, normalized_ndim, "add_layer_norm")


def _add_ln_ref(a, b, *affine, normalized_ndim: int, eps: float, has_weight: bool, has_bias: bool):
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "add_layer_norm")
    total = a + b
    return (total,) + _ln_forward(total, weight, bias, normalized_ndim, eps)


def _add_ln_grad(ctx, g_sum, g, g_mean=None, g_rstd=None):
    _ln_refuse_stat_grads("add_layer_norm", g_mean, g_rstd)
    a, b, *affine = ctx.inputs
    total, _, mean, rstd = ctx.outputs
    k, has_weight, has_bias = ctx.attrs["normalized_ndim"], ctx.attrs["has_weight"], ctx.attrs["has_bias"]
    weight, bias = _ln_affine_metas(affine, has_weight, has_bias, "add_layer_norm")
    if g is None:
        return (g_sum, g_sum) + (None,) * len(affine)
    dx = _ln_input_grad(g, total, mean, rstd, weight, k, residual=g_sum)
    dweight, dbias = _ln_param_grads(g, total, mean, rstd, weight, bias, k)
    return (dx, dx) + ((dweight,) if has_weight else ()) + ((dbias,) if has_bias else ())


def _ln_backward_operands(rest, has_weight, has_residual):
    if len(rest) != int(has_weight) + int(has_residual):
        raise ValueError(f"layer_norm_backward: expected {int(has_weight) + int(has_residual)} operands after "
                         f"rstd (has_weight={has_weight}, has_residual={has_residual}), got {len(rest)}")
    return (rest[0] if has_weight else None), (rest[-1] if has_residual else None)


def _ln_backward_infer(g, x, mean, rstd, *rest, normalized_ndim: int, has_weight: bool, has_residual: bool):
    weight, residual = _ln_backward_operands(rest, has_weight, has_residual)
    y, stat, _ = _ln_out_metas(x, weight, None, normalized_ndim, "layer_norm_backward")
    for meta, want, what in ((g, y, "output gradient"), (mean, stat, "mean"), (rstd, stat, "rstd")):
        if tuple(meta.shape) != tuple(want.shape) or meta.dtype != want.dtype:
            raise ValueError(f"layer_norm_backward: {what} is {meta}, expected {want}")
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        raise ValueError(f"layer_norm_backward: residual gradient is {residual}, expected {x.dtype.short}"
                         f"[{','.join(map(str, x.shape))}]")
    return TensorMeta(tuple(x.shape), x.dtype)


def _ln_backward_ref(g, x, mean, rstd, *rest, normalized_ndim: int, has_weight: bool, has_residual: bool):
    weight, residual = _ln_backward_operands(rest, has_weight, has_residual)
    ct = mean.dtype
    D = int(np.prod(x.shape[x.ndim - normalized_ndim:], dtype=np.int64))
    rows_mean, rows_rstd = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    xhat = (x.reshape(-1, D).astype(ct) - rows_mean) * rows_rstd
    gw = g.reshape(-1, D).astype(ct)
    if weight is not None:
        gw = gw * weight.reshape(D).astype(ct)
    mean_gw = (_row_sums(gw.astype(np.float64)) / float(D)).astype(ct)[:, None]
    mean_gw_xhat = (_row_sums((gw * xhat).astype(np.float64)) / float(D)).astype(ct)[:, None]
    dx = rows_rstd * ((gw - mean_gw) - xhat * mean_gw_xhat)
    if residual is not None:
        dx = dx.astype(x.dtype) + residual.reshape(dx.shape)
    return dx.astype(x.dtype, copy=False).reshape(x.shape)


def _ln_backward_grad(ctx, g):
    raise NotImplementedError("layer_norm: double backward (the gradient of layer_norm_backward) is not "
                              "implemented")


# In place (templates/layer_norm.cu.j2): y, the residual sum and dx are written at an element by
# the thread that has read every input at that element (x, a, b; g, x, residual) and reads none of
# them again, so they may take over those inputs. Not declared: mean and rstd (the one-thread-per-
# row kernel stores them before it reads x again, which with one element per row is the same
# element), and anything over weight, bias, mean or rstd, which other rows' threads read.
defop("layer_norm", infer=_ln_infer, ref=_ln_ref, grad=_ln_grad, num_outputs=3,
      lowering=Template("layer_norm", in_place=(("y", "x"),)), autocast="float32", sbp="normalized_rows",
      doc="layer_norm(x[, weight][, bias], normalized_ndim, eps, has_weight, has_bias) -> (y, mean, rstd): "
          "one row kernel, Welford statistics in double in a fixed lane order")
defop("add_layer_norm", infer=_add_ln_infer, ref=_add_ln_ref, grad=_add_ln_grad, num_outputs=4,
      lowering=Template("layer_norm", in_place=(("sum", "a"), ("sum", "b"), ("y", "a"), ("y", "b"))),
      sbp="normalized_rows",
      doc="add_layer_norm(a, b[, weight][, bias], ...) -> (a + b, y, mean, rstd): layer_norm of a residual "
          "sum, which it also writes")
defop("layer_norm_backward", infer=_ln_backward_infer, ref=_ln_backward_ref, grad=_ln_backward_grad,
      lowering=Template("layer_norm", in_place=(("dx", "g"), ("dx", "x"), ("dx", "residual"))),
      sbp="normalized_rows",
      doc="layer_norm_backward(g, x, mean, rstd[, weight][, residual], normalized_ndim, has_weight, "
          "has_residual) -> dx: the closed form, one row kernel (+ residual)")
