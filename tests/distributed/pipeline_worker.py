"""One rank of the pipeline tests in tests/test_distributed.py (run by mpiexec).

`python pipeline_worker.py OUTDIR SCENARIO...`: trains a small MLP cut into 2 or 3 pipeline stages
(`set_stage(s, placement on rank s)`) with gradient accumulation, and saves on
every rank OUTDIR/SCENARIO_rank{R}.npz: the per-call losses (every rank gets them), the final
parameters and optimizer slots (every rank holds all stages' after a step), the prediction of a
pipelined inference graph, the send/recv ops of this rank's training program and, for
"unsupported", what must be refused. `train(SCENARIO, staged=False)`
in one process is the reference: the same graph on one device.
"""
from __future__ import annotations

import sys
import tempfile

import numpy as np

import flowgen as flow
from flowgen.nn.graph import GraphModule

STEPS = 3
BATCH = 12

SCENARIOS = {   # name: (stages = ranks, optimizer, gradient accumulation steps)
    "sgd_acc2": (2, "sgd", 2),             # with activation checkpointing of stage 1
    "adam_acc4": (2, "adam", 4),
    "three_stages_adam_acc3": (3, "adam", 3),
    # OneFlow's way: each stage's modules placed on its rank (to_global), x on stage 0's rank and y
    # on the last stage's (three stages: y on stage 0's, sent to the last); the losses come back on
    # the last stage's placement, parameters and slots stay on their rank and are read from any
    "placed_sgd_acc2": (2, "sgd", 2),
    "placed_three_stages_adam_acc3": (3, "adam", 3),
}


class MLP(flow.nn.Module):
    """Two stages: Linear-ReLU | Linear-Tanh-Linear. Three: Linear-ReLU | Linear-Tanh | Linear, whose
    input adds stage 0's output to stage 1's (an op outside the staged modules: it runs on the
    stage of its latest operand, 1, and stage 0's output reaches both stage 1 and, backward, the
    gradient accumulation of two paths)."""

    def __init__(self, num_stages: int = 2):
        super().__init__()
        self.stage0 = flow.nn.Sequential(flow.nn.Linear(6, 16), flow.nn.ReLU())
        tail = [flow.nn.Linear(16, 16), flow.nn.Tanh(), flow.nn.Linear(16, 3)]
        if num_stages == 2:
            self.stage1 = flow.nn.Sequential(*tail)
        else:
            self.stage1, self.stage2 = flow.nn.Sequential(*tail[:2]), tail[2]

    def forward(self, x):
        h = self.stage0(x)
        return self.stage1(h) if not hasattr(self, "stage2") else self.stage2(self.stage1(h) + h)


def make_graph(model, optimizer, accumulation: int, staged: bool, num_stages: int = 2):
    class PipelineGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, flow.nn.MSELoss()
            self.add_optimizer(optimizer)
            self.config.set_gradient_accumulation_steps(accumulation)
            for s in range(num_stages if staged else 0):
                getattr(self.model, f"stage{s}").to(GraphModule).set_stage(
                    stage_id=s, placement=flow.placement("cpu", ranks=[s]))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return PipelineGraph()


def make_eval_graph(model, staged: bool, num_stages: int):
    class EvalGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            for s in range(num_stages if staged else 0):
                getattr(self.model, f"stage{s}").to(GraphModule).set_stage(s, flow.placement("cpu", ranks=[s]))

        def build(self, x):
            return self.model(x)

    return EvalGraph()


def batches():
    rng = np.random.default_rng(2)
    return (rng.standard_normal((STEPS, BATCH, 6)).astype(np.float32),
            rng.standard_normal((STEPS, BATCH, 3)).astype(np.float32))


