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

How gradients and 0-d outputs combine is read from the IR (`batch_reduction`), never guessed:
with global inputs the step must equal the global-batch step, so a loss that is a sum over the
batch sums the gradients, a sum divided by a constant tied to the batch (a mean) averages them, and
a sum divided by a sum over the batch (cross_entropy's mean over non-ignored targets, class
weights) is differentiated as the rank's share S_r / sum_r D_r and the gradients summed. A loss of any
other form is refused. A 0-d output combines the same way; one of unknown form must be equal on
every rank (checked), else the call raises. A DDP-wrapped module keeps PyTorch's contract instead:
each rank's gradients are averaged, whatever the loss (as eager DistributedDataParallel does).

With `graph.config.enable_zero(True, stage=1|2)` on several ranks, passes/zero.py shards the
optimizer slots: the device holds this rank's piece of each slot (`ShardedSlot.piece`, the tensor
bound to the graph); the optimizer's full slot tensors are assembled from the pieces (an all-gather,
so every rank must read them together, as `graph.state_dict()` does) when eager code reads them.
Stage 3 shards the parameters the same way: the module's parameter tensors (`model.weight`) show
the trained full value, gathered from the pieces when eager code reads them after a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flowgen.distributed import env, sbp
from flowgen.distributed.collectives import world
from flowgen.distributed.global_tensor import as_global, covers_world, holds
from flowgen.passes.optimizer import SlotBinding
from flowgen.tensor import Tensor

DEFAULT_BUCKET_SIZE = 10    # gradients per all_reduce, as DistributedDataParallel's bucket_size


@dataclass(frozen=True)
class DataParallel:
    world_size: int
    contract: str           # "global" (split(0) inputs: the global-batch step) | "ddp" (PyTorch's: average)
    bucket_size: int        # gradients per all_reduce call


@dataclass(frozen=True)
class BatchReduction:
    """How a 0-d value computed on this rank's part of the batch becomes the global-batch value:
    "sum" (add the ranks' values), "mean" (average them: equal parts), or "ratio" (value =
    `factor` * `numerator` / `denominator`, both sums over the batch: the global value is the
    ratio of the ranks' sums)."""
    kind: str
    numerator: object = None
    denominator: object = None
    factor: float = 1.0

    @property
    def gradient_op(self) -> str:
        """The collective op (all_reduce / reduce_scatter) that combines the ranks' gradients:
        "mean" for a mean loss; "sum" for a sum, and for a ratio, whose loss is differentiated as
        the rank's share S_r / sum_r D_r (gradient_allreduce.divide_ratio_loss_by_global_count)."""
        return "mean" if self.kind == "mean" else "sum"


def _constant_scalar(producers, value):
    node = producers.get(value)
    # the op by name: a constant factor in the loss's formula (batch_reduction)
    if node is None or node.op != "constant" or value.numel != 1:
        return None
    return float(np.asarray(node.attrs["value"]).reshape(-1)[0])


def _full_sum(producers, value):
    """The node summing (or averaging) a whole tensor into `value`, or None."""
    node = producers.get(value)
    # the ops by name: the loss formula's sum over a whole tensor (a mean is that sum over numel)
    if node is None or node.op not in ("sum", "mean"):
        return None
    return node if set(node.attrs["dims"]) == set(range(len(node.inputs[0].shape))) else None


