"""One rank of the multi-process tests in tests/test_distributed.py (run by mpiexec).

`python worker.py OUTDIR SCENARIO...`: for each training SCENARIO, trains on this rank's part of a
fixed global batch and, on rank 0, saves the global-batch losses and the final parameters to
OUTDIR/SCENARIO.npz. Every rank checks that its
parameters equal rank 0's (replicas must never drift apart) and exits non-zero if not. The
scenario "global_tensors" saves what OneFlow's to_global/to_local conversions gave.
`reference(SCENARIO, WORLD)` trains the same model in one process on the whole global batch: with
global inputs the graph's step is the global-batch step; a DDP-wrapped module follows PyTorch's
contract (gradients averaged over the ranks), so a sum loss acts as the global sum / WORLD.
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
    # name: (how the batch reaches the graph, loss, optimizer)
    "graph_global_split": ("global", "mean", "sgd"),
    "graph_zero1": ("global", "mean", "sgd"),      # the same with enable_zero(True, stage=1)
    "graph_zero2": ("global", "mean", "sgd"),      # ... and with stage=2
    "graph_global_sum": ("global", "sum", "sgd"),
    # cross_entropy's mean over the targets that are not ignored: the ignored ones all sit in rank 0's
    # part, so the ranks' denominators differ and only the weighted combination gives the batch's step
    "graph_global_ce": ("global", "ce_ignore", "sgd"),
    # ZeRO with the same ratio loss: each rank differentiates its share of the global-batch loss
    "graph_zero1_ce": ("global", "ce_ignore", "sgd"),
    "graph_zero2_ce": ("global", "ce_ignore", "sgd"),
    "graph_zero3_ce": ("global", "ce_ignore", "adam"),
    "graph_ddp_sum": ("ddp_graph", "sum", "sgd"),
    "graph_ddp_adam": ("ddp_graph", "mean", "adam"),
    "eager_ddp": ("ddp_eager", "mean", "sgd"),
}
IGNORED = 3    # targets 0..2 of every global batch are ignored by the "ce_ignore" loss


def make_loss(kind):
    if kind == "ce_ignore":
        return flow.nn.CrossEntropyLoss(ignore_index=-1)
    return flow.nn.MSELoss(reduction=kind)


def targets(kind, ys):
    """The global batch's targets for loss `kind`: class labels (some ignored) for cross-entropy."""
    if kind != "ce_ignore":
        return ys
    labels = ys.argmax(-1).astype(np.int64)
    labels[:, :IGNORED] = -1
    return labels


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


def zero_stage(scenario: str) -> int:
    """The ZeRO stage of a "graph_zero<stage>[_...]" scenario."""
    return int(scenario[len("graph_zero")])


def train(scenario: str, rank: int, world: int):
    """Losses per step and final parameters, training on this rank's part of the batch."""
    mode, loss_kind, opt_kind = SCENARIOS[scenario]
    model = make_model()
    loss_fn = make_loss(loss_kind)
    if mode.startswith("ddp"):
        model = flow.nn.parallel.DistributedDataParallel(model, bucket_size=2)
    optimizer = make_optimizer(opt_kind, model.parameters())
    graph = make_graph(model, loss_fn, optimizer) if mode != "ddp_eager" else None
    if scenario.startswith("graph_zero"):
        graph.config.enable_zero(True, stage=zero_stage(scenario), shard_min_size=1)
    xs, ys = global_batch()
    ys = targets(loss_kind, ys)
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
    if mode.startswith("ddp"):   # each rank's loss is over its part: DDP averages, as the gradients
        losses = flow.distributed.collectives.world().all_reduce([np.array(losses)], "mean")[0]
    # Reading a slot gathers its pieces from every rank under ZeRO (all ranks read them together).
    slots = [v.numpy().copy() for p in model.parameters() for v in optimizer.state[p].values()
             if isinstance(v, flow.Tensor)]
    state_bytes = graph.compiled.optimizer_state_bytes if graph is not None else 0
    collectives = [k.ops[0] for k in graph.compiled.program.kernels if k.collective] if graph is not None else []
    return np.array(losses), [p.numpy().copy() for p in model.parameters()], slots, state_bytes, collectives