def train(scenario: str, staged: bool) -> dict:
    num_stages, opt_kind, accumulation = SCENARIOS[scenario]
    flow.manual_seed(0)
    model = MLP(num_stages)
    placed = staged and scenario.startswith("placed_")
    if placed:
        for s in range(num_stages):
            getattr(model, f"stage{s}").to_global(placement=flow.placement("cpu", ranks=[s]), sbp=flow.sbp.broadcast)
    optimizer = (flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_kind == "sgd"
                 else flow.optim.Adam(model.parameters(), lr=0.01))
    graph = make_graph(model, optimizer, accumulation, staged, num_stages)
    if scenario.endswith("sgd_acc2"):   # stage 1 recomputes its activations in the backward pass
        graph.model.stage1.to(GraphModule).activation_checkpointing = True
    xs, ys = batches()
    label_rank = 0 if num_stages == 3 else num_stages - 1

    def inputs(s):
        x, y = flow.tensor(xs[s]), flow.tensor(ys[s])
        if not placed:
            return x, y
        return (x.to_global(flow.placement("cpu", ranks=[0]), flow.sbp.broadcast),
                y.to_global(flow.placement("cpu", ranks=[label_rank]), flow.sbp.broadcast))

    losses = [graph(*inputs(s)).numpy().copy() for s in range(STEPS)]
    # A pipelined inference graph on the trained parameters: no backward, a [batch, 3] output.
    prediction = make_eval_graph(model, staged, num_stages)(flow.tensor(xs[0])).numpy().copy()
    params = {name: p.numpy().copy() for name, p in model.named_parameters()}
    slots = {k: v.numpy().copy() for k, v in graph.state_dict().items() if isinstance(v, flow.Tensor)}
    transfers = [k.ops[0] for k in graph.compiled.program.kernels if k.collective]
    return {"losses": np.array(losses), "prediction": prediction, "transfers": np.array(transfers, dtype=str),
            **{f"param.{name}": p for name, p in params.items()}, **{f"slot.{k}": v for k, v in slots.items()}}


def _stage(module, stage_id: int, *ranks):
    module.to(GraphModule).set_stage(stage_id, flow.placement("cpu", list(ranks)))


UNSUPPORTED = {   # name: how the case stages graph.model
    "two_ranks_in_a_stage": lambda m: _stage(m.stage0, 0, 0, 1),
    "three_stages_on_two_ranks": lambda m: [_stage(m.stage0[0], 0, 0), _stage(m.stage0[1], 1, 1),
                                            _stage(m.stage1, 2, 1)],
    "parameter_without_stage": lambda m: [_stage(m.stage0, 0, 0), _stage(m.stage1[0], 1, 1)],
    "forward_to_an_earlier_stage": lambda m: [_stage(m.stage0, 1, 1), _stage(m.stage1, 0, 0)],
    "clipping_by_the_global_norm": lambda m: [_stage(m.stage0, 0, 0), _stage(m.stage1, 1, 1)],
}


def unsupported() -> dict:
    """What flowgen's pipelines refuse, with the message of each."""
    messages = {}
    xs, ys = batches()
    for what, stage in UNSUPPORTED.items():
        flow.manual_seed(0)
        model = MLP()
        params = ([{"params": model.parameters(), "clip_grad_max_norm": 1.0, "clip_grad_norm_type": 2.0}]
                   if what == "clipping_by_the_global_norm" else model.parameters())
        graph = make_graph(model, flow.optim.SGD(params, lr=0.1), 2, staged=False)
        stage(graph.model)
        try:
            graph(flow.tensor(xs[0]), flow.tensor(ys[0]))
            messages[what] = "no error"
        except (NotImplementedError, ValueError) as exc:
            messages[what] = str(exc)
    graph = make_graph(model, flow.optim.SGD(model.parameters(), lr=0.1), 2, staged=True)
    graph(flow.tensor(xs[0]), flow.tensor(ys[0]))
    try:
        flow.save(graph, tempfile.mkdtemp())
        messages["save"] = "no error"
    except NotImplementedError as exc:
        messages["save"] = str(exc)
    return messages


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    rank = flow.env.get_rank()
    for scenario in scenarios:
        results = unsupported() if scenario == "unsupported" else train(scenario, staged=True)
        np.savez(f"{out_dir}/{scenario}_rank{rank}.npz", **results)


if __name__ == "__main__":
    main()
