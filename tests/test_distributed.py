"""Distributed training: OneFlow's global-tensor API, DistributedDataParallel, data-parallel graphs.

In-process tests run at world size 1 (no MPI needed). The multi-process tests start 2 and 4 ranks
with mpiexec (tests/distributed/worker.py) and check that data-parallel training equals training
in one process on the global batch, and that ZeRO stage 3 equals stage 2 and plain data parallel
with a shard of the parameters per rank (tests/distributed/zero3_worker.py), that ZeRO 1/2/3 with
cross_entropy's mean over targets not ignored equals one process and PyTorch, that gradient
clipping inside build() and SyncBatchNorm equal one process on the global batch
(tests/distributed/clip_syncbn_worker.py), and that eager ops on global tensors, on every rank or
on some of them, equal local ops on the logical values (tests/distributed/global_ops_worker.py);
they skip when mpi4py or mpiexec is missing (`pip install -e '.[dist]'`).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flowgen as flow
from flowgen.distributed import launch
from flowgen.distributed.data_parallel import batch_reduction
from flowgen.ir.trace import Tracer
from flowgen.passes.gradient_allreduce import gradient_buckets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
import worker  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install -e '.[dist]')")


# ------------------------------------------------------------------ one process
def test_env_without_a_launcher_is_rank_0_of_1():
    assert (flow.env.get_rank(), flow.env.get_world_size(), flow.env.get_local_rank()) == (0, 1, 0)


def test_env_reads_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert (flow.env.get_rank(), flow.env.get_world_size(), flow.env.get_local_rank()) == (3, 4, 1)
    assert flow.env.get_node_size() == 2


def test_placement_and_sbp():
    p = flow.placement("cpu", ranks=[0])
    assert p == flow.placement.all("cpu") and p.ranks == [0] and p.hierarchy == (1,)
    assert repr(p) == 'flowgen.placement(type="cpu", ranks=[0])'
    assert repr(flow.sbp.split(1)) == "flowgen.sbp.split(dim=1)" and flow.sbp.split(1) == flow.sbp.split(1)
    assert flow.sbp.broadcast != flow.sbp.partial_sum
    with pytest.raises(ValueError, match="distinct ranks of this world of 1"):
        flow.placement("cpu", ranks=[0, 1])
    with pytest.raises(ValueError, match="flat list"):
        flow.placement("cpu", ranks=[[0]])
    with pytest.raises(ValueError, match="non-negative int"):
        flow.sbp.split(-1)


def test_to_global_and_back_on_one_rank():
    p = flow.placement("cpu", ranks=[0])
    x = flow.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    g = x.to_global(p, flow.sbp.split(0))
    assert g.is_global and not g.is_local and x.is_local
    assert g.shape == (2, 3) and g.placement == p and g.sbp == (flow.sbp.split(0),)
    np.testing.assert_array_equal(g.to_local().numpy(), x.numpy())
    b = g.to_global(sbp=flow.sbp.broadcast)
    assert b.sbp == (flow.sbp.broadcast,)
    np.testing.assert_array_equal(b.numpy(), x.numpy())
    assert g.to_global(p, [flow.sbp.split(0)]) is g       # same layout: the tensor itself
    assert "placement=flowgen.placement" in repr(g)


def test_global_tensor_errors_name_the_fix():
    x = flow.ones(2, 2)
    g = x.to_global(flow.placement("cpu", [0]), flow.sbp.broadcast)
    assert np.array_equal((g + 1).numpy(), np.full((2, 2), 2.0))   # eager ops on global tensors run
    with pytest.raises(RuntimeError, match="global and local tensors are mixed"):
        g + x
    with pytest.raises(RuntimeError, match="global.*to_local"):
        np.asarray(g)
    with pytest.raises(RuntimeError, match="already local"):
        x.to_local()
    with pytest.raises(RuntimeError, match="no placement"):
        x.placement
    with pytest.raises(ValueError, match="needs both placement and sbp"):
        x.to_global(flow.placement("cpu", [0]))
    with pytest.raises(ValueError, match="split"):
        x.to_global(flow.placement("cpu", [0]), flow.sbp.split(2))


def _train_eager(model, steps=3, batch=worker.GLOBAL_BATCH):
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = worker.global_batch()
    for s in range(steps):
        loss = flow.nn.functional.mse_loss(model(flow.tensor(xs[s, :batch])), flow.tensor(ys[s, :batch]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.numpy() for p in model.parameters()]


def test_ddp_on_one_rank_trains_exactly_like_the_module():
    plain = _train_eager(worker.make_model())
    wrapped = flow.nn.parallel.DistributedDataParallel(worker.make_model(), bucket_size=3)
    assert len(wrapped._data_parallel.buckets) == 2    # 4 parameters in buckets of 3
    for a, b in zip(plain, _train_eager(wrapped)):
        np.testing.assert_array_equal(a, b)


def test_ddp_requires_every_parameter_to_get_a_gradient():
    model = flow.nn.parallel.DistributedDataParallel(worker.make_model(), bucket_size=4)
    model[0](flow.randn(2, 6)).sum().backward()      # the last layer gets no gradient
    with pytest.raises(RuntimeError, match=r"no gradient to 2\.weight, 2\.bias"):
        model(flow.randn(2, 6))


def test_graph_of_a_ddp_module_runs_the_all_reduce_steps_on_one_rank():
    model = flow.nn.parallel.DistributedDataParallel(worker.make_model(), bucket_size=3)
    graph = worker.make_graph(model, flow.nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    plain = worker.make_model()
    xs, ys = worker.global_batch()
    half = worker.GLOBAL_BATCH // 2      # the batch of one of two ranks: its kernels are in the cache already
    for s in range(3):
        graph(flow.tensor(xs[s, :half]), flow.tensor(ys[s, :half]))
    steps = [k for k in graph.compiled.program.kernels if k.collective is not None]
    assert [len(k.args) for k in steps] == [6, 2]     # buckets of 3 gradients, 1 gradient (in + out)
    assert all(k.collective == {"op": "mean", "world_size": 1} for k in steps)
    assert not any("all_reduce" in k.ops for k in graph.compiled.program.kernels if k.source)   # host steps only
    for a, b in zip(_train_eager(plain, batch=half), model.parameters()):
        np.testing.assert_allclose(b.numpy(), a, rtol=1e-6, atol=1e-7)
    with pytest.raises(NotImplementedError, match="wrapped in DistributedDataParallel.*call the graph with global"):
        flow.save(graph, "unused_dir")


def test_enable_zero_on_one_rank_changes_nothing():
    model = flow.nn.parallel.DistributedDataParallel(worker.make_model(), bucket_size=3)
    graph = worker.make_graph(model, flow.nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.warns(UserWarning, match="enable_zero has no effect on a single device"):
        graph.config.enable_zero(True, stage=1, shard_min_size=1)
    xs, ys = worker.global_batch()
    half = worker.GLOBAL_BATCH // 2
    graph(flow.tensor(xs[0, :half]), flow.tensor(ys[0, :half]))
    assert graph.compiled.optimizer_state_bytes == sum(p.size_bytes() for p in model.parameters())
    assert graph.compiled.parameter_bytes == sum(p.size_bytes() for p in model.parameters())
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        graph.config.enable_zero(True, stage=4)


def test_gradient_buckets_follow_reverse_parameter_order():
    assert gradient_buckets(["w0", "b0", "w1", "b1", "w2"], 2) == [["w2", "b1"], ["w1", "b0"], ["w0"]]


def test_batch_reduction_reads_how_the_loss_combines_from_the_ir():
    """sum -> sum the ranks; a constant mean -> average; sum / sum (cross_entropy's mean) -> ratio;
    anything else -> unknown (refused for a loss, checked for an output)."""
    def kind(fn, *shapes_and_dtypes):
        tracer = Tracer("loss", flow.device("cpu"))
        inputs = [tracer.add_input(flow.ones(*shape, dtype=dtype), k) for k, (shape, dtype) in
                  enumerate(shapes_and_dtypes)]
        with tracer:
            out = fn(*inputs)
        found = batch_reduction(tracer.graph, out._value)
        return None if found is None else found.kind

    x = ((4, 3), flow.float32)
    labels = ((4,), flow.int64)
    assert kind(lambda a: flow.nn.MSELoss(reduction="sum")(a, a * 2), x) == "sum"
    assert kind(lambda a: flow.nn.MSELoss()(a, a * 2), x) == "mean"
    assert kind(lambda a: (a * a).sum(1).mean(), x) == "mean"
    assert kind(lambda a: a.sum() * 0.5, x) == "sum"
    assert kind(lambda a, t: flow.nn.CrossEntropyLoss()(a, t), x, labels) == "ratio"
    assert kind(lambda a: a.amax(), x) is None
    assert kind(lambda a: a.sum() / a.amax(), x) is None


def test_graph_inputs_must_be_split_on_dim_0_or_broadcast():
    model = worker.make_model()
    graph = worker.make_graph(model, flow.nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    p = flow.placement("cpu", [0])
    with pytest.raises(NotImplementedError, match=r"sbp flowgen.sbp.split\(dim=1\)"):
        graph(flow.randn(4, 6).to_global(p, flow.sbp.split(1)), flow.randn(4, 3))


def test_launcher_runs_mpiexec():
    assert launch.mpiexec_command(4, "train.py", ["--lr", "0.1"], mpiexec="/opt/mpi/bin/mpiexec") == [
        "/opt/mpi/bin/mpiexec", "-n", "4", sys.executable, "train.py", "--lr", "0.1"]
    with pytest.raises(SystemExit):
        launch.main(["--nnodes", "2", "train.py"])


# ---------------------------------------------------------------- several ranks
def _run_ranks(nproc: int, out_dir, *scenarios, via_launcher: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = [os.path.join(REPO, "tests", "distributed", "worker.py"), str(out_dir), *scenarios]
    command = ([sys.executable, "-m", "flowgen.distributed.launch", "--nproc_per_node", str(nproc), *script]
               if via_launcher else [MPIEXEC, "-n", str(nproc), sys.executable, *script])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


ZERO_CE = ("graph_zero1_ce", "graph_zero2_ce", "graph_zero3_ce")   # ZeRO 1/2/3, cross_entropy's mean


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    _run_ranks(2, out, "global_tensors", "unsupported", "graph_global_split", "graph_zero1", "graph_global_sum",
               "graph_global_ce", *ZERO_CE, "graph_ddp_sum", "graph_ddp_adam", "eager_ddp", via_launcher=True)
    return out


def FOUR_RANKS(*values):     # noqa: N802 (reads as a marker)
    """A 4-rank variant: marked slow (CI runs the 2-rank ones; `-m slow` these)."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("four_ranks")
    _run_ranks(4, out, "global_tensors", "graph_global_split", "graph_zero2", "graph_global_ce", *ZERO_CE)
    return out


def _assert_equals_one_process(result_file, scenario, world):
    losses, params = worker.reference(scenario, world)
    result = np.load(result_file)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-6)
    for k, p in enumerate(params):
        np.testing.assert_allclose(result[f"param_{k}"], p, rtol=1e-6, atol=1e-6 * np.abs(p).max())