def batch_reduction(ir, value):
    """The BatchReduction of IR value `value` (0-d), or None when its form is none of them.

    Walks back through reshapes, casts and multiplications/divisions by constants to a sum over
    a whole tensor: a constant factor of 1/numel or 1/batch (that tensor's first dim) makes it a
    mean, any other constant a (scaled) sum; a division of two such sums is a ratio."""
    producers = ir.producers()
    factor, v = 1.0, value
    while True:
        node = producers.get(v)
        if node is None:
            return None
        # the formula by op name: a reshape or cast of the loss keeps its form, a mul / div by a
        # constant scales it, a div of two sums is a ratio; any other op leaves it unknown (None)
        if node.op in ("reshape", "cast"):
            v = node.inputs[0]
            continue
        if node.op in ("mul", "div"):
            left, right = (_constant_scalar(producers, x) for x in node.inputs)
            if right is not None:
                factor = factor * right if node.op == "mul" else factor / right
                v = node.inputs[0]
                continue
            if left is not None and node.op == "mul":
                factor, v = factor * left, node.inputs[1]
                continue
            if node.op == "div" and all(getattr(_full_sum(producers, x), "op", None) == "sum" for x in node.inputs):
                return BatchReduction("ratio", node.inputs[0], node.inputs[1], factor)
            return None
        summed = _full_sum(producers, v)
        if summed is None:
            return None
        x = summed.inputs[0]
        if summed.op == "mean":
            factor /= x.numel
        sizes = (x.numel, x.shape[0] if x.shape else 1)
        if factor != 1.0 and any(math.isclose(factor * n, 1.0, rel_tol=1e-6) for n in sizes):
            return BatchReduction("mean")
        return BatchReduction("sum")


def gradient_reduction(graph_name, ir, loss_values, data_parallel):
    """The BatchReduction the gradients follow (see the module doc); raises for a loss of unknown form."""
    if data_parallel.contract == "ddp":
        return BatchReduction("mean")
    found = [batch_reduction(ir, v) for v in loss_values]
    if not found or any(r is None for r in found):
        raise ValueError(f"{graph_name}: a data-parallel graph with global inputs computes the global-batch step, "
                         f"so it needs to know how the loss combines over the batch; the loss must be a sum over "
                         f"the batch, a sum divided by a constant (a mean), or a sum divided by a sum "
                         f"(cross_entropy's mean), as flowgen's losses with reduction 'sum' or 'mean' are")
    if len(found) > 1 and any(r.kind == "ratio" for r in found):
        raise NotImplementedError(f"{graph_name}: gradient accumulation with a loss divided by a data-dependent "
                                  f"count (cross_entropy's mean) is not supported in data-parallel graphs yet")
    if len({r.kind for r in found}) > 1:
        raise ValueError(f"{graph_name}: the micro-batches' losses combine differently over the batch "
                         f"({', '.join(r.kind for r in found)})")
    return found[0]


def _wrapped_modules(graph) -> list:
    return [m._data_parallel for module in graph._modules.values() for m in module.modules()
            if getattr(m, "_data_parallel", None) is not None]


def split_inputs(graph, args) -> tuple:
    """(this rank's local arguments, each input's placement (None for a local one), data parallel?).

    A global input on a placement this rank is not part of has no component here: it is passed as
    zeros of its logical shape, which the step never reads on this rank (a pipeline reads it on
    its stage's rank, `pipeline.pipeline_of`; a graph on some of the ranks runs only there,
    `graph_placement`)."""
    placements, split = [], False
    for k, a in enumerate(args):
        if not a.is_global:
            placements.append(None)
            continue
        layout = a.sbp[0]
        if layout.kind == "split" and layout.dim == 0:
            split = True
            if not covers_world(a.placement):
                raise NotImplementedError(f"{graph.name}: input {k} is split over {a.placement!r}; data-parallel "
                                          f"graphs split their inputs over every rank of the world, i.e. "
                                          f"ranks={list(range(env.get_world_size()))}")
            if a.shape[0] % env.get_world_size():
                raise ValueError(f"{graph.name}: input {k} is split over {env.get_world_size()} ranks along a "
                                 f"batch of {a.shape[0]}; data-parallel graphs need equal parts (a batch "
                                 f"divisible by the world size) for the averaged gradients to be the batch's")
        elif layout.kind != "broadcast":
            raise NotImplementedError(f"{graph.name}: input {k} has sbp {layout!r}; graph inputs may be global "
                                      f"with flow.sbp.split(0) (data parallel) or flow.sbp.broadcast")
        placements.append(a.placement)
    local = [(a.to_local() if holds(a.placement) else Tensor(np.zeros(tuple(a.shape), a.dtype.np_dtype),
                                                               dtype=a.dtype, device=a.device))
             if a.is_global else a for a in args]
    return local, tuple(placements), split


