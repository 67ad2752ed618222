"""Eager ops on global tensors, as OneFlow runs them: each rank runs the op on its local
components and the result is a global tensor whose sbp is deduced from the operands' sbps.

Deduction (one placement dimension; B = broadcast, S(d) = split(d), P = partial_sum). Each op names
its rule with its defop (``sbp=``, flowgen/ops/registry.py PROPERTIES; an `Elementwise` op's
is "elementwise", a `Reduction` op's "reduction"), and the properties the rules read:

* any op, every operand B -> B (random ops excepted, ``random=True``: the ranks would draw
  different values);
* "elementwise": operands S(d) and B -> S(d) (a B operand that is not size 1 along d takes its own
  piece, a local slice; an op whose ``shape`` attribute is the logical result's, expand, runs with
  its piece's: ``local_shape_attr``); P stays P where the op is linear in it: every operand P of
  an ``additive`` op (add, sub), or one P operand beside B ones that the op is ``linear_in`` (neg,
  detach, expand, mul, div of P by B, a cast to a floating dtype: a cast to an integer or bool
  truncates each part); any other P operand is all-reduced to B first;
* "reduction" (sum / mean / max / min; a combine of "sum" is linear): S(d) reduced over d -> P
  (mean: each rank's sum / the logical count), over other dims -> S(d') (d' counts the kept dims);
  P -> P; max / min over a split dim gather the operand to B first;
* "sum_to": S(d) of a dim the target shape reduces -> P, of a dim it keeps -> S(d'); P -> P;
* "matmul": (S(m), B) -> S(m), (B, S(n)) -> S(n), (S(k), S(k)), (S(k), B) and (B, S(k)) -> P (a B
  operand takes its piece of k), (P, B) and (B, P) -> P;
* "permute": S(d) -> S(perm.index(d)); P -> P;
* "reshape": S(d) -> S(e) when the target keeps dim d whole with the same elements before it
  (unsqueeze / squeeze, reshaping trailing dims: matmul with a vector goes through it); P -> P;
* "rows", the ops declaring ``row_dim``, the dim each row runs along (softmax / log_softmax along
  `dim`; the cross-entropy rows of (N, C) logits and their gradient along the classes, dim 1):
  split along another dim than the row's -> the same split (a B operand takes its piece); split
  along the row's dim, or P, -> the operands are gathered to B first and the result is B;
* "normalized_rows", layer_norm / add_layer_norm / layer_norm_backward (rows over the trailing
  normalized dims): the row operands (the input's rank: x, g, mean, rstd, ...) split along one
  leading dim -> the same split, with B weight and bias whole (a B row operand takes its piece);
  anything else is gathered to B first.

Anything else with a non-broadcast operand raises `NotImplementedError` naming the op and the
operands' sbps, never a result with a guessed sbp. Autograd records the op on the global tensors,
so gradients are computed by the same rules (flowgen/autograd.py delivers each leaf's gradient in
the leaf's sbp, all-reducing a partial_sum gradient of a broadcast parameter).

Every rank takes the same path through the deduction (it reads logical shapes and sbps only), so
the boxing collectives match and the refusals above raise on every rank. Only the local op itself
can fail on some ranks and not others (it reads the rank's data); `_run_on_every_rank` makes
every rank raise then, at the cost of one small all-gather per op on several ranks.

The collectives run among the placement's ranks (global_tensor.placement_group). A rank outside
the operands' placement runs nothing: it gets the results' logical shapes and dtypes (absent
components) and records the op for autograd like the others, so every rank walks the same tape.

`to_global` between layouts or placements is on the tape too (`CONVERSION`, installed into
global_tensor.py): its gradient is converted back to the source's placement and layout (a
partial_sum source's gradient as broadcast: every part's gradient is the whole logical gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowgen.autograd import no_grad, record
from flowgen.distributed import global_tensor
from flowgen.distributed.sbp import broadcast, partial_sum, sbp as Sbp, split
from flowgen.ops import registry
from flowgen.ops.registry import OpDef
from flowgen.tensor import Tensor, as_tensor_like


@dataclass(frozen=True)
class _LocalRun:
    """What a rank runs instead of the op itself, for ops whose local form differs (mean over a
    split dim: the local sum, divided by the logical count)."""
    op_name: str
    attrs: dict
    divisor: float = 1.0


def _layout(t) -> Sbp:
    return t._global.sbp[0]


def _describe(op_name, tensors) -> str:
    return f"{op_name} on operands with sbp ({', '.join(repr(_layout(t)) for t in tensors)})"


def _unsupported(op_name, tensors, why=""):
    return NotImplementedError(
        f"flowgen has no eager {_describe(op_name, tensors)}{': ' + why if why else ''}; convert the operands "
        f"first, e.g. x.to_global(sbp=flow.sbp.broadcast)")


def _boxed(t, layout: Sbp):
    return t if _layout(t) == layout else global_tensor.to_global(t, sbp=layout)


def _local_piece(t, axis: int):
    """This rank's piece along `axis` of the broadcast global tensor `t`, as a local tensor (None
    on a rank outside the placement)."""
    local = t._global.local
    if local is None:
        return None
    comm = global_tensor.placement_group(t._global.placement)
    piece = global_tensor.local_part(local.numpy_view(), split(axis), comm.rank, comm.size)
    return type(local)(piece, dtype=t.dtype, device=local.device)


def _split_elementwise(op_name, tensors, out_ndim):
    """Local operands and output sbp of an elementwise op with some split operands."""
    dims = {out_ndim - t.ndim + _layout(t).dim for t in tensors if _layout(t).kind == "split"}
    if len(dims) != 1:
        raise _unsupported(op_name, tensors, "the split operands are split along different dims")
    d = dims.pop()
    locals_ = []
    for t in tensors:
        local = t._global.local
        axis = d - (out_ndim - t.ndim)
        if _layout(t).kind == "broadcast" and axis >= 0 and t.shape[axis] != 1:
            local = _local_piece(t, axis)
        locals_.append(local)
    return locals_, split(d)


def _keeps_partial_sum(op, kinds, attrs) -> bool:
    """Whether the ranks' results of `op` on operands laid out as `kinds` (some partial_sum) sum
    to its logical result: all operands partial and the op additive, or one partial operand the
    op is linear in beside broadcast ones."""
    if op.extra["additive"] and all(k == "partial_sum" for k in kinds):
        return True
    linear = op.extra["linear_in"]
    linear = linear(attrs) if callable(linear) else linear
    partial = [i for i, k in enumerate(kinds) if k == "partial_sum"]
    return (len(partial) == 1 and partial[0] in linear
            and all(k == "broadcast" for i, k in enumerate(kinds) if i != partial[0]))


def _elementwise(op, tensors, attrs, out_ndim):
    kinds = [_layout(t).kind for t in tensors]
    if "partial_sum" in kinds:
        if _keeps_partial_sum(op, kinds, attrs):
            return [t._global.local for t in tensors], partial_sum, attrs
        tensors = [_boxed(t, broadcast) if _layout(t).kind == "partial_sum" else t for t in tensors]
        kinds = [_layout(t).kind for t in tensors]
    if "split" in kinds:
        locals_, layout = _split_elementwise(op.name, tensors, out_ndim)
        if op.extra["local_shape_attr"]:
            attrs = dict(attrs, shape=_local_shape(attrs["shape"], layout.dim, locals_[0], tensors[0]))
        return locals_, layout, attrs
    return [t._global.local for t in tensors], broadcast, attrs


def _piece_size(local, axis: int) -> int:
    """The size of this rank's component along `axis` (0 on a rank outside the placement, which
    runs nothing: the attributes of its local op are never used)."""
    return local.shape[axis] if local is not None else 0


def _local_shape(shape, d, local, t):
    """`shape` (a logical shape attribute) with dim `d` made this rank's size."""
    shape = list(shape)
    axis = d - (len(shape) - t.ndim)
    shape[d] = _piece_size(local, axis) if axis >= 0 and t.shape[axis] != 1 else shape[d]
    return tuple(shape)


