"""ZeRO (`graph.config.enable_zero(True, stage=1|2)`): optimizer state sharded over the ranks.

Runs after optimizer lowering in a data-parallel graph. For each parameter of at least
`shard_min_size` elements (and one per rank: `shards_parameter`), the flattened parameter is cut
into one piece per rank (as even as possible, `split_sizes`); this rank

* keeps only its piece of every optimizer slot (momentum, exp_avg, exp_avg_sq): the slot state
  variables become 1-d shards;
* gets its piece of the gradient: stage 1 cuts it from the all-reduced gradient
  (passes/gradient_allreduce.py reduced every gradient); stage 2 reduce-scatters the rank's own
  gradients instead (`reduce_scatter` nodes, `bucket_size` parameters each), so no rank holds a
  reduced full gradient and half the all-reduce traffic is saved;
* re-emits the element-wise update chain (scope "optim...") on its pieces of the parameter and
  gradient, with the same hyper-parameters;
* all-gathers the updated pieces (`all_gather` nodes, `bucket_size` parameters per node) into the
  full parameter every rank keeps.

Collectives run on the host like the gradient all-reduce. Each element is updated by the same
arithmetic as without sharding: stage 1 equals plain data parallel bit for bit, stage 2 up to the
order MPI sums the ranks in. Optimizer-state bytes per rank: the whole over N plus at most one
element per sharded parameter, plus the parameters left whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from flowgen import functional as F
from flowgen.distributed import collectives  # noqa: F401  (registers the all_gather/reduce_scatter ops)
from flowgen.distributed.global_tensor import split_sizes
from flowgen.ir.graph import NameGen, StateVar, Value
from flowgen.ir.trace import Tracer
from flowgen.ops.lowering import Elementwise
from flowgen.ops.registry import get_op
from flowgen.passes.autodiff import next_value_index
from flowgen.passes.simplify import dce

SCOPE = "zero.shard"


@dataclass(frozen=True)
class Shard:
    param: str          # the parameter's state name
    shape: tuple        # the parameter's (and each slot's) full shape
    start: int          # this rank's first element of the flattened tensor
    size: int           # this rank's element count
    sizes: tuple        # every rank's piece size, in rank order


def _update_chain(graph, roots: list, shape: tuple) -> list:
    """The optimizer nodes that compute `roots` from full-shaped values, in graph order."""
    producers = graph.producers()
    chain, todo = set(), list(roots)
    while todo:
        node = producers.get(todo.pop())
        if node is None or id(node) in chain or not node.scope.startswith("optim") \
                or tuple(node.outputs[0].shape) != shape:
            continue
        chain.add(id(node))
        todo.extend(node.inputs)
    return [n for n in graph.nodes if id(n) in chain]


def shards_parameter(numel: int, world_size: int, shard_min_size: int) -> bool:
    """Whether ZeRO splits a parameter of `numel` elements (smaller ones stay whole everywhere)."""
    return numel >= max(shard_min_size, world_size)


@dataclass
class _Sharded:
    var: object          # the parameter's StateVar
    sizes: tuple
    start: int
    slots: list          # slot state names
    chain: list          # the update nodes
    piece_of: dict       # full-shaped Value -> this rank's piece


def shard_optimizer_state(graph, rank: int, world_size: int, shard_min_size: int, device, bucket_size: int = 10,
                          stage: int = 1, op: str = "mean"):
    """Returns (graph, {slot state name: Shard}) — see the module docstring. Stage 2 expects the
    gradients of sharded parameters not yet reduced; `op` says how to combine them."""
    state = graph.state_by_name()
    updates = dict(graph.updates)
    producers = graph.producers()
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph))
    tracer.scopes.append(SCOPE)
    new_state, shards, sharded = {}, {}, []
    for var in graph.state:
        update = producers.get(updates.get(var.name))
        if (var.kind != "param" or update is None or not update.scope.startswith("optim")
                or not shards_parameter(var.value.numel, world_size, shard_min_size)):
            continue
        sizes = tuple(split_sizes(var.value.numel, world_size))
        start, size = sum(sizes[:rank]), sizes[rank]
        slots = [n for n in updates if n.startswith(f"{var.name}.") and state[n].kind == "optim"]
        piece_of = {}
        for name in slots:
            new_state[name] = StateVar(name, Value(name, (size,), state[name].value.dtype), "optim")
            piece_of[state[name].value] = new_state[name].value
            shards[name] = Shard(var.name, tuple(var.value.shape), start, size, sizes)
        chain = _update_chain(graph, [updates[var.name]] + [updates[n] for n in slots], tuple(var.value.shape))
        sharded.append(_Sharded(var, sizes, start, slots, chain, piece_of))
    with tracer:
        gradients = []     # stage 2: (item, full-shaped gradient value) to reduce-scatter
        for item in sharded:
            shape, numel, size = tuple(item.var.value.shape), item.var.value.numel, item.sizes[rank]
            made_here = {v for node in item.chain for v in node.outputs}
            for node in item.chain:
                if not isinstance(get_op(node.op).lowering, Elementwise):
                    raise NotImplementedError(f"enable_zero(stage={stage}): the update of {item.var.name} uses "
                                              f"{node.op}, which is not element-wise, so it cannot run on a shard")
                for v in node.inputs:
                    if v in made_here or v in item.piece_of or v.numel == 1:
                        continue
                    if tuple(v.shape) != shape:
                        raise NotImplementedError(f"enable_zero(stage={stage}): the update of {item.var.name} reads "
                                                  f"a {v.type_str} value, neither a scalar nor parameter-shaped")
                    if stage == 2 and v is not item.var.value:
                        readers = [n.op for n in graph.nodes if v in n.inputs and n not in item.chain]
                        if readers:
                            raise NotImplementedError(
                                f"enable_zero(stage=2): the gradient of {item.var.name} is also read by {readers[0]} "
                                f"(gradient clipping?), which needs the whole reduced gradient; use stage=1")
                        gradients.append((item, v))
                        item.piece_of[v] = None      # filled by the reduce-scatter below
                    else:
                        item.piece_of[v] = F.narrow(F.reshape(tracer.lazy(v), (numel,)), 0, item.start, size)._value
        for first in range(0, len(gradients), bucket_size):
            bucket = gradients[first:first + bucket_size]
            node = tracer.emit("reduce_scatter", [g for _, g in bucket],
                               {"sizes": tuple(item.sizes for item, _ in bucket), "op": op,
                                "rank": rank, "world_size": world_size})
            for (item, g), piece in zip(bucket, node.outputs):
                item.piece_of[g] = piece
        for item in sharded:
            for node in item.chain:
                node_on_piece = tracer.emit(node.op, [item.piece_of.get(v, v) for v in node.inputs], node.attrs)
                item.piece_of.update(zip(node.outputs, node_on_piece.outputs))
            for name in item.slots:
                updates[name] = item.piece_of[updates[name]]
        for first in range(0, len(sharded), bucket_size):
            bucket = sharded[first:first + bucket_size]
            node = tracer.emit("all_gather", [item.piece_of[updates[item.var.name]] for item in bucket],
                               {"sizes": tuple(item.sizes for item in bucket), "world_size": world_size})
            for item, whole in zip(bucket, node.outputs):
                updates[item.var.name] = F.reshape(tracer.lazy(whole), tuple(item.var.value.shape))._value
    out.state = [new_state.get(s.name, s) for s in out.state]
    out.updates = [(name, updates[name]) for name, _ in graph.updates]
    return dce(out), shards
