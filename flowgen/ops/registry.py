"""The op registry: every op is declared exactly once, here-shaped.

An `OpDef` holds everything flowgen knows about an op:

* ``infer``  — shape/dtype rule: ``infer(*metas, **attrs) -> TensorMeta`` (or a
  tuple of them for multi-output ops). Used by eager mode for error messages
  and by the tracer to type IR values without running anything.
* ``ref``    — NumPy reference: ``ref(*arrays, **attrs) -> ndarray``. Eager mode
  runs it; the IR interpreter runs it; the tests compare kernels against it.
* ``grad``   — gradient, written with flowgen functional ops:
  ``grad(ctx, *grad_outputs) -> tuple`` with one entry per input (``None`` for
  inputs without a gradient). Because it only uses flowgen ops it works both on
  eager tensors (autograd tape) and on lazy tensors (the graph autodiff pass).
* ``lowering`` — how the graph compiler turns the op into kernel code (see
  `flowgen.ops.lowering`).

`apply(name, *inputs, **attrs)` is the single entry point used by functional
ops, Tensor methods and modules alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flowgen import dtype as dt


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: dt.DType

    def __str__(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"


@dataclass
class OpDef:
    name: str
    infer: Callable[..., Any]
    ref: Callable[..., Any]
    grad: Callable[..., tuple] | None = None
    lowering: Any = None
    num_outputs: int = 1
    # Attributes whose value is random state drawn at call time (dropout seed).
    doc: str = ""
    extra: dict = field(default_factory=dict)


REGISTRY: dict[str, OpDef] = {}


def defop(name: str, *, infer, ref, grad=None, lowering=None, num_outputs: int = 1, doc: str = "", **extra) -> OpDef:
    if name in REGISTRY:
        raise ValueError(f"op {name!r} is defined twice")
    op = OpDef(name, infer, ref, grad, lowering, num_outputs, doc, extra)
    REGISTRY[name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"flowgen has no op named {name!r}") from None


class GradContext:
    """What a gradient function may look at: inputs, outputs and attributes.

    In eager mode these are concrete tensors; during graph autodiff they are
    lazy tensors bound to IR values.
    """

    __slots__ = ("inputs", "outputs", "attrs")

    def __init__(self, inputs, outputs, attrs):
        self.inputs = inputs
        self.outputs = outputs
        self.attrs = attrs


# --------------------------------------------------------------------------
# Shape-rule helpers shared by op definitions.

def broadcast_shapes(*shapes, op: str = "op") -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        listed = " and ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{op}: shapes {listed} cannot be broadcast together") from None


def normalize_dim(dim: int, ndim: int, op: str = "op") -> int:
    lo, hi = (-ndim, ndim - 1) if ndim else (-1, 0)
    if not lo <= dim <= hi:
        raise IndexError(f"{op}: dimension {dim} is out of range for a tensor with {ndim} dims "
                         f"(expected to be in range of [{lo}, {hi}])")
    return dim % ndim if ndim else 0


def normalize_dims(dims, ndim: int, op: str = "op") -> tuple:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({normalize_dim(d, ndim, op) for d in dims}))


# --------------------------------------------------------------------------
# Dispatch.

_tracer_hook: Callable | None = None  # set by flowgen.ir.trace while tracing


def set_tracer_hook(hook):
    global _tracer_hook
    previous = _tracer_hook
    _tracer_hook = hook
    return previous


def apply(name: str, *inputs, **attrs):
    """Run op `name` on tensors (or Python scalars) — eagerly or into a trace."""
    from flowgen.tensor import Tensor, as_tensor_like

    op = get_op(name)
    like = next((x for x in inputs if isinstance(x, Tensor)), None)
    tensors = [x if isinstance(x, Tensor) else as_tensor_like(x, like) for x in inputs]
    if _tracer_hook is not None and any(t.is_lazy for t in tensors):
        return _tracer_hook(op, tensors, attrs)
    for t in tensors:
        if t.is_lazy:
            raise RuntimeError(f"{name}: a lazy (graph) tensor was used outside nn.Graph.build()")
    op.infer(*(t.meta for t in tensors), **attrs)  # raises readable shape/dtype errors
    result = op.ref(*(t.numpy_view() for t in tensors), **attrs)
    from flowgen import autograd

    return autograd.wrap_outputs(op, tensors, attrs, result)
