"""ZeRO (`graph.config.enable_zero(True, stage=1|2|3)`): optimizer state (and, stage 3, parameters)
sharded over the ranks.

Runs after optimizer lowering in a data-parallel graph. For each parameter of at least
`shard_min_size` elements (and one per rank: `shards_parameter`), the flattened parameter is cut
into one piece per rank (as even as possible, `split_sizes`); this rank

* keeps only its piece of every optimizer slot (momentum, exp_avg, exp_avg_sq): the slot state
  variables become 1-d shards;
* gets its piece of the gradient: stage 1 cuts it from the all-reduced gradient
  (passes/gradient_allreduce.py reduced every gradient); stages 2 and 3 reduce-scatter the rank's
  own gradients instead (`reduce_scatter` nodes, `bucket_size` parameters each), so no rank holds a
  reduced full gradient and half the all-reduce traffic is saved;
* re-emits the element-wise update chain (scope "optim...") on its pieces of the parameter and
  gradient, with the same hyper-parameters;
* stages 1 and 2: all-gathers the updated pieces (`all_gather` nodes, `bucket_size` parameters per
  node) into the full parameter every rank keeps as state.

Stage 3 keeps only the piece of the parameter as state too (the parameter's state variable
becomes 1-d) and nothing is gathered after the update (the next step gathers the new pieces).
Instead each module's sharded parameters are all-gathered just in time (`_gather_just_in_time`):
one `all_gather` node right before the module's first forward node that reads them, and a second
one right before its first backward node that reads them (only the parameters the backward reads:
a weight for the input gradient, not a bias), each copy read by its own phase only. A copy is an
ordinary temporary of the memory plan, alive from its gather to the last reader of its phase, then
its arena bytes are reused; no full parameter is state. Traffic: a forward and a backward
all-gather per step, against stage 2's one all-gather after the update.

Collectives run on the host like the gradient all-reduce. Each element is updated by the same
arithmetic as without sharding: stage 1 equals plain data parallel bit for bit, stages 2 and 3 up
to the order MPI sums the ranks in (stage 3 equals stage 2 bit for bit: same reduce-scatters, same
values gathered). Optimizer-state bytes per rank (and parameter bytes at stage 3): the whole over N
plus at most one element per sharded parameter, plus the parameters left whole.

Gradient clipping inside build() (`nn.utils.clip_grad_norm_` after `loss.backward()`): stage 1 clips
the all-reduced gradients as plain data parallel does. Stages 2 and 3 reduce-scatter the sharded
parameters' gradients right there (`reduce_scatter_traced_gradients`) and clip the pieces: the
global norm is the sum over the ranks (one all_reduce of a scalar) of the pieces' powered sums,
plus those of the gradients kept whole (all-reduced); no rank holds a full reduced gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

from flowgen import functional as F
from flowgen.distributed import collectives  # noqa: F401  (registers the all_gather/reduce_scatter ops)
from flowgen.distributed.global_tensor import split_sizes
from flowgen.ir.graph import NameGen, Node, StateVar, Value
from flowgen.ir.trace import Tracer
from flowgen.ops.lowering import Elementwise
from flowgen.ops.registry import apply, get_op
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


@dataclass(eq=False)
class _Sharded:
    var: object          # the parameter's StateVar
    sizes: tuple
    start: int
    slots: list          # slot state names
    chain: list          # the update nodes
    piece_of: dict       # full-shaped Value -> this rank's piece
    readers: tuple = ()  # stage 3: indices of the nodes reading the full parameter (or, backward, made values)


def regathered(piece, sizes: tuple, shape: tuple):
    """The full reduced gradient rebuilt from the ranks' pieces (an all_gather, reshaped): what
    build() sees of a gradient reduce-scattered in it; `shard_optimizer_state` gives the update the
    piece instead, so the all_gather dies unless build() itself reads the full value."""
    return F.reshape(apply("all_gather", piece, sizes=(tuple(sizes),), world_size=len(sizes)), shape)


def reduce_scatter_traced_gradients(tracer, grads: dict, rank: int, world_size: int, shard_min_size: int,
                                    bucket_size: int, op: str) -> dict:
    """Stages 2 and 3 when build() reads the step's gradients (`nn.utils.clip_grad_norm_`): the
    gradients of the parameters ZeRO shards are reduce-scattered at that point of the trace
    (`bucket_size` per node), each piece recorded in `tracer.gradient_pieces` (nn/utils.py clips
    the pieces: the global norm sums the pieces' powered sums over the ranks with one all_reduce of
    a scalar). Returns {name: the full gradient `regathered`} for those parameters."""
    names = [n for n, g in grads.items() if shards_parameter(g.numel, world_size, shard_min_size)]
    tracer.scopes.append(SCOPE)
    full = {}
    for first in range(0, len(names), bucket_size):
        bucket = names[first:first + bucket_size]
        sizes = tuple(tuple(split_sizes(grads[n].numel, world_size)) for n in bucket)
        node = tracer.emit("reduce_scatter", [grads[n] for n in bucket],
                           {"sizes": sizes, "op": op, "rank": rank, "world_size": world_size})
        for name, piece, piece_sizes in zip(bucket, node.outputs, sizes):
            tracer.gradient_pieces[name] = (piece, piece_sizes)
            full[name] = regathered(tracer.lazy(piece), piece_sizes, tuple(grads[name].shape))._value
    tracer.scopes.pop()
    return full


def shard_optimizer_state(graph, rank: int, world_size: int, shard_min_size: int, device, bucket_size: int = 10,
                          stage: int = 1, op: str = "mean", pieces: dict | None = None):
    """Returns (graph, {state name: Shard}) for the sharded slots (and, stage 3, parameters) — see
    the module docstring. Stages 2 and 3 expect the gradients of sharded parameters not yet
    reduced (`op` says how to combine them), except those in `pieces` ({full-shaped gradient
    value: this rank's piece}, reduced in build() by `reduce_scatter_traced_gradients`)."""
    pieces = pieces or {}
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
        if stage == 3:      # the parameter itself is kept as this rank's piece
            new_state[var.name] = StateVar(var.name, Value(var.name, (size,), var.value.dtype), "param")
            piece_of[var.value] = new_state[var.name].value
            shards[var.name] = Shard(var.name, tuple(var.value.shape), start, size, sizes)
        chain = _update_chain(graph, [updates[var.name]] + [updates[n] for n in slots], tuple(var.value.shape))
        sharded.append(_Sharded(var, sizes, start, slots, chain, piece_of))
    with tracer:
        gradients = []     # stages 2 and 3: (item, full-shaped gradient value) to reduce-scatter
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
                    if stage >= 2 and v in pieces:      # reduce-scattered in build()
                        item.piece_of[v] = pieces[v]
                    elif stage >= 2 and v is not item.var.value:
                        readers = [n.op for n in graph.nodes if v in n.inputs and n not in item.chain]
                        if readers:
                            raise NotImplementedError(
                                f"enable_zero(stage={stage}): the gradient of {item.var.name} is also read by "
                                f"{readers[0]} (a parameter group's clip_grad_max_norm?), which needs the whole "
                                f"reduced gradient; use stage=1, or clip inside build() with "
                                f"nn.utils.clip_grad_norm_ after loss.backward()")
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
        if stage == 3:      # the updated piece is the new state; the next step gathers it again
            for item in sharded:
                updates[item.var.name] = item.piece_of[updates[item.var.name]]
            _gather_just_in_time(out, tracer, sharded, world_size)
        else:
            _gather_updated_parameters(tracer, sharded, updates, world_size, bucket_size)
    out.state = [new_state.get(s.name, s) for s in out.state]
    out.updates = [(name, updates[name]) for name, _ in graph.updates]
    return dce(out), shards


def _gather_updated_parameters(tracer, sharded: list, updates: dict, world_size: int, bucket_size: int):
    """Stages 1 and 2: the updated pieces all-gathered into the full parameters every rank keeps."""
    for first in range(0, len(sharded), bucket_size):
        bucket = sharded[first:first + bucket_size]
        node = tracer.emit("all_gather", [item.piece_of[updates[item.var.name]] for item in bucket],
                           {"sizes": tuple(item.sizes for item in bucket), "world_size": world_size})
        for item, whole in zip(bucket, node.outputs):
            updates[item.var.name] = F.reshape(tracer.lazy(whole), tuple(item.var.value.shape))._value


def _phase(node) -> str:
    """"backward" for the nodes autodiff made (passes/autodiff.py scopes them "<module>.backward"),
    else "forward"."""
    return "backward" if node.scope == "backward" or node.scope.endswith(".backward") else "forward"


def _derived_in_forward(nodes: list, full: dict, dead: set) -> dict:
    """Forward values computed from one sharded parameter alone (its transpose, its cast under AMP):
    {Value: (the parameter's full Value, indices of the nodes computing it from the parameter)}.
    The parameters themselves are in it with no nodes."""
    derived = {v: (v, ()) for v in full}
    for i, node in enumerate(nodes):
        if (id(node) in dead or _phase(node) != "forward" or not node.inputs or get_op(node.op).extra.get("random")
                or any(v not in derived for v in node.inputs)):
            continue
        sources = {derived[v][0] for v in node.inputs}
        if len(sources) == 1:       # made from one parameter (and nothing else): cheap to make again
            (param,) = sources
            steps = tuple(sorted({k for v in node.inputs for k in derived[v][1]} | {i}))
            derived.update((v, (param, steps)) for v in node.outputs)
    return derived


def _reading_runs(nodes: list, group: list) -> list:
    """The readers of the group's parameters, in node order, cut where the phase changes:
    [[(node index, _Sharded)]]. Index len(nodes) stands for the graph's outputs (a run of its own)."""
    reads = sorted({(i, k) for k, item in enumerate(group) for i in item.readers})
    runs, phase = [], None
    for i, k in reads:
        now = _phase(nodes[i]) if i < len(nodes) else "output"
        if now != phase:
            runs.append([])
            phase = now
        runs[-1].append((i, group[k]))
    return runs


def _gather_just_in_time(out, tracer, sharded: list, world_size: int):
    """Stage 3: every reader of a sharded parameter's full value reads a gathered copy instead.

    The parameters are grouped by the module (scope) of their first reader. A group is gathered
    again for each run of its readers in one phase (`_reading_runs`: its forward, its backward;
    each micro-batch's under gradient accumulation): one `all_gather` (+ reshapes) right before
    the run's first reader, read by that run only, so the copy lives from the first to the last
    reader of the run. A backward node reading a forward value made from the parameter alone (the
    transpose a Linear multiplies by) reads it re-made from the backward copy, so the forward
    copy is not kept alive through it. The `nth` attribute numbers a group's gathers, so CSE keeps
    them apart."""
    dead = {id(node) for item in sharded for node in item.chain}    # re-emitted on the pieces
    full = {item.var.value: item for item in sharded}
    derived = _derived_in_forward(out.nodes, full, dead)
    needs: dict = {}        # (reader index, _Sharded) -> the values of that parameter the reader reads
    for i, node in enumerate(out.nodes):
        for v in node.inputs:
            if v in derived and id(node) not in dead and (v in full or _phase(node) == "backward"):
                needs.setdefault((i, full[derived[v][0]]), []).append(v)
    for v in out.outputs:
        if v in full:
            needs.setdefault((len(out.nodes), full[v]), []).append(v)
    groups: dict = {}       # scope of the first reader -> [_Sharded]
    for item in sharded:
        item.readers = tuple(sorted(i for i, reader_of in needs if reader_of is item))
        if item.readers:
            first = item.readers[0]
            groups.setdefault(out.nodes[first].scope if first < len(out.nodes) else "", []).append(item)
    copy_for: dict = {}     # (Value, reader index) -> the value made from a gathered copy that reader reads
    inserted: dict = {}     # reader index -> the nodes that go right before it
    for group in groups.values():
        for nth, run in enumerate(_reading_runs(out.nodes, group)):
            items = list(dict.fromkeys(item for _, item in run))
            emitted_from = len(out.nodes)
            node = tracer.emit("all_gather", [item.piece_of[item.var.value] for item in items],
                               {"sizes": tuple(item.sizes for item in items), "world_size": world_size, "nth": nth})
            made = {item.var.value: F.reshape(tracer.lazy(whole), tuple(item.var.value.shape))._value
                    for item, whole in zip(items, node.outputs)}
            for i, item in run:
                for v in needs[(i, item)]:
                    copy_for[(v, i)] = _remade(out.nodes, derived[v][1], v, made, tracer)
            inserted.setdefault(run[0][0], []).extend(out.nodes[emitted_from:])
            del out.nodes[emitted_from:]
    nodes = []
    for i, node in enumerate(out.nodes):
        nodes.extend(inserted.get(i, []))
        if any((v, i) in copy_for for v in node.inputs):
            node = Node(node.op, [copy_for.get((v, i), v) for v in node.inputs], node.outputs, node.attrs,
                        node.scope, node.loc)
        nodes.append(node)
    out.nodes = nodes + inserted.get(len(nodes), [])
    out.outputs = [copy_for.get((v, len(nodes)), v) for v in out.outputs]


def _remade(nodes: list, steps: tuple, value, made: dict, tracer):
    """`value` computed again by nodes[steps] from the gathered copies in `made` (which it extends)."""
    for k in steps:
        if nodes[k].outputs[0] not in made:
            again = tracer.emit(nodes[k].op, [made.get(v, v) for v in nodes[k].inputs], nodes[k].attrs)
            made.update(zip(nodes[k].outputs, again.outputs))
    return made[value]
