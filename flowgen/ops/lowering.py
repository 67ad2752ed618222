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

from dataclasses import dataclass


@dataclass(frozen=True)
class Elementwise:
    expr: str


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