def _reduction(op, tensors, attrs, out_ndim):
    """A `Reduction` over attrs["dims"]: a sum (mean: a sum divided by the count) is linear, so
    partial sums stay partial; a max or min needs the whole operand."""
    x, = tensors
    linear = op.lowering.combine == "sum"
    layout = _layout(x)
    if layout.kind == "partial_sum":
        if linear:
            return [x._global.local], partial_sum, attrs
        x = _boxed(x, broadcast)
        layout = broadcast
    if layout.kind == "broadcast":
        return [x._global.local], broadcast, attrs
    d = layout.dim
    local = x._global.local
    dims, keepdim = tuple(attrs["dims"]), attrs.get("keepdim", False)
    if d in dims:
        if not linear:
            x = _boxed(x, broadcast)
            return [x._global.local], broadcast, attrs
        if op.lowering.average:   # each rank's sum over its piece / the logical count: partial means
            count = float(np.prod([x.shape[r] for r in dims]))
            return [local], partial_sum, _LocalRun("sum", attrs, divisor=count)
        return [local], partial_sum, attrs
    return [local], split(d if keepdim else d - sum(1 for r in dims if r < d)), attrs


def _sum_to(op, tensors, attrs, out_ndim):
    """sum_to(x, shape): a split dim the target shape reduces (a leading one, or one it keeps as 1)
    gives partial sums, a dim it keeps stays split."""
    x, = tensors
    layout = _layout(x)
    local = x._global.local
    if layout.kind == "partial_sum":
        return [local], partial_sum, attrs
    d, shape = layout.dim, tuple(attrs["shape"])
    lead = x.ndim - len(shape)
    if d < lead or shape[d - lead] == 1 and x.shape[d] != 1:
        return [local], partial_sum, attrs
    return [local], split(d - lead), dict(attrs, shape=shape[:d - lead] + (_piece_size(local, d),)
                                          + shape[d - lead + 1:])


