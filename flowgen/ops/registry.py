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
from typing import Any, Callable, NamedTuple

import numpy as np

from flowgen import mixed_precision
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
    """Register op `name`. `extra` holds its properties, among them: ``view=True`` (PyTorch returns
    a view of the first input: record_view), ``grad_reads_inputs=False`` (the gradient reads no
    saved values, only the inputs' shapes and integer indices, so a second backward() may go
    through it without retain_graph: autograd.backward, Tracer.mark_backward), ``random=True``
    (draws on every call)."""
    if name in REGISTRY:
        raise ValueError(f"op {name!r} is defined twice")
    op = OpDef(name, infer, ref, grad, lowering, num_outputs, doc, extra)
    REGISTRY[name] = op
    return op


# Node attributes that only steer code generation (a conv's measured tile shape): not part of
# an op's meaning, so shape rules and NumPy references never see them.
HINT_ATTRS = frozenset({"tile"})


def semantic_attrs(attrs: dict) -> dict:
    """`attrs` without the code-generation hints (`HINT_ATTRS`)."""
    return {k: v for k, v in attrs.items() if k not in HINT_ATTRS} if HINT_ATTRS & attrs.keys() else attrs


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


def wants_grad(t) -> bool:
    """Whether a gradient function should compute the gradient of input `t`: eager tensors say so
    with requires_grad; lazy tensors in graph autodiff always get one (DCE drops unused ones)."""
    return t.is_lazy or t.requires_grad


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
    Tensor = _eager.tensor_type
    op = REGISTRY.get(name)
    if op is None:
        op = get_op(name)
    like = None
    all_tensors = True
    is_global = False
    for x in inputs:
        if isinstance(x, Tensor):
            if like is None:
                like = x
            if x._global is not None:
                is_global = True
        else:
            all_tensors = False
    if is_global and _tracer_hook is None:   # while tracing, global state is the graph's (data parallel)
        return _eager.apply_global(op, inputs, attrs)
    tensors = inputs if all_tensors else [x if isinstance(x, Tensor) else _eager.as_tensor_like(x, like)
                                          for x in inputs]
    if mixed_precision.active() is not None:   # autocast: the dtypes flowgen/mixed_precision.py gives the op
        plan = mixed_precision.plan(name, [t.dtype for t in tensors], mixed_precision.active())
        if plan is not None:
            return mixed_precision.run(plan, name, tensors, attrs, apply)
    lazy = False
    for t in tensors:
        if t._value is not None:
            lazy = True
            break
    if _tracer_hook is not None and (lazy or _tracer_hook.records(op, tensors)):
        if op.lowering is None:
            raise NotImplementedError(f"{name} runs in eager mode only: nn.Graph has no kernel for it yet "
                                      f"(call it outside build(), or on eager tensors)")
        out = _tracer_hook(op, list(tensors), attrs)
    else:
        if lazy:
            raise RuntimeError(f"{name}: a lazy (graph) tensor was used outside nn.Graph.build()")
        arrays = [t.numpy_view() for t in tensors]
        # infer raises readable shape/dtype errors before NumPy sees the data
        metas = op.infer(*[TensorMeta(a.shape, t._dtype) for a, t in zip(arrays, tensors)], **attrs)
        result = op.ref(*arrays, **attrs)
        out = _eager.wrap_outputs(op, tensors, attrs, result, metas)
    if op.extra.get("view"):
        record_view(out, tensors[0], name, attrs)
    return out


class View(NamedTuple):
    """What a view (Tensor._view) remembers of the tensor it views."""
    root: Any              # the tensor at the bottom of its chain of views
    replay: Callable       # replay(root) recomputes the view
    root_version: int      # root._version when the view last matched it
    whole: bool            # all of root's elements in their order (reshapes, detach): a write is root's new value
    differentiable: bool   # False through a detach(): a write changes root's values, not its gradient


