"""When an `nn.Graph` is data parallel, and what that changes around the compiled step.

A graph is data parallel when an input is a global tensor split along dim 0 (OneFlow's way:
`x.to_global(placement, flow.sbp.split(0))`), or when one of its modules was wrapped by
`flow.nn.parallel.DistributedDataParallel` (each rank then passes its own local batch). Then:

* the graph is traced and compiled for this rank's part of the batch (`to_local()` of the
  inputs); parameters and buffers are broadcast from rank 0 when a variant is compiled, so the
  replicas start equal (parameters stay local tensors);
* passes/gradient_allreduce.py reduces the gradients over the ranks before the update;
* with global inputs, outputs come back global: a 0-d output (the loss) combined over the ranks
  like the gradients, so every rank holds the global-batch value (`broadcast`), any other output
  as `split(0)` of the per-rank results.

How gradients combine follows the loss modules of the graph (`reduction`): "mean" (the default of
every loss, and what a loss of reduction "none" reduced by the user is assumed to do) averages,
which equals the global-batch gradient when the ranks' parts are equal (checked for global inputs);
"sum" sums. Graphs mixing both raise.

With `graph.config.enable_zero(True, stage=1)` on several ranks, passes/zero.py shards the optimizer
slots: the device holds this rank's piece of each slot (`ShardedSlot.piece`, the tensor bound to
the graph); the optimizer's full slot tensors are assembled from the pieces (an all-gather, so
every rank must read them together, as `graph.state_dict()` does) when eager code reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

from flowgen.distributed import env, sbp
from flowgen.distributed.collectives import world
from flowgen.distributed.global_tensor import as_global
from flowgen.passes.optimizer import SlotBinding

DEFAULT_BUCKET_SIZE = 10    # gradients per all_reduce, as DistributedDataParallel's bucket_size


@dataclass(frozen=True)
class DataParallel:
    world_size: int
    reduce: str             # how gradients and 0-d outputs combine: "mean" | "sum"
    bucket_size: int        # gradients per all_reduce call


def _wrapped_modules(graph) -> list:
    return [m._data_parallel for module in graph._modules.values() for m in module.modules()
            if getattr(m, "_data_parallel", None) is not None]


def loss_reduction(graph) -> str:
    found = {m.reduction for module in graph._modules.values() for m in module.modules()
             if isinstance(getattr(m, "reduction", None), str) and m.reduction in ("mean", "sum")}
    if len(found) > 1:
        raise ValueError(f"{graph.name}: data parallel training needs to know whether the loss is a mean or a sum "
                         f"over the batch, but the graph holds loss modules with reduction 'mean' and 'sum'")
    return found.pop() if found else "mean"


def split_inputs(graph, args) -> tuple:
    """(this rank's local arguments, the placement of the global inputs or None, data parallel?)."""
    placement, split = None, False
    for k, a in enumerate(args):
        if not a.is_global:
            continue
        layout = a.sbp[0]
        if layout.kind == "split" and layout.dim == 0:
            split = True
            if a.shape[0] % env.get_world_size():
                raise ValueError(f"{graph.name}: input {k} is split over {env.get_world_size()} ranks along a "
                                 f"batch of {a.shape[0]}; data-parallel graphs need equal parts (a batch "
                                 f"divisible by the world size) for the averaged gradients to be the batch's")
        elif layout.kind != "broadcast":
            raise NotImplementedError(f"{graph.name}: input {k} has sbp {layout!r}; graph inputs may be global "
                                      f"with flow.sbp.split(0) (data parallel) or flow.sbp.broadcast")
        placement = a.placement
    local = [a.to_local() if a.is_global else a for a in args]
    return local, placement, split


def data_parallel_of(graph, split: bool):
    """The graph's DataParallel settings, or None when it is not data parallel."""
    wrapped = _wrapped_modules(graph)
    if not split and not wrapped:
        return None
    bucket_size = wrapped[0].bucket_size if wrapped else DEFAULT_BUCKET_SIZE
    return DataParallel(env.get_world_size(), loss_reduction(graph), bucket_size)


def broadcast_state(graph):
    """Every rank takes rank 0's parameters and buffers (replicas start equal)."""
    comm = world()
    for module in graph._modules.values():
        for t in [*module.parameters(), *(b for b in module.buffers() if b is not None)]:
            t._data[...] = comm.broadcast(t.numpy(), root=0)
            t._version += 1


def global_outputs(tensors: list, placement, data_parallel) -> list:
    """A graph's outputs, computed on this rank's part, as global tensors (see the module doc)."""
    if data_parallel is None:
        return [as_global(t, placement, sbp.broadcast) for t in tensors]
    scalars = [i for i, t in enumerate(tensors) if t.ndim == 0]
    combined = world().all_reduce([tensors[i].numpy() for i in scalars], data_parallel.reduce)
    out = list(tensors)
    for i, value in zip(scalars, combined):
        out[i] = as_global(type(tensors[i])(value, dtype=tensors[i].dtype, device=tensors[i].device),
                           placement, sbp.broadcast)
    return [t if t.is_global else as_global(t, placement, sbp.split(0)) for t in out]


@dataclass
class ShardedSlot:
    """This rank's piece of an optimizer slot under ZeRO stage 1, and the full eager slot."""
    piece: object           # Tensor bound to the graph's shard state
    full: object            # the optimizer's slot tensor (optimizer.state[p][key])
    full_version: int       # full._version when the piece was cut (a newer one: a checkpoint was loaded)
    sizes: tuple            # every rank's piece size

    def gather(self, full):
        """`full`'s `_sync_from_device`: the whole slot from every rank's piece."""
        whole = world().all_gather_flat([self.piece.numpy()], [list(self.sizes)])[0]
        full._data[...] = whole.reshape(full._data.shape)


def shard_slot_tensors(store: dict, slots: list, shards: dict) -> tuple:
    """(slot bindings with sharded slots bound to this rank's pieces, the ShardedSlots used).
    `store` (the graph's, shared by its variants) keeps the pieces between compilations."""
    bindings, used = [], []
    for slot in slots:
        shard = shards.get(slot.state_name)
        if shard is None:
            bindings.append(slot)
            continue
        kept = store.get(slot.state_name)
        if kept is None or kept.full is not slot.tensor or kept.full_version != slot.tensor._version:
            flat = slot.tensor.numpy().reshape(-1)[shard.start:shard.start + shard.size].copy()
            piece = type(slot.tensor)(flat, dtype=slot.tensor.dtype, device=slot.tensor.device)
            kept = store[slot.state_name] = ShardedSlot(piece, slot.tensor, slot.tensor._version, shard.sizes)
        bindings.append(SlotBinding(slot.state_name, kept.piece))
        used.append(kept)
    return bindings, used
