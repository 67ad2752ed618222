"""Pipeline parallelism: `set_stage(stage_id, placement)` on the modules of an nn.Graph.

Every rank traces the whole step (all micro-batches of `set_gradient_accumulation_steps(n)`,
their backward passes and the optimizer update) and keeps the part of its own stage:

* **Stages of nodes.** A node traced inside a staged module (the longest staged module path
  that prefixes its scope) runs on that stage; a backward node on the stage of the module it
  differentiates (scope `<module path>.backward`). Other nodes follow their operands: a forward
  node the latest stage among them, a backward node the earliest, an optimizer-update node the
  one stage of its gradient. A node that reads no staged value (a constant, a slice of an input,
  a learning rate) belongs to no stage and is kept on every rank (dead-code elimination drops it
  where nothing reads it).
* **Transfers.** A value made on stage a and read on stage b gets a `send` on a's rank right
  after it is made and a `recv` on b's rank right before its first reader (ops in
  distributed/collectives.py: the activation goes forward, its gradient backward). Each
  transfer has its own MPI tag, the same on every rank because every rank traced the same step.
* **Schedule: 1F1B.** The micro-batches' forward (F) and backward (B) node groups are ordered
  per stage as one-forward-one-backward: stage s of S runs min(S - 1 - s, n) forwards first,
  then alternates F and B, then the remaining backwards; then the optimizer update of its own
  parameters (after the last micro-batch). Sends never block, gradients flow to earlier stages
  only, and the passes keep every rank's sends and recvs in this order (checked), so the ranks
  never wait on each other in a cycle.
* **Outputs** (the per-micro-batch losses, stacked) are computed on the stage that makes them
  and sent to every other rank: every rank returns the same values. With global inputs they are
  global tensors on the placement of the stage that made them (OneFlow returns the loss on the last
  stage's placement).
* **Parameters and optimizer slots** live on the rank of their stage; there the graph updates
  them. Local ones (every rank holds a copy): after each step every rank takes every stage's new
  values from the stage's rank (one broadcast per stage), so eager code (`graph.state_dict()`,
  `p.numpy()`) and other graphs read the trained values on any rank, at the cost of sending the
  parameters and slots once per step. OneFlow's way, modules placed on their stage's rank
  (`module.to_global(placement=P0, sbp=B)`): the parameters and their slots are global tensors on
  that rank only, nothing is sent after a step, and reading one elsewhere (`numpy()`) fetches it.
* **Global inputs** (OneFlow's tutorial: `x.to_global(P0, B)`, `y.to_global(P1, B)`): an input
  placed on one stage's rank is held there (the other ranks pass zeros in its place). Like a local
  input it is no stage's value: the nodes reading it follow their other operands (a micro-batch's
  slice of it runs on every rank that needs it), and the holder sends it, at the start of the
  step, to each other stage whose nodes read it (`_placed_input_readers`), so no rank reads the
  zeros. An input on every rank is read where it is needed.

Refused, naming the module and stage: stages without a placement or on several ranks (data
parallelism inside a stage), two stages on one rank, ranks without a stage, pipelines with
data-parallel inputs, a staged module's parameter on another placement than its stage's, an input
on several ranks but not all, a value flowing from a later stage back to an earlier one in the forward
pass or a backward value to a later stage, a parameter without a stage or read on two stages, an
update mixing stages (gradient clipping by a global norm, a dynamic GradScaler), random ops
(their Philox offsets would differ per rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowgen import dtype as dt
from flowgen.distributed import env
from flowgen.distributed.collectives import world
from flowgen.distributed.global_tensor import covers_world
from flowgen.ir.graph import NameGen, Node, Value
from flowgen.passes.autodiff import next_value_index
from flowgen.passes.simplify import impure

MAX_TAG = 32767   # the largest tag MPI guarantees


@dataclass(frozen=True)
class Pipeline:
    stage_of_path: dict     # staged module path -> stage id
    ranks: tuple            # stage id -> its rank
    stage: int              # this rank's stage
    placements: tuple       # stage id -> its placement (set_stage's)
    input_stages: tuple     # per graph input: the stage whose rank holds it, or None (every rank)

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def stage_of_scope(self, scope: str):
        """The stage of the innermost staged module on `scope`, or None."""
        best = None
        for path, stage in self.stage_of_path.items():
            if (scope == path or scope.startswith(path + ".")) and (best is None or len(path) > len(best[0])):
                best = (path, stage)
        return None if best is None else best[1]


def pipeline_of(graph, data_parallel, input_placements=()):
    """The graph's Pipeline on this rank, or None (no set_stage, or a process started alone).
    `input_placements`: each input's placement, None for a local one."""
    staged = {path: m for path, m in graph._module_configs.items() if m.stage_id is not None}
    world_size = env.get_world_size()
    if not staged or world_size == 1:
        return None
    first = next(iter(staged))
    if data_parallel is not None:
        raise NotImplementedError(f"{graph.name}: set_stage on {first} (stage {staged[first].stage_id}) in a "
                                  f"data-parallel graph (inputs split by flow.sbp.split(0) or a "
                                  f"DistributedDataParallel module): flowgen pipelines do not combine with data "
                                  f"parallelism yet; pass local tensors, every stage on one rank")
    rank_of = {}
    for path, m in staged.items():
        ranks = None if m.stage_placement is None else list(m.stage_placement.ranks)
        if ranks is None or len(ranks) != 1:
            raise NotImplementedError(f"{graph.name}: set_stage on {path} (stage {m.stage_id}) with placement "
                                      f"{m.stage_placement!r}: flowgen runs each pipeline stage on exactly one rank "
                                      f"(no data parallelism inside a stage); give flow.placement(type, ranks=[r])")
        if rank_of.setdefault(m.stage_id, ranks[0]) != ranks[0]:
            raise ValueError(f"{graph.name}: set_stage on {path}: stage {m.stage_id} is on rank {rank_of[m.stage_id]} "
                             f"for another module but on rank {ranks[0]} here")
    stages = sorted(rank_of)
    if stages != list(range(len(stages))):
        raise ValueError(f"{graph.name}: set_stage ids must be 0, 1, ..., got {stages}")
    ranks = tuple(rank_of[s] for s in stages)
    if len(set(ranks)) != len(ranks) or len(ranks) != world_size:
        raise NotImplementedError(f"{graph.name}: set_stage gives stages {stages} the ranks {list(ranks)} in a world "
                                  f"of {world_size}: flowgen runs one stage per rank, every rank one stage")
    placements = tuple(next(m.stage_placement for m in staged.values() if m.stage_id == s) for s in stages)
    _check_placed_state(graph, staged)
    return Pipeline({path: m.stage_id for path, m in staged.items()}, ranks, ranks.index(env.get_rank()),
                    placements, _input_stages(graph.name, input_placements, ranks))


