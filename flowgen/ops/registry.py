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
* properties — what the passes ask of an op, answered by keywords of its defop
  (``fusion="gemm"``, ``autocast="float32"``, ``sbp="matmul"``...): `PROPERTIES` lists each
  one with its values and its default; a name or value outside them raises. Passes read
  ``op.extra[name]``, never the op's name.

`apply(name, *inputs, **attrs)` is the single entry point used by functional
ops, Tensor methods and modules alike.

The contract in full (the layers that install into `apply`, closed-form ops, every property and
lowering kind): docs/op_contract.md; adding an op in short: ARCHITECTURE.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from flowgen import mixed_precision
from flowgen import dtype as dt
from flowgen.ops.lowering import Elementwise, Reduction, Template, View


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: dt.DType

    def __str__(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class ViewOf:
    """What an op returning a view of its first input, as PyTorch's does, declares (``view=``, read
    by `record_view`): `strides(base_shape, base_strides, attrs, shape)` is the view's strides, None
    where PyTorch copies instead; `in_order`: the view lists its base's elements in their order
    (reshape, detach), so a write to all of them is the base's new value; `differentiable` False
    (detach): a write through the view changes the base's values, not its gradient."""
    strides: Callable[[tuple, tuple, dict, tuple], tuple | None]
    in_order: bool = False
    differentiable: bool = True


@dataclass(frozen=True)
class Property:
    """A question the passes ask of every op, answered where the op is defined (a keyword of its
    defop). `valid(value)` says whether a value is one the property takes; an op that does not
    answer gets `default(lowering, declared)` (its lowering decides most: an `Elementwise` op
    fuses into elementwise kernels)."""
    doc: str
    valid: Callable[[Any], bool]
    default: Callable[[Any, dict], Any]


def _flag(value) -> bool:
    return isinstance(value, bool)


def _one_of(*choices):
    return lambda value: any(value is c or (type(value) is type(c) and value == c) for c in choices)


def _operand_indices(value) -> bool:
    return callable(value) or (isinstance(value, tuple) and all(type(i) is int and i >= 0 for i in value))


def _by_lowering(**answers):
    """The default answering by the lowering's kind (`Elementwise`, `Reduction`, `View`), else None."""
    kinds = {Elementwise: answers.get("elementwise"), Reduction: answers.get("reduction"), View: answers.get("view")}
    return lambda lowering, declared: kinds.get(type(lowering))


def _false(lowering, declared):
    return False


def _none(lowering, declared):
    return None


# The roles of `fusion` and the lowering each needs (the fused kernel renders the op's expression,
# combine or template); an Elementwise or Reduction op is rendered only inside a fused kernel, so
# it takes its role.
FUSION_LOWERING = {"elementwise": Elementwise, "reduction": Reduction, "view": View, "gemm": Template,
                   "conv": Template, "transpose": Template}
_fusion_default = _by_lowering(elementwise="elementwise", reduction="reduction", view="view")
SBP_RULES = ("elementwise", "reduction", "sum_to", "reshape", "matmul", "permute", "rows", "normalized_rows")
_sbp_by_lowering = _by_lowering(elementwise="elementwise", reduction="reduction")


def _sbp_default(lowering, declared):
    """A row op's rule is "rows"; an Elementwise or Reduction op's its kind's."""
    return "rows" if declared.get("row_dim") is not None else _sbp_by_lowering(lowering, declared)


PROPERTIES: dict[str, Property] = {
    "view": Property(
        "a ViewOf: PyTorch returns a view of the first input (record_view), else None",
        lambda value: value is None or isinstance(value, ViewOf), _none),
    "grad_reads_inputs": Property(
        "False: the gradient reads no saved values, only the inputs' shapes and integer indices, so a second "
        "backward() may go through it without retain_graph (autograd.backward, Tracer.mark_backward)",
        _flag, lambda lowering, declared: True),
    "random": Property(
        "draws random numbers on every call: never shared or precomputed, given a Philox offset per call "
        "(passes/random_streams.py), refused on global tensors", _flag, _false),
    "side_effect": Property(
        "acts beyond its result (a pipeline's send and recv): never shared or precomputed", _flag, _false),
    "fusion": Property(
        "its role in passes/fusion.py: 'elementwise' (chains, prologues, epilogues), 'reduction' (an anchor "
        "taking a prologue and an epilogue), 'view' (free inside a chain), 'gemm' / 'conv' (anchors taking an "
        "epilogue), 'transpose' (a permutation of its `dims` attribute, read in place by the GEMM it feeds or "
        "follows when it swaps the last two), None (a kernel of its own)",
        _one_of(None, *FUSION_LOWERING), _fusion_default),
    "cast_scale": Property(
        "its part in the cast/scale fusion family (graph.config.allow_fuse_cast_scale): 'cast', or 'scale' "
        "(with one operand of one element), else None", _one_of(None, "cast", "scale"), _none),
    "residual_add": Property(
        "the sum of its two operands: with both of the result's size a residual add, which "
        "allow_fuse_add_to_output keeps out of GEMM/conv epilogues and a layer_norm row kernel takes in",
        _flag, _false),
    "autocast": Property(
        "its class under autocast (flowgen/mixed_precision.py): 'lower_precision' (runs in the 16-bit dtype), "
        "'float32' (runs in float32), None (runs in its inputs' dtypes)",
        _one_of(None, "lower_precision", "float32"), _none),
    "sbp": Property(
        "the rule deducing its result's sbp from global operands' (distributed/global_ops.py), None: broadcast "
        "operands only", _one_of(None, *SBP_RULES), _sbp_default),
    "row_dim": Property(
        "row ops: row_dim(attrs), the dim each row runs along (sbp rule 'rows')",
        lambda value: value is None or callable(value), _none),
    "linear_in": Property(
        "the operands it is linear in, each alone with the others fixed (a partial_sum operand stays partial "
        "beside broadcast ones): a tuple of operand indices, or linear_in(attrs) -> tuple",
        _operand_indices, lambda lowering, declared: ()),
    "additive": Property(
        "linear in all operands together, f(a + a', b + b') = f(a, b) + f(a', b') (partial_sum operands give "
        "a partial_sum)", _flag, _false),
    "local_shape_attr": Property(
        "its `shape` attribute is the result's logical shape: on split operands each rank runs it with its "
        "piece's", _flag, _false),
}


def _checked_properties(name: str, lowering, declared: dict) -> dict:
    """`declared` validated against `PROPERTIES`, completed with their defaults."""
    unknown = sorted(declared.keys() - PROPERTIES.keys())
    if unknown:
        raise ValueError(f"op {name!r}: unknown propert{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                         f"(an op's properties are {', '.join(PROPERTIES)}: flowgen/ops/registry.py PROPERTIES)")
    for key, value in declared.items():
        if not PROPERTIES[key].valid(value):
            raise ValueError(f"op {name!r}: {key}={value!r} is not a value of {key}: {PROPERTIES[key].doc}")
    properties = {key: declared[key] if key in declared else prop.default(lowering, declared)
                  for key, prop in PROPERTIES.items()}
    role, needs = properties["fusion"], FUSION_LOWERING.get(properties["fusion"])
    if (needs is not None and not isinstance(lowering, needs)) or \
            (isinstance(lowering, (Elementwise, Reduction)) and role != _fusion_default(lowering, declared)):
        raise ValueError(f"op {name!r}: fusion={role!r} does not go with its lowering {lowering!r} (an Elementwise "
                         f"op is 'elementwise', a Reduction 'reduction'; 'gemm', 'conv' and 'transpose' take a "
                         f"Template, 'view' a View)")
    if (properties["sbp"] == "rows") != (properties["row_dim"] is not None):
        raise ValueError(f"op {name!r}: sbp='rows' and row_dim go together (row_dim names the rows' dim)")
    return properties


@dataclass
class OpDef:
    name: str
    infer: Callable[..., Any]
    ref: Callable[..., Any]
    grad: Callable[..., tuple] | None = None
    lowering: Any = None
    num_outputs: int = 1
    doc: str = ""
    # Its properties (`PROPERTIES`), each name present: what it declared, else the default.
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.extra = _checked_properties(self.name, self.lowering, self.extra)


REGISTRY: dict[str, OpDef] = {}


def defop(name: str, *, infer, ref, grad=None, lowering=None, num_outputs: int = 1, doc: str = "",
          **properties) -> OpDef:
    """Register op `name`; `properties` answer what the passes ask of it (`PROPERTIES`: e.g.
    ``fusion="gemm"``, ``autocast="float32"``), the others take their defaults."""
    if name in REGISTRY:
        raise ValueError(f"op {name!r} is defined twice")
    op = OpDef(name, infer, ref, grad, lowering, num_outputs, doc, properties)
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
        plan = mixed_precision.plan(op, [t.dtype for t in tensors], mixed_precision.active())
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
    if op.extra["view"] is not None:
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
    """`out` is a view of `base` made by op `name` (an op declaring ``view=ViewOf(...)``, among them
    detach for Tensor.detach: PyTorch returns one sharing base's memory): it keeps a `View` of the
    tensor at the bottom of its chain of views, and the strides PyTorch's view has (stride(),
    is_contiguous()). flowgen's tensors own their data (a permute is a copy), so aliasing is
    carried by this record instead:
    an in-place write to `out` is written back into the root (Tensor._write_through), and a read
    of `out` after the root was written recomputes it (Tensor._refresh_view), in eager mode and
    while tracing alike. A reshape that base's strides do not allow (of a permuted or step-sliced
    tensor) is a copy in PyTorch, so it is not recorded."""
    of_base = get_op(name).extra["view"]
    strides = of_base.strides(tuple(base.shape), base.stride(), attrs, tuple(out.shape))
    if strides is None:
        return
    in_order, differentiable = of_base.in_order, of_base.differentiable
    if base._view is not None:
        root, base_replay = base._view.root, base._view.replay
        replay = lambda r: apply(name, base_replay(r), **attrs)   # noqa: E731
        in_order = in_order and base._view.whole
        differentiable = differentiable and base._view.differentiable
    else:
        root, replay = base, (lambda r: apply(name, r, **attrs))
    out._view = View(root, replay, root._version, in_order and out.numel() == root.numel(), differentiable)
    out._view_strides = None if strides == out._row_major_strides() else strides


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
