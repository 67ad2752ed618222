"""One rank of OneFlow's pipeline tutorial (tests/test_oneflow_pipeline.py runs it with mpiexec -n 2).

The program of https://docs.oneflow.org/en/master/parallelism/06_pipeline.html as written, on
"cpu" placements: the stage modules placed with `module.to_global(placement=P0 | P1, sbp=B)`,
the activation moved with `to_global(placement=P1, sbp=B)`, `config.set_stage(s, P)` in the graph,
gradient accumulation 2, inputs placed with `x.to_global(P0, B)` / `y.to_global(P1, B)`. Each rank
seeds its generator with its rank, so rank 0's module init and data differ from rank 1's: the
placed tensors must take the values of their placement's rank (stage 0 and x from rank 0, stage 1
and y from rank 1), which `reference` rebuilds in one process.

`python oneflow_pipeline_worker.py OUTDIR SCENARIO...` saves OUTDIR/SCENARIO_rank{R}.npz.
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

import flowgen as flow

BATCH_SIZE = 16
STEPS = 4
BROADCAST = [flow.sbp.broadcast]
P0 = P1 = None      # flow.placement("cpu", [0]) and [1], made in main(): a process started alone has rank 0 only


# ---------------------------------------------------------------- the tutorial's modules
class Stage0Module(flow.nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = flow.nn.Flatten()
        self.linear0 = flow.nn.Linear(28*28, 512)
        self.relu0 = flow.nn.ReLU()

    def forward(self, x):
        out = self.flatten(x)
        out = self.linear0(out)
        out = self.relu0(out)
        return out


class Stage1Module(flow.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = flow.nn.Linear(512, 512)
        self.relu1 = flow.nn.ReLU()
        self.linear2 = flow.nn.Linear(512, 10)
        self.relu2 = flow.nn.ReLU()

    def forward(self, x):
        out = self.linear1(x)
        out = self.relu1(out)
        out = self.linear2(out)
        out = self.relu2(out)
        return out


class PipelineModule(flow.nn.Module):
    def __init__(self, placed: bool = True):
        super().__init__()
        self.m_stage0 = Stage0Module()
        self.m_stage1 = Stage1Module()
        self.placed = placed
        if placed:
            self.m_stage0.to_global(placement=P0, sbp=BROADCAST)
            self.m_stage1.to_global(placement=P1, sbp=BROADCAST)

    def forward(self, x):
        out_stage0 = self.m_stage0(x)
        in_stage1 = out_stage0.to_global(placement=P1, sbp=BROADCAST) if self.placed else out_stage0
        out_stage1 = self.m_stage1(in_stage1)
        return out_stage1


def make_pipeline_graph(module_pipeline, sgd):
    class PipelineGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.module_pipeline = module_pipeline
            self.module_pipeline.m_stage0.config.set_stage(stage_id=0, placement=P0)
            self.module_pipeline.m_stage1.config.set_stage(stage_id=1, placement=P1)
            self.loss_fn = flow.nn.CrossEntropyLoss()
            self.config.set_gradient_accumulation_steps(2)
            self.add_optimizer(sgd)

        def build(self, x, y):
            out = self.module_pipeline(x)
            loss = self.loss_fn(out, y)
            loss.backward()
            return loss

    return PipelineGraph()


def data():
    """The tutorial's random batch, drawn from this rank's generator after the module's init."""
    x = flow.randn(BATCH_SIZE, 1, 28, 28)
    y = flow.randint(0, 10, (BATCH_SIZE,))
    return x, y


def trained(module_pipeline) -> dict:
    """Each trained parameter as every rank reads it (numpy() fetches it from its stage's rank)."""
    return {f"param.{name}": p.numpy().copy() for name, p in module_pipeline.named_parameters()}


# ---------------------------------------------------------------- scenarios
def graph(labels_on=None) -> dict:
    """The tutorial's graph; `labels_on=P0` places y on stage 0's rank (not P1), so the graph sends it."""
    module_pipeline = PipelineModule()
    sgd = flow.optim.SGD(module_pipeline.parameters(), lr=0.001)
    graph_pipeline = make_pipeline_graph(module_pipeline, sgd)
    x, y = data()
    x = x.to_global(P0, BROADCAST)
    y = y.to_global(labels_on or P1, BROADCAST)
    losses, locals_ = [], []
    for _ in range(STEPS):
        loss = graph_pipeline(x, y)
        locals_.append(loss.to_local().numpy().copy())
        losses.append(loss.numpy().copy())
    transfers = [f"{k.ops[0]}" for k in graph_pipeline.compiled.program.kernels if k.collective]
    return {"losses": np.array(losses), "local_losses": np.array(locals_), "loss_placement": repr(loss.placement),
            "transfers": np.array(transfers, dtype=str), **trained(module_pipeline)}