def _check_placed_state(graph, staged: dict):
    """A staged module's global parameters and buffers sit on its stage's placement (OneFlow's
    `module.to_global(placement=P, sbp=B)` with `set_stage(s, P)`) or on every rank (a replica)."""
    modules = {path: module for name, top in graph._modules.items() for path, module in top.named_modules(prefix=name)}
    for path, options in staged.items():
        tensors = [*modules[path].named_parameters(prefix=path), *modules[path].named_buffers(prefix=path)]
        for name, t in tensors:
            if t is None or not t.is_global:
                continue
            on_its_stage = t.placement == options.stage_placement or covers_world(t.placement)
            if t.sbp[0].kind != "broadcast" or not on_its_stage:
                raise NotImplementedError(f"{graph.name}: {name} is on {t.placement!r} with sbp {t.sbp[0]!r} but "
                                          f"set_stage puts {path} (stage {options.stage_id}) on "
                                          f"{options.stage_placement!r}; place the module as its stage: module."
                                          f"to_global(placement=<the stage's placement>, sbp=flow.sbp.broadcast)")


def _input_stages(graph_name, input_placements, ranks: tuple) -> tuple:
    """Per input: the stage whose rank alone holds it, or None (a local input, or one on every rank)."""
    out = []
    for k, p in enumerate(input_placements):
        if p is None or covers_world(p):
            out.append(None)
        elif len(p.ranks) == 1:
            out.append(ranks.index(p.ranks[0]))
        else:
            raise NotImplementedError(f"{graph_name}: input {k} is on {p!r}; a pipelined graph takes each input on "
                                      f"one stage's rank (flow.placement(type, ranks=[r])) or on every rank")
    return tuple(out)


