"""Global tensors: one logical value laid out over the ranks of a placement by an SBP.

A global `Tensor` keeps its local component (this rank's part, an ordinary local tensor) in
`GlobalInfo.local` and reports the logical shape. A placement may hold any of the world's ranks
(OneFlow's pipeline places each stage's modules on its own rank: `flow.placement("cpu", ranks=[1])`):
on a rank outside it the tensor has its logical shape and dtype but no component (`local` is None,
`to_local()` an empty tensor, as OneFlow's), and eager ops on it do nothing there
(distributed/global_ops.py). Every rank runs the same global-tensor code, as OneFlow's programs do;
the data moves among the ranks that hold it (`placement_group`). Conversions follow OneFlow:

* local -> global (`to_global` on a local tensor, every rank calls it): the tensor becomes this
  rank's component, no communication except for `broadcast`, where the placement's first rank's
  data replaces the others' so the ranks agree; `split(d)` makes the logical size along d the sum
  of the placement's ranks' sizes (shapes are exchanged, so every rank knows the logical shape).
* global -> global: the logical value is assembled on the source placement (all-gather for split,
  all-reduce for partial_sum), sent to the ranks of the new placement that lack it (a broadcast
  among the two placements' ranks) and each takes its part of the new layout (B -> P keeps the
  value on the first rank and zeros elsewhere). Autograd records it: the gradient goes back the
  same way (global_ops.py), so a pipeline's activation moved to the next stage's rank
  (`h.to_global(placement=P1, sbp=B)`) carries its gradient back.
* `to_local()`: the local component; `numpy()`: the logical value on every rank.

Inside `nn.Graph.build()` a broadcast `to_global` is the identity: the graph moves values between
pipeline stages itself (flowgen/distributed/pipeline.py).

Eager ops on global tensors run on the local components with a deduced sbp
(flowgen/distributed/global_ops.py); global tensors are also the inputs and outputs of
data-parallel and pipelined `nn.Graph`s (flowgen/distributed/data_parallel.py, pipeline.py).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from flowgen.device import as_device
from flowgen.distributed import env
from flowgen.distributed.collectives import group, world
from flowgen.distributed.placement import placement as Placement
from flowgen.distributed.sbp import broadcast, sbp as Sbp
from flowgen.ops import registry
from flowgen.tensor import Tensor, c_array, install_global_tensor


@dataclass(frozen=True)
class GlobalInfo:
    placement: Placement
    sbp: tuple          # one flow.sbp.sbp per placement dimension (flowgen: always one)
    shape: tuple        # the logical shape
    local: object       # this rank's component, a local Tensor; None on a rank outside the placement


def holds(placement) -> bool:
    """Whether this rank is one of `placement`'s (holds a component of its tensors)."""
    return env.get_rank() in placement.ranks


def covers_world(placement) -> bool:
    """Whether `placement` is every rank of the world, in order (data parallelism's placement)."""
    return placement.ranks == list(range(env.get_world_size()))


def placement_group(placement):
    """The communicator of `placement`'s ranks (its `rank` is this rank's index in the placement);
    only those ranks may call it."""
    return group(placement.ranks)


def _normalized_sbp(sbp, ndim: int) -> tuple:
    sbps = tuple(sbp) if isinstance(sbp, (list, tuple)) else (sbp,)
    if len(sbps) != 1 or not isinstance(sbps[0], Sbp):
        raise ValueError(f"to_global: sbp must be one flow.sbp.broadcast / split(dim) / partial_sum (flowgen "
                         f"placements are one-dimensional), got {sbp!r}")
    if sbps[0].kind == "split" and sbps[0].dim >= max(ndim, 1):
        raise ValueError(f"to_global: {sbps[0]!r} on a tensor with {ndim} dims")
    return sbps


def _check_placement(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"to_global: placement must be a flow.placement, got {placement!r}")
    return placement


