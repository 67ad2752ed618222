"""`flowgen build --lib` and `flow.load_compiled`: a graph as a shared library with a C API, called
from Python (several threads at once), from C (examples/embed/main.c, README's snippet) and from a
C program that feeds it bad arguments and files under AddressSanitizer and UndefinedBehaviorSanitizer
(tests/embed_checks.c; and, built by hand, ThreadSanitizer)."""
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen import aot
from flowgen.codegen.library import API_FUNCTIONS
from c_callers import ROOT, compile_c
from graphs import InferGraph, TrainGraph

try:
    from flowgen_cli.main import cli
except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
    from cli.main import cli



def conv_model():
    """Conv, BatchNorm (eval: folded by prepare kernels), ReLU, pooling and a Linear layer."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    with flow.no_grad():
        model[1].running_mean.copy_(flow.randn(8) * 0.1)
        model[1].running_var.copy_(flow.rand(8) + 0.5)
    model.eval()
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The conv model as an inference graph, saved and built with --lib for the CPU."""
    flow.manual_seed(0)
    tmp = tmp_path_factory.mktemp("embed")
    graph = InferGraph(conv_model())
    xs = [np.random.default_rng(k).standard_normal((2, 3, 8, 8)).astype(np.float32) for k in range(4)]
    expected = [graph(flow.tensor(x)).numpy().copy() for x in xs]
    flow.save(graph, tmp / "saved")
    result = aot.build(tmp / "saved", tmp / "out", target="cpu", lib=True)
    return {"tmp": tmp, "out": tmp / "out", "graph": graph, "xs": xs, "expected": expected,
            "manifest": result.manifest}


def test_the_library_computes_what_the_graph_does(built):
    manifest, out = built["manifest"], built["out"]
    assert manifest["library"] == f"lib{manifest['graph']}.so" and manifest["header"] == f"{manifest['graph']}.h"
    assert json.loads((out / "manifest.json").read_text())["library"] == manifest["library"]
    header = (out / manifest["header"]).read_text()
    assert "int flowgen_run(flowgen_model* model, const flowgen_tensor* inputs" in header
    exported = subprocess.run(["nm", "-D", "--defined-only", str(out / manifest["library"])], capture_output=True,
                              text=True, check=True).stdout
    assert sorted(re.findall(r" T (\w+)", exported)) == sorted(API_FUNCTIONS)   # nothing else

    model = flow.load_compiled(out)
    assert [str(t) for t in model.inputs] == ["input_0: float32[2, 3, 8, 8]"]
    assert [str(t) for t in model.outputs] == ["output_0: float32[2, 5]"]
    assert model.inputs[0].min_shape == model.inputs[0].max_shape == (2, 3, 8, 8)
    for x, expected in zip(built["xs"], built["expected"]):
        np.testing.assert_array_equal(model(x), expected)
    # A view (not C-contiguous) and a DLPack object (a flowgen tensor) are read as their values.
    x = built["xs"][1]
    np.testing.assert_array_equal(model(np.asfortranarray(x)), built["expected"][1])
    np.testing.assert_array_equal(model(flow.tensor(x)), built["expected"][1])
    first = model(built["xs"][0])
    model(built["xs"][2])
    np.testing.assert_array_equal(first, built["expected"][0])   # results are the caller's copies