def record_view(out, base, name: str, attrs: dict) -> None:
    """`out` is a view of `base` (an op defined with ``view=True``, or Tensor.detach: PyTorch
    returns one sharing base's memory): it keeps a `View` of the tensor at the bottom of its
    chain of views, and the strides PyTorch's view has (stride(), is_contiguous()). flowgen's
    tensors own their data (a permute is a copy), so aliasing is carried by this record instead:
    an in-place write to `out` is written back into the root (Tensor._write_through), and a read
    of `out` after the root was written recomputes it (Tensor._refresh_view), in eager mode and
    while tracing alike. A reshape that base's strides do not allow (of a permuted or step-sliced
    tensor) is a copy in PyTorch, so it is not recorded."""
    strides = _view_strides(name, base, attrs, tuple(out.shape))
    if strides is None:
        return
    in_order = name in ("reshape", "detach")   # the view lists the root's elements in their order
    differentiable = name != "detach"
    if base._view is not None:
        root, base_replay = base._view.root, base._view.replay
        replay = lambda r: apply(name, base_replay(r), **attrs)   # noqa: E731
        in_order = in_order and base._view.whole
        differentiable = differentiable and base._view.differentiable
    else:
        root, replay = base, (lambda r: apply(name, r, **attrs))
    out._view = View(root, replay, root._version, in_order and out.numel() == root.numel(), differentiable)
    out._view_strides = None if strides == out._row_major_strides() else strides


def _view_strides(name: str, base, attrs: dict, shape: tuple) -> tuple | None:
    """The strides of PyTorch's view of `base` made by op `name`, or None where PyTorch copies."""
    strides = base.stride()
    if name == "permute":
        return tuple(strides[d] for d in attrs["dims"])
    if name == "slice":
        return tuple(stride * step for stride, step in zip(strides, attrs["steps"]))
    if name == "expand":
        lead = len(shape) - len(base.shape)
        return (0,) * lead + tuple(0 if size == 1 and new != 1 else stride
                                   for size, new, stride in zip(base.shape, shape[lead:], strides))
    if name == "reshape":
        return _reshape_strides(tuple(base.shape), strides, shape)
    return strides   # detach


def _reshape_strides(old_shape: tuple, old_strides: tuple, new_shape: tuple) -> tuple | None:
    """The strides of `new_shape` viewing memory laid out as `old_shape` with `old_strides`, or
    None when no view can (PyTorch's computeStride: dims are split or merged only within runs of
    dims contiguous with each other; size-1 dims go anywhere)."""
    if not old_shape or 0 in old_shape:
        return tuple(int(np.prod(new_shape[i + 1:], dtype=np.int64)) for i in range(len(new_shape)))
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in reversed(range(len(old_shape))):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (old_shape[tensor_d - 1] != 1
                             and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_strides) if view_d == -1 else None


class _EagerRuntime:
    """What `apply` needs from the layers above the op registry, installed by them when they load
    (the registry is below Tensor, autograd and global tensors, which all call `apply`)."""
    tensor_type: type = type(None)      # flowgen.tensor.Tensor (flowgen.autograd installs it)
    as_tensor_like: Callable = None     # a Python scalar operand as a tensor beside another
    wrap_outputs: Callable = None       # NumPy results -> tensors, recorded on the autograd tape
    apply_global: Callable = None       # an op with a global operand (flowgen/distributed/global_ops.py)


_eager = _EagerRuntime()


def install_eager_runtime(tensor_type, as_tensor_like, wrap_outputs) -> None:
    """flowgen.autograd, when it loads: the tensor type eager `apply` runs on and its tape."""
    _eager.tensor_type, _eager.as_tensor_like, _eager.wrap_outputs = tensor_type, as_tensor_like, wrap_outputs


def install_global_apply(apply_global) -> None:
    """flowgen.distributed.global_ops, when it loads: `apply_global(op, inputs, attrs)` runs an op
    with a global operand (Python scalars among `inputs` included)."""
    _eager.apply_global = apply_global
