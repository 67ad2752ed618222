"""The `flowgen` command line: build / run / inspect, and examples/deploy.py end to end."""
import json
import os
import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flowgen as flow
import flowgen.nn as nn

try:
    from flowgen_cli.main import cli
except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
    from cli.main import cli

REPO = Path(__file__).resolve().parent.parent


class MLPGraph(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small inference graph, saved and built for the CPU through the CLI."""
    flow.manual_seed(0)
    tmp = tmp_path_factory.mktemp("cli")
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4), nn.Softmax(dim=1))
    graph = MLPGraph(model)
    x = flow.randn(3, 6)
    expected = graph(x).numpy().copy()
    flow.save(graph, tmp / "saved")
    np.save(tmp / "x.npy", x.numpy())
    result = CliRunner().invoke(cli, ["build", str(tmp / "saved"), "-o", str(tmp / "out"), "--target", "cpu"])
    return {"tmp": tmp, "expected": expected, "build": result, "graph": graph}


@pytest.mark.parametrize("args", [["--help"], ["build", "--help"], ["run", "--help"], ["inspect", "--help"],
                                  ["bench", "--help"]])
def test_help(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output


_STARTUP_PROBE = """
import sys
import cli.main
for args in (["--help"], ["--version"], ["build", "--help"], ["run", "--help"], ["inspect", "--help"],
             ["bench", "--help"]):
    try:
        cli.main.main(args)
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
print("LOADED", *sorted(m for m in sys.modules if m.split(".")[0] in ("flowgen", "numpy", "jinja2", "ml_dtypes")))
"""


def test_help_and_version_do_not_import_flowgen():
    """`flowgen --help`/`--version` start in a fraction of a second: the CLI module and its argument
    parsing load click, not flowgen (NumPy, Jinja2, every op). cli/ is imported as the top-level
    package the `flowgen` script runs (flowgen_cli when installed), since anything under flowgen.
    runs flowgen/__init__.py first."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _STARTUP_PROBE], capture_output=True, text=True, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"flowgen, version {flow.__version__}" in proc.stdout
    loaded = proc.stdout.rsplit("LOADED", 1)[1].split()
    assert loaded == [], f"importing the CLI and printing its help loaded {loaded}"
    script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["flowgen"]
    assert not script.startswith("flowgen."), script


def test_cli_sanitizer_choices_are_the_compilers():
    from flowgen.codegen.aot import SANITIZERS

    assert sys.modules[cli.callback.__module__].SANITIZERS == SANITIZERS


def test_build_reports_each_stage_with_times(built):
    result = built["build"]
    assert result.exit_code == 0, result.output
    for stage in ("load", "render", "compile host code", "write weights"):
        assert f"  {stage} " in result.output
    assert " s " in result.output and "built " in result.output
    out = built["tmp"] / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / manifest["binary"]).is_file() and manifest["graph"] == built["graph"].name
    assert manifest["outputs"][0]["shape"] == [3, 4] and manifest["flowgen_version"] == flow.__version__


def test_run_writes_outputs(built):
    tmp = built["tmp"]
    result = CliRunner().invoke(cli, ["run", str(tmp / "out"), str(tmp / "x.npy"), "-o", str(tmp / "res")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp / "res" / "output_0.npy"), built["expected"], rtol=1e-6, atol=1e-6)


def test_run_passes_on_the_programs_refusal(built):
    tmp = built["tmp"]
    np.save(tmp / "bad.npy", np.zeros((3, 5), np.float32))
    result = CliRunner().invoke(cli, ["run", str(tmp / "out"), str(tmp / "bad.npy"), "-o", str(tmp / "res2")])
    assert result.exit_code == 1 and "shape [3,5], expected [3,6]" in result.output


