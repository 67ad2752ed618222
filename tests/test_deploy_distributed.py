"""Standalone data-parallel programs (`flow.save` of a graph called with split(0) global inputs).

Training graphs traced on 2 ranks (tests/distributed/deploy_worker.py, started by flowgen's
launcher; an MSE loss, whose gradients are averaged, and a cross-entropy with ignored targets in
one rank's rows, whose loss and gradients combine as sum / sum over the ranks) are saved by every
rank, built for the CPU emulator and run with `mpiexec -n 2` and with `flowgen run --nproc 2`:
their losses, parameters and momentum buffers equal the Python data-parallel run bit for bit (the
same kernels, the same MPI sum of two ranks, the same division for the mean). The MSE graph on
one rank builds without MPI and equals Python too.
The MPI tests skip where mpi4py or mpiexec is missing (`pip install -e '.[dist]'`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

import flowgen as flow
from flowgen import serialization
from flowgen.codegen import aot
from flowgen.saved_graph import FormatError

try:   # this checkout's cli/ (the installed flowgen_cli may be another checkout's)
    from cli.main import cli
except ImportError:
    from flowgen_cli.main import cli

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
import deploy_worker  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install -e '.[dist]')")
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def run_program(out: Path, *launcher, result: str = "res"):
    """Run the program built in out/build on out/x.npy, y.npy; its completed process."""
    binary = out / "build" / json.loads((out / "build" / "manifest.json").read_text())["binary"]
    command = [*launcher, str(binary), "--input", str(out / "x.npy"), "--input", str(out / "y.npy"),
               "--out", str(out / result)]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)


def assert_equals_python(out: Path, result: str):
    python = np.load(out / "python.npz")
    np.testing.assert_array_equal(np.load(out / result / "losses.npy"), python["losses"])
    weights = load_file(out / result / "weights.safetensors")
    for name in python.files:
        if name != "losses":
            np.testing.assert_array_equal(weights[name], python[name], err_msg=name)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The graphs traced, saved and trained on 2 ranks; their programs built for the CPU."""
    out = tmp_path_factory.mktemp("deploy_two_ranks")
    worker = str(REPO / "tests" / "distributed" / "deploy_worker.py")
    result = subprocess.run([sys.executable, "-m", "flowgen.distributed.launch", "--nproc_per_node", "2", worker,
                             str(out)], env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for scenario in deploy_worker.SCENARIOS:
        aot.build(out / scenario / "saved", out / scenario / "build", target="cpu")
    return out


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("scenario, combine, all_reduces", [("mse", "mean", 1), ("ce", "global", 3)])
def test_mpiexec_program_equals_the_python_data_parallel_run(two_ranks, scenario, combine, all_reduces):
    out = two_ranks / scenario
    doc = json.loads((out / "saved" / "graph.json").read_text())
    assert doc["data_parallel"] == {"world_size": 2, "inputs": ["split", "split"], "outputs": [combine]}
    # mse: the 4 gradients in one bucket; ce: + the count of targets and the loss's sum and count
    assert sum(n["op"] == "all_reduce" for n in doc["nodes"]) == all_reduces
    manifest = json.loads((out / "build" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    source = (out / "build" / "program.cu").read_text()
    assert "#include <mpi.h>" in source and "all_reduce_step(dev, {" in source
    proc = run_program(out, MPIEXEC, "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("step ") == deploy_worker.STEPS       # rank 0 prints, the other rank does not
    assert_equals_python(out, "res")


@needs_mpi
@pytest.mark.slow
def test_flowgen_run_nproc_starts_the_ranks(two_ranks):
    out = two_ranks / "mse"
    args = ["run", str(out / "build"), str(out / "x.npy"), str(out / "y.npy"), "-o"]
    result = CliRunner().invoke(cli, [*args, str(out / "res_cli"), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    assert "step 3/3" in result.output
    assert_equals_python(out, "res_cli")
    result = CliRunner().invoke(cli, [*args, str(out / "res_default")])   # the saved world size
    assert result.exit_code == 0, result.output
    assert_equals_python(out, "res_default")
    result = CliRunner().invoke(cli, [*args, str(out / "res_3"), "--nproc", "3"])
    assert result.exit_code != 0 and "saved on 2 rank(s)" in result.output


@needs_mpi
@pytest.mark.slow
def test_program_refuses_another_world_size_and_documents_the_split(two_ranks):
    out = two_ranks / "mse"
    proc = run_program(out, MPIEXEC, "-n", "1", result="res_one")
    assert proc.returncode != 0
    assert "over 2 ranks but was started as 1" in proc.stderr and "mpiexec -n 2" in proc.stderr
    assert not (out / "res_one" / "weights.safetensors").exists()
    binary = out / "build" / json.loads((out / "build" / "manifest.json").read_text())["binary"]
    help_text = subprocess.run([MPIEXEC, "-n", "1", str(binary), "--help"], env=ENV, capture_output=True,
                               text=True, timeout=60).stdout
    assert "Data parallel over 2 ranks" in help_text and "input_0 float32[8,6]" in help_text


@needs_mpi
@pytest.mark.slow
def test_save_refuses_what_a_program_cannot_run(two_ranks):
    messages = json.loads((two_ranks / "refusals.json").read_text())
    assert "shards its optimizer state" in messages["zero"] and "without enable_zero" in messages["zero"]
    assert "input(s) 1 of the data-parallel graph are local tensors" in messages["local_input"]
    assert not (two_ranks / "zero").exists() and not (two_ranks / "local_input").exists()


@needs_mpi
@pytest.mark.slow
def test_building_without_mpi_names_what_to_install(two_ranks, monkeypatch, tmp_path):
    monkeypatch.setattr(aot.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(aot.BuildError, match=r"needs MPI to build.*pip install mpich"):
        aot.build(two_ranks / "mse" / "saved", tmp_path / "build", target="cpu")


@pytest.mark.slow
def test_one_rank_data_parallel_program_builds_without_mpi_and_equals_python(tmp_path):
    deploy_worker.train_scenario(tmp_path, flow.nn.MSELoss(), deploy_worker.mse_targets)
    doc = json.loads((tmp_path / "saved" / "graph.json").read_text())
    assert doc["data_parallel"]["world_size"] == 1
    aot.build(tmp_path / "saved", tmp_path / "build", target="cpu")
    source = (tmp_path / "build" / "program.cu").read_text()
    assert "mpi.h" not in source and "all_reduce_step(dev, {" in source
    proc = run_program(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_equals_python(tmp_path, "res")
    # A data_parallel entry that does not fit the graph is refused, even with a valid hash.
    for entry, why in (({"world_size": 0, "inputs": ["split", "split"], "outputs": ["mean"]}, "world_size 0"),
                       ({"world_size": 1, "inputs": ["split"], "outputs": ["mean"]}, "per graph input"),
                       ({"world_size": 1, "inputs": ["split", "split"], "outputs": ["split"]}, "not 0-d")):
        shutil.copytree(tmp_path / "saved", tmp_path / "bad", dirs_exist_ok=True)
        doc = json.loads((tmp_path / "bad" / "graph.json").read_text())
        doc.pop("graph_sha256")
        doc["data_parallel"] = entry
        (tmp_path / "bad" / "graph.json").write_text(json.dumps(serialization.with_self_hash(doc, "graph_sha256")))
        with pytest.raises(FormatError, match=why):
            flow.load(tmp_path / "bad")
