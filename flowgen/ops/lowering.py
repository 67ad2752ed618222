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
* `Collective` — no kernel: the executor exchanges the values with the other ranks on the host
  (the data-parallel gradient all-reduce, the ZeRO parameter all-gather).
"""
from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass

import numpy as np


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

    def render(self, operands, attrs, idx: str = "idx", double: bool = False, expanded=None) -> str:
        """The expression with operands, ``{idx}`` and the attributes it names substituted;
        `expanded` holds attributes already written as C++ (a dropout's seed read from the rng
        state). `double`: a float64 kernel, so float math and literals become double ones."""
        expr = self.expression(attrs)
        fields = {f for _, f, _, _ in string.Formatter().parse(expr) if f and not f.isdigit()}
        expanded = expanded or {}
        named = {f: expanded[f] if f in expanded else cpp_literal(attrs[f], double) for f in fields if f != "idx"}
        text = expr.format(*operands, idx=idx, **named)
        return as_double(text) if double else text


_FLOAT_MATH = re.compile(r"\b(exp|exp2|log|log2|log10|log1p|expm1|sqrt|rsqrt|sin|cos|tan|asin|acos|atan|sinh|cosh|"
                         r"tanh|asinh|acosh|atanh|erf|erfc|erfinv|pow|floor|ceil|fabs|fmin|fmax|round|rint|trunc|fmod|"
                         r"atan2|hypot|copysign)f\(")
_FLOAT_LITERAL = re.compile(r"(\b\d+\.\d*(?:e[-+]?\d+)?)f\b")


def as_double(expr: str) -> str:
    """An op's float expression (``expf``, ``1.0f``) in double precision, for float64 kernels."""
    return _FLOAT_LITERAL.sub(r"\1", _FLOAT_MATH.sub(r"\1(", expr))


def cpp_literal(value, double: bool = False) -> str:
    """A Python/NumPy scalar as a C++ literal: bools true/false, integers with an ``LL`` suffix
    outside int32, floats with an ``f`` suffix (none in float64 kernels, where it would round
    the constant), infinities ``INFINITY``, NaN ``NAN``."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        value = int(value)
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
    text = repr(value) if "e" in repr(value) or "." in repr(value) else f"{value!r}.0"
    text = text if double else f"{text}f"
    return text if value >= 0 else f"({text})"


@dataclass(frozen=True)
class Reduction:
    combine: str       # "sum" | "max" | "min"
    identity: str      # C++ literal of the identity element
    average: bool = False   # divide the accumulated sum by the reduced count before rounding (mean)


@dataclass(frozen=True)
class View:
    pass


@dataclass(frozen=True)
class Template:
    """A kernel family; ``in_place`` is the op's in-place safety: the (output, input) pairs, by
    the family's kernel parameter names, where the output may be written over the input's memory
    (when the input dies at this kernel and has the output's byte size and element count).

    A pair is declared only where the kernel guarantees it: every element of the input is read
    before the output's bytes over it are stored (a row read whole before a barrier, or an
    element read by the thread that then writes that element), and no thread reads the input
    afterwards. Everything else is never shared: an input read at other elements (a weight read
    by every row), or after a store (layer_norm's one-thread-per-row kernel stores the row's
    mean before it reads x again: with one element per row, mean over x would corrupt y).
    memory/planner.py pairs only what is declared (`Step.in_place`); codegen checks every shared
    buffer of a launch against the same pairs (codegen/program.py `declare_shared_memory`)."""
    family: str
    in_place: tuple = ()


@dataclass(frozen=True)
class Collective:
    """No kernel: the executor exchanges the node's inputs with the other ranks on the host
    (MPI) between the kernel launches before and after it (flowgen/distributed/collectives.py)."""
    kind: str          # "all_reduce" | "reduce_scatter" | "all_gather" | "send" | "recv"
