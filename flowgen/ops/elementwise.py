"""Elementwise ops: unary, binary (broadcasting) and ternary.

Each definition gives the NumPy reference, the gradient in flowgen ops and
the C++ expression the fused elementwise kernel evaluates.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops.lowering import Elementwise
from flowgen.ops.registry import TensorMeta, broadcast_shapes, defop


def _binary_infer(name):
    def infer(a, b):
        return TensorMeta(broadcast_shapes(a.shape, b.shape, op=name), dt.promote(a.dtype, b.dtype))
    return infer


def _unary_infer(a):
    return a


def _float_unary_infer(a):
    return TensorMeta(a.shape, a.dtype if a.dtype.is_floating else dt.float32)


def _compare_infer(name):
    def infer(a, b):
        return TensorMeta(broadcast_shapes(a.shape, b.shape, op=name), dt.bool_)
    return infer


# ---------------------------------------------------------------- binary
defop("add", infer=_binary_infer("add"), ref=np.add,
      grad=lambda ctx, g: (F.sum_to(g, ctx.inputs[0].shape), F.sum_to(g, ctx.inputs[1].shape)),
      lowering=Elementwise("({0} + {1})"))

defop("sub", infer=_binary_infer("sub"), ref=np.subtract,
      grad=lambda ctx, g: (F.sum_to(g, ctx.inputs[0].shape), F.sum_to(-g, ctx.inputs[1].shape)),
      lowering=Elementwise("({0} - {1})"))

defop("mul", infer=_binary_infer("mul"), ref=np.multiply,
      grad=lambda ctx, g: (F.sum_to(g * ctx.inputs[1], ctx.inputs[0].shape),
                           F.sum_to(g * ctx.inputs[0], ctx.inputs[1].shape)),
      lowering=Elementwise("({0} * {1})"))