def test_bench_times_the_program_and_writes_json(built):
    import json

    tmp = built["tmp"]
    result = CliRunner().invoke(cli, ["bench", str(tmp / "out"), str(tmp / "x.npy"), "--steps", "20",
                                      "--json", str(tmp / "bench.json")])
    assert result.exit_code == 0, result.output
    assert "ms/step" in result.output
    data = json.loads((tmp / "bench.json").read_text())
    assert data["steps"] == 20 and data["seconds"] > 0 and abs(data["ms_per_step"] - data["seconds"] / 20 * 1e3) < 1e-9
    manifest = json.loads((tmp / "out" / "manifest.json").read_text())
    assert data["target"] == "cpu" and data["cpu_kernels"] == manifest["cpu_kernels"] == "emulator"   # conftest's


def test_inspect_summary_ir_source_memory(built):
    tmp = built["tmp"]
    for path in (tmp / "saved", tmp / "out"):
        result = CliRunner().invoke(cli, ["inspect", str(path)])
        assert result.exit_code == 0, result.output
        assert "launches per step" in result.output and "lower bound" in result.output
        assert "input_0: float32[3, 6]" in result.output and "kernels:" in result.output
    built_only = CliRunner().invoke(cli, ["inspect", str(tmp / "out"), "--ir", "--source", "--memory"])
    assert built_only.exit_code == 0, built_only.output
    assert "build: " in built_only.output                    # the manifest's line
    assert f"graph {built['graph'].name}(" in built_only.output   # the IR text
    assert "static void run_step(" in built_only.output       # program.cu
    assert "arena layout" in built_only.output


def test_inspect_describes_the_kernels_the_build_compiled(built, monkeypatch):
    """`inspect BUILD_DIR` renders the program as the manifest says it was built, whatever
    $FLOWGEN_CPU_KERNELS says when inspecting: a --target emulator build (and a --target cpu build
    made with FLOWGEN_CPU_KERNELS=emulator) shows the CUDA source's GEMMs, a native cpu build
    its native ones, and each shows the kernels program.cu holds."""
    tmp = built["tmp"]
    builds = {"emulator": (tmp / "emulator", ["--target", "emulator"], "native"),
              "cpu, emulator kernels": (tmp / "cpu_emulated", ["--target", "cpu"], "emulator"),
              "cpu, native kernels": (tmp / "cpu_native", ["--target", "cpu"], "native")}
    for what, (out, args, environment) in builds.items():
        monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native" if what == "cpu, native kernels" else "emulator")
        result = CliRunner().invoke(cli, ["build", str(tmp / "saved"), "-o", str(out), *args])
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["target"] == "cpu"
        assert manifest["cpu_kernels"] == ("native" if what == "cpu, native kernels" else "emulator"), what
        monkeypatch.setenv("FLOWGEN_CPU_KERNELS", environment)   # the other kind than was built
        summary = CliRunner().invoke(cli, ["inspect", str(out)])
        assert summary.exit_code == 0, summary.output
        program_cu = (out / "program.cu").read_text()
        kernels = [line.split()[1].rstrip(":") for line in summary.output.split("  kernels:\n")[1].splitlines()]
        assert kernels == [k["name"] for k in manifest["kernels"]] and "note:" not in summary.output
        for name in kernels:
            assert f"void {name}(" in program_cu, (what, name)
        if manifest["cpu_kernels"] == "native":
            # the saved MLP's products are small: one fused multiply-add chain per output, as eager's
            assert "(fused multiply-add chains)" in summary.output, summary.output
            assert "native kernels where flowgen has them" in summary.output
        else:
            assert "fused multiply-add chains" not in summary.output and "flowgen_cpu.h" not in program_cu
            assert "every kernel the CUDA source on the emulator" in summary.output, what
    # a build whose kernels this flowgen would render otherwise (an older version's) says so
    manifest["kernels"][0]["name"] = "k0_from_another_version"
    (out / "manifest.json").write_text(json.dumps(manifest))
    summary = CliRunner().invoke(cli, ["inspect", str(out)])
    assert summary.exit_code == 0 and "note: this flowgen" in summary.output, summary.output


