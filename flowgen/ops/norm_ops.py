"""Normalisation ops with a closed-form gradient.

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

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Elementwise
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
    return TensorMeta(tuple(x.shape), dt.promote(x.dtype, weight.dtype))


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
