"""ZeRO stage 1 (`graph.config.enable_zero(True, stage=1)`): optimizer state sharded over the ranks.

Runs after optimizer lowering in a data-parallel graph (the gradients are already all-reduced, so
every rank holds the same full gradients). For each parameter of at least `shard_min_size`
elements (and one per rank), the flattened parameter is cut into one piece per rank (as even as
possible, `split_sizes`); this rank

* keeps only its piece of every optimizer slot (momentum, exp_avg, exp_avg_sq): the slot state
  variables become 1-d shards;
* re-emits the element-wise update chain (scope "optim...") on its pieces of the parameter and
  gradient, with the same hyper-parameters;
* all-gathers the updated pieces (`all_gather` nodes, `bucket_size` parameters per node, run on
  the host like the gradient all-reduce) into the full parameter every rank keeps.

Every element is updated by exactly the same arithmetic as without sharding, so the parameters
equal plain data parallel bit for bit. Optimizer-state bytes per rank: the whole over N plus at
most one element per sharded parameter, plus the parameters left whole (below shard_min_size).
"""
from __future__ import annotations

from dataclasses import dataclass

from flowgen import functional as F
from flowgen.distributed import collectives  # noqa: F401  (registers the all_gather op)
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


def shard_optimizer_state(graph, rank: int, world_size: int, shard_min_size: int, device, bucket_size: int = 10):
    """Returns (graph, {slot state name: Shard}) — see the module docstring."""
    state = graph.state_by_name()
    updates = dict(graph.updates)
    producers = graph.producers()
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph))
    tracer.scopes.append(SCOPE)
    new_state, shards, pieces = {}, {}, []
    with tracer:
        for var in graph.state:
            update = producers.get(updates.get(var.name))
            numel = var.value.numel
            if (var.kind != "param" or update is None or not update.scope.startswith("optim")
                    or numel < max(shard_min_size, world_size)):
                continue
            shape, sizes = tuple(var.value.shape), tuple(split_sizes(numel, world_size))
            start, size = sum(sizes[:rank]), sizes[rank]
            slots = [n for n in updates if n.startswith(f"{var.name}.") and state[n].kind == "optim"]
            piece_of = {}
            for name in slots:
                new_state[name] = StateVar(name, Value(name, (size,), state[name].value.dtype), "optim")
                piece_of[state[name].value] = new_state[name].value
                shards[name] = Shard(var.name, shape, start, size, sizes)
            chain = _update_chain(graph, [updates[var.name]] + [updates[n] for n in slots], shape)
            made_here = {v for node in chain for v in node.outputs}
            for node in chain:
                if not isinstance(get_op(node.op).lowering, Elementwise):
                    raise NotImplementedError(f"enable_zero(stage=1): the update of {var.name} uses {node.op}, "
                                              f"which is not element-wise, so it cannot run on a shard")
                for v in node.inputs:
                    if v in made_here or v in piece_of or v.numel == 1:
                        continue
                    if tuple(v.shape) != shape:
                        raise NotImplementedError(f"enable_zero(stage=1): the update of {var.name} reads a "
                                                  f"{v.type_str} value, neither a scalar nor parameter-shaped")
                    piece_of[v] = F.narrow(F.reshape(tracer.lazy(v), (numel,)), 0, start, size)._value
                node_on_piece = tracer.emit(node.op, [piece_of.get(v, v) for v in node.inputs], node.attrs)
                piece_of.update(zip(node.outputs, node_on_piece.outputs))
            for name in slots:
                updates[name] = piece_of[updates[name]]
            pieces.append((var, sizes, piece_of[updates[var.name]]))
        for first in range(0, len(pieces), bucket_size):
            bucket = pieces[first:first + bucket_size]
            node = tracer.emit("all_gather", [piece for _, _, piece in bucket],
                               {"sizes": tuple(sizes for _, sizes, _ in bucket), "world_size": world_size})
            for (var, _, _), whole in zip(bucket, node.outputs):
                updates[var.name] = F.reshape(tracer.lazy(whole), tuple(var.value.shape))._value
    out.state = [new_state.get(s.name, s) for s in out.state]
    out.updates = [(name, updates[name]) for name, _ in graph.updates]
    return dce(out), shards