def graph_momentum() -> dict:
    """The tutorial's graph with SGD momentum: the slots live on their stage's rank and every rank
    reads them through graph.state_dict(); a checkpoint taken after STEPS steps and loaded back
    (parameters and slots written on their ranks) resumes bit for bit."""
    module_pipeline = PipelineModule()
    sgd = flow.optim.SGD(module_pipeline.parameters(), lr=0.001, momentum=0.9)
    graph_pipeline = make_pipeline_graph(module_pipeline, sgd)
    x, y = data()
    x, y = x.to_global(P0, BROADCAST), y.to_global(P1, BROADCAST)
    losses = [graph_pipeline(x, y).numpy().copy() for _ in range(STEPS)]
    state = graph_pipeline.state_dict()
    slots = {f"slot.{k}": v.numpy().copy() for k, v in state.items() if k.endswith("-momentum")}
    checkpoint = _copied(state)
    params = trained(module_pipeline)
    after = [graph_pipeline(x, y).numpy().copy() for _ in range(2)]
    graph_pipeline.load_state_dict(checkpoint)
    resumed = [graph_pipeline(x, y).numpy().copy() for _ in range(2)]
    return {"losses": np.array(losses), "after": np.array(after), "resumed": np.array(resumed), **params, **slots}


def _copied(state):
    """A checkpoint: every tensor of a state dict copied out as a local tensor of its whole value."""
    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    return flow.tensor(state.numpy().copy()) if isinstance(state, flow.Tensor) else state