def graph_placement(graph, input_placements, data_parallel, pipelined: bool):
    """Where a graph that is not a pipeline runs: None (every rank: its tensors are local, or on
    every rank), or the one placement of its global inputs, parameters and buffers when that is
    some of the ranks (each of them runs the whole step; the others run nothing and get outputs
    without components). Raises, naming the tensors, for placements a graph cannot combine."""
    placed = [(f"input {k}", p) for k, p in enumerate(input_placements) if p is not None]
    for module_name, module in graph._modules.items():
        for name, t in [*module.named_parameters(prefix=module_name), *module.named_buffers(prefix=module_name)]:
            if t is not None and t.is_global:
                placed.append((name, t.placement))
    if pipelined or not placed:
        return None
    if data_parallel is not None:
        for what, p in placed:
            if not covers_world(p):
                raise NotImplementedError(f"{graph.name}: {what} is on {p!r} in a data-parallel graph; data "
                                          f"parallelism runs on every rank of the world, so place it with "
                                          f"ranks={list(range(env.get_world_size()))}")
        return None
    first_what, first = placed[0]
    for what, p in placed[1:]:
        if p != first:
            raise NotImplementedError(f"{graph.name}: {first_what} is on {first!r} but {what} on {p!r}; a graph runs "
                                      f"on one placement, or as a pipeline: give its modules "
                                      f"set_stage(stage_id, placement), one rank per stage")
    return None if covers_world(first) else first


def data_parallel_of(graph, split: bool):
    """The graph's DataParallel settings, or None when it is not data parallel."""
    wrapped = _wrapped_modules(graph)
    if not split and not wrapped:
        return None
    bucket_size = wrapped[0].bucket_size if wrapped else DEFAULT_BUCKET_SIZE
    return DataParallel(env.get_world_size(), "global" if split else "ddp", bucket_size)


def broadcast_state(graph):
    """Every rank takes rank 0's parameters and buffers (replicas start equal)."""
    comm = world()
    for module in graph._modules.values():
        for t in [*module.parameters(), *(b for b in module.buffers() if b is not None)]:
            if t.is_global:   # to_global(..., broadcast) already gave every rank rank 0's data
                continue
            t._data[...] = comm.broadcast(t.numpy(), root=0)
            t._version += 1


def global_outputs(tensors: list, placements: list, combine) -> list:
    """A graph's outputs, computed on this rank's part, as global tensors on `placements` (one per
    output). `combine` is None when the graph is not data parallel (the ranks of the output's
    placement computed the whole value: broadcast; a rank outside it gets no component), else
    `combine[i]` says how 0-d output i becomes the global-batch value: "sum"/"mean" over the
    ranks, "global" (the graph already combined it), "replicated" (must be equal on every rank:
    checked) or None for an output that is not 0-d (it is `split(0)` of the ranks' results)."""
    if combine is None:
        return [as_global(t, p, sbp.broadcast) for t, p in zip(tensors, placements)]
    comm = world()
    out = list(tensors)
    for op in ("sum", "mean"):
        picked = [i for i, how in enumerate(combine) if how == op]
        for i, value in zip(picked, comm.all_reduce([tensors[i].numpy() for i in picked], op)):
            out[i] = type(tensors[i])(value, dtype=tensors[i].dtype, device=tensors[i].device)
    for i, how in enumerate(combine):
        if how == "replicated":
            values = comm.all_gather(tensors[i].numpy())
            if any(not np.array_equal(v, values[0], equal_nan=True) for v in values):
                raise RuntimeError(f"output {i} of the data-parallel graph is 0-d but not a sum or mean over the "
                                   f"batch, and its ranks disagree ({', '.join(str(v) for v in values)}); return "
                                   f"it per sample (not reduced), or as a sum or mean over the batch")
    return [as_global(t, p, sbp.split(0) if how is None else sbp.broadcast)
            for t, p, how in zip(out, placements, combine)]