@needs_mpi
@pytest.mark.parametrize("scenario", ["graph_global_split", "graph_global_sum", "graph_global_ce", "graph_ddp_sum",
                                      "graph_ddp_adam", "eager_ddp"])
def test_two_ranks_train_like_one_process_on_the_global_batch(two_ranks, scenario):
    _assert_equals_one_process(two_ranks / f"{scenario}.npz", scenario, 2)


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["graph_global_split", "graph_global_ce"])
def test_four_ranks_train_like_one_process_on_the_global_batch(four_ranks, scenario):
    _assert_equals_one_process(four_ranks / f"{scenario}.npz", scenario, 4)


@needs_mpi
@pytest.mark.parametrize(("ranks", "stage"), [("two_ranks", 1), FOUR_RANKS("four_ranks", 2)])
def test_zero_equals_plain_data_parallel_with_a_shard_of_the_state_per_rank(request, ranks, stage):
    out = request.getfixturevalue(ranks)
    plain, zero = np.load(out / "graph_global_split.npz"), np.load(out / f"graph_zero{stage}.npz")
    for key in plain.files:
        if key.startswith(("param_", "slot_")) or key == "losses":   # slots: the gathered momentum buffers
            if stage == 1:      # the same arithmetic per element
                np.testing.assert_array_equal(zero[key], plain[key], err_msg=key)
            else:               # reduce-scatter may add the ranks in another order than all-reduce
                np.testing.assert_allclose(zero[key], plain[key], rtol=1e-6, atol=1e-7, err_msg=key)
    world = 2 if ranks == "two_ranks" else 4
    # Stage 2 reduce-scatters the gradients of sharded parameters: at 4 ranks the 3 biases (fewer
    # elements than ranks) stay whole and keep an all-reduce.
    expected = {1: {"all_reduce", "all_gather"}, 2: {"reduce_scatter", "all_gather"} | (
        {"all_reduce"} if world == 4 else set())}[stage]
    assert set(zero["collectives"]) == expected and set(plain["collectives"]) == {"all_reduce"}
    whole = int(plain["state_bytes"].ravel()[0])
    params = [k for k in plain.files if k.startswith("param_")]
    assert whole == sum(plain[k].nbytes for k in params)          # SGD momentum: one slot per parameter
    per_rank = zero["state_bytes"].ravel()
    assert len(per_rank) == world and per_rank.sum() >= whole
    assert per_rank.max() <= whole / world + 4 * len(params)       # + at most one float per parameter


