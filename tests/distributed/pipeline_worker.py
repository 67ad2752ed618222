"""One rank of the pipeline tests in tests/test_distributed.py (run by mpiexec).

`python pipeline_worker.py OUTDIR SCENARIO...`: trains a small MLP whose two halves are pipeline
stages (`set_stage(0, rank 0)`, `set_stage(1, rank 1)`) with gradient accumulation, and saves on
every rank OUTDIR/SCENARIO_rank{R}.npz: the per-call losses (every rank gets them), the final
parameters (read on every rank together: each comes from its stage's rank), the send/recv ops of
this rank's program and, for "unsupported", what must be refused. `train(SCENARIO, staged=False)`
in one process is the reference: the same graph on one device.
"""
from __future__ import annotations

import sys

import numpy as np

import flowgen as flow
from flowgen.nn.graph import GraphModule

STEPS = 3
BATCH = 8

SCENARIOS = {   # name: (optimizer, gradient accumulation steps)
    "sgd_acc2": ("sgd", 2),
    "adam_acc4": ("adam", 4),
}


class MLP(flow.nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = flow.nn.Sequential(flow.nn.Linear(6, 16), flow.nn.ReLU())
        self.stage1 = flow.nn.Sequential(flow.nn.Linear(16, 16), flow.nn.Tanh(), flow.nn.Linear(16, 3))

    def forward(self, x):
        return self.stage1(self.stage0(x))


def make_graph(model, optimizer, accumulation: int, staged: bool):
    class PipelineGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, flow.nn.MSELoss()
            self.add_optimizer(optimizer)
            self.config.set_gradient_accumulation_steps(accumulation)
            if staged:
                self.model.stage0.to(GraphModule).set_stage(stage_id=0, placement=flow.placement("cpu", ranks=[0]))
                self.model.stage1.to(GraphModule).set_stage(stage_id=1, placement=flow.placement("cpu", ranks=[1]))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return PipelineGraph()


def batches():
    rng = np.random.default_rng(2)
    return (rng.standard_normal((STEPS, BATCH, 6)).astype(np.float32),
            rng.standard_normal((STEPS, BATCH, 3)).astype(np.float32))


def train(scenario: str, staged: bool) -> dict:
    opt_kind, accumulation = SCENARIOS[scenario]
    flow.manual_seed(0)
    model = MLP()
    optimizer = (flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_kind == "sgd"
                 else flow.optim.Adam(model.parameters(), lr=0.01))
    graph = make_graph(model, optimizer, accumulation, staged)
    xs, ys = batches()
    losses = [graph(flow.tensor(xs[s]), flow.tensor(ys[s])).numpy().copy() for s in range(STEPS)]
    params = {name: p.numpy().copy() for name, p in model.named_parameters()}
    transfers = [k.ops[0] for k in graph.compiled.program.kernels if k.collective]
    return {"losses": np.array(losses), "transfers": np.array(transfers, dtype=str),
            **{f"param.{name}": p for name, p in params.items()}}


def unsupported() -> dict:
    """What flowgen's pipelines refuse, with the message of each."""
    messages = {}
    cases = {
        "two_ranks_in_a_stage": lambda m: m.stage0.to(GraphModule).set_stage(0, flow.placement("cpu", [0, 1])),
        "three_stages_on_two_ranks": lambda m: [
            m.stage0[0].to(GraphModule).set_stage(0, flow.placement("cpu", [0])),
            m.stage0[1].to(GraphModule).set_stage(1, flow.placement("cpu", [1])),
            m.stage1.to(GraphModule).set_stage(2, flow.placement("cpu", [1]))],
        "parameter_without_stage": lambda m: m.stage0.to(GraphModule).set_stage(0, flow.placement("cpu", [0])),
    }
    xs, ys = batches()
    for what, stage in cases.items():
        flow.manual_seed(0)
        model = MLP()
        graph = make_graph(model, flow.optim.SGD(model.parameters(), lr=0.1), 2, staged=False)
        stage(graph.model)
        if what == "parameter_without_stage":
            graph.model.stage1[0].to(GraphModule).set_stage(1, flow.placement("cpu", [1]))
        try:
            graph(flow.tensor(xs[0]), flow.tensor(ys[0]))
            messages[what] = "no error"
        except (NotImplementedError, ValueError) as exc:
            messages[what] = str(exc)
    return messages


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    rank = flow.env.get_rank()
    for scenario in scenarios:
        results = unsupported() if scenario == "unsupported" else train(scenario, staged=True)
        np.savez(f"{out_dir}/{scenario}_rank{rank}.npz", **results)


if __name__ == "__main__":
    main()