def split_sizes(size: int, parts: int) -> list:
    """Sizes of `parts` pieces of `size`, as even as possible, the first ones one longer."""
    return [size // parts + (1 if i < size % parts else 0) for i in range(parts)]


def _make_global(local, placement, sbps, shape, dtype=None):
    """A global tensor with component `local` here (None outside the placement: `dtype` then)."""
    dtype = local.dtype if local is not None else dtype
    t = Tensor.__new__(Tensor)
    Tensor.__init__(t, None, dtype=dtype, device=as_device(placement.type))
    t._data, t._dtype = None, dtype
    t._global = GlobalInfo(placement, sbps, tuple(shape), local)
    return t


def wrap_local(local, placement, layout: Sbp, shape):
    """A global tensor with `local` as this rank's component as it is (no communication): the
    caller knows the components agree with `layout` and that `shape` is the logical shape."""
    return _make_global(local, placement, (layout,), tuple(shape))


def broadcast_beside(local, like):
    """The local constant `local` as a broadcast global tensor on `like`'s placement (every rank of
    it holds the value; none on a rank outside it): a scalar operand beside a global tensor."""
    placement = like._global.placement
    if not holds(placement):
        return absent(local.dtype, placement, broadcast, tuple(local.shape))
    return wrap_local(local, placement, broadcast, tuple(local.shape))


def absent(dtype, placement, layout: Sbp, shape):
    """A global tensor on a rank outside `placement`: its logical shape and dtype, no component."""
    return _make_global(None, placement, (layout,), tuple(shape), dtype)


def local_or_empty(tensor):
    """`to_local()`: the component, or on a rank outside the placement an empty tensor (OneFlow's)."""
    info = tensor._global
    if info.local is not None:
        return info.local
    return Tensor(np.empty((0,), tensor.dtype.np_dtype), dtype=tensor.dtype, device=tensor.device)


def detached(tensor):
    """`detach()` of a global tensor: the same component, no history."""
    info = tensor._global
    if info.local is None:
        return absent(tensor.dtype, info.placement, info.sbp[0], info.shape)
    return wrap_local(info.local.detach(), info.placement, info.sbp[0], info.shape)


def component_copy(tensor, dtype):
    """`tensor` (global) with a fresh copy of its component in `dtype` (an accumulated gradient)."""
    info = tensor._global
    if info.local is None:
        return absent(dtype, info.placement, info.sbp[0], info.shape)
    local = Tensor(c_array(info.local.numpy_view(), dtype.np_dtype).copy(), dtype=dtype, device=info.local.device)
    return wrap_local(local, info.placement, info.sbp[0], info.shape)


def local_to_global(tensor, placement, sbp):
    """Every rank of the world calls it (the local shapes are exchanged, so that every rank knows
    the logical shape); the placement's ranks keep their tensor as their component."""
    if placement is None or sbp is None:
        raise ValueError("to_global on a local tensor needs both placement and sbp")
    placement = _check_placement(placement)
    sbps = _normalized_sbp(sbp, tensor.ndim)
    layout = sbps[0]
    shapes = [tuple(int(n) for n in s) for s in world().all_gather(np.array(tensor.shape, np.int64))]
    shapes = [shapes[r] for r in placement.ranks]
    shape = shapes[0]
    if layout.kind == "split":
        d = layout.dim
        if any(len(s) != len(shape) or s[:d] + s[d + 1:] != shape[:d] + shape[d + 1:] for s in shapes):
            raise ValueError(f"to_global with {layout!r}: the ranks' local shapes {shapes} differ outside dim {d}")
        shape = shape[:d] + (sum(s[d] for s in shapes),) + shape[d + 1:]
    elif any(s != shape for s in shapes):
        raise ValueError(f"to_global with {layout!r}: the local shapes of ranks {placement.ranks} differ: {shapes}")
    if not holds(placement):
        return absent(tensor.dtype, placement, layout, shape)
    device = as_device(placement.type)     # the component lives on the placement's device type
    local = tensor.detach()
    if local.device != device:
        local = local.to(device)
    if layout.kind == "broadcast":
        data = placement_group(placement).broadcast(tensor.numpy(), root=0)
        local = Tensor(data, dtype=tensor.dtype, device=device)
    return _make_global(local, placement, sbps, shape)


def _assembled(info, comm) -> np.ndarray:
    """The logical value of a global tensor from its components: a collective of the placement's
    ranks (`comm`, their group)."""
    layout, local = info.sbp[0], info.local.numpy()
    if layout.kind == "broadcast":
        return np.array(local)
    if layout.kind == "partial_sum":
        return comm.all_reduce([local], "sum")[0]
    return np.concatenate(comm.all_gather(local), axis=layout.dim)


def logical_value(tensor) -> np.ndarray:
    """The whole value of a global tensor on every rank (a collective: every rank of the world
    calls it; a placement of some ranks assembles it there and broadcasts it from its first rank)."""
    info = tensor._global
    if covers_world(info.placement):
        return _assembled(info, world())
    value = (_assembled(info, placement_group(info.placement)) if holds(info.placement)
             else np.empty(info.shape, tensor.dtype.np_dtype))
    return world().broadcast(value, root=info.placement.ranks[0])


def local_part(value: np.ndarray, layout: Sbp, rank: int, size: int) -> np.ndarray:
    """This rank's component of a logical `value` laid out by `layout`."""
    if layout.kind == "broadcast":
        return np.array(value)
    if layout.kind == "partial_sum":
        return np.array(value) if rank == 0 else np.zeros_like(value)
    sizes = split_sizes(value.shape[layout.dim], size)
    start = sum(sizes[:rank])
    return np.array(np.take(value, range(start, start + sizes[rank]), axis=layout.dim))


def assign_whole(tensor, array):
    """Write the logical value `array` into the global `tensor` (a checkpoint loaded into a placed
    module or optimizer slot): each rank of its placement its own part, no communication; a graph
    holding the component uploads it again before its next call."""
    info = tensor._global
    if info.local is None:
        return
    comm = placement_group(info.placement)
    dest = info.local.numpy_view()
    dest[...] = local_part(np.asarray(array), info.sbp[0], comm.rank, comm.size).astype(dest.dtype, copy=False)
    info.local._version += 1


def global_to_global(tensor, placement, sbp):
    """The ranks of both placements call it (the others get the result's shape and dtype only)."""
    info = tensor._global
    placement = info.placement if placement is None else _check_placement(placement)
    sbps = info.sbp if sbp is None else _normalized_sbp(sbp, len(info.shape))
    if placement == info.placement and sbps == info.sbp:
        return tensor
    ranks = sorted(set(info.placement.ranks) | set(placement.ranks))
    if env.get_rank() not in ranks:
        return absent(tensor.dtype, placement, sbps[0], info.shape)
    value = (_assembled(info, placement_group(info.placement)) if holds(info.placement)
             else np.empty(info.shape, tensor.dtype.np_dtype))
    if placement != info.placement:     # the ranks of the new placement that lack the value get it
        value = group(ranks).broadcast(value, root=ranks.index(info.placement.ranks[0]))
    if not holds(placement):
        return absent(tensor.dtype, placement, sbps[0], info.shape)
    comm = placement_group(placement)
    part = local_part(value, sbps[0], comm.rank, comm.size)
    local = Tensor(part, dtype=tensor.dtype, device=as_device(placement.type))
    return _make_global(local, placement, sbps, info.shape)


_record_conversion = None   # installed by distributed/global_ops.py: puts a conversion on the autograd tape


def install_conversion_recorder(record):
    """`record(source, converted)` notes that `converted` is `source` moved by to_global (autograd
    sends the gradient back); global_ops.py, which owns the tape's view of global tensors, installs it."""
    global _record_conversion
    _record_conversion = record


def to_global(tensor, placement=None, sbp=None):
    if tensor.is_lazy:
        return _traced_to_global(tensor, placement, sbp)
    if tensor._global is None:
        return local_to_global(tensor, placement, sbp)
    converted = global_to_global(tensor, placement, sbp)
    if converted is not tensor:
        _record_conversion(tensor, converted)
    return converted


def _traced_to_global(tensor, placement, sbp):
    """`to_global` inside nn.Graph.build() (OneFlow's pipeline moves an activation to the next
    stage's placement so): the graph keeps one value per tensor and moves it between pipeline
    stages itself, so a broadcast to a placement of the graph's device type is the identity."""
    scope = registry._tracer_hook.scope if registry._tracer_hook is not None else ""
    where = f"in {scope}" if scope else "in build()"
    layout = broadcast if sbp is None else _normalized_sbp(sbp, tensor.ndim)[0]
    if layout.kind != "broadcast":
        raise NotImplementedError(f"to_global(placement={placement!r}, sbp={layout!r}) {where}: inside "
                                  f"nn.Graph.build() flowgen converts values to flow.sbp.broadcast only; split "
                                  f"the graph's inputs with to_global before calling it (data parallel)")
    if placement is not None and as_device(_check_placement(placement).type).type != tensor.device.type:
        raise NotImplementedError(f"to_global(placement={placement!r}) {where}: the value is on {tensor.device}; "
                                  f"a graph runs on one device type, place its modules and inputs on "
                                  f"{tensor.device.type}")
    return tensor


def as_global(tensor, placement, layout: Sbp):
    """A global tensor whose component here is the local `tensor`, for components that already
    agree with `layout` (a broadcast takes no data from rank 0); on a rank outside `placement`,
    one without a component."""
    if not holds(_check_placement(placement)):
        return absent(tensor.dtype, placement, layout, tuple(tensor.shape))
    if layout.kind == "broadcast":
        return _make_global(tensor, placement, (layout,), tuple(tensor.shape))
    return local_to_global(tensor, placement, layout)


def filled_like(tensor, make_local):
    """A global tensor of `tensor`'s logical shape and placement holding a constant: each rank's
    component is `make_local(shape of the component)`. Laid out as `tensor` is, except that a
    partial_sum tensor's constant is laid out broadcast (every rank holds the logical value)."""
    info = tensor._global
    layout = broadcast if info.sbp[0].kind == "partial_sum" else info.sbp[0]
    if info.local is None:
        return absent(tensor.dtype, info.placement, layout, info.shape)
    shape = info.shape if layout.kind == "broadcast" else tuple(info.local.shape)
    return wrap_local(make_local(shape), info.placement, layout, info.shape)


def graph_storage(tensor, what: str):
    """The local tensor a compiled graph holds for the state tensor `tensor` (a parameter or
    buffer, named `what` in errors): `tensor` itself when it is local; the component of a
    global tensor laid out as `broadcast` (every rank holds the whole value, the replicas of a
    data-parallel graph), which the graph reads and updates in place; None on a rank outside the
    tensor's placement (a pipeline stage's parameter on the other stages' ranks, which never bind it)."""
    info = tensor._global
    if info is None:
        return tensor
    if info.sbp[0].kind != "broadcast":
        raise NotImplementedError(f"nn.Graph: {what} is a global tensor with sbp {info.sbp[0]!r}; flowgen graphs "
                                  f"hold global parameters and buffers as flow.sbp.broadcast only (data parallel), "
                                  f"not split or partial_sum (model parallel)")
    return info.local


def graph_state_like(tensor, what: str, make_like):
    """A new tensor of graph state beside the state tensor `tensor` (named `what`; an optimizer slot
    of a parameter): `make_like(storage)` of the graph's storage of it (`graph_storage`), as a
    global tensor on `tensor`'s placement when that is some of the ranks (the ranks outside it,
    which trace the step but never run that part, hold no component; `numpy()` fetches it)."""
    info = tensor._global
    if info is None or covers_world(info.placement):
        return make_like(graph_storage(tensor, what))
    if info.local is None:
        return absent(tensor.dtype, info.placement, info.sbp[0], info.shape)
    return wrap_local(make_like(graph_storage(tensor, what)), info.placement, info.sbp[0], info.shape)


# The tensor core (Tensor's methods, autograd, creation) calls this module for global tensors; it
# cannot import it (this module builds on Tensor), so the module installs itself there.
install_global_tensor(sys.modules[__name__])
