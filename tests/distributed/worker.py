"""One rank of the multi-process tests in tests/test_distributed.py (run by mpiexec).

`python worker.py SCENARIO OUT.npz`: trains as SCENARIO says on this rank's part of a fixed
global batch and, on rank 0, saves the losses and final parameters to OUT.npz. Every rank checks
that its parameters equal rank 0's (replicas must never drift apart) and exits non-zero if not.
`reference(SCENARIO)` trains the same model in one process on the whole global batch.
"""
from __future__ import annotations

import sys

import numpy as np

import flowgen as flow

STEPS = 4
GLOBAL_BATCH = 8


def make_model():
    flow.manual_seed(0)
    return flow.nn.Sequential(flow.nn.Linear(6, 16), flow.nn.ReLU(), flow.nn.Linear(16, 3))


def global_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS, GLOBAL_BATCH, 6)).astype(np.float32)
    y = rng.standard_normal((STEPS, GLOBAL_BATCH, 3)).astype(np.float32)
    return x, y


SCENARIOS = {
    # name: (how the batch reaches the graph, loss reduction, optimizer)
    "graph_global_split": ("global", "mean", "sgd"),
    "graph_ddp_sum": ("ddp_graph", "sum", "adam"),
    "eager_ddp": ("ddp_eager", "mean", "sgd"),
}


def make_optimizer(kind, params):
    if kind == "sgd":
        return flow.optim.SGD(params, lr=0.1, momentum=0.9)
    return flow.optim.Adam(params, lr=0.01)


def make_graph(model, loss_fn, optimizer):
    class TrainGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, loss_fn
            self.add_optimizer(optimizer)

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return TrainGraph()


def train(scenario: str, rank: int, world: int):
    """Losses per step and final parameters, training on this rank's part of the batch."""
    mode, reduction, opt_kind = SCENARIOS[scenario]
    model = make_model()
    loss_fn = flow.nn.MSELoss(reduction=reduction)
    if mode.startswith("ddp"):
        model = flow.nn.parallel.DistributedDataParallel(model, bucket_size=2)
    optimizer = make_optimizer(opt_kind, model.parameters())
    graph = make_graph(model, loss_fn, optimizer) if mode != "ddp_eager" else None
    xs, ys = global_batch()
    part = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        x = flow.tensor(xs[step, rank * part:(rank + 1) * part])
        y = flow.tensor(ys[step, rank * part:(rank + 1) * part])
        if mode == "global":
            placement = flow.placement("cpu", ranks=list(range(world)))
            x, y = x.to_global(placement, flow.sbp.split(0)), y.to_global(placement, flow.sbp.split(0))
            loss = graph(x, y)
            assert loss.is_global and loss.sbp == (flow.sbp.broadcast,)
            losses.append(float(loss.to_local()))
        elif mode == "ddp_graph":
            losses.append(float(graph(x, y)))
        else:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    return np.array(losses), [p.numpy().copy() for p in model.parameters()]


def reference(scenario: str):
    """One process, the whole global batch: what every data-parallel run must equal."""
    _, reduction, opt_kind = SCENARIOS[scenario]
    model = make_model()
    loss_fn = flow.nn.MSELoss(reduction=reduction)
    optimizer = make_optimizer(opt_kind, model.parameters())
    graph = make_graph(model, loss_fn, optimizer)
    xs, ys = global_batch()
    losses = [float(graph(flow.tensor(xs[s]), flow.tensor(ys[s]))) for s in range(STEPS)]
    return np.array(losses), [p.numpy().copy() for p in model.parameters()]


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    losses, params = train(scenario, rank, world)
    comm = flow.distributed.collectives.world()
    for k, p in enumerate(params):
        if any(not np.array_equal(p, other) for other in comm.all_gather(p)):
            sys.exit(f"rank {rank}: parameter {k} differs between ranks after training")
    if rank == 0:
        np.savez(out, losses=losses, *params)


if __name__ == "__main__":
    main()
