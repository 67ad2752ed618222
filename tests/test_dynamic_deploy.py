"""Dynamic dimensions past Python (issue 27): a graph compiled with graph.config.dynamic_shapes
is saved with them (flow.save), and its saved form, its standalone program and its library
(flowgen build --lib, flow.load_compiled) take any size in range with eager's numbers, refusing
other sizes with the input, the axis, the Dim and its range named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from click.testing import CliRunner

import flowgen as flow
from flowgen import nn
from flowgen.codegen import aot
from flowgen.saved_graph import FormatError
from flowgen.serialization import with_self_hash
from c_callers import ROOT, compile_c
from safetensors.numpy import load_file
from first_contact_cases import gpu_arch
from graphs import FirstOutput, InferGraph, TrainGraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import gpt_char  # noqa: E402

try:
    from flowgen_cli.main import cli
except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
    from cli.main import cli


@pytest.fixture(scope="module")
def native():
    """Native cpu kernels (the emulated ones' launch grids follow the batch: refused for now)."""
    before = os.environ.get("FLOWGEN_CPU_KERNELS")
    os.environ["FLOWGEN_CPU_KERNELS"] = "native"
    yield
    if before is None:
        del os.environ["FLOWGEN_CPU_KERNELS"]
    else:
        os.environ["FLOWGEN_CPU_KERNELS"] = before


def _mlp():
    flow.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 48), nn.GELU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5)).eval()


def _eager(model, x):
    return model(flow.tensor(x)).numpy()


def _saved(model, spec, example, path):
    """`model` as an inference graph with dynamic_shapes `spec`, called once on `example` and saved
    to `path` (flow.save keeps the Dims)."""
    graph = InferGraph(model)
    graph.config.dynamic_shapes(spec)
    graph(example)
    flow.save(graph, path)


@pytest.fixture(scope="module")
def mlp(native, tmp_path_factory):
    """An MLP with a dynamic batch (2 to 64), saved and built with --lib for the cpu."""
    tmp = tmp_path_factory.mktemp("dynamic_deploy")
    model = _mlp()
    _saved(model, [{0: flow.Dim("batch", min=2, max=64)}], flow.randn(5, 20), tmp / "saved")
    result = aot.build(tmp / "saved", tmp / "out", target="cpu", lib=True)
    return {"tmp": tmp, "model": model, "binary": result.binary, "out": tmp / "out", "manifest": result.manifest}


def _rows(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 20)).astype(np.float32)


