"""Matrix multiplication: ``matmul(a, b)`` on operands with 2+ dims (Template ``gemm``).

``a`` is ``[..., m, k]``, ``b`` is ``[..., k, n]``; the batch dims ``...`` broadcast
(NumPy rules) and the result is ``[broadcast(...), m, n]`` with the promoted dtype.
1-D operands are handled by `flowgen.functional.matmul` (it reshapes them, as
torch.matmul does), so the primitive never sees them. Float16/bfloat16 products
accumulate in float32, as the kernels do.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Template
from flowgen.ops.registry import TensorMeta, defop

_LOW_PRECISION = {dt.float16.np_dtype, dt.bfloat16.np_dtype}


def matmul_shape(a_shape, b_shape, op="matmul") -> tuple:
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(f"{op}: the primitive needs operands with at least 2 dims, got shapes "
                         f"{a_shape} and {b_shape}")
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"{op}: shapes {a_shape} and {b_shape} cannot be multiplied "
                         f"({a_shape[-2]}x{a_shape[-1]} and {b_shape[-2]}x{b_shape[-1]}: "
                         f"inner sizes {a_shape[-1]} != {b_shape[-2]})")
    try:
        batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    except ValueError:
        raise ValueError(f"{op}: batch dims of shapes {a_shape} and {b_shape} cannot be broadcast "
                         f"({a_shape[:-2]} vs {b_shape[:-2]})") from None
    return batch + (a_shape[-2], b_shape[-1])


def _matmul_infer(a, b):
    return TensorMeta(matmul_shape(a.shape, b.shape), dt.promote(a.dtype, b.dtype))


def _matmul_ref(a, b):
    if a.dtype in _LOW_PRECISION or b.dtype in _LOW_PRECISION:
        out_dtype = dt.promote(dt.from_numpy(a.dtype), dt.from_numpy(b.dtype)).np_dtype
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(out_dtype)
    if a.dtype != b.dtype:
        target = dt.promote(dt.from_numpy(a.dtype), dt.from_numpy(b.dtype)).np_dtype
        a, b = a.astype(target, copy=False), b.astype(target, copy=False)
    if a.dtype == np.float32 and a.ndim >= 2 and b.ndim >= 2 and \
            is_fma_chain(a.shape[-1], _batch_count(a.shape, b.shape) * a.shape[-2] * b.shape[-1]):
        return _fused_chain(a, b)
    return np.matmul(a, b)


# Small float32 products are computed as flowgen's GEMM kernels compute them: each output a chain
# of fused multiply-adds along k (the GPU's FFMA; the cpu target's native GEMM computes the same
# chain for these sizes, codegen/cpu/gemm.py), so a graph's small matmuls equal eager's bit for bit.
# Large ones go to BLAS, whose blocking orders the sums its own way (the same error bound).
SMALL_MATMUL_MACS = 1 << 18
SMALL_MATMUL_K = 256


def is_fma_chain(k: int, outputs: int) -> bool:
    """Whether a float32 product with inner size `k` and `outputs` elements (batch included) is
    small enough to be computed as one fused multiply-add chain per output, in eager and graphs."""
    return k <= SMALL_MATMUL_K and outputs * k <= SMALL_MATMUL_MACS


def _batch_count(a_shape, b_shape) -> int:
    return int(np.prod(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]), dtype=np.int64))


def _fused_chain(a, b):
    """c = fma(a[..., k], b[k, ...], c) for k = 0, 1, ...: float64 holds each product exactly, and
    rounding product + c once to float32 is fmaf (up to a double rounding of about 2^-29 odds)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = np.zeros(shape, np.float32)
    for k in range(a.shape[-1]):
        acc = (a64[..., :, k:k + 1] * b64[..., k:k + 1, :] + acc).astype(np.float32)
    return acc


def _swap_last(t):
    n = len(t.shape)
    return F.apply("permute", t, dims=tuple(range(n - 2)) + (n - 1, n - 2))


def _matmul_grad(ctx, g):
    a, b = ctx.inputs
    ga = gb = None
    if a.requires_grad or a.is_lazy:
        ga = F.sum_to(F.apply("matmul", g, _swap_last(b)), a.shape)
    if b.requires_grad or b.is_lazy:
        if len(b.shape) == 2 and len(a.shape) > 2:
            # A weight shared by every batch (Linear over [B, T, C]): one GEMM over the flattened
            # rows, k = B*T, instead of a product per batch summed afterwards (a [B, C, N] temporary).
            k, n = a.shape[-1], g.shape[-1]
            count = math.prod(a.shape[:-1])
            rows = F.apply("reshape", a, shape=(count, k))
            gb = F.apply("matmul", _swap_last(rows), F.apply("reshape", g, shape=(count, n)))
        else:
            gb = F.sum_to(F.apply("matmul", _swap_last(a), g), b.shape)
    return ga, gb


defop("matmul", infer=_matmul_infer, ref=_matmul_ref, grad=_matmul_grad, lowering=Template("gemm"),
      doc="matmul(a[..., m, k], b[..., k, n]) -> [..., m, n], batch dims broadcast",
      fusion="gemm", autocast="lower_precision", sbp="matmul")