def eager() -> dict:
    """The tutorial's module trained without a graph: each op runs on its placement's rank."""
    module_pipeline = PipelineModule()
    sgd = flow.optim.SGD(module_pipeline.parameters(), lr=0.001)
    loss_fn = flow.nn.CrossEntropyLoss()
    x, y = data()
    x, y = x.to_global(P0, BROADCAST), y.to_global(P1, BROADCAST)
    losses = []
    for _ in range(STEPS):
        step = []
        for j in range(2):      # the graph's two micro-batches, accumulated
            rows = slice(j * BATCH_SIZE // 2, (j + 1) * BATCH_SIZE // 2)
            loss = loss_fn(module_pipeline(x[rows]), y[rows])
            (loss / 2).backward()
            step.append(loss.numpy().copy())
        sgd.step()
        sgd.zero_grad()
        losses.append(step)
    return {"losses": np.array(losses), **trained(module_pipeline)}


def one_placement() -> dict:
    """A graph whose modules and inputs are all on rank 1 (no stages): rank 1 trains, rank 0 runs
    nothing and gets outputs without a component."""
    module = PipelineModule(placed=False).to_global(placement=P1, sbp=BROADCAST)
    sgd = flow.optim.SGD(module.parameters(), lr=0.001)

    class OneRankGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.module = module
            self.loss_fn = flow.nn.CrossEntropyLoss()
            self.add_optimizer(sgd)

        def build(self, x, y):
            loss = self.loss_fn(self.module(x), y)
            loss.backward()
            return loss

    one_rank = OneRankGraph()
    x, y = data()
    x, y = x.to_global(P1, BROADCAST), y.to_global(P1, BROADCAST)
    losses = [one_rank(x, y) for _ in range(STEPS)]
    saved = os.path.join(tempfile.mkdtemp(), "one_rank")    # flow.save on every rank: rank 1 writes it
    flow.save(one_rank, saved)
    return {"losses": np.array([loss.numpy() for loss in losses]), "saved": saved if os.path.exists(saved) else "",
            "local_sizes": np.array([loss.to_local().numel() for loss in losses]), **trained(module)}


def refusals() -> dict:
    """What the placements of a graph cannot be, with the message of each."""
    messages = {}

    def attempt(what, run):
        try:
            run()
            messages[what] = "no error"
        except NotImplementedError as exc:
            messages[what] = str(exc)

    def stage_on_the_wrong_rank():
        module_pipeline = PipelineModule()
        graph_pipeline = make_pipeline_graph(module_pipeline, flow.optim.SGD(module_pipeline.parameters(), lr=0.1))
        graph_pipeline.module_pipeline.m_stage0.config.set_stage(stage_id=0, placement=P1)
        graph_pipeline.module_pipeline.m_stage1.config.set_stage(stage_id=1, placement=P0)
        x, y = data()
        graph_pipeline(x.to_global(P0, BROADCAST), y.to_global(P1, BROADCAST))

    def two_placements_without_stages():
        module_pipeline = PipelineModule()

        class EvalGraph(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.module_pipeline = module_pipeline

            def build(self, x):
                return self.module_pipeline(x)

        EvalGraph()(data()[0].to_global(P0, BROADCAST))

    def split_inside_build():
        module_pipeline = PipelineModule()
        module_pipeline.placed = False    # forward as below: a split to_global in build()

        class SplitGraph(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.module_pipeline = module_pipeline
                self.module_pipeline.m_stage0.config.set_stage(stage_id=0, placement=P0)
                self.module_pipeline.m_stage1.config.set_stage(stage_id=1, placement=P1)

            def build(self, x):
                h = self.module_pipeline.m_stage0(x)
                return self.module_pipeline.m_stage1(h.to_global(placement=P1, sbp=flow.sbp.split(0)))

        SplitGraph()(data()[0].to_global(P0, BROADCAST))

    attempt("stage_on_the_wrong_rank", stage_on_the_wrong_rank)
    attempt("two_placements_without_stages", two_placements_without_stages)
    attempt("split_inside_build", split_inside_build)
    return messages


SCENARIOS = {"graph": graph, "graph_labels_on_stage0": lambda: graph(labels_on=P0), "graph_momentum": graph_momentum,
             "eager": eager,
             "one_placement": one_placement, "refusals": refusals}


# ---------------------------------------------------------------- the one-process reference
def reference(scenario: str) -> dict:
    """One process, eager, no placements: stage 0 and x as rank 0 drew them (seed 0), stage 1 and y
    as rank 1 did (seed 1; `one_placement`: everything from rank 1), trained by the tutorial's
    step: two micro-batches, each loss halved and backpropagated, then SGD (with momentum for
    `graph_momentum`, whose buffers it returns as "slot.<parameter path>-momentum")."""
    drawn = {}
    for rank in (0, 1):
        flow.manual_seed(rank)
        module = PipelineModule(placed=False)
        drawn[rank] = (module, *data())
    if scenario == "one_placement":
        module, x, y = drawn[1]
        micro_batches = 1
    else:
        module, x = drawn[0][0], drawn[0][1]
        module.m_stage1 = drawn[1][0].m_stage1
        y = drawn[0 if scenario == "graph_labels_on_stage0" else 1][2]
        micro_batches = 2
    sgd = flow.optim.SGD(module.parameters(), lr=0.001, momentum=0.9 if scenario == "graph_momentum" else 0.0)
    loss_fn = flow.nn.CrossEntropyLoss()
    losses = []
    for _ in range(STEPS):
        step = []
        for j in range(micro_batches):
            rows = slice(j * BATCH_SIZE // micro_batches, (j + 1) * BATCH_SIZE // micro_batches)
            loss = loss_fn(module(x[rows]), y[rows])
            (loss / micro_batches).backward()
            step.append(loss.numpy().copy())
        sgd.step()
        sgd.zero_grad()
        losses.append(step if micro_batches > 1 else step[0])
    slots = {f"slot.module_pipeline.{name}-momentum": sgd.state[p]["momentum_buffer"].numpy().copy()
             for name, p in module.named_parameters() if "momentum_buffer" in sgd.state.get(p, {})}
    return {"losses": np.array(losses), **{f"param.{name}": p.numpy().copy() for name, p in module.named_parameters()},
            **slots}


def main():
    global P0, P1
    P0, P1 = flow.placement("cpu", [0]), flow.placement("cpu", [1])
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    rank = flow.env.get_rank()
    for scenario in scenarios:
        flow.manual_seed(rank)
        np.savez(f"{out_dir}/{scenario}_rank{rank}.npz", **SCENARIOS[scenario]())


if __name__ == "__main__":
    main()