# ----------------------------------------------------------------- stages
def _is_backward(node) -> bool:
    return node.scope == "backward" or node.scope.endswith(".backward")


def _phases(ir, micro_ends: list) -> list:
    """Per node: ("F" | "B", micro-batch) or ("U", None) for what follows the last micro-batch."""
    out, start = [], 0
    for j, end in enumerate(micro_ends):
        first_backward = next((i for i in range(start, end) if _is_backward(ir.nodes[i])), end)
        out += [("F", j) if i < first_backward else ("B", j) for i in range(start, end)]
        start = end
    return out + [("U", None)] * (len(ir.nodes) - start)


def _state_stages(graph_name, ir, pipeline) -> dict:
    """State Value -> its stage: that of the staged module owning the parameter or buffer, or
    the parameter of an optimizer slot (named after it). Other state (hyper-parameters, a free
    eager tensor build() reads) is on every rank."""
    out = {}
    for s in ir.state:
        stage = pipeline.stage_of_scope(s.name) if s.kind in ("param", "buffer", "optim") else None
        if stage is None and s.kind == "param":
            raise NotImplementedError(f"{graph_name}: parameter {s.name} belongs to no module with set_stage; "
                                      f"every parameter of a pipelined graph needs a stage (call set_stage on its "
                                      f"module or a parent)")
        if stage is not None:
            out[s.value] = stage
    return out


def _node_stages(graph_name, ir, pipeline, phases) -> dict:
    """Value -> stage (None: made on every rank) for every value of the IR."""
    home = _state_stages(graph_name, ir, pipeline)
    state_names = {s.value: s.name for s in ir.state}
    for node, (phase, _j) in zip(ir.nodes, phases):
        if impure(node.op):
            raise NotImplementedError(f"{graph_name}: {node.op} in {node.scope or 'build()'} in a pipelined graph: "
                                      f"random ops would draw other numbers than on one device; remove dropout "
                                      f"and random ops or set_stage")
        operands = {home[v] for v in node.inputs if home.get(v) is not None}
        own = pipeline.stage_of_scope(node.scope[:-len(".backward")] if node.scope.endswith(".backward")
                                      else node.scope)
        if phase == "F" and own is not None and operands and max(operands) > own:
            raise NotImplementedError(f"{graph_name}: {node.scope} (stage {own}) reads a value computed on stage "
                                      f"{max(operands)} in the forward pass; stages must follow the data flow")
        if phase == "U" and own is None and len(operands) > 1:
            raise NotImplementedError(f"{graph_name}: {node.op} in {node.scope} combines values of stages "
                                      f"{sorted(operands)} after the micro-batches (gradient clipping by a global "
                                      f"norm, a dynamic GradScaler): not supported in a pipelined graph")
        stage = own if own is not None else (
            None if not operands else min(operands) if phase == "B" else max(operands))
        for v in node.inputs:
            if v in state_names and home.get(v) is not None and home[v] != stage:
                raise NotImplementedError(f"{graph_name}: {state_names[v]} (stage {home[v]}) is read on stage {stage} "
                                          f"by {node.op} in {node.scope or 'build()'}; a parameter is used by one "
                                          f"stage only")
        for v in node.outputs:
            home[v] = stage
    return home


