"""One rank of the global eager-op tests in tests/test_distributed.py (run by mpiexec).

`python global_ops_worker.py OUTDIR`: runs every case of `CASES` on global tensors laid out over
all ranks and saves, per rank, OUTDIR/global_ops_rank{R}.npz: each case's logical value
(`numpy()`) and sbp, a short SGD training of a broadcast model on a split(0) batch, and the
messages of what must be refused. The cases and the training run again on a placement of some of
the ranks, in another order (`subset_placement`: the ranks outside it run nothing and read the
values with `numpy()`), and `moved` carries values and their gradients between placements. The
test compares them with `reference_case`, `reference_training` and `reference_moved`: the same
code on plain local tensors holding the whole (logical) values.
"""
from __future__ import annotations

import sys

import numpy as np

import flowgen as flow
from flowgen.distributed import global_ops

S0, S1, B = flow.sbp.split(0), flow.sbp.split(1), flow.sbp.broadcast


def inputs():
    rng = np.random.default_rng(0)
    shapes = {"x": (6, 4), "y": (6, 4), "w": (4, 5), "v": (4,), "r3": (3, 4), "t": (2, 3, 4)}
    data = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    data["labels"] = np.array([0, 3, 1, 1, 2, 0], np.int64)
    return data


def boxed(t, sbp):
    """`t` converted to `sbp` (the reference's local tensors stay as they are)."""
    return t.to_global(sbp=sbp) if t.is_global else t


# name: (what it computes from T(name, sbp) -> a tensor, the sbp its result must have)
CASES = {
    "add_split_broadcast": (lambda T: T("x", S0) + T("v", B), S0),
    "mul_split_split": (lambda T: T("x", S0) * T("y", S0), S0),
    "exp_split1": (lambda T: flow.exp(T("x", S1)) - 1.0, S1),
    "sum_all_of_split": (lambda T: T("x", S0).sum(), flow.sbp.partial_sum),
    "sum_split_dim": (lambda T: T("x", S0).sum(0), flow.sbp.partial_sum),
    "sum_other_dim": (lambda T: T("x", S0).sum(1), S0),
    "sum_other_dim_of_split1": (lambda T: T("t", S1).sum(0), S0),
    "sum_keepdim": (lambda T: T("x", S0).sum(1, keepdim=True), S0),
    "partial_sum_times_scalar": (lambda T: T("x", S0).sum(0) * 3.0, flow.sbp.partial_sum),
    "partial_sum_plus_scalar": (lambda T: T("x", S0).sum() + 1.0, B),   # all-reduced before the add
    "partial_sum_to_int": (lambda T: (T("x", S0) * 10.0).sum(0).to(flow.int32), B),
    "mean_all": (lambda T: T("x", S0).mean(), flow.sbp.partial_sum),
    "mean_split_dim": (lambda T: T("x", S0).mean(0), flow.sbp.partial_sum),
    "mean_other_dim": (lambda T: T("x", S0).mean(1), S0),
    "amax_split_dim": (lambda T: T("x", S0).amax(0), B),
    "amax_other_dim": (lambda T: T("x", S0).amax(1), S0),
    "matmul_split_broadcast": (lambda T: flow.matmul(T("x", S0), T("w", B)), S0),
    "matmul_broadcast_split1": (lambda T: flow.matmul(T("x", B), T("w", S1)), S1),
    "matmul_inner_dim": (lambda T: flow.matmul(T("x", S1), T("w", S0)), flow.sbp.partial_sum),
    "matmul_inner_dim_broadcast": (lambda T: flow.matmul(T("x", B), T("w", S0)), flow.sbp.partial_sum),
    "matrix_times_split_vector": (lambda T: flow.matmul(T("x", B), T("v", S0)), flow.sbp.partial_sum),
    "permute_split": (lambda T: T("t", S0).permute(2, 0, 1), flow.sbp.split(1)),
    "transpose_split": (lambda T: T("x", S0).transpose(0, 1), S1),
    "reshape_keeping_the_split_dim": (lambda T: T("t", S1).reshape(2, 3, 2, 2), S1),
    "unsqueeze_split": (lambda T: T("x", S0).unsqueeze(0), S1),
    "box_split_to_broadcast": (lambda T: boxed(T("x", S0) * 2.0, B), B),
    "box_partial_to_split": (lambda T: boxed(flow.matmul(T("x", S1), T("w", S0)), S0), S0),
    "mse_loss": (lambda T: flow.nn.functional.mse_loss(T("x", S0), T("y", S0)), flow.sbp.partial_sum),
    "zeros_like_split": (lambda T: flow.zeros_like(T("x", S0)), S0),
    "full_like_split1": (lambda T: flow.full_like(T("x", S1), 2.5), S1),
    "ones_like_partial_sum": (lambda T: flow.ones_like(T("x", S0).sum(0)), B),
    "softmax_rows_of_split": (lambda T: flow.softmax(T("x", S0), 1), S0),
    "log_softmax_along_the_split": (lambda T: flow.log_softmax(T("x", S0), 0), B),
    # the mean divides a partial sum of losses by a partial count: all-reduced before the division
    "cross_entropy_split_rows": (lambda T: flow.nn.functional.cross_entropy(T("x", S0), T("labels", S0)), B),
    "cross_entropy_input_grad": (lambda T: _input_grad(lambda x: flow.nn.functional.cross_entropy(x, T("labels", S0)),
                                                       T("x", S0)), S0),
    "layer_norm_split_rows": (lambda T: flow.nn.functional.layer_norm(T("x", S0), 4, T("v", B)), S0),
    "layer_norm_along_the_split": (lambda T: flow.nn.functional.layer_norm(T("x", S1), 4), B),
    "layer_norm_input_grad": (lambda T: _input_grad(
        lambda x: (flow.nn.functional.layer_norm(x, 4, T("v", B)) * T("y", S0)).sum(), T("x", S0)), S0),
    # 3 rows over 4 ranks: the last rank's piece is empty
    "uneven_pieces": (lambda T: flow.matmul(flow.exp(T("r3", S0)), T("w", B)).mean(0) + T("r3", S0).amax(1).sum(),
                      flow.sbp.partial_sum),
}


