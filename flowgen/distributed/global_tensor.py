"""Global tensors: one logical value laid out over the ranks of a placement by an SBP.

A global `Tensor` keeps its local component (this rank's part, an ordinary local tensor) in
`GlobalInfo.local` and reports the logical shape. Conversions follow OneFlow:

* local -> global (`to_global` on a local tensor): the tensor becomes this rank's component, no
  communication except for `broadcast`, where rank 0's data replaces the others' so the ranks agree;
  `split(d)` makes the logical size along d the sum of the ranks' sizes (shapes are exchanged).
* global -> global: the logical value is assembled (all-gather for split, all-reduce for
  partial_sum) and this rank's part of the new layout is taken (B -> P keeps the value on the
  first rank and zeros elsewhere).
* `to_local()`: the local component; `numpy()`: the logical value on every rank.

Eager ops on global tensors run on the local components with a deduced sbp
(flowgen/distributed/global_ops.py); global tensors are also the inputs and outputs of
data-parallel `nn.Graph`s (flowgen/distributed/data_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowgen.device import as_device
from flowgen.distributed import env
from flowgen.distributed.collectives import world
from flowgen.distributed.placement import placement as Placement
from flowgen.distributed.sbp import broadcast, sbp as Sbp


@dataclass(frozen=True)
class GlobalInfo:
    placement: Placement
    sbp: tuple          # one flow.sbp.sbp per placement dimension (flowgen: always one)
    shape: tuple        # the logical shape
    local: object       # this rank's component, a local Tensor


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
    if placement.ranks != list(range(env.get_world_size())):
        raise NotImplementedError(f"to_global: placement ranks {placement.ranks}: flowgen places global tensors "
                                  f"on every rank in order, i.e. ranks={list(range(env.get_world_size()))}")
    return placement


def split_sizes(size: int, parts: int) -> list:
    """Sizes of `parts` pieces of `size`, as even as possible, the first ones one longer."""
    return [size // parts + (1 if i < size % parts else 0) for i in range(parts)]


def _make_global(tensor_type, local, placement, sbps, shape):
    t = tensor_type.__new__(tensor_type)
    tensor_type.__init__(t, None, dtype=local.dtype, device=as_device(placement.type))
    t._data, t._dtype = None, local.dtype
    t._global = GlobalInfo(placement, sbps, tuple(shape), local)
    return t


def wrap_local(local, placement, layout: Sbp, shape):
    """A global tensor with `local` as this rank's component as it is (no communication): the
    caller knows the components agree with `layout` and that `shape` is the logical shape."""
    return _make_global(type(local), local, placement, (layout,), tuple(shape))


def local_to_global(tensor, placement, sbp):
    if placement is None or sbp is None:
        raise ValueError("to_global on a local tensor needs both placement and sbp")
    placement = _check_placement(placement)
    sbps = _normalized_sbp(sbp, tensor.ndim)
    comm = world()
    device = as_device(placement.type)     # the component lives on the placement's device type
    local = tensor.detach()
    if local.device != device:
        local = local.to(device)
    shape = tuple(tensor.shape)
    layout = sbps[0]
    if layout.kind == "broadcast":
        local = type(local)(comm.broadcast(tensor.numpy(), root=0), dtype=tensor.dtype, device=device)
    shapes = [tuple(int(n) for n in s) for s in comm.all_gather(np.array(shape, np.int64))]
    if layout.kind == "split":
        d = layout.dim
        if any(len(s) != len(shape) or s[:d] + s[d + 1:] != shape[:d] + shape[d + 1:] for s in shapes):
            raise ValueError(f"to_global with {layout!r}: the ranks' local shapes {shapes} differ outside dim {d}")
        shape = shape[:d] + (sum(s[d] for s in shapes),) + shape[d + 1:]
    elif any(s != shape for s in shapes):
        raise ValueError(f"to_global with {layout!r}: the ranks' local shapes differ: {shapes}")
    return _make_global(type(local), local, placement, sbps, shape)


def logical_value(tensor) -> np.ndarray:
    """The whole value of a global tensor (a collective: every rank of the placement must call it)."""
    info = tensor._global
    layout, local = info.sbp[0], info.local.numpy()
    comm = world()
    if layout.kind == "broadcast":
        return np.array(local)
    if layout.kind == "partial_sum":
        return comm.all_reduce([local], "sum")[0]
    return np.concatenate(comm.all_gather(local), axis=layout.dim)


def local_part(value: np.ndarray, layout: Sbp, rank: int, size: int) -> np.ndarray:
    """This rank's component of a logical `value` laid out by `layout`."""
    if layout.kind == "broadcast":
        return np.array(value)
    if layout.kind == "partial_sum":
        return np.array(value) if rank == 0 else np.zeros_like(value)
    sizes = split_sizes(value.shape[layout.dim], size)
    start = sum(sizes[:rank])
    return np.array(np.take(value, range(start, start + sizes[rank]), axis=layout.dim))


def global_to_global(tensor, placement, sbp):
    info = tensor._global
    placement = info.placement if placement is None else _check_placement(placement)
    sbps = info.sbp if sbp is None else _normalized_sbp(sbp, len(info.shape))
    if sbps == info.sbp:
        return tensor
    comm = world()
    part = local_part(logical_value(tensor), sbps[0], comm.rank, comm.size)
    local = type(info.local)(part, dtype=tensor.dtype, device=info.local.device)
    return _make_global(type(local), local, placement, sbps, info.shape)


def to_global(tensor, placement=None, sbp=None):
    if tensor.is_lazy:
        raise NotImplementedError("to_global inside nn.Graph.build(): make the graph's inputs global before "
                                  "calling the graph instead")
    if tensor._global is None:
        return local_to_global(tensor, placement, sbp)
    return global_to_global(tensor, placement, sbp)


def as_global(tensor, placement, layout: Sbp):
    """A global tensor whose component here is the local `tensor`, for components that already
    agree with `layout` (a broadcast takes no data from rank 0)."""
    if layout.kind == "broadcast":
        return _make_global(type(tensor), tensor, _check_placement(placement), (layout,), tuple(tensor.shape))
    return local_to_global(tensor, placement, layout)


def filled_like(tensor, make_local):
    """A global tensor of `tensor`'s logical shape and placement holding a constant: each rank's
    component is `make_local(shape of the component)`. Laid out as `tensor` is, except that a
    partial_sum tensor's constant is laid out broadcast (every rank holds the logical value)."""
    info = tensor._global
    layout = broadcast if info.sbp[0].kind == "partial_sum" else info.sbp[0]
    shape = info.shape if layout.kind == "broadcast" else tuple(info.local.shape)
    return wrap_local(make_local(shape), info.placement, layout, info.shape)


def graph_storage(tensor, what: str):
    """The local tensor a compiled graph holds for the state tensor `tensor` (a parameter or
    buffer, named `what` in errors): `tensor` itself when it is local; the component of a
    global tensor laid out as `broadcast` (every rank holds the whole value, the replicas of a
    data-parallel graph), which the graph reads and updates in place."""
    info = tensor._global
    if info is None:
        return tensor
    if info.sbp[0].kind != "broadcast":
        raise NotImplementedError(f"nn.Graph: {what} is a global tensor with sbp {info.sbp[0]!r}; flowgen graphs "
                                  f"hold global parameters and buffers as flow.sbp.broadcast only (data parallel), "
                                  f"not split or partial_sum (model parallel)")
    return info.local
