"""One rank of the ZeRO stage-3 tests in tests/test_distributed.py (run by mpiexec).

`python zero3_worker.py OUTDIR`: trains worker.py's MLP on this rank's part of its global batch
for STEPS steps in each of MODES (plain data parallel, ZeRO-2, ZeRO-3), with SGD (momentum) and
AdamW, and saves on rank 0 OUTDIR/<optimizer>_<mode>.npz: the losses, the parameters as eager code
reads them after the steps (`model.parameters()`), the optimizer slots, every rank's parameter and
optimizer-state bytes, the program's launches in order (collectives by op, kernels as "kernel"),
per gathered parameter copy its gather's `nth` and its lifetime in the memory plan (first and last
launch), the parameters `graph.state_dict()` returned, and what `after_eager_write` gives. Every rank checks that the parameters it
reads equal rank 0's and exits non-zero if not. "zero3" also saves whether a checkpoint round trip
(`flow.save(graph.state_dict())`, one more step, `graph.load_state_dict`, the same step again)
gives the same parameters.
"""
from __future__ import annotations

import sys

import numpy as np

import flowgen as flow
import worker

STEPS = 3
# mode: (ZeRO stage or None, shard_min_size); "zero3_min20" keeps the biases (16 and 3 elements) whole
MODES = {"plain": (None, 1), "zero2": (2, 1), "zero3": (3, 1), "zero3_min20": (3, 20)}


def make_optimizer(kind, params):
    if kind == "sgd":
        return flow.optim.SGD(params, lr=0.1, momentum=0.9)
    return flow.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def batch(step: int, rank: int, world: int) -> tuple:
    """The global batch of `step` as global tensors split over the ranks."""
    xs, ys = worker.global_batch()
    part = worker.GLOBAL_BATCH // world
    placement = flow.placement("cpu", ranks=list(range(world)))
    return tuple(flow.tensor(a[step, rank * part:(rank + 1) * part]).to_global(placement, flow.sbp.split(0))
                 for a in (xs, ys))


def resumes_exactly(graph, model, step_batch, path) -> bool:
    """A step after loading a checkpoint equals the same step without the round trip."""
    flow.save(graph.state_dict(), path)
    graph(*step_batch)
    straight = [p.numpy().copy() for p in model.parameters()]
    graph.load_state_dict(flow.load(path))
    graph(*step_batch)
    return all(np.array_equal(a, p.numpy()) for a, p in zip(straight, model.parameters()))


def make_eval_graph(model):
    class EvalGraph(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return self.model(x)

    return EvalGraph()


def after_eager_write(graph, model, rank: int, world: int) -> tuple:
    """An eval graph compiled over the trained parameters; then eager code writes the parameters
    (the initial weights loaded into the module) and the training graph takes a step from them:
    (the parameters after that step, the eval graph's output on them). Both graphs must see the
    eager write and each other's updates."""
    evaluate = make_eval_graph(model)
    x = batch(STEPS, rank, world)[0]
    evaluate(x)
    model.load_state_dict(worker.make_model().state_dict())
    graph(*batch(0, rank, world))
    return [p.numpy().copy() for p in model.parameters()], evaluate(x).numpy()


def train(opt_kind: str, mode: str, rank: int, world: int, out_dir: str) -> dict:
    stage, shard_min_size = MODES[mode]
    model = worker.make_model()
    optimizer = make_optimizer(opt_kind, model.parameters())
    graph = worker.make_graph(model, flow.nn.MSELoss(), optimizer)
    if stage is not None:
        graph.config.enable_zero(True, stage=stage, shard_min_size=shard_min_size)
    losses = [float(graph(*batch(step, rank, world)).to_local()) for step in range(STEPS)]
    compiled = graph.compiled
    launches = [k.ops[0] if k.collective else "kernel" for k in compiled.program.kernels]
    bytes_here = np.array([compiled.parameter_bytes, compiled.optimizer_state_bytes])
    copies = [(node.attrs.get("nth", 0), *compiled.program.plan.lifetimes[v])
              for node in compiled.ir.nodes if node.op == "all_gather" and stage == 3 for v in node.outputs]
    # Eager reads after the steps (all ranks together: under stage 3 each read gathers the pieces).
    params = [p.numpy().copy() for p in model.parameters()]
    slots = [v.numpy().copy() for p in model.parameters() for v in optimizer.state[p].values()
             if isinstance(v, flow.Tensor)]
    saved = [t.numpy().copy() for t in graph.state_dict()["model"].values()]
    comm = flow.distributed.collectives.world()
    for k, p in enumerate(params):
        if any(not np.array_equal(p, other) for other in comm.all_gather(p)):
            sys.exit(f"rank {rank}: parameter {k} differs between ranks ({opt_kind}, {mode})")
    rewritten, evaluated = after_eager_write(graph, model, rank, world)
    resumed = mode == "zero3" and resumes_exactly(graph, model, batch(STEPS, rank, world),
                                             f"{out_dir}/checkpoint_{opt_kind}_rank{rank}")
    return {"losses": np.array(losses), "bytes": np.array(comm.all_gather(bytes_here)), "resumed": resumed,
            "launches": np.array(launches, dtype=str), "copies": np.array(copies, dtype=np.int64).reshape(-1, 3),
            **{f"param_{k}": p for k, p in enumerate(params)}, **{f"slot_{k}": v for k, v in enumerate(slots)},
            **{f"saved_{k}": t for k, t in enumerate(saved)}, "evaluated": evaluated,
            **{f"rewritten_{k}": p for k, p in enumerate(rewritten)}}


def main():
    out_dir = sys.argv[1]
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    for opt_kind in ("sgd", "adamw"):
        for mode in MODES:
            results = train(opt_kind, mode, rank, world, out_dir)
            if rank == 0:
                np.savez(f"{out_dir}/{opt_kind}_{mode}.npz", **results)


if __name__ == "__main__":
    main()