def test_build_name_names_the_program_library_and_header(built, tmp_path):
    """`flowgen build --lib --name NAME`: OUT/NAME, libNAME.so and NAME.h, recorded in the manifest;
    a C program (examples/embed/main.c) links against them and computes what the graph does."""
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["build", str(built["tmp"] / "saved"), "-o", str(out), "--target", "cpu",
                                      "--lib", "--name", "mlp_v2"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["name"], manifest["binary"], manifest["library"], manifest["header"]) == (
        "mlp_v2", "mlp_v2", "libmlp_v2.so", "mlp_v2.h")
    assert manifest["graph"] == built["graph"].name   # the graph keeps its name
    assert not any(out.glob(f"*{built['graph'].name}*"))
    assert "#define FLOWGEN_MODEL_MLP_V2_H" in (out / "mlp_v2.h").read_text()
    demo = tmp_path / "demo"
    subprocess.run(["gcc", "-std=c99", "-O2", "-Wall", "-Werror", str(REPO / "examples" / "embed" / "main.c"),
                    f"-I{out}", '-DFLOWGEN_MODEL_HEADER="mlp_v2.h"', f"-L{out}", "-lmlp_v2", f"-Wl,-rpath,{out}",
                    "-lm", "-o", str(demo)], check=True, capture_output=True, text=True)
    proc = subprocess.run([str(demo)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    x = np.sin(0.37 * np.arange(3 * 6)).astype(np.float32).reshape(3, 6)   # the example's input pattern
    values = [float(v) for v in proc.stdout.split("\n") if re.fullmatch(r"-?[0-9.e+-]+", v)]
    np.testing.assert_allclose(values, built["graph"](flow.tensor(x)).numpy().ravel(), rtol=1e-5, atol=1e-6)
    model = flow.load_compiled(out)   # finds libmlp_v2.so through the manifest
    np.testing.assert_allclose(model(x), built["graph"](flow.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    model.close()
    run = CliRunner().invoke(cli, ["run", str(out), str(built["tmp"] / "x.npy"), "-o", str(tmp_path / "res")])
    assert run.exit_code == 0, run.output
    np.testing.assert_allclose(np.load(tmp_path / "res" / "output_0.npy"), built["expected"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, message", [("9lives", "must be a C identifier"), ("my-model", "must be a C identifier"),
                                           ("flowgen_emu", "runtime header")])
def test_build_name_must_be_a_c_identifier(built, tmp_path, name, message):
    result = CliRunner().invoke(cli, ["build", str(built["tmp"] / "saved"), "-o", str(tmp_path / "out"),
                                      "--target", "cpu", "--name", name])
    assert result.exit_code == 1 and f"--name {name}" in result.output.replace("'", "") and message in result.output
    assert not (tmp_path / "out").exists()


def test_build_errors_are_messages_not_tracebacks(tmp_path):
    result = CliRunner().invoke(cli, ["build", str(tmp_path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "no graph.json" in result.output
    result = CliRunner().invoke(cli, ["run", str(tmp_path), "x.npy", "-o", str(tmp_path / "res")])
    assert result.exit_code == 1 and "manifest.json is missing" in result.output


def test_nvcc_missing_is_a_clear_error(built, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    result = CliRunner().invoke(cli, ["build", str(built["tmp"] / "saved"), "-o", str(built["tmp"] / "nvcc"),
                                      "--compiler", "nvcc"])
    assert result.exit_code == 1 and "nvcc is not on PATH" in result.output


@pytest.mark.slow
def test_deploy_example(tmp_path, capsys):
    """examples/deploy.py: train, checkpoint, flow.save(graph), flowgen build + run, compare."""
    module = runpy.run_path(str(REPO / "examples" / "deploy.py"))
    diff = module["main"](target="cpu", workdir=tmp_path, steps=10)
    assert diff <= 1e-6
    assert "program output vs graph output" in capsys.readouterr().out