def _torch_reference(scenario: str) -> tuple:
    """PyTorch trains the same model (flowgen's initial parameters) on the whole global batch."""
    torch = pytest.importorskip("torch")
    _mode, loss_kind, opt_kind = worker.SCENARIOS[scenario]
    assert loss_kind == "ce_ignore"
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, q in zip(model.parameters(), worker.make_model().parameters()):
            p.copy_(torch.from_numpy(q.numpy()))
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_kind == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=0.01))
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-1)
    xs, ys = worker.global_batch()
    ys = worker.targets(loss_kind, ys)
    losses = []
    for s in range(worker.STEPS):
        loss = loss_fn(model(torch.from_numpy(xs[s])), torch.from_numpy(ys[s]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), [p.detach().numpy().copy() for p in model.parameters()]


@needs_mpi
@pytest.mark.parametrize("ranks", ["two_ranks", FOUR_RANKS("four_ranks")])
@pytest.mark.parametrize("scenario", ZERO_CE)
def test_zero_with_cross_entropy_mean_and_ignored_targets_trains_like_one_process(request, ranks, scenario):
    """cross_entropy's mean divides by the count of targets not ignored, a sum over the batch: every
    rank differentiates its share of the global-batch loss (the count all-reduced first). The ignored
    targets sit in rank 0's rows (at 4 ranks all of them: its own count is 0)."""
    out = request.getfixturevalue(ranks)
    world = 2 if ranks == "two_ranks" else 4
    _assert_equals_one_process(out / f"{scenario}.npz", scenario, world)
    result = np.load(out / f"{scenario}.npz")
    torch_losses, torch_params = _torch_reference(scenario)
    np.testing.assert_allclose(result["losses"], torch_losses, rtol=1e-5)
    for k, p in enumerate(torch_params):
        np.testing.assert_allclose(result[f"param_{k}"], p, rtol=1e-5, atol=1e-5 * np.abs(p).max())
    stage = worker.zero_stage(scenario)
    assert {1: "all_gather", 2: "reduce_scatter", 3: "reduce_scatter"}[stage] in set(result["collectives"])
    plain = np.load(out / "graph_global_ce.npz")
    whole = int(plain["state_bytes"].ravel()[0])        # SGD's momentum: one slot as large as the parameters
    slots = {"sgd": 1, "adam": 2}[worker.SCENARIOS[scenario][2]]
    params = [k for k in plain.files if k.startswith("param_")]
    assert result["state_bytes"].ravel().max() <= slots * (whole / world + 4 * len(params))
    if stage == 1:      # the same arithmetic per element as plain data parallel
        for key in plain.files:
            if key.startswith("param_") or key == "losses":
                np.testing.assert_array_equal(result[key], plain[key], err_msg=key)


@needs_mpi
def test_what_flowgen_cannot_split_raises_on_several_ranks(two_ranks):
    messages = np.load(two_ranks / "unsupported.npz")
    assert "set_stage on model.0 (stage 0) in a data-parallel graph" in str(messages["set_stage"])
    assert "needs a data-parallel graph" in str(messages["zero_without_data_parallel"])
    assert "enable_zero(stage=2): the gradient of model.0.weight is also read by" in str(
        messages["zero_stage2_with_clipping"])


@needs_mpi
@pytest.mark.parametrize("ranks", ["two_ranks", FOUR_RANKS("four_ranks")])
def test_to_global_conversions_across_ranks(request, ranks):
    r = np.load(request.getfixturevalue(ranks) / "global_tensors.npz")
    world = 2 if ranks == "two_ranks" else 4
    parts = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * k for k in range(world)]
    assert list(r["split_shape"]) == [2 * world, 3] and list(r["split1_shape"]) == [2, 3 * world]
    np.testing.assert_array_equal(r["split_to_broadcast"], np.concatenate(parts, 0))
    np.testing.assert_array_equal(r["split1_numpy"], np.concatenate(parts, 1))
    np.testing.assert_array_equal(r["broadcast_local"], parts[0])          # rank 0's data everywhere
    np.testing.assert_array_equal(r["broadcast_to_split_all"], parts[0])   # ... as the other ranks' pieces show
    np.testing.assert_array_equal(r["partial_to_broadcast"], sum(parts))
    np.testing.assert_array_equal(r["partial_to_split_all"], sum(parts))


