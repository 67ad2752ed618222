"""Functional ops (`flow.add`, `flow.matmul`, ...): argument handling, then `apply`.

No math lives here: each function normalises its arguments and calls the op
definition in `flowgen/ops/` through `apply`. Tensor methods and nn modules
call these functions, so every path reaches the same definition.
"""
from __future__ import annotations

from flowgen.ops.registry import apply


def add(a, b, alpha=1):
    return apply("add", a, b if alpha == 1 else mul(b, alpha))


def sub(a, b, alpha=1):
    return apply("sub", a, b if alpha == 1 else mul(b, alpha))


def mul(a, b):
    return apply("mul", a, b)


def sum_to(t, shape):
    """Sum `t` down to `shape` (undoing broadcasting); used by gradients."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    return apply("sum_to", t, shape=shape)
