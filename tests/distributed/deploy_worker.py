"""One rank of tests/test_deploy_distributed.py (run by mpiexec).

`python deploy_worker.py OUTDIR` (or `train_and_save(OUTDIR)` in a process of one rank): for each
loss in SCENARIOS, every rank traces a data-parallel training graph (global split(0) inputs, an
MLP with SGD momentum), compiles it without taking a step, and saves it with
`flow.save(graph, OUTDIR/<loss>/saved)` (all ranks call it; rank 0 writes). Then it trains STEPS
steps on its part of each global batch; rank 0 writes the global batches (x.npy, y.npy: the files
the standalone program reads) and what Python computed (python.npz: the losses, the final
parameters and momentum buffers under the program's state names) beside `saved`. Last, the graphs
a standalone program cannot run (ZeRO, a local input beside split ones) are saved, and rank 0
writes what flow.save raised to OUTDIR/refusals.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import flowgen as flow
from worker import GLOBAL_BATCH, IGNORED, global_batch, make_graph, make_model

STEPS = 3


def mse_targets(ys):
    return ys


def ce_targets(ys):
    """Class labels; the first IGNORED of every global batch (all in rank 0's rows) are ignored, so
    the ranks' counts differ and the loss and gradients combine as sum / sum (a ratio)."""
    labels = ys.argmax(-1).astype(np.int64)
    labels[:, :IGNORED] = -1
    return labels


SCENARIOS = {   # name: (loss, targets from the regression targets)
    "mse": (lambda: flow.nn.MSELoss(), mse_targets),
    "ce": (lambda: flow.nn.CrossEntropyLoss(ignore_index=-1), ce_targets),
}


def train_and_save(out: Path):
    """Per scenario: save the graph to out/<name>/saved, train it in Python, write the data and
    results (module doc)."""
    for name, (make_loss, targets) in SCENARIOS.items():
        train_scenario(out / name, make_loss(), targets)
    messages = refusals(out)
    if flow.env.get_rank() == 0:
        (out / "refusals.json").write_text(json.dumps(messages))


def refusals(out: Path) -> dict:
    """What flow.save raises, on every rank, for data-parallel graphs a program cannot run."""
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    x = flow.randn(GLOBAL_BATCH // world, 6).to_global(placement, flow.sbp.split(0))
    y = flow.randn(GLOBAL_BATCH // world, 3)
    messages = {}
    for what in ("zero", "local_input"):
        model = make_model()
        graph = make_graph(model, flow.nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
        if what == "zero":
            graph.config.enable_zero(True, stage=1, shard_min_size=1)
        graph._compile(x, y.to_global(placement, flow.sbp.split(0)) if what == "zero" else y)
        try:
            flow.save(graph, out / what)
            messages[what] = "no error"
        except NotImplementedError as exc:
            messages[what] = str(exc)
    return messages


def train_scenario(out: Path, loss_fn, targets):
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    model = make_model()
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph = make_graph(model, loss_fn, optimizer)
    xs, ys = global_batch()
    xs, ys = xs[:STEPS], targets(ys[:STEPS])
    placement = flow.placement("cpu", ranks=list(range(world)))
    part = GLOBAL_BATCH // world

    def split(a, step):
        return flow.tensor(a[step, rank * part:(rank + 1) * part]).to_global(placement, flow.sbp.split(0))

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    graph._compile(split(xs, 0), split(ys, 0))
    flow.save(graph, out / "saved")
    losses = [float(graph(split(xs, s), split(ys, s)).to_local()) for s in range(STEPS)]
    # The trained parameters and momentum buffers, under the program's state names.
    state = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = p.numpy().copy()
        state[f"model.{name}.momentum_buffer"] = optimizer.state[p]["momentum_buffer"].numpy().copy()
    if rank == 0:
        np.save(out / "x.npy", xs.reshape(STEPS * GLOBAL_BATCH, *xs.shape[2:]))
        np.save(out / "y.npy", ys.reshape(STEPS * GLOBAL_BATCH, *ys.shape[2:]))
        np.savez(out / "python.npz", losses=np.array(losses, np.float32), **state)


if __name__ == "__main__":
    train_and_save(Path(sys.argv[1]))