# ------------------------------------------------------- ZeRO stage 3, several ranks
import zero3_worker  # noqa: E402


@pytest.fixture(scope="module", params=[2, FOUR_RANKS(4)], ids=["two_ranks", "four_ranks"])
def zero3_ranks(request, tmp_path_factory):
    """(world size, rank 0's results of tests/distributed/zero3_worker.py by "<optimizer>_<mode>")."""
    world = request.param
    out = tmp_path_factory.mktemp(f"zero3_{world}")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = os.path.join(REPO, "tests", "distributed", "zero3_worker.py")
    result = subprocess.run([MPIEXEC, "-n", str(world), sys.executable, script, str(out)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return world, {f"{opt}_{mode}": np.load(out / f"{opt}_{mode}.npz")
                   for opt in ("sgd", "adamw") for mode in zero3_worker.MODES}


@needs_mpi
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_zero3_equals_zero2_and_plain_data_parallel(zero3_ranks, opt):
    """Parameters as eager code reads them after the steps, the gathered optimizer slots, the
    parameters graph.state_dict() returns and the losses; after eager code wrote the parameters,
    the next step's parameters and an eval graph's output: stage 3 equals stage 2 bit for bit (the
    same reduce-scatters, the same values gathered) and plain data parallel within 1e-6."""
    _world, runs = zero3_ranks
    plain, zero2, zero3 = (runs[f"{opt}_{mode}"] for mode in ("plain", "zero2", "zero3"))
    keys = [k for k in plain.files if k.startswith(("param_", "slot_", "saved_", "rewritten_"))
            or k in ("losses", "evaluated")]
    assert len([k for k in keys if k.startswith("saved_")]) == 4
    for key in keys:
        np.testing.assert_array_equal(zero3[key], zero2[key], err_msg=key)
        np.testing.assert_allclose(zero3[key], plain[key], rtol=1e-6, atol=1e-6 * np.abs(plain[key]).max(),
                                   err_msg=key)
    for k in range(4):
        np.testing.assert_array_equal(zero3[f"saved_{k}"], zero3[f"param_{k}"])
    assert not np.array_equal(zero3["param_0"], worker.make_model()[0].weight.numpy())   # it trained
    assert bool(zero3["resumed"])       # a checkpoint round trip resumes the same step


@needs_mpi
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize(("mode", "shard_min_size"), [("zero3", 1), ("zero3_min20", 20)])
def test_zero3_keeps_a_shard_of_parameters_and_state_per_rank(zero3_ranks, opt, mode, shard_min_size):
    """graph.compiled.parameter_bytes + optimizer_state_bytes: this rank's pieces, <= the whole / N
    + one element per sharded tensor, + the parameters kept whole (below shard_min_size, or fewer
    elements than ranks) and their slots."""
    world, runs = zero3_ranks
    plain, zero3 = runs[f"{opt}_plain"], runs[f"{opt}_{mode}"]
    slots = 1 if opt == "sgd" else 2                       # momentum / exp_avg, exp_avg_sq
    numels = [plain[f"param_{k}"].size for k in range(4)]  # 96, 16, 48, 3
    assert plain["bytes"].tolist() == [[4 * sum(numels), 4 * slots * sum(numels)]] * world
    whole = [n for n in numels if n < max(world, shard_min_size)]
    per_rank = zero3["bytes"].sum(axis=1)                  # parameter + optimizer-state bytes of each rank
    for rank in range(world):
        sizes = [n if n in whole else n // world + (rank < n % world) for n in numels]
        assert zero3["bytes"][rank].tolist() == [4 * sum(sizes), 4 * slots * sum(sizes)]
    bound = (1 + slots) * 4 * (sum(numels) / world + (len(numels) - len(whole)) + sum(whole))
    assert per_rank.max() <= bound and per_rank.sum() >= (1 + slots) * 4 * sum(numels)
    for key in [k for k in plain.files if k.startswith(("param_", "slot_")) or k == "losses"]:
        np.testing.assert_allclose(zero3[key], plain[key], rtol=1e-6, atol=1e-6 * np.abs(plain[key]).max(),
                                   err_msg=key)


@needs_mpi
def test_zero3_gathers_each_layer_just_in_time_and_nothing_after_the_update(zero3_ranks):
    """Each Linear layer's pieces are all-gathered right before its forward (the second layer's
    after the first layer's kernels), the second layer's weight again before its backward (the
    first layer's is not read there: the input needs no gradient). Each copy is a temporary of
    the memory plan that dies before the next gather of the same parameter: the forward copies
    within the forward. Gradients are reduce-scattered (the biases too small to shard at 4 ranks
    all-reduced) and no all_gather follows: the next step gathers the updated pieces again."""
    world, runs = zero3_ranks
    for opt in ("sgd", "adamw"):
        result = runs[f"{opt}_zero3"]
        launches = list(result["launches"])
        gathers = [i for i, op in enumerate(launches) if op == "all_gather"]
        assert len(gathers) == 3 and gathers[0] == 0 and launches[1] == "kernel"
        assert gathers[0] < gathers[1] - 1 < gathers[2] - 2 and gathers[2] < launches.index("reduce_scatter")
        assert "all_gather" not in launches[launches.index("reduce_scatter"):]
        small_biases = {"all_reduce"} if world == 4 else set()
        assert set(launches) - {"kernel"} == {"all_gather", "reduce_scatter"} | small_biases
        copies = result["copies"].tolist()      # [nth, first launch, last launch] per gathered parameter
        forward, backward = [c for c in copies if c[0] == 0], [c for c in copies if c[0] == 1]
        assert len(forward) == (4 if world == 2 else 3) and len(backward) == 1   # the unsharded bias: no copy
        assert max(last for _, _, last in forward) < backward[0][1]
        assert backward[0][2] < launches.index("reduce_scatter")


# ---------------------------------------------- eager ops on global tensors, several ranks
import global_ops_worker  # noqa: E402


@pytest.fixture(scope="module", params=[2, FOUR_RANKS(4)], ids=["two_ranks", "four_ranks"])
def global_ops_ranks(request, tmp_path_factory):
    """Every rank's results of tests/distributed/global_ops_worker.py (a hang fails the timeout)."""
    world = request.param
    out = tmp_path_factory.mktemp(f"global_ops_{world}")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = os.path.join(REPO, "tests", "distributed", "global_ops_worker.py")
    result = subprocess.run([sys.executable, "-m", "flowgen.distributed.launch", "--nproc_per_node", str(world),
                             script, str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return [np.load(out / f"global_ops_rank{r}.npz") for r in range(world)]


@needs_mpi
@pytest.mark.parametrize("case", list(global_ops_worker.CASES))
def test_global_eager_ops_equal_local_ops_on_the_logical_tensors(global_ops_ranks, case):
    expected = global_ops_worker.reference_case(case)
    sbp = global_ops_worker.CASES[case][1]
    for rank, result in enumerate(global_ops_ranks):
        assert str(result[f"sbp_{case}"]) == repr(sbp), f"rank {rank}"
        np.testing.assert_allclose(result[f"value_{case}"], expected, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")


@needs_mpi
@pytest.mark.parametrize("case", list(global_ops_worker.CASES))
def test_global_eager_ops_on_some_of_the_ranks_equal_local_ops(global_ops_ranks, case):
    """The same cases on a placement of some ranks in another order ([1, 0] of 2, [3, 1] of 4): its
    ranks compute, the others hold no component and read the logical value with numpy()."""
    expected = global_ops_worker.reference_case(case)
    sbp = global_ops_worker.CASES[case][1]
    holders = global_ops_worker.subset_ranks(len(global_ops_ranks))
    for rank, result in enumerate(global_ops_ranks):
        assert str(result[f"subset_sbp_{case}"]) == repr(sbp), f"rank {rank}"
        np.testing.assert_allclose(result[f"subset_value_{case}"], expected, rtol=1e-5, atol=1e-6,
                                   err_msg=f"rank {rank}")
        if rank not in holders:
            assert int(result[f"subset_local_size_{case}"]) == 0, f"rank {rank}"


@needs_mpi
def test_global_training_on_some_of_the_ranks_and_gradients_across_placements(global_ops_ranks):
    """SGD of a model placed on some ranks equals one process; a loss on another placement than the
    weight it differentiates gives the weight (on its placement) the one-process gradient."""
    losses, params, grads = global_ops_worker.reference_training()
    holders = global_ops_worker.subset_ranks(len(global_ops_ranks))
    moved = global_ops_worker.reference_moved()
    for rank, result in enumerate(global_ops_ranks):
        np.testing.assert_allclose(result["subset_losses"], losses, rtol=1e-6, err_msg=f"rank {rank}")
        for k, (p, g) in enumerate(zip(params, grads)):
            np.testing.assert_allclose(result[f"subset_param_{k}"], p, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank}")
            if rank in holders:
                np.testing.assert_allclose(result[f"subset_grad_local_{k}"], g, rtol=1e-5, atol=1e-6)
            else:
                assert result[f"subset_grad_local_{k}"].size == 0
        for prefix in ("moved_", "moved_back_"):
            for key, value in moved.items():
                np.testing.assert_allclose(result[prefix + key], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{prefix}{key} rank {rank}")
        assert str(result["moved_w_grad_placement"]) == f'flowgen.placement(type="cpu", ranks={holders})'
        last = len(global_ops_ranks) - 1
        assert str(result["moved_back_w_grad_placement"]) == f'flowgen.placement(type="cpu", ranks=[{last}])'


@needs_mpi
def test_global_sgd_on_a_split_batch_equals_one_process_on_the_whole_batch(global_ops_ranks):
    losses, params, grads = global_ops_worker.reference_training()
    for rank, result in enumerate(global_ops_ranks):
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-6, err_msg=f"rank {rank}")
        for k, (p, g) in enumerate(zip(params, grads)):
            assert str(result[f"param_sbp_{k}"]) == str(result[f"grad_sbp_{k}"]) == repr(flow.sbp.broadcast)
            np.testing.assert_allclose(result[f"param_{k}"], p, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank}")
            np.testing.assert_allclose(result[f"grad_local_{k}"], g, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
            np.testing.assert_array_equal(result[f"grad_local_{k}"], global_ops_ranks[0][f"grad_local_{k}"])


@needs_mpi
def test_global_eager_refusals_raise_on_every_rank_and_leave_none_waiting(global_ops_ranks):
    expected = {
        "reshape_split": r"NotImplementedError: flowgen has no eager reshape .*split\(dim=0\)",
        "dropout": "NotImplementedError: flowgen has no eager dropout on global tensors",
        "rand_like": "NotImplementedError: flowgen has no rand_like of a global tensor",
        "split_along_different_dims": "NotImplementedError: .*split along different dims",
    }
    total = str(global_ops_worker.inputs()["x"].sum())
    for rank, result in enumerate(global_ops_ranks):
        for name, pattern in expected.items():
            assert re.match(pattern, str(result[f"refused_{name}"])), (rank, str(result[f"refused_{name}"]))
        failed = str(result["refused_fails_on_rank_1_only"])
        assert failed == ("ValueError: bad index in this piece" if rank == 1 else
                          "RuntimeError: example on global tensors failed on rank 1 (this rank's part ran): "
                          "ValueError: bad index in this piece")
        for name in [*expected, "fails_on_rank_1_only"]:     # and the ranks went on together
            np.testing.assert_allclose(float(result[f"refused_{name}_then"]), float(total), rtol=1e-5)


# ------------------------------------------------- pipeline stages (set_stage), several ranks
import pipeline_worker  # noqa: E402


def _run_pipeline(nproc: int, out, *scenarios):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = os.path.join(REPO, "tests", "distributed", "pipeline_worker.py")
    result = subprocess.run([MPIEXEC, "-n", str(nproc), sys.executable, script, str(out), *scenarios],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def pipeline_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_two_ranks")
    _run_pipeline(2, out, "sgd_acc2", "adam_acc4", "placed_sgd_acc2", "unsupported")
    return out


@pytest.fixture(scope="module")
def pipeline_three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_three_ranks")
    _run_pipeline(3, out, "three_stages_adam_acc3", "placed_three_stages_adam_acc3")
    return out


def _assert_pipeline_equals_one_device(out, scenario: str, world: int):
    expected = pipeline_worker.train(scenario, staged=False)
    for rank in range(world):
        result = np.load(out / f"{scenario}_rank{rank}.npz")
        assert set(result.files) == set(expected)
        for key in expected:
            if key != "transfers":   # losses, every parameter and optimizer slot, on every rank
                np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-7,
                                           err_msg=f"rank {rank}: {key}")


@needs_mpi
@pytest.mark.parametrize("scenario", ["sgd_acc2", "adam_acc4", "placed_sgd_acc2"])
def test_two_stage_pipeline_trains_like_one_device(pipeline_two_ranks, scenario):
    _assert_pipeline_equals_one_device(pipeline_two_ranks, scenario, 2)


@needs_mpi
def test_placed_stages_and_inputs_move_only_what_another_stage_reads(pipeline_two_ranks):
    """OneFlow's placements (modules on their stage's rank, x on stage 0's, y on the last's) send
    the same activations and gradients as local modules and inputs: no input crosses; with three
    stages and y on stage 0's rank, y goes to the last stage once, first (slow: 3 ranks)."""
    for rank in range(2):
        placed = np.load(pipeline_two_ranks / f"placed_sgd_acc2_rank{rank}.npz")["transfers"]
        local = np.load(pipeline_two_ranks / f"sgd_acc2_rank{rank}.npz")["transfers"]
        assert list(placed) == list(local)


@needs_mpi
def test_pipeline_stages_run_one_forward_one_backward(pipeline_two_ranks):
    """Four micro-batches on two stages: stage 0 sends micro-batch j + 1's activation before it
    waits for j's gradient (1F1B; GPipe would send all four first); the last recv is the loss."""
    first = [str(t) for t in np.load(pipeline_two_ranks / "adam_acc4_rank0.npz")["transfers"]]
    last = [str(t) for t in np.load(pipeline_two_ranks / "adam_acc4_rank1.npz")["transfers"]]
    assert first == ["send", "send", "recv", "send", "recv", "send", "recv", "recv", "recv"]
    assert last == ["recv", "send"] * 4 + ["send"]


@needs_mpi
@pytest.mark.slow
def test_three_stage_pipeline_trains_like_one_device(pipeline_three_ranks):
    _assert_pipeline_equals_one_device(pipeline_three_ranks, "three_stages_adam_acc3", 3)
    _assert_pipeline_equals_one_device(pipeline_three_ranks, "placed_three_stages_adam_acc3", 3)
    first = [str(t) for t in np.load(pipeline_three_ranks / "placed_three_stages_adam_acc3_rank0.npz")["transfers"]]
    last = [str(t) for t in np.load(pipeline_three_ranks / "placed_three_stages_adam_acc3_rank2.npz")["transfers"]]
    local = [str(t) for t in np.load(pipeline_three_ranks / "three_stages_adam_acc3_rank0.npz")["transfers"]]
    assert first == ["send"] + local and last[0] == "recv"     # y, placed on rank 0, is sent to stage 2 first


@needs_mpi
def test_what_pipelines_cannot_do_raises_naming_the_module(pipeline_two_ranks):
    for rank in range(2):
        messages = np.load(pipeline_two_ranks / f"unsupported_rank{rank}.npz")
        assert "set_stage on model.stage0 (stage 0) with placement" in str(messages["two_ranks_in_a_stage"])
        assert "exactly one rank" in str(messages["two_ranks_in_a_stage"])
        assert "stages [0, 1, 2] the ranks [0, 1, 1]" in str(messages["three_stages_on_two_ranks"])
        assert "parameter model.stage1.2.weight belongs to no module with set_stage" in str(
            messages["parameter_without_stage"])
        assert "model.stage1.0 (stage 0) reads a value computed on stage 1 in the forward pass" in str(
            messages["forward_to_an_earlier_stage"])
        assert "combines values of stages [0, 1] after the micro-batches (gradient clipping by a global norm" in str(
            messages["clipping_by_the_global_norm"])
        assert "the graph is a pipeline (set_stage)" in str(messages["save"])


# ------------------------------------- gradient clipping in build() and SyncBatchNorm, several ranks
import clip_syncbn_worker  # noqa: E402

CLIP_SYNCBN_SCENARIOS = {2: ["clip_norm", "clip_value", "clip_norm_zero1", "clip_norm_zero2", "clip_value_zero2",
                             "clip_inf_zero2", "syncbn_graph", "syncbn_graph_ce", "syncbn_graph_zero3",
                             "syncbn_eager_ddp", "syncbn_refusals", "gpt_ddp"],
                         4: ["clip_norm", "clip_norm_zero2", "clip_norm_zero3", "syncbn_graph", "syncbn_graph_ce"]}


def _clip_syncbn_runs(world: int, tmp_path_factory) -> tuple:
    """(world size, rank 0's results of tests/distributed/clip_syncbn_worker.py by scenario)."""
    out = tmp_path_factory.mktemp(f"clip_syncbn_{world}")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = os.path.join(REPO, "tests", "distributed", "clip_syncbn_worker.py")
    result = subprocess.run([MPIEXEC, "-n", str(world), sys.executable, script, str(out),
                             *CLIP_SYNCBN_SCENARIOS[world]], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return world, {s: np.load(out / f"{s}.npz") for s in CLIP_SYNCBN_SCENARIOS[world]}


@pytest.fixture(scope="module")
def clip_syncbn_2(tmp_path_factory):
    return _clip_syncbn_runs(2, tmp_path_factory)


@pytest.fixture(scope="module")
def clip_syncbn_4(tmp_path_factory):
    return _clip_syncbn_runs(4, tmp_path_factory)


def _runs_with(scenario_filter) -> list:
    """(fixture, scenario) pairs of the runs whose scenario passes `scenario_filter`."""
    return [(FOUR_RANKS if world == 4 else pytest.param)(f"clip_syncbn_{world}", s)
            for world, names in CLIP_SYNCBN_SCENARIOS.items() for s in names if scenario_filter(s)]


def _assert_close_to(result, expected: dict, tol: float):
    for key, value in expected.items():
        np.testing.assert_allclose(result[key], value, rtol=tol, atol=tol * max(np.abs(value).max(initial=0), 1e-3),
                                   err_msg=key)


@needs_mpi
@pytest.mark.parametrize(("ranks", "scenario"), _runs_with(lambda s: s in ("clip_norm", "clip_value")))
def test_clipping_in_build_of_a_data_parallel_graph_clips_the_global_batch_gradients(request, ranks, scenario):
    """nanoGPT's loop (loss.backward(); clip_grad_norm_ / clip_grad_value_ in build()) on 2 and 4
    ranks equals one process on the global batch: the clip reads the all-reduced gradients, the
    returned total norm is the global one, and the clipping is active (the unclipped run differs)."""
    world, runs = request.getfixturevalue(ranks)
    expected = clip_syncbn_worker.reference(scenario)
    _assert_close_to(runs[scenario], expected, 1e-6)
    if scenario == "clip_norm":
        assert len(expected["norms"]) == clip_syncbn_worker.STEPS
        assert (expected["norms"] > clip_syncbn_worker.MAX_NORM).all()
    unclipped = clip_syncbn_worker.reference(scenario, clipping=False)
    assert not np.allclose(unclipped["param_0"], expected["param_0"], rtol=1e-3)
    assert list(runs[scenario]["collectives"]) == ["all_reduce"]


@needs_mpi
@pytest.mark.parametrize(("ranks", "scenario"),
                         _runs_with(lambda s: s.startswith(("clip_norm_zero", "clip_value_zero"))))
def test_clipping_in_build_with_zero_equals_plain_data_parallel(request, ranks, scenario):
    """ZeRO-1 clips the all-reduced gradients (bit for bit plain data parallel's); ZeRO-2/3 clip
    the reduce-scattered pieces, the norm summed over the ranks by one all_reduce of a scalar (at 4
    ranks the biases, fewer elements than ranks, stay whole and all-reduced: one all_reduce for
    them too), and no full reduced gradient is gathered: only the update's all_gather (stage 2) or
    the parameters' just-in-time gathers (stage 3) remain."""
    world, runs = request.getfixturevalue(ranks)
    plain, result = runs["clip_norm" if "norm" in scenario else "clip_value"], runs[scenario]
    for key in [k for k in result.files if k.startswith("param_") or k in ("losses", "norms")]:
        if scenario.endswith("zero1"):
            np.testing.assert_array_equal(result[key], plain[key], err_msg=key)
        else:
            np.testing.assert_allclose(result[key], plain[key], rtol=1e-6, atol=1e-6 * np.abs(plain[key]).max(
                initial=1e-3), err_msg=key)
    stage, whole_biases = int(scenario[-1]), ["all_reduce"] * (world == 4)
    norm = ["all_reduce"] * ("norm" in scenario)
    expected = {1: ["all_reduce", "all_gather"], 2: ["reduce_scatter", "all_gather"] + norm + whole_biases,
                3: ["all_gather"] * 3 + ["reduce_scatter"] + norm + whole_biases}[stage]
    assert sorted(result["collectives"]) == sorted(expected)


@needs_mpi
def test_nanogpt_loop_with_ddp_in_a_graph_equals_one_process(clip_syncbn_2):
    """examples/gpt_char.py --graph --ddp on 2 ranks (AdamW groups, warm-up + cosine LR,
    clip_grad_norm_ in build(), tied embedding) equals its eager loop in one process on the whole
    batch: the losses within 1e-6, the parameters within Adam's amplified rounding (as the
    example's own eager-vs-PyTorch test)."""
    _world, runs = clip_syncbn_2
    expected = clip_syncbn_worker.reference("gpt_ddp")
    np.testing.assert_allclose(runs["gpt_ddp"]["losses"], expected["losses"], rtol=1e-6)
    for key in [k for k in expected if k.startswith("param_")]:
        np.testing.assert_allclose(runs["gpt_ddp"][key], expected[key], rtol=1e-4, atol=3e-5, err_msg=key)


@needs_mpi
def test_zero2_refuses_the_max_norm_in_build(clip_syncbn_2):
    _world, runs = clip_syncbn_2
    message = str(runs["clip_inf_zero2"]["message"])
    assert "clip_grad_norm_(norm_type=inf) inside build() with enable_zero(stage=2|3)" in message
    assert "use a finite norm_type or stage=1" in message


@needs_mpi
@pytest.mark.parametrize(("ranks", "scenario"),
                         _runs_with(lambda s: s.startswith("syncbn_") and s != "syncbn_refusals"))
def test_sync_batchnorm_on_several_ranks_equals_batchnorm_on_the_global_batch(request, ranks, scenario):
    """A conv net with SyncBatchNorm trained 3 SGD steps in a data-parallel graph (MSE mean, and
    cross_entropy's mean with the ranks' counts of non-ignored targets differing; MSE with ZeRO-3)
    and eagerly under DDP equals one process with BatchNorm2d on the global batch: losses,
    parameters and running statistics (unbiased global variance). The graph all-reduces in the forward (sums
    and counts, then squared deviations) and the backward (the two channel sums) besides the
    gradients' bucket."""
    world, runs = request.getfixturevalue(ranks)
    expected = clip_syncbn_worker.reference(scenario)
    prefix = "buffer_0.1." if scenario.endswith("_ce") else "buffer_1."
    assert {k for k in expected if k.startswith("buffer_")} == {
        prefix + name for name in ("running_mean", "running_var", "num_batches_tracked")}
    _assert_close_to(runs[scenario], expected, 1e-5)
    if scenario == "syncbn_graph":
        assert list(runs[scenario]["collectives"]) == ["all_reduce"] * 4


@needs_mpi
def test_sync_batchnorm_refuses_what_it_would_get_wrong(clip_syncbn_2):
    _world, runs = clip_syncbn_2
    messages = runs["syncbn_refusals"]
    assert "SyncBatchNorm (model.1) in a pipelined graph" in str(messages["pipeline"])
    assert "SyncBatchNorm: a global input (sbp flowgen.sbp.split(dim=0)) on 2 ranks is not supported" in str(
        messages["global"])