def combine_outputs(ir, emit, world_size: int) -> tuple:
    """(ir with its ratio outputs combined in the graph, each output's `global_outputs` mode).
    A ratio output factor * S / D becomes factor * all_reduce(S) / all_reduce(D), nodes made by
    `emit(op, inputs, attrs)` (a Tracer's, writing into `ir`)."""
    outputs, combine = list(ir.outputs), []
    for i, v in enumerate(ir.outputs):
        if v.shape:
            combine.append(None)
            continue
        how = batch_reduction(ir, v)
        if how is None:
            combine.append("replicated")
        elif how.kind == "ratio":
            summed = emit("all_reduce", [how.numerator, how.denominator], {"op": "sum", "world_size": world_size})
            ratio = emit("div", list(summed.outputs), {}).output
            if how.factor != 1.0:
                scale = emit("constant", [], {"value": np.asarray(how.factor, v.dtype.np_dtype)}).output
                ratio = emit("mul", [ratio, scale], {}).output
            outputs[i] = ratio
            combine.append("global")
        else:
            combine.append(how.kind)
    ir.outputs = outputs
    return ir, combine


@dataclass
class ShardedSlot:
    """This rank's piece of a tensor ZeRO shards (an optimizer slot; a parameter at stage 3), and
    the full eager tensor."""
    piece: object           # Tensor bound to the graph's shard state
    full: object            # the optimizer's slot tensor (optimizer.state[p][key]) or the parameter
    full_version: int       # full._version when the piece was cut (a newer one: a checkpoint was loaded)
    sizes: tuple            # every rank's piece size

    def gather(self, full):
        """`full`'s `_sync_from_device`: the whole slot from every rank's piece."""
        whole = world().all_gather_flat([self.piece.numpy_view()], [list(self.sizes)])[0]
        full._data[...] = whole.reshape(full._data.shape)

    def cut_again_if_written(self):
        """Before a call: when eager code wrote `full` since the piece was cut (a state_dict loaded
        into the module, an in-place update), this rank's piece is cut from it again (and uploaded:
        its version moves)."""
        if self.full._version == self.full_version:
            return
        rank = world().rank
        start = sum(self.sizes[:rank])
        self.piece.numpy_view()[...] = self.full.numpy_view().reshape(-1)[start:start + self.sizes[rank]]
        self.piece._version += 1
        self.full_version = self.full._version


def _piece(store: dict, name: str, full, shard) -> ShardedSlot:
    """The ShardedSlot of state `name`: the one in `store` (the graph's, shared by its variants, so
    pieces live between compilations) unless eager code replaced or wrote `full` since it was cut."""
    kept = store.get(name)
    if kept is None or kept.full is not full or kept.full_version != full._version:
        flat = full.numpy_view().reshape(-1)[shard.start:shard.start + shard.size].copy()
        piece = Tensor(flat, dtype=full.dtype, device=full.device)
        kept = store[name] = ShardedSlot(piece, full, full._version, shard.sizes)
    return kept


def shard_slot_tensors(store: dict, slots: list, shards: dict) -> tuple:
    """(slot bindings with sharded slots bound to this rank's pieces, the ShardedSlots used)."""
    bindings, used = [], []
    for slot in slots:
        shard = shards.get(slot.state_name)
        if shard is None:
            bindings.append(slot)
            continue
        kept = _piece(store, slot.state_name, slot.tensor, shard)
        bindings.append(SlotBinding(slot.state_name, kept.piece))
        used.append(kept)
    return bindings, used


def shard_parameter_bindings(store: dict, bindings: list, state: dict, shards: dict) -> tuple:
    """ZeRO stage 3: (the graph's (state Value, tensor) bindings with each sharded parameter bound
    to this rank's piece, the piece's state Value from `state` (the sharded IR's, by name); the
    ShardedSlots of those parameters)."""
    out, used = [], []
    for value, tensor in bindings:
        shard = shards.get(value.name)
        if shard is None or shard.param != value.name:
            out.append((value, tensor))
            continue
        kept = _piece(store, value.name, tensor, shard)
        out.append((state[value.name].value, kept.piece))
        used.append(kept)
    return out, used