def _order(stage: int, num_stages: int, steps: int) -> list:
    """The 1F1B order of (phase, micro-batch) groups on `stage`, then the update."""
    warmup = min(num_stages - 1 - stage, steps)
    order = [("F", j) for j in range(warmup)]
    for j in range(steps - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", j) for j in range(steps - warmup, steps)] + [("U", None)]


# ---------------------------------------------------------------- the split
@dataclass
class StageProgram:
    """What one rank runs of a pipelined step: the IR of its stage (with send/recv nodes) and the
    state the stages update (every rank takes it from its stage's rank after a step)."""
    ir: object
    num_user_outputs: int       # the IR's outputs after these are send tokens (kept alive)
    foreign: dict               # state name -> rank that updates it
    owned: list                 # names of state this rank updates
    stage: int                  # this rank's stage
    output_stages: tuple        # per user output: the stage that makes it (None: every rank)
    shared: dict = None         # name -> (state Value here or None, eager Tensor) of foreign + owned state

    def user_structure(self, structure):
        """The build() output structure over the user outputs (the send tokens are left out)."""
        return lambda tensors: structure(tensors[:self.num_user_outputs])

    def check_transfer_order(self, ir):
        """The passes kept this rank's sends and recvs in the planned order (the other ranks rely
        on it: a recv moved before a send could wait forever); raises otherwise."""
        def transfers(graph):
            return [(n.op, n.attrs["tag"]) for n in graph.nodes if n.op in ("send", "recv")]

        if transfers(ir) != transfers(self.ir):
            raise RuntimeError(f"{ir.name}: the passes reordered the pipeline's sends and recvs on this rank; "
                               f"ranks would wait on each other (a bug: please report it)")

    def keep_bindings(self, full_ir, bindings: list, host_scalars: list, placed=frozenset()) -> tuple:
        """(bindings, host scalars) of the state this rank's IR keeps; remembers the tensors of
        the state the stages update, which `after_step` shares between the ranks, except the
        `placed` state (global tensors on their stage's rank alone, which no other rank holds)."""
        self.foreign = {n: r for n, r in self.foreign.items() if n not in placed}
        self.owned = [n for n in self.owned if n not in placed]
        kept = {s.value for s in self.ir.state}
        name = {s.value: s.name for s in full_ir.state}
        absent = [name[v] for v, t in bindings if v in kept and t is None]
        if absent:
            raise NotImplementedError(f"{full_ir.name}: stage {self.stage} reads {absent[0]}, which is placed on "
                                      f"another rank; a stage reads the parameters and buffers of its own modules")
        self.shared = {name[v]: (v if v in kept else None, t) for v, t in bindings
                       if name[v] in self.foreign or name[v] in self.owned}
        return [(v, t) for v, t in bindings if v in kept], [(v, h) for v, h in host_scalars if v in kept]

    def after_step(self, compiled):
        """Sends are complete; every rank takes each stage's new parameters, buffers and optimizer
        slots from that stage's rank (one broadcast per stage), so eager code and other graphs read
        them on any rank."""
        comm = world()
        comm.wait_sends()
        owners = sorted(set(self.foreign.values()) | ({comm.rank} if self.owned else set()))
        for root in owners:
            names = sorted(n for n in self.shared if self.foreign.get(n, comm.rank) == root)
            if root == comm.rank:
                arrays = [compiled.executor.read_value(self.shared[n][0]) for n in names]
            else:
                arrays = [self.shared[n][1]._data for n in names]
            for name, array in zip(names, _broadcast_arrays(comm, arrays, root)):
                tensor = self.shared[name][1]
                tensor._sync_from_device = None
                tensor._data[...] = array.reshape(tensor._data.shape)
                if root != comm.rank:
                    tensor._version += 1    # another graph holding it on this rank uploads it again


def _broadcast_arrays(comm, arrays: list, root: int) -> list:
    """`arrays` of rank `root` on every rank, in one MPI call (packed as bytes)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    packed = comm.broadcast(np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays] or
                                           [np.zeros(0, np.uint8)]), root=root)
    out, offset = [], 0
    for a in arrays:
        out.append(packed[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape))
        offset += a.nbytes
    return out


def split_stage(graph_name, ir, pipeline, micro_ends: list) -> StageProgram:
    """This rank's part of the traced step `ir` (nodes of micro-batch j end before
    `micro_ends[j]`; the optimizer update follows), with send/recv at the stage boundaries."""
    phases = _phases(ir, micro_ends)
    home = _node_stages(graph_name, ir, pipeline, phases)
    readers = _readers(ir, home, pipeline.num_stages)
    holders = {v: stage for v, stage in zip(ir.inputs, pipeline.input_stages) if stage is not None}
    readers.update(_placed_input_readers(ir, home, holders, pipeline.num_stages))
    source = {**home, **holders}    # the stage that sends a value: its own, or the one holding a placed input
    sends = _transfers(graph_name, ir, source, readers, phases)
    nodes, tokens, outputs = _stage_nodes(ir, home, source, phases, sends, pipeline, len(micro_ends))
    _check_order(graph_name, ir, nodes)
    updates, foreign, owned = _stage_updates(graph_name, ir, home, readers, pipeline)
    used = {v for n in nodes for v in n.inputs} | {v for _, v in updates}
    kept = [s for s in ir.state if s.value in used or s.name in dict(updates)]
    out = ir.copy_with(nodes=nodes, state=kept, updates=updates, outputs=outputs + tokens)
    return StageProgram(out, len(ir.outputs), foreign, owned, pipeline.stage, tuple(home.get(v) for v in ir.outputs))


def _readers(ir, home: dict, num_stages: int) -> dict:
    """Value -> the stages of the nodes reading it (None: a node on every rank); every stage
    reads the outputs."""
    readers: dict = {}
    for node in ir.nodes:
        for v in node.inputs:
            readers.setdefault(v, set()).add(home.get(node.outputs[0]))
    for v in ir.outputs:
        readers.setdefault(v, set()).update(range(num_stages))
    return readers


def _placed_input_readers(ir, home: dict, holders: dict, num_stages: int) -> dict:
    """Placed input -> the stages that read it. An input is no stage's value (the nodes reading it
    follow their other operands, or run on every rank), so a stage reads it when one of its nodes
    does, or a node on every rank that its own nodes (or the outputs, or the updates) need."""
    producer = {v: n for n in ir.nodes for v in n.outputs}
    everywhere_roots = [v for v in [*ir.outputs, *(v for _, v in ir.updates)] if v in producer and home.get(v) is None]
    out = {v: set(range(num_stages)) if v in ir.outputs else set() for v in holders}
    for stage in range(num_stages):
        live, todo = set(), [n for n in ir.nodes if home.get(n.outputs[0]) == stage]
        todo += [producer[v] for v in everywhere_roots]
        while todo:
            node = todo.pop()
            if id(node) in live:
                continue
            live.add(id(node))
            for v in node.inputs:
                if v in out:
                    out[v].add(stage)
                elif v in producer and home.get(v) is None:
                    todo.append(producer[v])
    return out


def _transfers(graph_name, ir, home: dict, readers: dict, phases: list) -> dict:
    """Value -> [(reading stage, MPI tag)] for each value read on another stage than its own.
    The tags number the transfers in trace order: the same on every rank. Gradients flow to
    earlier stages only (the 1F1B order relies on it)."""
    order = {v: k - len(ir.inputs) for k, v in enumerate(ir.inputs)}   # inputs first: sent at the start
    order.update((v, i) for i, n in enumerate(ir.nodes) for v in n.outputs)
    pairs = sorted(((v, b) for v, stages in readers.items() if home.get(v) is not None and v in order
                    for b in stages if b not in (None, home[v])), key=lambda t: (order[t[0]], t[1]))
    for v, b in pairs:
        if order[v] >= 0 and phases[order[v]][0] == "B" and b > home[v] and v not in ir.outputs:
            node = ir.nodes[order[v]]
            raise NotImplementedError(f"{graph_name}: {node.op} in {node.scope} (backward, stage {home[v]}) makes a "
                                      f"value that stage {b} reads: in a pipelined graph gradients flow to earlier "
                                      f"stages only; move the op that {node.scope or 'build()'} differentiates into "
                                      f"a staged module")
    if len(pairs) > MAX_TAG:
        raise NotImplementedError(f"{graph_name}: {len(pairs)} transfers between pipeline stages exceed MPI's "
                                  f"{MAX_TAG} tags")
    sends: dict = {}
    for tag, (v, b) in enumerate(pairs):
        sends.setdefault(v, []).append((b, tag))
    return sends


def _stage_nodes(ir, home: dict, source: dict, phases: list, sends: dict, pipeline, steps: int) -> tuple:
    """(this stage's nodes in 1F1B order with send/recv nodes, the sends' tokens, the outputs).
    `source`: the stage sending each value (`home`, and the holders of placed inputs, sent first;
    where one arrives, its readers read the recv's value instead of the input)."""
    me, ranks = pipeline.stage, pipeline.ranks
    names = NameGen(start=next_value_index(ir))
    inputs = set(ir.inputs)
    groups: dict = {}
    for node, phase in zip(ir.nodes, phases):
        groups.setdefault(phase, []).append(node)
    nodes, tokens, received = [], [], set()
    arrived = {}    # a placed input -> the value its recv makes here (the input itself holds zeros)

    def receive(v):
        # (a placed input read by a node on every rank that this stage does not need, which DCE
        # drops, is not sent here: `_placed_input_readers`)
        if v not in received and source.get(v) not in (None, me) and me in dict(sends.get(v, ())):
            tag = dict(sends[v])[me]
            attrs = {"shape": tuple(v.shape), "dtype": v.dtype, "source": ranks[source[v]], "tag": tag}
            made = v if v not in inputs else arrived.setdefault(v, Value(names(), tuple(v.shape), v.dtype))
            nodes.append(Node("recv", [], [made], attrs, f"pipeline.recv_from_stage{source[v]}", ""))
            received.add(v)

    def send(v, scope):
        for b, tag in sends.get(v, ()):
            tokens.append(Value(names(), (), dt.float32))
            nodes.append(Node("send", [v], [tokens[-1]], {"dest": ranks[b], "tag": tag},
                              f"{scope or 'outputs'}.send_to_stage{b}", ""))

    for v in ir.inputs:     # an input placed on this stage's rank, read on other stages
        if v not in home and source.get(v) == me:
            send(v, "inputs")
    for phase in _order(me, pipeline.num_stages, steps):
        for node in groups.get(phase, []):
            stage = home.get(node.outputs[0])
            if stage not in (None, me):
                continue
            for v in node.inputs:
                receive(v)
            if any(v in arrived for v in node.inputs):
                node = Node(node.op, [arrived.get(v, v) for v in node.inputs], node.outputs, node.attrs, node.scope,
                            node.loc)
            nodes.append(node)
            if stage == me:
                for v in node.outputs:
                    send(v, node.scope)
    for v in ir.outputs:
        receive(v)
    return nodes, tokens, [arrived.get(v, v) for v in ir.outputs]


def _stage_updates(graph_name, ir, home: dict, readers: dict, pipeline) -> tuple:
    """(the state updates this rank makes, {state name: rank updating it} of the other stages',
    names of the state this stage updates)."""
    me, ranks = pipeline.stage, pipeline.ranks
    state = {s.name: s.value for s in ir.state}
    updates, foreign, owned = [], {}, []
    for name, v in ir.updates:
        stage = home.get(v)
        if home.get(state[name]) is None and stage is not None and readers.get(state[name], set()) - {stage}:
            raise NotImplementedError(f"{graph_name}: {name} belongs to no stage but stage {stage} updates it "
                                      f"while other stages read it too; give its module a stage")
        if stage in (None, me):
            updates.append((name, v))
        if stage == me:
            owned.append(name)
        elif stage is not None:
            foreign[name] = ranks[stage]
    return updates, foreign, owned


def _check_order(graph_name, ir, nodes):
    """Every value is made before it is read (the 1F1B order moved whole micro-batch groups)."""
    made = set(ir.inputs) | {s.value for s in ir.state}
    for node in nodes:
        missing = [v for v in node.inputs if v not in made]
        if missing:
            raise NotImplementedError(f"{graph_name}: {node.op} in {node.scope or 'build()'} reads {missing[0]!r}, "
                                      f"which the pipeline schedule computes later (a value shared between "
                                      f"micro-batches?); not supported in a pipelined graph")
        made.update(node.outputs)