def test_saved_graph_runs_at_every_size(mlp):
    saved = flow.load(mlp["tmp"] / "saved")
    assert [d.name for d in saved.dynamic.dims] == ["batch"]
    for n in (2, 17, 64):
        x = _rows(n, n)
        (out,) = saved.run(x)
        assert out.shape == (n, 5)
        np.testing.assert_allclose(out, _eager(mlp["model"], x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"input_0 has size 65 at axis 0, which is Dim\('batch', min=2, max=64\): "
                                         r"allowed 2 to 64"):
        saved.run(_rows(65))
    with pytest.raises(ValueError, match=r"input 0 \(input_0\) has shape \(5, 21\), expected \(batch, 20\)"):
        saved.run(np.zeros((5, 21), np.float32))


def _run_program(binary, x, where):
    np.save(where / "x.npy", x)
    proc = subprocess.run([str(binary), "--input", str(where / "x.npy"), "--out", str(where / "o")],
                          capture_output=True, text=True, timeout=120)
    return proc, (np.load(where / "o" / "output_0.npy") if proc.returncode == 0 else None)


def test_program_takes_any_batch_in_range(mlp, tmp_path):
    for n in (2, 9, 64):
        x = _rows(n, n)
        proc, out = _run_program(mlp["binary"], x, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert out.shape == (n, 5)
        np.testing.assert_allclose(out, _eager(mlp["model"], x), rtol=1e-5, atol=1e-6)
    for shape, why in (((1, 20), "axis 0 is batch = 1, allowed 2 to 64"),
                       ((65, 20), "axis 0 is batch = 65, allowed 2 to 64"), ((5, 3), "expected [batch,20]")):
        proc, _ = _run_program(mlp["binary"], np.zeros(shape, np.float32), tmp_path)
        assert proc.returncode == 1 and why in proc.stderr, proc.stderr
    help_text = subprocess.run([str(mlp["binary"]), "--help"], capture_output=True, text=True).stdout
    assert "input_0 float32[batch,20]" in help_text and "batch: any size from 2 to 64" in help_text
    assert "batch: 2 to 64" in (mlp["out"] / mlp["manifest"]["header"]).read_text()


def test_library_signature_sizes_and_threads(mlp):
    model = mlp["model"]
    with flow.load_compiled(mlp["out"]) as compiled:
        (x_info,), (y_info,) = compiled.inputs, compiled.outputs
        assert (x_info.shape, x_info.min_shape, x_info.max_shape) == ((None, 20), (2, 20), (64, 20))
        assert (y_info.shape, y_info.min_shape, y_info.max_shape) == ((None, 5), (2, 5), (64, 5))
        for n in (64, 3, 31):
            x = _rows(n, 100 + n)
            np.testing.assert_allclose(compiled(x), _eager(model, x), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"input 0 \(input_0\): shape \[70,20\], expected \[batch,20\]: axis 0 is "
                                             r"batch = 70, allowed 2 to 64"):
            compiled(np.zeros((70, 20), np.float32))
        # Threads at different sizes at once: each call its own sizes and activation memory.
        inputs = [_rows(2 + 5 * t, t) for t in range(8)]
        expected = [_eager(model, x) for x in inputs]
        results, failures = [None] * 8, []

        def work(t):
            try:
                for _ in range(5):
                    results[t] = compiled(inputs[t])
            except Exception as e:   # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures
        for got, want in zip(results, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gpt_with_dynamic_batch_and_sequence_as_a_library(native, tmp_path):
    """Two Dims, an output whose sizes follow both ([batch, seq, vocab]), each Dim from 1."""
    flow.manual_seed(0)
    config = gpt_char.GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    model = FirstOutput(gpt_char.define(flow)(config)).eval()
    rng = np.random.default_rng(1)
    _saved(model, [{0: flow.Dim("batch", min=1, max=4), 1: flow.Dim("seq", min=1, max=16)}],
           flow.tensor(rng.integers(0, 32, (3, 5)).astype(np.int64)), tmp_path / "saved")
    aot.build(tmp_path / "saved", tmp_path / "out", target="cpu", lib=True)
    with flow.load_compiled(tmp_path / "out") as compiled:
        assert compiled.outputs[0].shape == (None, None, 32)
        assert (compiled.outputs[0].min_shape, compiled.outputs[0].max_shape) == ((1, 1, 32), (4, 16, 32))
        # programs for batch 1, seq 1 and both, beside the one for the other sizes
        for size in ((2, 2), (4, 16), (1, 1), (3, 7), (1, 9), (4, 1), (2, 16)):
            tokens = rng.integers(0, 32, size).astype(np.int64)
            np.testing.assert_allclose(compiled(tokens), model(flow.tensor(tokens)).numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"size {size}")


def test_a_size_of_one_gets_a_program_of_its_own(native, tmp_path):
    """At batch 1 the MLP compiles to other kernels (a bias read without its broadcast), which the
    kernels fitted for batches 2 up cannot run: the build holds a second program for it, as the
    Python graph compiles a variant, and the program and library pick it by size."""
    model = _mlp()
    graph = InferGraph(model)
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=1, max=16)}])
    with pytest.raises(ValueError, match=r"has run only with every Dim at 1 .*call it once with sizes above 1"):
        graph(flow.randn(1, 20))
        flow.save(graph, tmp_path / "saved")
    graph(flow.randn(4, 20))
    graph(flow.randn(1, 20))   # the last call ran the variant for batch 1; the dynamic one is saved
    flow.save(graph, tmp_path / "saved")
    assert [v["ones"] for v in json.loads((tmp_path / "saved" / "graph.json").read_text())["dynamic"]["variants"]] \
        == [[0]]
    result = aot.build(tmp_path / "saved", tmp_path / "out", target="cpu", lib=True)
    source = (tmp_path / "out" / "program.cu").read_text()
    assert "static void run_step_batch1(" in source and "k0_model_0_matmul_add_gelu_batch1" in source
    assert result.manifest["dynamic"]["dims"] == [{"name": "batch", "min": 1, "max": 16}]
    assert [p["dims_at_1"] for p in result.manifest["size_one_programs"]] == [["batch"]]
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out")])
    assert shown.exit_code == 0, shown.output
    assert "dynamic dimensions: batch 1..16 (input 0 axis 0); 1 more program(s) for sizes of 1" in shown.output
    for n in (1, 5, 16, 1):
        x = _rows(n, 50 + n)
        proc, out = _run_program(result.binary, x, tmp_path)
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_allclose(out, _eager(model, x), rtol=1e-5, atol=1e-6, err_msg=f"batch {n}")
    with flow.load_compiled(tmp_path / "out") as compiled:
        assert (compiled.outputs[0].min_shape, compiled.outputs[0].max_shape) == ((1, 5), (16, 5))
        for n in (16, 1, 2):
            x = _rows(n, n)
            np.testing.assert_allclose(compiled(x), _eager(model, x), rtol=1e-5, atol=1e-6, err_msg=f"batch {n}")