def _reshape(op, tensors, attrs, out_ndim):
    """S(d) -> S(e) when the target shape keeps dim d whole with the same elements before it
    (prod(shape[:e]) == prod(x.shape[:d]) and shape[e] == x.shape[d]): each rank's piece reshapes
    to its piece of the result (inserting or dropping size-1 dims, reshaping the trailing dims).
    P -> P; any other reshape of a split tensor would need other ranks' elements."""
    x, = tensors
    layout = _layout(x)
    if layout.kind == "partial_sum":
        return [x._global.local], partial_sum, attrs
    d, shape = layout.dim, tuple(attrs["shape"])
    before = int(np.prod(x.shape[:d]))
    for e in range(len(shape)):
        if int(np.prod(shape[:e])) == before and shape[e] == x.shape[d] and x.shape[d] != 1:
            local = x._global.local
            local_shape = shape[:e] + (_piece_size(local, d),) + shape[e + 1:]
            return [local], split(e), dict(attrs, shape=local_shape)
    raise _unsupported(op.name, (x,), f"the split dim {d} of shape {tuple(x.shape)} does not survive as one dim "
                                      f"of shape {shape}")


def _matmul(op, tensors, attrs, out_ndim):
    a, b = tensors
    la, lb = _layout(a), _layout(b)
    pair = (la.kind, lb.kind)
    if pair == ("broadcast", "broadcast"):
        layout = broadcast
    elif pair in (("partial_sum", "broadcast"), ("broadcast", "partial_sum")):
        layout = partial_sum
    elif pair == ("split", "broadcast") and la.dim == a.ndim - 2:
        layout = split(out_ndim - 2)
    elif pair == ("broadcast", "split") and lb.dim == b.ndim - 1:
        layout = split(out_ndim - 1)
    elif (la.kind != "partial_sum" and lb.kind != "partial_sum" and "split" in pair
          and la in (broadcast, split(a.ndim - 1)) and lb in (broadcast, split(b.ndim - 2))):
        # split along k (a broadcast operand takes its own piece of k): each rank's product is a partial sum
        local_a, local_b = a._global.local, b._global.local
        if la.kind == "broadcast":
            local_a = _local_piece(a, a.ndim - 1)
        if lb.kind == "broadcast":
            local_b = _local_piece(b, b.ndim - 2)
        return [local_a, local_b], partial_sum, attrs
    else:
        raise _unsupported(op.name, (a, b))
    return [a._global.local, b._global.local], layout, attrs