def _input_grad(loss_of, x):
    """The gradient of loss_of(x) with respect to x."""
    x.requires_grad = True
    loss_of(x).backward()
    return x.grad


def case_tensor(data, placement):
    """T(name, sbp) of the cases: the logical value `data[name]` laid out by sbp (every rank
    holds the whole value, so split pieces are cut from it: uneven ones included)."""
    return lambda name, sbp: flow.tensor(data[name]).to_global(placement, B).to_global(sbp=sbp)


def reference_case(name):
    data = inputs()
    return CASES[name][0](lambda key, sbp: flow.tensor(data[key])).numpy()


GLOBAL_BATCH, STEPS = 10, 3      # 10 rows: uneven pieces on 4 ranks


def training_data():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((STEPS, GLOBAL_BATCH, 4)).astype(np.float32),
            rng.standard_normal((STEPS, GLOBAL_BATCH, 3)).astype(np.float32))


def make_model():
    flow.manual_seed(0)
    return flow.nn.Sequential(flow.nn.Linear(4, 8), flow.nn.Tanh(), flow.nn.Linear(8, 3))


def train(placement=None):
    """SGD with momentum, loss = mean over the global batch; global when `placement` is given:
    broadcast parameters, the batch split(0)."""
    model = make_model()
    if placement is not None:
        model.to_global(placement, B)
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = training_data()
    losses, grads = [], []
    for s in range(STEPS):
        x, y = flow.tensor(xs[s]), flow.tensor(ys[s])
        if placement is not None:
            x, y = (t.to_global(placement, B).to_global(sbp=S0) for t in (x, y))
        loss = flow.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        optimizer.step()
        losses.append(float(loss.numpy()))
    return model, np.array(losses), grads


def reference_training():
    model, losses, grads = train()
    return losses, [p.numpy() for p in model.parameters()], [g.numpy() for g in grads]