def test_a_damaged_dynamic_entry_is_refused_when_loading(mlp, tmp_path):
    doc = json.loads((mlp["tmp"] / "saved" / "graph.json").read_text())
    (tmp_path / "bad").mkdir()
    for name in ("constants.safetensors", "weights.safetensors", "signature.json"):
        (tmp_path / "bad" / name).write_bytes((mlp["tmp"] / "saved" / name).read_bytes())
    doc.pop("graph_sha256")
    doc["dynamic"]["uses"] = [[0, 0, 1]]   # axis 1 (20 wide) as the batch
    (tmp_path / "bad" / "graph.json").write_text(json.dumps(with_self_hash(doc, "graph_sha256")))
    with pytest.raises(FormatError, match=r"the 'dynamic' field ties axis 1 of input 0 \(20\) to "
                                          r"Dim\('batch', min=2, max=64\), whose max it must be"):
        flow.load(tmp_path / "bad")


@pytest.mark.slow
def test_c_api_with_a_dynamic_batch_under_address_and_ub_sanitizers(native, tmp_path):
    """tests/embed_dynamic_checks.c: the signature's -1 and ranges, every batch from 1 to 6 (two
    programs: batch 1's and the others'), sizes out of range (0, 7, -3, 2^40), a wrong fixed size
    or rank, threads at different batches at once."""
    flow.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).eval()
    _saved(model, [{0: flow.Dim("batch", min=1, max=6)}], flow.randn(4, 6), tmp_path / "saved")
    out = tmp_path / "out"
    manifest = aot.build(tmp_path / "saved", out, target="cpu", sanitize="address,undefined", lib=True).manifest
    checks = compile_c(ROOT / "tests" / "embed_dynamic_checks.c", out, manifest, tmp_path / "checks", "-O1", "-g",
                        "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer")
    proc = subprocess.run([str(checks)], capture_output=True, text=True, timeout=300, cwd=out,
                          env={"ASAN_OPTIONS": "detect_leaks=1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert "input: input_0 ndim 2 [-1 1..6] [6 6..6]" in lines
    assert "output: output_0 ndim 2 [-1 1..6] [3 3..3]" in lines
    refused = dict(line.split(": ", 1) for line in lines if ": rc " in line)
    for batch in ("0", "7", "-3", str(1 << 40)):
        assert refused[f"run batch {batch}"] == (f"rc 1: input 0 (input_0): shape [{batch},6], expected [batch,6]: "
                                                 f"axis 0 is batch = {batch}, allowed 1 to 6")
    assert refused["run features + 1"] == "rc 1: input 0 (input_0): shape [1,7], expected [batch,6]"
    assert refused["run NULL data"].startswith("rc 1: input 0 (input_0): data is NULL; expected 24 bytes")
    for n in range(1, 7):
        values = next(line for line in lines if line.startswith(f"batch {n}:")).split()[2:]
        k = np.arange(n * 6)
        x = (((k * 7 + n * 3) % 13) / 6.0 - 1.0).astype(np.float32).reshape(n, 6)   # the C file's fill(x, n)
        np.testing.assert_allclose(np.array(values, np.float32).reshape(n, 3), _eager(model, x), rtol=1e-5,
                                   atol=1e-6, err_msg=f"batch {n}")
    assert "threads: 80 calls agree" in lines


def test_flow_save_with_dynamic_shapes_of_a_graph_compiled_for_fixed_ones(native, tmp_path):
    """torch.export's way: the graph ran at batch 5, and flow.save(..., dynamic_shapes=) saves its
    step with a dynamic batch; the graph itself keeps its fixed-shape config."""
    model = _mlp()
    graph = InferGraph(model)
    graph(flow.randn(5, 20))
    flow.save(graph, tmp_path / "saved", dynamic_shapes=[{0: flow.Dim("batch", min=2, max=32)}])
    assert graph.config.dynamic is None
    saved = flow.load(tmp_path / "saved")
    for n in (2, 32, 9):
        x = _rows(n, 200 + n)
        np.testing.assert_allclose(saved.run(x)[0], _eager(model, x), rtol=1e-5, atol=1e-6, err_msg=f"batch {n}")
    with pytest.raises(ValueError, match="dynamic_shapes has 2 entries for 1 inputs"):
        flow.save(graph, tmp_path / "bad", dynamic_shapes=[{0: flow.Dim("batch", min=2, max=32)}, None])
    with pytest.raises(TypeError, match="dynamic_shapes= applies to an nn.Graph"):
        flow.save({"w": flow.ones(2)}, tmp_path / "dict", dynamic_shapes=[None])


def test_kernels_whose_launch_grid_follows_the_batch(native, tmp_path):
    """`--target emulator` builds every kernel as its CUDA source for the CPU emulator: their launch
    grids follow the batch (blocks over its rows, a GEMM's row tiles), so the program computes
    each grid from the step's sizes (codegen/dynamic.py GridSize), at every batch from 1 to 512;
    the cuda target's program and library build the same way (NVRTC, no GPU needed to build)."""
    flow.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.LayerNorm(64), nn.Linear(64, 5)).eval()
    _saved(model, [{0: flow.Dim("batch", min=1, max=512)}], flow.randn(3, 64), tmp_path / "saved")
    binary = aot.build(tmp_path / "saved", tmp_path / "out", target="emulator").binary
    assert "Dims{unsigned(flowgen_blocks(m.size[0], " in (tmp_path / "out" / "program.cu").read_text()
    for n in (1, 2, 9, 300, 512):
        x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
        proc, out = _run_program(binary, x, tmp_path)
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_allclose(out, _eager(model, x), rtol=1e-5, atol=1e-6, err_msg=f"batch {n}")
    aot.build(tmp_path / "saved", tmp_path / "cuda", target="cuda", arch="sm_90", lib=True)
    launches = [line for line in (tmp_path / "cuda" / "program.cu").read_text().splitlines()
                if "dev.launch(" in line and "_batch1," not in line]   # the batch-1 program's grids are fixed
    assert launches and all("flowgen_blocks(m.size[0], " in line for line in launches), launches


def _dynamic_training(min_batch=2):
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.Adam(model.parameters(), lr=0.01))
    batch = flow.Dim("batch", min=min_batch, max=32)
    graph.config.dynamic_shapes([{0: batch}, {0: batch}])
    return model, graph


