"""OneFlow's pipeline-parallel tutorial as written (tests/distributed/oneflow_pipeline_worker.py,
run on 2 ranks): modules and inputs placed on one rank each with `to_global`, the activation moved
to the next stage's placement, `config.set_stage` in the graph. The graph and the same module
trained eagerly equal one process training the tutorial's model eagerly on the data each placed
tensor takes (its placement's rank's). Skips without mpi4py and mpiexec (`pip install -e '.[dist]'`).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flowgen as flow

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
import oneflow_pipeline_worker as worker  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                                reason="needs mpi4py and mpiexec (pip install -e '.[dist]')")
SCENARIOS = ("graph", "graph_labels_on_stage0", "graph_momentum", "eager", "one_placement", "refusals")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each scenario's results on rank 0 and rank 1."""
    out = tmp_path_factory.mktemp("oneflow_pipeline")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    command = [MPIEXEC, "-n", "2", sys.executable, os.path.join(REPO, "tests", "distributed",
                                                                 "oneflow_pipeline_worker.py"), str(out), *SCENARIOS]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return {scenario: [np.load(out / f"{scenario}_rank{rank}.npz") for rank in (0, 1)] for scenario in SCENARIOS}


@functools.lru_cache(maxsize=None)
def _reference(scenario: str) -> dict:
    return worker.reference("graph" if scenario == "eager" else scenario)


def _assert_trains_like_one_process(results, scenario: str):
    expected = _reference(scenario)
    for rank, result in enumerate(results):
        np.testing.assert_allclose(result["losses"], expected["losses"], rtol=1e-6, err_msg=f"rank {rank}")
        params = [k for k in expected if k.startswith("param.")]
        assert sorted(params) == sorted(k for k in result.files if k.startswith("param.")) and len(params) == 6
        for key in params:   # every rank reads every stage's trained parameters
            np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-6, err_msg=f"{key} rank {rank}")


@pytest.mark.parametrize("scenario", ["graph", "graph_labels_on_stage0", "eager"])
def test_the_tutorials_pipeline_trains_like_one_process(ranks, scenario):
    """Stage 0 and x take rank 0's values, stage 1 and y rank 1's (each rank drew its own), and
    training equals one process on those values: the graph (2 micro-batches, 1F1B), the graph with
    the labels placed on stage 0's rank, and the module trained eagerly on its placements."""
    _assert_trains_like_one_process(ranks[scenario], scenario)


def test_placed_optimizer_slots_are_read_from_any_rank_and_a_checkpoint_resumes_exactly(ranks):
    """SGD with momentum: each stage's buffers live on its rank; graph.state_dict() on either rank
    gives the one-process buffers, and loading a checkpoint copied out after the steps (parameters
    and slots written back on their ranks) repeats the next two steps bit for bit."""
    _assert_trains_like_one_process(ranks["graph_momentum"], "graph_momentum")
    expected = _reference("graph_momentum")
    slots = [k for k in expected if k.startswith("slot.")]
    assert len(slots) == 6
    for rank, result in enumerate(ranks["graph_momentum"]):
        assert sorted(slots) == sorted(k for k in result.files if k.startswith("slot."))
        for key in slots:
            np.testing.assert_allclose(result[key], expected[key], rtol=1e-6, atol=1e-7, err_msg=f"{key} rank {rank}")
        np.testing.assert_array_equal(result["resumed"], result["after"])


def test_the_loss_comes_back_on_the_last_stages_placement(ranks):
    rank0, rank1 = ranks["graph"]
    assert str(rank0["loss_placement"]) == str(rank1["loss_placement"]) == 'flowgen.placement(type="cpu", ranks=[1])'
    assert rank0["local_losses"].size == 0      # to_local() outside the placement: empty, as OneFlow's
    np.testing.assert_array_equal(rank1["local_losses"], rank1["losses"])
    np.testing.assert_array_equal(rank0["losses"], rank1["losses"])    # numpy() reads it from any rank


def test_each_placed_input_stays_on_its_rank_unless_another_stage_reads_it(ranks):
    """1F1B with 2 micro-batches: stage 0 sends 2 activations and receives 2 gradients and the loss;
    x (on rank 0) and y (on rank 1) are read where they are and never sent. With the labels on
    rank 0, stage 0 sends them to the loss on stage 1 once, at the start of the step."""
    placed = [list(r["transfers"]) for r in ranks["graph"]]
    assert placed == [["send", "send", "recv", "recv", "recv"], ["recv", "send", "recv", "send", "send"]]
    moved = [list(r["transfers"]) for r in ranks["graph_labels_on_stage0"]]
    assert moved == [["send", "send", "send", "recv", "recv", "recv"],
                     ["recv", "recv", "send", "recv", "send", "send"]]


def test_a_graph_on_one_rank_runs_there_only(ranks):
    """Modules and inputs all on rank 1, no stages: rank 1 trains, rank 0 runs nothing and gets the
    loss without a component (reading it with numpy() fetches rank 1's)."""
    _assert_trains_like_one_process(ranks["one_placement"], "one_placement")
    rank0, rank1 = ranks["one_placement"]
    assert list(rank0["local_sizes"]) == [0] * worker.STEPS and list(rank1["local_sizes"]) == [1] * worker.STEPS
    assert str(rank0["saved"]) == "" and str(rank1["saved"])    # flow.save: rank 1 wrote the graph it ran
    saved = flow.load(str(rank1["saved"]))
    expected = _reference("one_placement")
    for key, value in expected.items():
        if key.startswith("param."):
            np.testing.assert_array_equal(saved.weights["module." + key[len("param."):]], rank1[key])


def test_placements_a_graph_cannot_run_raise_naming_the_module_and_placement(ranks):
    for result in ranks["refusals"]:
        assert ("module_pipeline.m_stage0.linear0.weight is on flowgen.placement(type=\"cpu\", ranks=[0]) with sbp "
                "flowgen.sbp.broadcast but set_stage puts module_pipeline.m_stage0 (stage 0) on "
                "flowgen.placement(type=\"cpu\", ranks=[1])") in str(result["stage_on_the_wrong_rank"])
        assert ("input 0 is on flowgen.placement(type=\"cpu\", ranks=[0]) but module_pipeline.m_stage1.linear1.weight "
                "on flowgen.placement(type=\"cpu\", ranks=[1]); a graph runs on one placement, or as a pipeline"
                ) in str(result["two_placements_without_stages"])
        assert str(result["split_inside_build"]).startswith(
            "to_global(placement=flowgen.placement(type=\"cpu\", ranks=[1]), sbp=flowgen.sbp.split(dim=0)) in build(): "
            "inside nn.Graph.build() flowgen converts values to flow.sbp.broadcast only")