def test_threads_call_one_model_at_once(built):
    """Several threads on one loaded model: shared weights, activation memory per call."""
    model = flow.load_compiled(built["out"])
    results, errors = {}, []

    def work(k):
        try:
            results[k] = [model(built["xs"][k]) for _ in range(8)]
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(built["xs"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, expected in enumerate(built["expected"]):
        for got in results[k]:
            np.testing.assert_array_equal(got, expected)


def test_bad_calls_are_refused_with_what_is_allowed(built):
    model = flow.load_compiled(built["out"])
    x = built["xs"][0]
    with pytest.raises(TypeError, match=r"takes 1 input\(s\) \(input_0: float32\[2, 3, 8, 8\]\), got 2"):
        model(x, x)
    with pytest.raises(ValueError, match=r"input 0 \(input_0\): dtype float64 \(FLOWGEN_FLOAT64\), expected float32"):
        model(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"input 0 \(input_0\): shape \[1,3,8,8\], expected \[2,3,8,8\]"):
        model(x[:1])
    with pytest.raises(ValueError, match=r"ndim is 9 \(0 to 8 allowed\)"):
        model(np.zeros((1,) * 9, np.float32))
    with pytest.raises(ValueError, match=r"dtype uint8, expected float32"):
        model(x.astype(np.uint8))
    with pytest.raises(TypeError, match=r"input 0 \(input_0\) is a list"):
        model([1.0])

    class OnTheGpu:   # what CuPy and PyTorch CUDA tensors offer
        __cuda_array_interface__ = {"shape": (2, 3, 8, 8), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    with pytest.raises(ValueError, match=r"input 0 \(input_0\) is in CUDA device memory .* built for the cpu target"):
        model(OnTheGpu())
    np.testing.assert_array_equal(model(x), built["expected"][0])   # still fine after refusals
    model.close()
    with pytest.raises(ValueError, match="closed"):
        model(x)


def test_weights_are_checked_when_loading(built, tmp_path):
    weights = (built["out"] / "weights.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(weights[:-4])
    with pytest.raises(ValueError, match=r"truncated\.safetensors: .*(truncated|cover)"):
        flow.load_compiled(built["out"], weights=tmp_path / "truncated.safetensors")
    with pytest.raises(ValueError, match=r"cannot open weights file .*missing\.safetensors"):
        flow.load_compiled(built["out"], weights=tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        flow.load_compiled(tmp_path)


def test_graphs_that_change_their_state_are_refused(tmp_path):
    flow.manual_seed(0)
    model = nn.Linear(3, 1)
    train = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    train(flow.randn(4, 3), flow.randn(4, 1))
    flow.save(train, tmp_path / "train")
    with pytest.raises(aot.BuildError, match=r"--lib: graph TrainGraph\w* is a training step"):
        aot.build(tmp_path / "train", tmp_path / "out", target="cpu", lib=True)
    batch_norm = InferGraph(nn.BatchNorm1d(3))   # train mode: it updates its running statistics
    batch_norm(flow.randn(4, 3))
    flow.save(batch_norm, tmp_path / "bn")
    with pytest.raises(aot.BuildError, match=r"writes its state every call \(.*running_mean.*model\.eval\(\)"):
        aot.build(tmp_path / "bn", tmp_path / "out", target="cpu", lib=True)
    dropout = InferGraph(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))   # train mode: it draws
    dropout(flow.randn(4, 3))
    flow.save(dropout, tmp_path / "dropout")
    with pytest.raises(aot.BuildError, match=r"draws random numbers .*Dropout in train mode"):
        aot.build(tmp_path / "dropout", tmp_path / "out", target="cpu", lib=True)


# ------------------------------------------------------------------------------------- C callers
@pytest.mark.slow
def test_example_c_program_and_readme_snippet(built, tmp_path):
    out, manifest, graph = built["out"], built["manifest"], built["graph"]
    demo = compile_c(ROOT / "examples" / "embed" / "main.c", out, manifest, tmp_path / "demo", "-O2")
    proc = subprocess.run([str(demo)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    k = np.arange(2 * 3 * 8 * 8)
    x = np.sin(0.37 * k).astype(np.float32).reshape(2, 3, 8, 8)   # the example's input pattern
    values = [float(v) for v in proc.stdout.split("\n") if re.fullmatch(r"-?[0-9.e+-]+", v)]
    np.testing.assert_array_equal(np.array(values, np.float32), graph(flow.tensor(x)).numpy().ravel())

    snippet = re.search(r"^```c\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M).group(1)
    (tmp_path / "snippet.c").write_text(snippet.replace('"model.h"', f'"{manifest["header"]}"'))
    binary = compile_c(tmp_path / "snippet.c", out, manifest, tmp_path / "snippet")
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(float(proc.stdout.split()[-1]), graph(flow.ones(2, 3, 8, 8)).numpy()[0, 0],
                               rtol=1e-6)


@pytest.mark.slow
def test_c_api_against_bad_arguments_and_files_under_address_and_ub_sanitizers(tmp_path):
    flow.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    graph = InferGraph(model)
    x = flow.randn(4, 6)
    graph(x)
    flow.save(graph, tmp_path / "saved")
    out = tmp_path / "out"
    manifest = aot.build(tmp_path / "saved", out, target="cpu", sanitize="address,undefined", lib=True).manifest
    checks = compile_c(ROOT / "tests" / "embed_checks.c", out, manifest, tmp_path / "checks", "-O1", "-g",
                        "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer")
    weights = (out / "weights.safetensors").read_bytes()
    bad = {"truncated": weights[:len(weights) // 2], "header only": weights[:8], "garbage": b"\x00" * 3,
           "flipped length": (len(weights) * 2).to_bytes(8, "little") + weights[8:]}
    for name, data in bad.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
    paths = [str(tmp_path / f"{name}.safetensors") for name in bad] + [str(tmp_path / "missing.safetensors")]
    proc = subprocess.run([str(checks), str(out / "weights.safetensors"), *paths], capture_output=True, text=True,
                          timeout=300, env={"ASAN_OPTIONS": "detect_leaks=1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": rc " in line)
    assert re.fullmatch(r"rc 1: weights file .*truncated\.safetensors: truncated.*", lines["create bad weights 1"])
    assert "cannot open weights file" in lines["create bad weights 5"]
    assert lines["run dtype float64"] == ("rc 1: input 0 (input_0): dtype float64 (FLOWGEN_FLOAT64), expected "
                                          "float32 (FLOWGEN_FLOAT32)")
    assert lines["run bad shape"] == "rc 1: input 0 (input_0): shape [5,6], expected [4,6]"
    assert lines["run n_inputs 2"].startswith("rc 1: n_inputs is 2; graph InferGraph")
    assert "built for the cpu target" in lines["run device memory"]
    values = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("value ")]
    pattern = ((np.arange(24) * 7) % 11 / 5.0 - 1.0).astype(np.float32).reshape(4, 6)   # embed_checks.c's fill(x, 0)
    np.testing.assert_allclose(values, graph(flow.tensor(pattern)).numpy().ravel(), rtol=1e-6)
    assert "threads: 100 calls agree" in proc.stdout


@pytest.mark.slow
def test_an_out_of_range_index_is_an_index_error_and_the_next_call_runs(tmp_path):
    flow.manual_seed(2)
    graph = InferGraph(nn.Embedding(10, 4))
    ids = np.array([[1, 2, 3], [4, 5, 9]], np.int64)
    expected = graph(flow.tensor(ids)).numpy()
    flow.save(graph, tmp_path / "saved")
    result = CliRunner().invoke(cli, ["build", str(tmp_path / "saved"), "-o", str(tmp_path / "out"), "--target",
                                         "cpu", "--lib"])
    assert result.exit_code == 0, result.output
    assert "build library" in result.output and "calls run one at a time" in result.output
    model = flow.load_compiled(tmp_path / "out")
    with pytest.raises(IndexError, match=r"IndexError: .*12"):
        model(np.array([[1, 2, 3], [4, 12, 9]], np.int64))
    np.testing.assert_array_equal(model(ids), expected)


def _gpu_available():
    try:
        from flowgen.runtime import cuda_driver
        return cuda_driver.available()
    except Exception:   # noqa: BLE001 - no driver bindings at all
        return False


@pytest.mark.slow
def test_cuda_library_builds_without_a_gpu(built, tmp_path):
    out = tmp_path / "cuda"
    manifest = aot.build(built["tmp"] / "saved", out, target="cuda", arch="sm_80", lib=True).manifest
    source = (out / "library.cpp").read_text()
    assert "constexpr bool ONE_CALL_AT_A_TIME = true;" in source and "CUDA_TARGET = true" in source
    exported = subprocess.run(["nm", "-D", "--defined-only", str(out / manifest["library"])], capture_output=True,
                              text=True, check=True).stdout
    assert sorted(re.findall(r" T (\w+)", exported)) == sorted(API_FUNCTIONS)
    if _gpu_available():
        return   # test_cuda_library_on_gpu runs one
    with pytest.raises(RuntimeError, match=r"no CUDA (driver|GPU).*--target cpu"):
        flow.load_compiled(out)


@pytest.mark.gpu
def test_cuda_library_on_gpu(built, tmp_path):
    from flowgen.runtime import cuda_driver

    context = cuda_driver.CudaContext.get()
    aot.build(built["tmp"] / "saved", tmp_path / "gpu", target="cuda", arch=context.arch, lib=True)
    model = flow.load_compiled(tmp_path / "gpu")
    for x, expected in zip(built["xs"], built["expected"]):
        np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-5)
    x = built["xs"][1]
    pointer = context.alloc(x.nbytes)   # an input already on the GPU, as CuPy or PyTorch hand it over
    context.memcpy_htod(pointer, x)

    class OnTheGpu:
        __cuda_array_interface__ = {"shape": x.shape, "typestr": "<f4", "data": (pointer, False), "version": 3}

    np.testing.assert_allclose(model(OnTheGpu()), built["expected"][1], rtol=1e-4, atol=1e-5)
    context.free(pointer)
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, model(built["xs"][k])))
               for k in range(len(built["xs"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, expected in enumerate(built["expected"]):
        np.testing.assert_allclose(results[k], expected, rtol=1e-4, atol=1e-5)


def _commands_in(source: Path, what: str) -> list:
    """The command a generated file's header comment gives for building `what` by hand."""
    return re.search(rf"^//   {what}: +(.*)$", source.read_text(), flags=re.M).group(1).split()


@pytest.mark.slow
def test_by_hand_build_under_thread_sanitizer_has_no_races(tmp_path):
    """library.cpp's header says how to build the library by hand; built so with ThreadSanitizer
    on the host code (the pool, the per-thread outputs, the error messages), four threads calling one
    model race nowhere. The MLP's launches are small, so they run on the calling threads."""
    flow.manual_seed(3)
    graph = InferGraph(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    graph(flow.randn(4, 6))
    flow.save(graph, tmp_path / "saved")
    out = tmp_path / "out"
    manifest = aot.build(tmp_path / "saved", out, target="cpu", lib=True).manifest
    (out / manifest["library"]).unlink()
    tsan = ["-g", "-fsanitize=thread"]
    kernels = _commands_in(out / "program.cu", "kernels")   # as they are: the kernels touch no shared host state
    host, link = (_commands_in(out / "library.cpp", what) for what in ("host", "link"))
    for command in (kernels, [host[0], *tsan, *host[1:]], [link[0], *tsan, *link[1:]]):
        subprocess.run(command, cwd=out, check=True, capture_output=True, text=True)
    checks = compile_c(ROOT / "tests" / "embed_checks.c", out, manifest, tmp_path / "checks", "-O1", *tsan)
    proc = subprocess.run([str(checks), str(out / "weights.safetensors")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ThreadSanitizer" not in proc.stderr, proc.stdout + proc.stderr
    assert "threads: 100 calls agree" in proc.stdout


@pytest.mark.slow
def test_embed_overhead_benchmark_runs(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embed_overhead.py"), "--models", "mlp", "--calls", "50",
                    "--out", str(tmp_path / "embed.json")], check=True, capture_output=True, text=True, timeout=600)
    row, = json.loads((tmp_path / "embed.json").read_text())["rows"]
    assert row["model"] == "mlp" and row["step_us"] > 0 and row["load_compiled_us"] > 0
    assert row["calls_per_s_1_thread"] > 0 and row["calls_per_s_2_threads"] > 0