def test_a_training_program_takes_a_dataset_of_any_length(native, tmp_path):
    """A training step with a dynamic batch, saved and built: the program reads inputs of any
    number of rows and trains on batches of the Dim's max rows, the last one what remains (70
    rows: 32, 32, 6), with the Python graph's losses, parameters and BatchNorm statistics;
    rows that leave a last batch below the Dim's minimum, or inputs of different rows, are
    refused naming them."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((70, 8)).astype(np.float32), rng.standard_normal((70, 3)).astype(np.float32)
    _, graph = _dynamic_training()
    graph(flow.tensor(x[:5]), flow.tensor(y[:5]))
    flow.save(graph, tmp_path / "saved")
    model, reference = _dynamic_training()
    reference(flow.tensor(x[:5]), flow.tensor(y[:5]))
    losses = [float(reference(flow.tensor(x[a:a + 32]), flow.tensor(y[a:a + 32])).numpy()) for a in (0, 32, 64)]
    binary = aot.build(tmp_path / "saved", tmp_path / "out", target="cpu").binary
    assert "a Dim holds any number of rows" in subprocess.run([str(binary), "--help"], capture_output=True,
                                                              text=True).stdout

    def run(*arrays):
        args = []
        for k, a in enumerate(arrays):
            np.save(tmp_path / f"in{k}.npy", a)
            args += ["--input", str(tmp_path / f"in{k}.npy")]
        return subprocess.run([str(binary), *args, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                              timeout=120)

    proc = run(x, y)
    assert proc.returncode == 0, proc.stderr
    assert "step 3/3" in proc.stdout
    np.testing.assert_allclose(np.load(tmp_path / "o" / "losses.npy"), losses, rtol=1e-6)
    weights = load_file(tmp_path / "o" / "weights.safetensors")
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(weights[f"model.{name}"], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    proc = run(x[:65], y[:65])
    assert proc.returncode != 0
    assert "its 65 rows make batches of batch = 32 and a last one of 1, below batch's minimum 2" in proc.stderr
    proc = run(x, y[:69])
    assert proc.returncode != 0 and "69 rows, but input 0 has 70: both are batches of batch" in proc.stderr


def test_a_training_step_with_dims_off_the_first_axis_is_not_saved(native, tmp_path):
    flow.manual_seed(0)
    model = nn.Linear(8, 3)
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    seq = flow.Dim("seq", min=2, max=16)
    graph.config.dynamic_shapes([{1: seq}, {1: seq}])
    graph(flow.randn(2, 5, 8), flow.randn(2, 5, 3))
    with pytest.raises(NotImplementedError, match=r"its Dim\('seq', min=2, max=16\) is axis 1 of input 0; .* must be "
                                                  r"the inputs' first axis"):
        flow.save(graph, tmp_path / "saved")


@pytest.mark.gpu
def test_a_cuda_library_with_a_dynamic_batch_on_the_gpu(native, tmp_path):
    """The cuda target's library (launch grids computed from the batch) on the GPU at every batch."""
    flow.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.LayerNorm(64), nn.Linear(64, 5)).eval()
    _saved(model, [{0: flow.Dim("batch", min=1, max=512)}], flow.randn(3, 64), tmp_path / "saved")
    aot.build(tmp_path / "saved", tmp_path / "cuda", target="cuda", arch=gpu_arch(), lib=True)
    with flow.load_compiled(tmp_path / "cuda") as library:
        for n in (1, 2, 9, 300, 512):
            x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
            np.testing.assert_allclose(library(x), _eager(model, x), rtol=1e-4, atol=1e-5, err_msg=f"batch {n}")
