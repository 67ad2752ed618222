"""How an op becomes kernel code. Each OpDef carries one of these.

* `Elementwise` — a C++ expression over the op's inputs (``{0}``, ``{1}``...)
  and attributes (``{alpha}``), evaluated in the compute type (float for
  half/bf16 storage). Chains of elementwise ops fuse into one kernel.
* `Reduction`  — reduce over ``attrs["dims"]`` with an associative combiner;
  elementwise producers fuse in as a prologue, consumers as an epilogue.
* `View`       — no kernel: the output aliases the input's memory (reshape of a
  contiguous tensor). The memory planner extends the base's lifetime.
* `Template`   — a kernel family rendered from ``templates/<family>.cu.j2``
  (GEMM, conv, pooling, gather, softmax, copy...).
"""
from __future__ import annotations

import math
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class Elementwise:
    """A C++ expression; ``{0}``, ``{1}``... are the inputs (identifiers or literals holding
    values already converted to the compute type), ``{name}`` an attribute rendered as a C++
    literal, ``{idx}`` the linear output index.

    ``expr`` is a string, or a callable ``expr(attrs) -> str`` when the expression depends on
    an attribute (gelu's ``approximate``). `expression(attrs)` resolves it and
    `render(operands, attrs)` does the whole substitution (attributes through `cpp_literal`).
    """

    expr: object

    def expression(self, attrs) -> str:
        return self.expr(attrs) if callable(self.expr) else self.expr

    def render(self, operands, attrs, idx: str = "idx") -> str:
        expr = self.expression(attrs)
        fields = {f for _, f, _, _ in string.Formatter().parse(expr) if f and not f.isdigit()}
        named = {f: cpp_literal(attrs[f]) for f in fields if f != "idx"}
        return expr.format(*operands, idx=idx, **named)


def cpp_literal(value) -> str:
    """A Python attribute value as a C++ literal: floats get an ``f`` suffix, infinities
    ``INFINITY``, integers outside int32 an ``LL`` suffix, bools true/false."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value == -(2 ** 63):
            return "(-9223372036854775807LL - 1)"
        if value >= 2 ** 63:
            return f"{value}ULL"
        return f"{value}LL" if not -(2 ** 31) <= value < 2 ** 31 else str(value)
    value = float(value)
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(value)
    return f"{text}f" if value >= 0 else f"({text}f)"


@dataclass(frozen=True)
class Reduction:
    combine: str       # "sum" | "max" | "min"
    identity: str      # C++ literal of the identity element


@dataclass(frozen=True)
class View:
    pass


@dataclass(frozen=True)
class Template:
    family: str