def refusals(placement, rank):
    """What global eager ops refuse: the same error on every rank, and the ranks go on together."""
    data = inputs()
    T = case_tensor(data, placement)
    attempts = {
        "reshape_split": lambda: T("x", S0).reshape(24),
        "dropout": lambda: flow.nn.functional.dropout(T("x", S0), p=0.5),
        "rand_like": lambda: flow.rand_like(T("x", B)),
        "split_along_different_dims": lambda: T("x", S0) + T("y", S1),
        # a local op failing on one rank only (its data): every rank must raise, none wait
        "fails_on_rank_1_only": lambda: global_ops._run_on_every_rank(
            "example", placement,
            lambda: (_ for _ in ()).throw(ValueError("bad index in this piece")) if rank == 1 else 0),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            messages[name] = f"{type(exc).__name__}: {exc}"
        # a collective after each refusal: a rank left behind in the op's collectives would hang here
        messages[name + "_then"] = str(T("x", S0).sum().numpy())
    return messages


def subset_ranks(world: int) -> list:
    """Some of the ranks, not in rank order: [1, 0] of 2 (every rank, reordered: a communicator of
    its own), [3, 1] of 4 (two ranks of four)."""
    return [1, 0] if world == 2 else [3, 1]


def moved(first, second) -> dict:
    """Values and gradients carried between two placements: x split on `first` to split(1) on
    `second`, and a loss on `second` of an activation made on `first`, differentiated back to a
    broadcast weight on `first` (to_global on the autograd tape)."""
    data = inputs()
    x = flow.tensor(data["x"]).to_global(first, B).to_global(sbp=S0)
    w = flow.tensor(data["w"]).to_global(first, B)
    w.requires_grad = True
    h = flow.tanh(flow.matmul(x, w))                       # split(0) on `first`
    loss = (h.to_global(placement=second, sbp=B) * 2.0).sum()
    loss.backward()
    return {"x_on_second": x.to_global(second, S1).numpy(), "loss": loss.numpy(), "w_grad": w.grad.numpy(),
            "w_grad_placement": repr(w.grad.placement), "w_grad_sbp": repr(w.grad.sbp[0])}


def reference_moved() -> dict:
    data = inputs()
    w = flow.tensor(data["w"], requires_grad=True)
    loss = (flow.tanh(flow.matmul(flow.tensor(data["x"]), w)) * 2.0).sum()
    loss.backward()
    return {"x_on_second": data["x"], "loss": loss.numpy(), "w_grad": w.grad.numpy()}


def run_cases(placement, prefix: str) -> dict:
    results = {}
    T = case_tensor(inputs(), placement)
    for name, (compute, _) in CASES.items():
        out = compute(T)
        results[f"{prefix}value_{name}"] = out.numpy()
        results[f"{prefix}sbp_{name}"] = repr(out.sbp[0])
        results[f"{prefix}local_size_{name}"] = out.to_local().numel()
    model, losses, grads = train(placement)
    results[f"{prefix}losses"] = losses
    for k, (p, g) in enumerate(zip(model.parameters(), grads)):
        results[f"{prefix}param_{k}"] = p.numpy()
        results[f"{prefix}param_sbp_{k}"] = repr(p.sbp[0])
        results[f"{prefix}grad_sbp_{k}"] = repr(g.sbp[0])
        results[f"{prefix}grad_local_{k}"] = g.to_local().numpy()  # broadcast: the whole gradient on its ranks
    return results


def main():
    out_dir = sys.argv[1]
    rank, world = flow.env.get_rank(), flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    results = run_cases(placement, "")
    results.update({f"refused_{k}": v for k, v in refusals(placement, rank).items()})
    subset = flow.placement("cpu", ranks=subset_ranks(world))
    results.update(run_cases(subset, "subset_"))
    one_rank = flow.placement("cpu", ranks=[world - 1])
    results.update({f"moved_{k}": v for k, v in moved(subset, one_rank).items()})
    results.update({f"moved_back_{k}": v for k, v in moved(one_rank, placement).items()})
    np.savez(f"{out_dir}/global_ops_rank{rank}.npz", **results)


if __name__ == "__main__":
    main()