def unsupported_on_several_ranks(world: int) -> dict:
    """What flowgen cannot split yet must say so on several ranks, never be ignored."""
    placement = flow.placement("cpu", ranks=list(range(world)))
    x = flow.randn(2, 6).to_global(placement, flow.sbp.split(0))
    y = flow.randn(2, 3).to_global(placement, flow.sbp.split(0))
    messages = {}
    for what in ("set_stage", "zero_without_data_parallel", "zero_stage2_with_clipping"):
        model = make_model()
        clipped = [{"params": model.parameters(), "clip_grad_max_norm": 1.0, "clip_grad_norm_type": 2.0}]
        optimizer = flow.optim.SGD(clipped if what.endswith("clipping") else model.parameters(), lr=0.1)
        graph = make_graph(model, flow.nn.MSELoss(), optimizer)
        args = (x, y)
        if what == "zero_stage2_with_clipping":
            graph.config.enable_zero(True, stage=2, shard_min_size=1)
        elif what == "set_stage":
            graph.model[0].to(flow.nn.graph.GraphModule).set_stage(0, placement)
        else:
            graph.config.enable_zero(True, stage=1)
            args = (x.to_local(), y.to_local())
        try:
            graph(*args)
            messages[what] = "no error"
        except NotImplementedError as exc:
            messages[what] = str(exc)
    return messages


def global_tensors(rank: int, world: int) -> dict:
    """OneFlow's conversions: local -> global (split, broadcast from rank 0, partial_sum) and
    global -> global (S -> B, P -> B, B -> S), with their logical shapes."""
    placement = flow.placement("cpu", ranks=list(range(world)))
    local = flow.tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * rank)
    split = local.to_global(placement, flow.sbp.split(0))
    split1 = local.to_global(placement, flow.sbp.split(1))
    broadcast = local.to_global(placement, flow.sbp.broadcast)
    partial = local.to_global(placement, flow.sbp.partial_sum)
    return {
        "split_shape": np.array(split.shape), "split1_shape": np.array(split1.shape),
        "split_to_broadcast": split.to_global(sbp=flow.sbp.broadcast).to_local().numpy(),
        "split1_numpy": split1.numpy(),
        "broadcast_local": broadcast.to_local().numpy(),
        "partial_to_broadcast": partial.to_global(sbp=flow.sbp.broadcast).to_local().numpy(),
        "broadcast_to_split_local": broadcast.to_global(sbp=flow.sbp.split(1)).to_local().numpy(),
        "partial_to_split_local": partial.to_global(sbp=flow.sbp.split(0)).to_local().numpy(),
    }


def reference(scenario: str, world: int):
    """One process, the whole global batch, eager mode: what every data-parallel run must equal."""
    mode, loss_kind, opt_kind = SCENARIOS[scenario]
    model = make_model()
    loss_fn = make_loss(loss_kind)
    optimizer = make_optimizer(opt_kind, model.parameters())
    xs, ys = global_batch()
    ys = targets(loss_kind, ys)
    averaged = 1.0 / world if mode.startswith("ddp") and loss_kind == "sum" else 1.0
    losses = []
    for s in range(STEPS):
        loss = loss_fn(model(flow.tensor(xs[s])), flow.tensor(ys[s])) * averaged
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return np.array(losses), [p.numpy().copy() for p in model.parameters()]


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    comm = flow.distributed.collectives.world()
    for scenario in scenarios:
        if scenario == "global_tensors":
            results = global_tensors(rank, world)
            gathered = comm.all_gather(results["broadcast_to_split_local"])
            results["broadcast_to_split_all"] = np.concatenate(gathered, axis=1)
            gathered = comm.all_gather(results["partial_to_split_local"])
            results["partial_to_split_all"] = np.concatenate(gathered, axis=0)
            if rank == 0:
                np.savez(f"{out_dir}/{scenario}.npz", **results)
            continue
        if scenario == "unsupported":
            messages = unsupported_on_several_ranks(world)
            if rank == 0:
                np.savez(f"{out_dir}/{scenario}.npz", **messages)
            continue
        losses, params, slots, state_bytes, collectives = train(scenario, rank, world)
        for k, p in enumerate(params):
            if any(not np.array_equal(p, other) for other in comm.all_gather(p)):
                sys.exit(f"rank {rank}: parameter {k} differs between ranks after {scenario}")
        every_rank_bytes = comm.all_gather(np.array(state_bytes))
        if rank == 0:
            np.savez(f"{out_dir}/{scenario}.npz", losses=losses, state_bytes=np.array(every_rank_bytes),
                     collectives=np.array(collectives, dtype=str),
                     **{f"param_{k}": p for k, p in enumerate(params)}, **{f"slot_{k}": v for k, v in enumerate(slots)})


if __name__ == "__main__":
    main()
