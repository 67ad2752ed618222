"""Ops that only appear in graphs: constants captured while tracing."""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.ops.lowering import Template
from flowgen.ops.registry import TensorMeta, defop

# A tensor that was concrete while tracing (a captured array, a Python scalar).
# Scalars are inlined into fused expressions; arrays live in the persistent region.
defop("constant",
      infer=lambda value: TensorMeta(tuple(value.shape), dt.from_numpy(value.dtype)),
      ref=lambda value: value,
      lowering=Template("constant"))
