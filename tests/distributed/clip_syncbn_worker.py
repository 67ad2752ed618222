"""One rank of the gradient-clipping and SyncBatchNorm tests in tests/test_distributed.py (run by mpiexec).

`python clip_syncbn_worker.py OUTDIR SCENARIO...`: each SCENARIO trains on this rank's part of a
fixed global batch; rank 0 saves the losses (and, with clipping, the total norms build() returned),
the final parameters and buffers to OUTDIR/SCENARIO.npz. Every rank checks that its parameters
equal rank 0's. `reference(SCENARIO)` trains the same model eagerly in one process on the whole
global batch (SyncBatchNorm scenarios: with plain BatchNorm2d), which every run must equal.

* clip_norm, clip_value: a data-parallel graph (global split inputs) that clips inside build()
  with nn.utils.clip_grad_norm_ / clip_grad_value_, as nanoGPT's loop does every step;
* clip_norm_zero1, clip_norm_zero2, clip_value_zero2, clip_norm_zero3: the same with
  enable_zero(stage=1|2|3); clip_inf_zero2 saves the refusal of norm_type=inf at stage 2;
* gpt_ddp: examples/gpt_char.py's nanoGPT loop (AdamW groups, warm-up + cosine LR, clipping in
  build()) with --graph --ddp, 4 steps without dropout, against the eager loop in one process;
* syncbn_graph: a conv net whose BatchNorm2d was converted to SyncBatchNorm, in a data-parallel graph;
* syncbn_graph_ce: the same net flattened into 32 logits, cross_entropy's mean with the ignored
  targets all in rank 0's part (the ranks' counts differ: the backward's sums are weighted by them);
* syncbn_graph_zero3: syncbn_graph with enable_zero(stage=3);
* syncbn_eager_ddp: the same net eagerly under DistributedDataParallel;
* syncbn_refusals: the refusals of SyncBatchNorm in a pipelined graph and on an eager global
  tensor (2 ranks), saved as messages.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import flowgen as flow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import gpt_char  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 8
MAX_NORM = 0.5      # below every step's gradient norm: clipping is active on every step
CLIP_VALUE = 0.02


def clip_model():
    flow.manual_seed(0)
    return flow.nn.Sequential(flow.nn.Linear(6, 16), flow.nn.ReLU(), flow.nn.Linear(16, 3))


def bn_model(sync: bool, scenario: str = "syncbn_graph"):
    flow.manual_seed(0)
    model = flow.nn.Sequential(flow.nn.Conv2d(2, 4, 3), flow.nn.BatchNorm2d(4), flow.nn.ReLU(),
                               flow.nn.Conv2d(4, 2, 1))
    if scenario.endswith("_ce"):
        model = flow.nn.Sequential(model, flow.nn.Flatten())
    return flow.nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def make_loss(scenario: str):
    return flow.nn.CrossEntropyLoss(ignore_index=-1) if scenario.endswith("_ce") else flow.nn.MSELoss()


def global_batch(scenario: str):
    rng = np.random.default_rng(2)
    if scenario.startswith("syncbn"):
        x = rng.standard_normal((STEPS, GLOBAL_BATCH, 2, 6, 6)).astype(np.float32) * 2.0 + 1.0
        y = rng.standard_normal((STEPS, GLOBAL_BATCH, 2, 4, 4)).astype(np.float32)
        if scenario.endswith("_ce"):    # labels of the 32 logits, the first 3 of each batch ignored
            y = y.reshape(STEPS, GLOBAL_BATCH, 32).argmax(-1).astype(np.int64)
            y[:, :3] = -1
    else:
        x = rng.standard_normal((STEPS, GLOBAL_BATCH, 6)).astype(np.float32)
        y = rng.standard_normal((STEPS, GLOBAL_BATCH, 3)).astype(np.float32)
    return x, y


def clip(scenario: str, params):
    """Clips the gradients of `params` as `scenario` says; the total norm (0 for clip_value)."""
    if scenario.startswith("clip_value"):
        flow.nn.utils.clip_grad_value_(params, CLIP_VALUE)
        return None
    return flow.nn.utils.clip_grad_norm_(params, MAX_NORM, float("inf") if "inf" in scenario else 2.0)


def make_graph(scenario: str, model, optimizer):
    loss_fn = make_loss(scenario)

    class TrainGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, loss_fn
            self.add_optimizer(optimizer)

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            norm = clip(scenario, self.model.parameters()) if scenario.startswith("clip") else None
            return loss if norm is None else (loss, norm)

    return TrainGraph()


def gpt_config():
    return gpt_char.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.0)


def gpt(ddp: bool) -> dict:
    model, losses = gpt_char.train(gpt_config(), STEPS + 1, batch=4, use_graph=ddp, ddp=ddp, log=None)
    return {"losses": np.array(losses), **{f"param_{k}": p.numpy().copy() for k, p in enumerate(model.parameters())}}


def train(scenario: str, rank: int, world: int) -> dict:
    if scenario == "gpt_ddp":
        return gpt(True)
    net = bn_model(True, scenario) if scenario.startswith("syncbn") else clip_model()
    model = flow.nn.parallel.DistributedDataParallel(net) if scenario == "syncbn_eager_ddp" else net
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph = None if scenario == "syncbn_eager_ddp" else make_graph(scenario, model, optimizer)
    if "zero" in scenario:
        graph.config.enable_zero(True, stage=int(scenario[-1]), shard_min_size=1)
    xs, ys = global_batch(scenario)
    part = GLOBAL_BATCH // world
    placement = flow.placement("cpu", ranks=list(range(world)))
    losses, norms = [], []
    for step in range(STEPS):
        x = flow.tensor(xs[step, rank * part:(rank + 1) * part])
        y = flow.tensor(ys[step, rank * part:(rank + 1) * part])
        if graph is None:
            loss = make_loss(scenario)(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            continue
        x, y = x.to_global(placement, flow.sbp.split(0)), y.to_global(placement, flow.sbp.split(0))
        out = graph(x, y)
        if not scenario.startswith(("syncbn", "clip_value")):
            out, norm = out
            norms.append(float(norm.to_local()))
        losses.append(float(out.to_local()))
    if graph is None:   # each rank's loss is over its equal part: the global mean is their mean
        losses = flow.distributed.collectives.world().all_reduce([np.array(losses)], "mean")[0]
    return {"losses": np.array(losses), "norms": np.array(norms),
            "collectives": np.array([k.ops[0] for k in graph.compiled.program.kernels if k.collective]
                                    if graph is not None else [], dtype=str),
            **{f"param_{k}": p.numpy().copy() for k, p in enumerate(net.parameters())},
            **{f"buffer_{name}": b.numpy().copy() for name, b in net.named_buffers()}}


def _refusal(graph, *args) -> str:
    try:
        graph(*args)
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def syncbn_refusals(world: int) -> dict:
    net = bn_model(True)
    graph = make_graph("syncbn_pipeline", net, flow.optim.SGD(net.parameters(), lr=0.1))
    for index, module in enumerate(graph.model):
        module.to(flow.nn.graph.GraphModule).set_stage(index // 2, flow.placement("cpu", ranks=[index // 2]))
    messages = {"pipeline": _refusal(graph, flow.randn(2, 2, 6, 6), flow.randn(2, 2, 4, 4))}
    split = flow.randn(2, 2, 6, 6).to_global(flow.placement("cpu", ranks=list(range(world))), flow.sbp.split(0))
    try:
        flow.nn.SyncBatchNorm(2)(split)
        messages["global"] = "no error"
    except NotImplementedError as exc:
        messages["global"] = str(exc)
    return messages


def reference(scenario: str, clipping: bool = True) -> dict:
    """One process, the whole global batch, eager mode (BatchNorm2d for the SyncBatchNorm net)."""
    if scenario == "gpt_ddp":
        return gpt(False)
    model = bn_model(False, scenario) if scenario.startswith("syncbn") else clip_model()
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = global_batch(scenario)
    losses, norms = [], []
    for step in range(STEPS):
        loss = make_loss(scenario)(model(flow.tensor(xs[step])), flow.tensor(ys[step]))
        optimizer.zero_grad()
        loss.backward()
        if scenario.startswith("clip") and clipping:
            norm = clip(scenario, model.parameters())
            if norm is not None:
                norms.append(float(norm))
        optimizer.step()
        losses.append(float(loss))
    return {"losses": np.array(losses), "norms": np.array(norms),
            **{f"param_{k}": p.numpy().copy() for k, p in enumerate(model.parameters())},
            **{f"buffer_{name}": b.numpy().copy() for name, b in model.named_buffers()}}


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    comm = flow.distributed.collectives.world()
    for scenario in scenarios:
        if scenario == "syncbn_refusals":
            messages = syncbn_refusals(world)
            if rank == 0:
                np.savez(f"{out_dir}/{scenario}.npz", **messages)
            continue
        if scenario == "clip_inf_zero2":
            try:
                train(scenario, rank, world)
                message = "no error"
            except NotImplementedError as exc:
                message = str(exc)
            if rank == 0:
                np.savez(f"{out_dir}/{scenario}.npz", message=message)
            continue
        results = train(scenario, rank, world)
        for key in [k for k in results if k.startswith("param_")]:
            if any(not np.array_equal(results[key], other) for other in comm.all_gather(results[key])):
                sys.exit(f"rank {rank}: {key} differs between ranks after {scenario}")
        if rank == 0:
            np.savez(f"{out_dir}/{scenario}.npz", **results)


if __name__ == "__main__":
    main()
