"""README.md as a new user reads it (issue 24, item 9): its Python snippets run as written, in
order, in a fresh directory; its shell commands name scripts, modules, extras, subcommands and
options that exist; its measured numbers are the ones in the committed benchmark JSON files."""
import importlib.util
import json
import re
import shlex
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flowgen as flow

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"


def _blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_readme_has_the_snippets_this_file_reads():
    assert len(_blocks("python")) >= 2 and len(_blocks("bash")) >= 4


def test_python_snippets_run_as_written_in_order(tmp_path, monkeypatch, capsys):
    """One namespace, as a reader pasting them into one session: the deployment snippet saves
    the graph the first one trained."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWGEN_CPU_KERNELS", raising=False)   # a reader's default: the native cpu kernels
    namespace = {"__name__": "__readme__"}
    for number, block in enumerate(_blocks("python")):
        exec(compile(block, f"README.md python snippet {number}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "__global__" in out                                   # the generated CUDA C++ was printed
    assert np.isfinite(namespace["loss"].numpy()).all()
    saved = namespace["saved"]
    x, y = namespace["x"].numpy(), namespace["y"].numpy()
    np.testing.assert_allclose(saved.run(x, y)[0], namespace["graph"](namespace["x"], namespace["y"]).numpy(),
                               rtol=1e-5)
    # A float64 array where float32 is expected: refused, saying how to convert it.
    with pytest.raises(ValueError, match=r"has dtype float64, expected float32; convert it with "
                                         r"x\.astype\(np\.float32\)"):
        saved.run(x.astype(np.float64), y)


def _commands():
    """Each command of the bash blocks, split into words (comments and comment-only lines dropped)."""
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            for command in line.split("&&"):
                yield shlex.split(command.strip())


def _cli():
    spec = importlib.util.spec_from_file_location("flowgen_cli_main", ROOT / "cli" / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cli


def _options(words):
    return [w.strip("[]").split("=")[0] for w in words if w.strip("[]").startswith("-")]


def test_shell_commands_name_what_exists():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cli = _cli()
    program_source = (ROOT / "templates" / "program_host.cpp.j2").read_text()
    checked = set()
    for words in _commands():
        tool = words[0]
        if tool == "pip":
            for word in words:
                for extra in re.findall(r"\.\[([a-z,]+)\]", word):
                    assert set(extra.split(",")) <= set(extras), word
            checked.add("pip")
        elif tool == "python" and words[1] == "-m":
            if words[2] != "pytest":
                assert importlib.util.find_spec(words[2]) is not None, words[2]
                source = Path(importlib.util.find_spec(words[2]).origin).read_text()
                assert all(option in source for option in _options(words[3:])), words
            checked.add(f"python -m {words[2]}")
        elif tool == "python":
            script = ROOT / words[1]
            assert script.is_file(), words[1]
            assert all(option in script.read_text() for option in _options(words[2:])), words
            checked.add("python")
        elif tool == "flowgen":
            result = CliRunner().invoke(cli, [words[1], "--help"])
            assert result.exit_code == 0, (words, result.output)
            for option in _options(words[2:]):
                assert option in result.output, (words, option)
            checked.add(f"flowgen {words[1]}")
        elif tool.startswith("out/"):                    # the built program run by hand
            assert all(f'"{option}"' in program_source for option in _options(words[1:])), words
            checked.add("binary")
        else:
            pytest.fail(f"README.md runs {tool!r}, which this test does not know how to check: {words}")
    assert {"pip", "python", "flowgen build", "flowgen run", "flowgen inspect", "flowgen bench", "binary"} <= checked


def test_cli_help_names_the_build_and_results_folders_apart():
    cli = _cli()
    run_help = CliRunner().invoke(cli, ["run", "--help"]).output
    assert "Usage: cli run [OPTIONS] BUILD_DIR INPUT.npy..." in run_help
    assert "-o, --out RESULTS_DIR" in run_help
    assert " OUT" not in run_help and "OUT/" not in run_help
    build_help = CliRunner().invoke(cli, ["build", "--help"]).output
    assert "SAVED_DIR" in build_help and "-o, --out BUILD_DIR" in build_help


# ------------------------------------------------------------------ measured numbers
def _three_figures(value):
    return f"{value:.3g}"


CPU_ROWS = {"gpt_char_train": "GPT of `examples/gpt_char.py`", "mobilenet_v2_b8_train": "MobileNetV2, batch 8",
            "resnet18_b8_train": "ResNet-18, batch 8", "mlp_train": "3-layer MLP"}


def test_the_cpu_table_is_the_committed_graph_cpu_json():
    data = json.loads((RESULTS / "graph_cpu.json").read_text())
    rows = {row["graph"]: row for row in data["rows"]}
    for name, label in CPU_ROWS.items():
        row = rows[name]
        cells = [_three_figures(row[k]) for k in ("graph_step_ms", "eager_step_ms", "graph_infer_ms", "eager_infer_ms")]
        assert f"| {label} | {' | '.join(cells)} |" in README, name
    assert f"flowgen {data['flowgen_commit'][:7]}" in README and data["date_utc"][:10] in README
    assert f"takes about {rows['polyfit_train']['polyfit_2000_steps_s']:.1f} s" in README
    train = next(r for r in data["launches"] if r["graph"] == "mobilenet_v2_train")
    infer = next(r for r in data["launches"] if r["graph"] == "mobilenet_v2_infer")
    assert f"runs {train['kernels_fused']} at batch {train['batch']} ({train['kernels_unfused']:,} before fusion" \
        in README
    assert f"An eval MobileNetV2 runs {infer['kernels_fused']} kernels per call" in README


def test_compile_times_are_the_committed_compile_time_json():
    stages = json.loads((RESULTS / "compile_time.json").read_text())["stages"]
    cold = next(s for s in stages if s["stage"] == "emulator first call" and s["cache"] == "cold")
    warm = next(s for s in stages if s["stage"] == "emulator first call" and s["cache"] == "warm")
    assert f"compiles cold in {cold['wall_s']:.1f} s" in README
    assert f"finds it in the cache in\n{warm['inner_s']:.1f} s" in README


def test_native_compile_times_are_the_committed_compile_time_cpu_json():
    stages = {(s["stage"], s["cache"]): s for s in json.loads((RESULTS / "compile_time_cpu.json").read_text())["stages"]}
    assert (f"its first call\ntakes {stages['native first call', 'cold']['wall_s']:.1f} s cold (the emulator program "
            f"{stages['emulator first call', 'cold']['wall_s']:.1f} s) and "
            f"{stages['native first call', 'warm']['wall_s']:.1f} s warm") in README


def test_the_gpu_table_is_the_committed_mobilenet_cuda_json():
    result = json.loads((RESULTS / "mobilenet_cuda.json").read_text())["result"]
    train = [f"{result[k]:,.0f}" for k in ("train_images_per_s", "torch_eager_train_images_per_s",
                                            "torch_compile_train_images_per_s")]
    infer = [f"{result[k]:.2f}" for k in ("infer_latency_ms", "torch_eager_infer_latency_ms",
                                          "torch_compile_infer_latency_ms")]
    assert f"| training, batch {result['batch']} (images/s) | {' | '.join(train)} |" in README
    assert f"| inference, batch 1 (ms) | {' | '.join(infer)} |" in README
    assert f"the {result['train_launches_fused']}-launch training step" in README


CPU_VS_TORCH_ROWS = {"mobilenet_train": "MobileNetV2-CIFAR training", "mobilenet_infer": "MobileNetV2-CIFAR inference",
                     "resnet18_train": "ResNet-18 training", "resnet18_infer": "ResNet-18 inference",
                     "gpt_train": "GPT of `examples/gpt_char.py`, training",
                     "gpt_decode": "the same GPT, decoding a token", "mlp_train": "3-layer MLP training"}
CPU_VS_TORCH_COLUMNS = ("flowgen_graph", "flowgen_graph_emulator", "flowgen_eager", "torch_eager",
                        "torch_eager_1thread", "torch_compile")


def test_the_cpu_vs_torch_table_is_the_committed_json():
    data = json.loads((RESULTS / "cpu_vs_torch.json").read_text())
    rows = {(row["case"], row["row"]): row for row in data["rows"]}
    for case, label in CPU_VS_TORCH_ROWS.items():
        cells = [_three_figures(rows[case, column]["median_ms"]) for column in CPU_VS_TORCH_COLUMNS]
        assert f"| {label} | {' | '.join(cells)} |" in README, case
    environment = data["environment"]
    assert f"flowgen {environment['flowgen_commit'][:7]}" in README and environment["date_utc"][:10] in README