def _permute(op, tensors, attrs, out_ndim):
    x, = tensors
    layout = _layout(x)
    if layout.kind == "split":
        layout = split(list(attrs["dims"]).index(layout.dim))
    return [x._global.local], layout, attrs


def _rows(op, tensors, attrs, out_ndim):
    """Each rank runs its own rows when the operands are split along one dim the rows do not
    run along (the op's row_dim); otherwise the operands are gathered to broadcast first (module
    docstring)."""
    row_dim = op.extra["row_dim"](attrs)
    dims = {_layout(t).dim if _layout(t).kind == "split" else None for t in tensors} - {None}
    kinds = {_layout(t).kind for t in tensors}
    if "partial_sum" in kinds or len(dims) != 1 or row_dim in dims:
        return [_boxed(t, broadcast)._global.local for t in tensors], broadcast, attrs
    d = dims.pop()
    locals_ = [_local_piece(t, d) if _layout(t).kind == "broadcast" else t._global.local for t in tensors]
    return locals_, split(d), attrs


def _normalized_rows(op, tensors, attrs, out_ndim):
    """The layer_norm family: each rank normalizes its own rows when the row operands are split
    along one leading dim and the weight and bias (of the normalized shape) are broadcast."""
    ndim = max(t.ndim for t in tensors)
    rows = [t for t in tensors if t.ndim == ndim]
    affine = [t for t in tensors if t.ndim != ndim]
    dims = {_layout(t).dim for t in rows if _layout(t).kind == "split"}
    lead = ndim - attrs["normalized_ndim"]
    if (len(dims) != 1 or next(iter(dims)) >= lead or any(_layout(t).kind == "partial_sum" for t in rows)
            or any(_layout(t).kind != "broadcast" for t in affine)):
        return [_boxed(t, broadcast)._global.local for t in tensors], broadcast, attrs
    d = dims.pop()
    locals_ = [_local_piece(t, d) if t.ndim == ndim and _layout(t).kind == "broadcast" else t._global.local
               for t in tensors]
    return locals_, split(d), attrs


# The sbp rules an op names with its defop (``sbp=``; registry.SBP_RULES), but "elementwise",
# which runs on broadcast operands too.
_RULES = {"reduction": _reduction, "sum_to": _sum_to, "reshape": _reshape, "matmul": _matmul, "permute": _permute,
          "rows": _rows, "normalized_rows": _normalized_rows}


def _local_inputs(op, tensors, attrs, out_ndim):
    """(local operands, output sbp, local attrs) for `op` on global `tensors`."""
    if op.extra["random"]:
        raise NotImplementedError(f"flowgen has no eager {op.name} on global tensors (each rank would draw "
                                  f"different random values); run it on local tensors or inside an nn.Graph")
    rule = op.extra["sbp"]
    if rule == "elementwise":
        return _elementwise(op, tensors, attrs, out_ndim)
    if all(_layout(t).kind == "broadcast" for t in tensors):
        return [t._global.local for t in tensors], broadcast, attrs
    if rule is None:
        raise _unsupported(op.name, tensors)
    return _RULES[rule](op, tensors, attrs, out_ndim)


def apply_global(op, tensors, attrs):
    """Run `op` on `tensors`, of which at least one is global."""
    globals_ = [t for t in tensors if t._global is not None]
    placement = globals_[0]._global.placement
    if any(t._global.placement != placement for t in globals_):
        raise RuntimeError(f"{op.name}: the operands are global tensors on different placements "
                           f"({', '.join(repr(t._global.placement) for t in globals_)}); move them to one "
                           f"placement with to_global(placement=...)")
    if len(globals_) != len(tensors):
        raise RuntimeError(f"{op.name}: global and local tensors are mixed; make the local operand global with "
                           f"to_global(placement, sbp) (a Python scalar needs nothing)")
    metas = op.infer(*(t.meta for t in tensors), **attrs)
    multi = type(metas) is tuple
    metas = metas if multi else (metas,)
    with no_grad():   # the boxing of operands is not on the tape: the op itself is, below
        locals_, layout, local_run = _local_inputs(op, tensors, attrs, len(metas[0].shape))
        if not global_tensor.holds(placement):
            outs = tuple(global_tensor.absent(m.dtype, placement, layout, m.shape) for m in metas)
        else:
            if not isinstance(local_run, _LocalRun):
                local_run = _LocalRun(op.name, local_run)
            result = _run_on_every_rank(op.name, placement, lambda: _run_local(local_run, locals_))
            outs = tuple(global_tensor.wrap_local(r, placement, layout, m.shape)
                         for r, m in zip(result if multi else (result,), metas))
    record(op, tensors, attrs, outs)
    return outs if multi else outs[0]


def _run_local(local_run, locals_):
    result = registry.apply(local_run.op_name, *locals_, **local_run.attrs)
    return result if local_run.divisor == 1.0 else registry.apply("div", result, local_run.divisor)


def _run_on_every_rank(op_name, placement, run):
    """`run()` on this rank's components, raising on every rank if it raised on any.

    The local op can fail on one rank only (its data: an index out of range in its piece, a
    failure on an empty piece). Were the error raised there alone, a caller catching it would go
    on while the other ranks wait in their next collective with mismatched partners, a deadlock.
    So the ranks of the placement agree first (one all-gather of a flag per op, two when one
    failed): the failing rank raises its own exception, the others a RuntimeError naming the
    rank and its error."""
    comm = global_tensor.placement_group(placement)
    if comm.size == 1:
        return run()
    error, result = None, None
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - every error is re-raised after the ranks agree
        error = exc
    failed = [bool(f) for f in comm.all_gather(np.array(error is not None))]
    if not any(failed):
        return result
    messages = comm.all_gather(np.array([f"{type(error).__name__}: {error}" if error is not None else ""]))
    if error is not None:
        raise error
    first = failed.index(True)
    raise RuntimeError(f"{op_name} on global tensors failed on rank {placement.ranks[first]} (this rank's part "
                       f"ran): {messages[first][0]}")


def _conversion_grad(ctx, g):
    source = ctx.inputs[0]._global
    layout = broadcast if source.sbp[0].kind == "partial_sum" else source.sbp[0]
    return global_tensor.to_global(g, source.placement, layout)


# The autograd op of a global -> global `to_global` (outside the registry: it runs through
# to_global, never registry.apply): the gradient goes back to the source's placement, laid out as
# the source (a partial_sum source's as broadcast: each part's gradient is the whole logical
# gradient). It reads the source's placement and sbp only, no values.
CONVERSION = OpDef("to_global", infer=None, ref=None, grad=_conversion_grad,
                   doc="to_global(x, placement, sbp) on the autograd tape", extra={"grad_reads_inputs": False})


def _record_conversion(source, converted):
    record(CONVERSION, [source], {}, [converted])


def _apply_with_scalars(op, inputs, attrs):
    """`registry.apply` of an op with a global operand: Python scalars beside it become broadcast
    global tensors."""
    like = next(x for x in inputs if isinstance(x, Tensor) and x._global is not None)
    return apply_global(op, [x if isinstance(x, Tensor) else as_tensor_like(x, like) for x in inputs], attrs)


registry.install_global_apply(_apply_with_scalars)
global_tensor.install_conversion_recorder(_record_conversion)
