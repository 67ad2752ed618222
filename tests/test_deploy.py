"""Deployment: flow.save(graph, dir) / flow.load(dir), the standalone program built from it,
and resuming training from flow.save(graph.state_dict()).

Every program here is built for the CPU emulator (`--target cpu`) and compared with the
graph it came from; the CUDA target is built too (no GPU needed) and run where a GPU exists.
"""
import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors_bytes, load_file, save_file

import flowgen as flow
import flowgen.nn as nn
from flowgen import serialization
from flowgen.codegen import aot
from flowgen.codegen.fused import GRAPH_VALUE_PREFIX
from flowgen.saved_graph import FormatError, SavedGraph
from graphs import InferGraph, TrainGraph


def conv_model():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    with flow.no_grad():   # non-trivial BatchNorm statistics, so eval mode uses them
        model[1].running_mean.copy_(flow.randn(8) * 0.1)
        model[1].running_var.copy_(flow.rand(8) + 0.5)
    model.eval()
    return model


def run_binary(out_dir, *args, binary=None):
    manifest = json.loads((out_dir / "manifest.json").read_text())
    exe = binary or out_dir / manifest["binary"]
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, errors="replace", timeout=120)
    assert proc.returncode >= 0, f"the program was killed by signal {-proc.returncode}:\n{proc.stderr}"
    return proc


def build_and_train(graph, xs, ys, steps, tmp_path):
    """Save `graph`, build its cpu program, run `steps` training steps on (xs, ys); the weights
    and the losses it wrote."""
    flow.save(graph, tmp_path / "saved")
    aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")
    np.save(tmp_path / "x.npy", xs)
    np.save(tmp_path / "y.npy", ys)
    proc = run_binary(tmp_path / "out", "--input", tmp_path / "x.npy", "--input", tmp_path / "y.npy",
                      "--out", tmp_path / "res", "--steps", steps)
    assert proc.returncode == 0, proc.stderr
    return load_file(tmp_path / "res" / "weights.safetensors"), np.load(tmp_path / "res" / "losses.npy")


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    """The issue's conv model as an inference graph: saved, and built for the CPU."""
    flow.manual_seed(0)
    tmp = tmp_path_factory.mktemp("conv")
    model = conv_model()
    graph = InferGraph(model)
    x = flow.randn(2, 3, 8, 8)
    expected = graph(x).numpy().copy()
    flow.save(graph, tmp / "saved")
    aot.build(tmp / "saved", tmp / "out", target="cpu")
    np.save(tmp / "x.npy", x.numpy())
    return {"tmp": tmp, "graph": graph, "x": x.numpy(), "expected": expected, "saved": tmp / "saved",
            "out": tmp / "out"}


# Poly-fit (seed 004, examples/polyfit_graph.py) with 4 batches of 50 points and momentum SGD.
POLY_BATCH, POLY_BATCHES = 50, 4


def poly_data():
    x = np.linspace(-math.pi, math.pi, POLY_BATCH * POLY_BATCHES).astype(np.float32)
    xx = np.stack([x, x ** 2, x ** 3], axis=1).astype(np.float32)
    return xx, np.sin(x).astype(np.float32)


def poly_batch(step):
    xx, y = poly_data()
    b = step % POLY_BATCHES
    return flow.tensor(xx[b * POLY_BATCH:(b + 1) * POLY_BATCH]), flow.tensor(y[b * POLY_BATCH:(b + 1) * POLY_BATCH])


@pytest.fixture(scope="module")
def poly(tmp_path_factory):
    flow.manual_seed(0)
    tmp = tmp_path_factory.mktemp("poly")
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    optimizer = flow.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)
    graph = TrainGraph(model, nn.MSELoss(reduction="sum"), optimizer)
    graph(*poly_batch(0))                     # traced, compiled, one step taken
    flow.save(graph, tmp / "saved")
    aot.build(tmp / "saved", tmp / "out", target="cpu")
    xx, y = poly_data()
    np.save(tmp / "x.npy", xx)
    np.save(tmp / "y.npy", y)
    momentum = graph.state_dict()["model.0.weight-momentum"].numpy().copy()
    return {"tmp": tmp, "graph": graph, "model": model, "saved": tmp / "saved", "out": tmp / "out",
            "momentum_at_save": momentum}


# ----------------------------------------------------------------------------- flow.save(graph)
def test_saved_graph_directory_and_format(conv):
    saved_dir = conv["saved"]
    assert sorted(os.listdir(saved_dir)) == ["constants.safetensors", "graph.json", "signature.json",
                                             "weights.safetensors"]
    doc = json.loads((saved_dir / "graph.json").read_text())
    assert doc["format"] == "flowgen.graph" and doc["version"] == 1 and doc["training"] is False
    assert doc["inputs"] == [{"name": "input_0", "shape": [2, 3, 8, 8], "dtype": "float32"}]
    kinds = {s["name"]: s["kind"] for s in doc["state"]}
    assert kinds["model.0.weight"] == "param" and kinds["model.1.running_mean"] == "buffer"
    def walk(nodes):   # nodes and the bodies of fused nodes
        for n in nodes:
            yield n
            yield from walk(n.get("body", []))

    nodes = list(walk(doc["nodes"]))
    ops = [n["op"] for n in nodes]
    assert "conv2d" in ops and "max_pool2d" in ops
    conv_node = nodes[ops.index("conv2d")]
    assert conv_node["scope"] == "model.0" and conv_node["attrs"]["padding"] == {"$tuple": [1, 1]}
    assert conv_node["outputs"][0] == {"name": conv_node["outputs"][0]["name"], "shape": [2, 8, 8, 8],
                                       "dtype": "float32"}
    fused = [n for n in doc["nodes"] if n["op"] == "fused"]
    assert fused and all(n["body"] and "kind" in n["attrs"] for n in fused)

    signature = json.loads((saved_dir / "signature.json").read_text())
    assert signature["graph"] == conv["graph"].name and signature["training"] is False
    assert signature["outputs"][0]["name"] == "output_0" and signature["outputs"][0]["shape"] == [2, 5]
    weights = load_file(saved_dir / "weights.safetensors")
    model = conv["graph"].model
    np.testing.assert_array_equal(weights["model.1.running_var"], model[1].running_var.numpy())


def test_load_rebuilds_the_same_program_and_runs_it(conv):
    saved = flow.load(conv["saved"])
    assert isinstance(saved, SavedGraph) and not saved.training
    assert str(saved.ir) == str(conv["graph"].compiled.ir)
    assert saved.program("cpu").source == conv["graph"].compiled.program.source
    (out,) = saved.run(conv["x"])
    np.testing.assert_array_equal(out, conv["expected"])
    with pytest.raises(ValueError, match="shape"):
        saved.run(conv["x"][:1])


def test_constants_go_to_constants_safetensors_keyed_by_value_name(poly):
    doc = json.loads((poly["saved"] / "graph.json").read_text())
    constants = load_file(poly["saved"] / "constants.safetensors")
    refs = [n["attrs"]["value"] for n in doc["nodes"] if n["op"] == "constant"]
    assert refs and all(r["$array"] in constants for r in refs)
    for node in (n for n in doc["nodes"] if n["op"] == "constant"):
        assert node["attrs"]["value"]["$array"] == node["outputs"][0]["name"]


def test_training_graph_saves_optimizer_state_and_hyper_scalars(poly):
    weights = load_file(poly["saved"] / "weights.safetensors")
    doc = json.loads((poly["saved"] / "graph.json").read_text())
    kinds = {s["name"]: s["kind"] for s in doc["state"]}
    assert doc["training"] is True and set(weights) == set(kinds)
    assert {"param", "optim", "hyper"} <= set(kinds.values())
    assert weights["optim0.group0.lr"] == np.float32(1e-5)
    # After the first step momentum is on: the hyper scalars hold the values of the next step.
    assert weights["optim0.group0.model.0.weight.momentum"] == np.float32(0.9)
    np.testing.assert_array_equal(weights["model.0.weight.momentum_buffer"], poly["momentum_at_save"])


def test_load_refuses_other_versions_and_corrupt_files(conv, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(conv["saved"], copy)
    doc = json.loads((copy / "graph.json").read_text())
    (copy / "graph.json").write_text(json.dumps(dict(doc, version=99)))
    with pytest.raises(FormatError, match="version 99"):
        flow.load(copy)
    (copy / "graph.json").write_text(json.dumps(doc))
    weights = load_file(copy / "weights.safetensors")
    weights["model.0.weight"] = weights["model.0.weight"][:4]
    save_file(weights, copy / "weights.safetensors")
    with pytest.raises(FormatError, match="weights.safetensors is corrupt.*weights_sha256"):
        flow.load(copy)
    _rehash_graph_json(copy)
    with pytest.raises(FormatError, match="model.0.weight.*shape"):
        flow.load(copy)


def _rehash_graph_json(directory):
    """Record the current weights' hash in graph.json and re-hash it: a consistent hand edit."""
    doc = json.loads((directory / "graph.json").read_text())
    doc.pop("graph_sha256")
    doc["weights_sha256"] = serialization.file_sha256(directory / "weights.safetensors")
    (directory / "graph.json").write_text(json.dumps(serialization.with_self_hash(doc, "graph_sha256")))


def test_load_names_a_bad_step_count_in_the_weights_metadata(conv, tmp_path):
    """Issue 9: a step count that is not a number raised UnboundLocalError."""
    copy = tmp_path / "copy"
    shutil.copytree(conv["saved"], copy)
    save_file(load_file(copy / "weights.safetensors"), copy / "weights.safetensors",
              metadata={"format": "flowgen.weights", "step": "abc"})
    _rehash_graph_json(copy)
    with pytest.raises(FormatError, match="weights.safetensors: metadata 'step' is 'abc', not a step count"):
        flow.load(copy)


def test_save_before_the_first_call_says_what_to_do(tmp_path):
    with pytest.raises(RuntimeError, match="call it once"):
        flow.save(InferGraph(nn.Linear(2, 2)), tmp_path / "g")


# ----------------------------------------------------------------------------- the program
def test_cpu_program_matches_the_graph(conv, tmp_path):
    proc = run_binary(conv["out"], "--input", conv["tmp"] / "x.npy", "--out", tmp_path / "res")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "res" / "output_0.npy")
    np.testing.assert_allclose(got, conv["expected"], rtol=1e-6, atol=1e-6)
    assert sorted(os.listdir(tmp_path / "res")) == ["output_0.npy"]   # no temporary files left behind


def test_program_is_readable_and_described_by_the_manifest(conv):
    out = conv["out"]
    text = (out / "program.cu").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    import hashlib

    assert manifest["program_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert manifest["inputs"] == [{"name": "input_0", "shape": [2, 3, 8, 8], "dtype": "float32"}]
    assert manifest["training"] is False and manifest["target"] == "cpu"
    assert [s["name"] for s in manifest["state"]][:2] == ["model.0.weight", "model.0.bias"]
    program = flow.load(conv["saved"]).program("cpu")
    assert program.source.rstrip("\n") in text                       # the kernels, verbatim
    for k in program.kernels:                                        # straight-line launches, commented
        assert f"// [{program.kernels.index(k)}] {k.name}: {k.comment}" in text
    assert "constexpr size_t ARENA_BYTES = " in text and "constexpr size_t OFF_" in text
    help_text = run_binary(out, "--help")
    assert help_text.returncode == 0 and "input_0 float32[2,3,8,8]" in help_text.stdout


def test_training_program_matches_graph_steps(poly, tmp_path):
    steps = 6   # wraps around the 4 batches
    proc = run_binary(poly["out"], "--input", poly["tmp"] / "x.npy", "--input", poly["tmp"] / "y.npy",
                      "--out", tmp_path / "res", "--steps", steps)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("loss") == steps
    graph = poly["graph"]
    losses = [float(graph(*poly_batch(s)).numpy()) for s in range(steps)]
    np.testing.assert_allclose(np.load(tmp_path / "res" / "losses.npy"), losses, rtol=1e-6)
    weights = load_file(tmp_path / "res" / "weights.safetensors")
    state = graph.state_dict()
    for name in ("0.weight", "0.bias"):
        np.testing.assert_allclose(weights[f"model.{name}"], state["model"][name].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(weights["model.0.weight.momentum_buffer"], state["model.0.weight-momentum"].numpy(),
                               rtol=1e-6, atol=1e-6)
    # The written weights are a valid starting point: two more steps from them.
    again = run_binary(poly["out"], "--weights", tmp_path / "res" / "weights.safetensors", "--input",
                       poly["tmp"] / "x.npy", "--input", poly["tmp"] / "y.npy", "--out", tmp_path / "res2",
                       "--steps", 2)
    assert again.returncode == 0, again.stderr


# ----------------------------------------------------------------------------- refusing bad files
def _npy_bytes(array):
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def bad_inputs(x):
    """(file name, bytes, words the error must contain)."""
    good = _npy_bytes(x)
    return [
        ("wrong_shape.npy", _npy_bytes(x[:1]), ["shape", "[1,3,8,8]", "expected [2,3,8,8]"]),
        ("wrong_dtype.npy", _npy_bytes(x.astype(np.float64)), ["dtype", "float64", "expected float32",
                                                                "astype(np.float32)"]),
        ("int_dtype.npy", _npy_bytes(x.astype(np.int64)), ["dtype", "int64", "expected float32"]),
        ("truncated.npy", good[:-7], ["truncated"]),
        ("header_only.npy", good[:40], ["truncated"]),
        ("trailing.npy", good + b"\0" * 8, ["unexpected bytes"]),
        ("fortran.npy", _npy_bytes(np.asfortranarray(x)), ["Fortran order"]),
        ("random.npy", np.random.default_rng(1).bytes(600), ["not a .npy file"]),
        ("empty.npy", b"", ["not a .npy file"]),
        ("bad_header.npy", good[:10] + b"{'descr': '<f4', 'shape': [2, 3]}".ljust(len(good) - 10, b" "),
         ["corrupt .npy header"]),
    ]


def bad_weights(path):
    """(file name, bytes, words the error must contain) made from the good weights file at `path`."""
    good = path.read_bytes()
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    tensors = load_file(path)

    def rewrite(change):
        h = json.loads(good[8:8 + n])
        change(h)
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + good[8 + n:]

    first = "model.0.weight"
    missing = dict(tensors)
    missing.pop(first)
    wrong_shape = dict(tensors)
    wrong_shape[first] = tensors[first].reshape(-1)[:-1].copy() if tensors[first].size > 1 else np.zeros(2, np.float32)
    import io
    from safetensors.numpy import save

    return [
        ("truncated.safetensors", good[:-5], ["truncated"]),
        ("short.safetensors", good[:5], ["truncated"]),
        ("header_len.safetensors", (10 ** 9).to_bytes(8, "little") + good[8:], ["header length"]),
        ("corrupt_header.safetensors", good[:8] + b"{\"x\": [1, 2" + good[19:], ["corrupt header"]),
        ("garbage.safetensors", np.random.default_rng(2).bytes(len(good)), ["weights file"]),
        ("wrong_dtype.safetensors", rewrite(lambda h: h[first].update(dtype="F64")), ["dtype F64", "need", "bytes"]),
        ("offsets.safetensors", rewrite(lambda h: h[first].update(data_offsets=[0, 10 ** 6])), ["truncated"]),
        ("missing.safetensors", save(missing), ["missing tensor", first]),
        ("wrong_shape.safetensors", save(wrong_shape), [first, "shape"]),
        ("extra.safetensors", save(dict(tensors, surplus=np.zeros(3, np.float32))), ["unexpected tensor 'surplus'"]),
    ]


def test_bad_inputs_are_refused_with_a_reason(conv, tmp_path):
    for name, data, words in bad_inputs(conv["x"]):
        (tmp_path / name).write_bytes(data)
        proc = run_binary(conv["out"], "--input", tmp_path / name, "--out", tmp_path / "res")
        assert proc.returncode == 1, (name, proc.stderr)
        for word in words:
            assert word in proc.stderr, (name, word, proc.stderr)
    assert not (tmp_path / "res" / "output_0.npy").exists()
    missing = run_binary(conv["out"], "--input", tmp_path / "nope.npy", "--out", tmp_path / "res")
    assert missing.returncode == 1 and "cannot open" in missing.stderr
    usage = run_binary(conv["out"], "--out", tmp_path / "res")
    assert usage.returncode == 2 and "expected 1 --input" in usage.stderr


def test_header_length_shortened_into_its_padding_is_refused(conv, tmp_path):
    """Issue 9: one byte less of header length still parses as JSON (the padding is spaces), but
    every tensor would load one byte off; the tensors no longer tile the data, so it is refused."""
    good = (conv["out"] / "weights.safetensors").read_bytes()
    n = int.from_bytes(good[:8], "little")
    assert good[8 + n - 1:8 + n] == b" "   # the header ends in padding
    shortened = (n - 1).to_bytes(8, "little") + good[8:]
    with pytest.raises(SafetensorError):   # the safetensors library refuses it: the oracle
        load_safetensors_bytes(shortened)
    (tmp_path / "short.safetensors").write_bytes(shortened)
    proc = run_binary(conv["out"], "--weights", tmp_path / "short.safetensors", "--input", conv["tmp"] / "x.npy",
                      "--out", tmp_path / "res")
    assert proc.returncode == 1 and "short.safetensors" in proc.stderr and "cover" in proc.stderr, proc.stderr
    assert not (tmp_path / "res").exists()


def test_build_outputs_get_normal_permissions(conv):
    """Files of a build are readable by others as the umask allows (not 0600); the binary is executable."""
    mask = os.umask(0)
    os.umask(mask)
    out = conv["out"]
    binary = json.loads((out / "manifest.json").read_text())["binary"]
    names = sorted(os.listdir(out))
    assert {"program.cu", "weights.safetensors", "manifest.json", binary} <= set(names)
    assert not [n for n in names if n.endswith(".tmp") or n.endswith(".partial")]
    for name in names:
        mode = os.stat(out / name).st_mode & 0o777
        assert mode == (0o777 if name == binary else 0o666) & ~mask, (name, oct(mode), oct(mask))


DETERMINISM_SCRIPT = """
import sys
import numpy as np
import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen import aot
from graphs import TrainGraph

out = sys.argv[1]
flow.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Dropout(0.1), nn.Linear(4 * 4 * 4, 3))
opt = flow.optim.Adam(model.parameters(), lr=1e-3)
graph = TrainGraph(model, nn.CrossEntropyLoss(), (opt, flow.optim.lr_scheduler.StepLR(opt, 2)))
graph(flow.randn(2, 3, 4, 4), flow.tensor(np.array([0, 2])))
flow.save(graph, out + "/saved")
flow.save(graph.state_dict(), out + "/state")
saved = flow.load(out + "/saved")
program = saved.program("cpu")
text, constants = aot.render_program(program, name=saved.name, training=True, target="cpu", arch="sm_90",
                                     build_commands=[])
open(out + "/program.cu", "w").write(text)
open(out + "/program_constants.inc", "w").write(constants)
"""


def test_generated_files_and_weights_are_identical_across_processes(tmp_path):
    """Two processes (different hash seeds) save the same graph and state dict and render its
    program: every byte matches (issue 9: the weights' metadata came out in hash order)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    for seed in ("1", "2"):
        (tmp_path / seed).mkdir()
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", DETERMINISM_SCRIPT, str(tmp_path / seed)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    files = sorted(str(p.relative_to(tmp_path / "1")) for p in (tmp_path / "1").rglob("*") if p.is_file())
    assert {"saved/weights.safetensors", "state/tensors.safetensors", "program.cu"} <= set(files)
    for name in files:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name


def test_bad_weights_are_refused_with_a_reason(conv, tmp_path):
    for name, data, words in bad_weights(conv["out"] / "weights.safetensors"):
        (tmp_path / name).write_bytes(data)
        proc = run_binary(conv["out"], "--weights", tmp_path / name, "--input", conv["tmp"] / "x.npy",
                          "--out", tmp_path / "res")
        assert proc.returncode == 1, (name, proc.stderr)
        for word in words:
            assert word in proc.stderr, (name, word, proc.stderr)


# ----------------------------------------------------------------------------- the CUDA target
def _gpu_available():
    try:
        from flowgen.runtime import cuda_driver
        return cuda_driver.available()
    except Exception:   # noqa: BLE001 - no driver bindings at all
        return False


def test_cuda_target_builds_without_a_gpu(conv, tmp_path):
    out = tmp_path / "cuda"
    result = aot.build(conv["saved"], out, target="cuda", arch="sm_80")
    assert result.binary.is_file() and (out / "program_cubin.inc").is_file()
    assert set(result.timings) >= {"render", "compile device code", "compile host code", "write weights"}
    assert result.manifest["target"] == "cuda" and result.manifest["arch"] == "sm_80"
    assert "dlopen(\"libcuda.so.1\"" in (out / "program.cu").read_text()
    assert run_binary(out, "--help").returncode == 0
    if _gpu_available():
        return   # test_cuda_program_on_gpu runs it
    proc = run_binary(out, "--input", conv["tmp"] / "x.npy", "--out", tmp_path / "res")
    assert proc.returncode == 3 and "CUDA" in proc.stderr and "--target cpu" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_target_with_nvcc(poly, tmp_path):
    result = aot.build(poly["saved"], tmp_path / "nvcc", target="cuda", compiler="nvcc", arch="sm_80")
    assert result.binary.is_file() and result.manifest["compiler"] == "nvcc"
    assert "nvcc -cubin -arch=sm_80" in (tmp_path / "nvcc" / "program.cu").read_text()


@pytest.mark.gpu
def test_cuda_program_on_gpu(conv, poly, tmp_path):
    from flowgen.runtime import cuda_driver

    arch = cuda_driver.CudaContext.get().arch
    aot.build(conv["saved"], tmp_path / "conv", target="cuda", arch=arch)
    proc = run_binary(tmp_path / "conv", "--input", conv["tmp"] / "x.npy", "--out", tmp_path / "res")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "res" / "output_0.npy"), conv["expected"], rtol=1e-4, atol=1e-5)
    aot.build(poly["saved"], tmp_path / "poly", target="cuda", arch=arch)
    saved = flow.load(poly["saved"])            # same weights, same (constant) hyper scalars
    expected = [float(saved.run(*(t.numpy() for t in poly_batch(s)))[0]) for s in range(3)]
    proc = run_binary(tmp_path / "poly", "--input", poly["tmp"] / "x.npy", "--input", poly["tmp"] / "y.npy",
                      "--out", tmp_path / "res_poly", "--steps", 3)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "res_poly" / "losses.npy"), expected, rtol=1e-4)


# ----------------------------------------------------------------------------- resuming training
def _resume_setup(seed):
    flow.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0, 1))
    sgd = flow.optim.SGD(list(model[0].parameters()) + list(model[1].parameters()), lr=0.05, momentum=0.9)
    adam = flow.optim.Adam(model[3].parameters(), lr=0.01)
    schedule = flow.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
    return TrainGraph(model, nn.MSELoss(), sgd, (adam, schedule))


def test_resume_from_state_dict_is_bit_identical(tmp_path):
    rng = np.random.default_rng(0)
    batches = [(flow.tensor(rng.standard_normal((16, 3)).astype(np.float32)),
                flow.tensor(rng.standard_normal(16).astype(np.float32))) for _ in range(8)]
    graph = _resume_setup(seed=0)
    first = [float(graph(*b).numpy()) for b in batches[:4]]
    flow.save(graph.state_dict(), tmp_path / "ckpt")
    uninterrupted = [float(graph(*b).numpy()) for b in batches[4:]]

    resumed_graph = _resume_setup(seed=123)   # different initial weights: everything must come from the file
    resumed_graph.load_state_dict(flow.load(tmp_path / "ckpt"))
    resumed = [float(resumed_graph(*b).numpy()) for b in batches[4:]]
    assert resumed == uninterrupted
    assert first[0] != resumed[0]
    state, resumed_state = graph.state_dict(), resumed_graph.state_dict()
    assert list(state) == list(resumed_state)
    for name, value in state["model"].items():
        np.testing.assert_array_equal(value.numpy(), resumed_state["model"][name].numpy(), err_msg=name)
    for name, value in state.items():
        if isinstance(value, flow.Tensor):   # optimizer slots, train step, random state
            np.testing.assert_array_equal(value.numpy(), resumed_state[name].numpy(), err_msg=name)
    assert resumed_state["System-Train-TrainStep"].numpy()[0] == state["System-Train-TrainStep"].numpy()[0] == 8


def test_module_state_dict_through_the_graph_proxy(conv, tmp_path):
    """Seed 003 warns that graph.model.state_dict() fails in OneFlow; in flowgen the proxy forwards it."""
    state = conv["graph"].model.state_dict()
    flow.save(state, tmp_path / "model_state")
    restored = conv_model()
    restored.load_state_dict(flow.load(tmp_path / "model_state"))
    np.testing.assert_allclose(restored(flow.tensor(conv["x"])).numpy(), conv["expected"], rtol=1e-5, atol=1e-5)


def test_flowgen_run_trains_and_prints_the_loss(poly, tmp_path):
    from click.testing import CliRunner

    try:
        from flowgen_cli.main import cli
    except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
        from cli.main import cli
    result = CliRunner().invoke(cli, ["run", str(poly["out"]), str(poly["tmp"] / "x.npy"), str(poly["tmp"] / "y.npy"),
                                      "-o", str(tmp_path / "res"), "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert [line.split()[:2] for line in result.output.splitlines()[:3]] == [["step", "1/3"], ["step", "2/3"],
                                                                             ["step", "3/3"]]
    saved = flow.load(poly["saved"])
    expected = [float(saved.run(*(t.numpy() for t in poly_batch(s)))[0]) for s in range(3)]
    np.testing.assert_allclose(np.load(tmp_path / "res" / "losses.npy"), expected, rtol=1e-6)
    weights = load_file(tmp_path / "res" / "weights.safetensors")
    for name, value in saved.weights.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_training_program_advances_adam_bias_correction_and_dropout(tmp_path):
    """Hyper state with a per-step schedule (Adam's bias corrections, the dropout Philox offset,
    SGD's first momentum step) advances inside the program exactly as the Python runtime sets it."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1), nn.Flatten(0, 1))
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.Adam(model.parameters(), lr=1e-2))
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((3 * 8, 5)).astype(np.float32)
    ys = rng.standard_normal(3 * 8).astype(np.float32)
    graph(flow.tensor(xs[:8]), flow.tensor(ys[:8]))          # one step: traced and compiled
    steps = 5
    weights, program_losses = build_and_train(graph, xs, ys, steps, tmp_path)
    losses = [float(graph(flow.tensor(xs[8 * (s % 3):8 * (s % 3) + 8]), flow.tensor(ys[8 * (s % 3):8 * (s % 3) + 8])))
              for s in range(steps)]
    np.testing.assert_allclose(program_losses, losses, rtol=1e-5)
    state = graph.state_dict()
    for name in ("0.weight", "3.weight"):
        np.testing.assert_allclose(weights[f"model.{name}"], state["model"][name].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_opt,make_sch", [
    (lambda p: flow.optim.Adam(p, lr=0.05), lambda o: flow.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    (lambda p: flow.optim.SGD(p, lr=0.05), lambda o: flow.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 3, 3],
                                                                                        gamma=0.5)),
    (lambda p: flow.optim.AdamW(p, lr=0.05, weight_decay=0.1),
     lambda o: flow.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=0.001)),
    (lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9),
     lambda o: flow.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3)),
], ids=["adam_step", "sgd_multistep", "adamw_cosine", "momentum_linear"])
def test_training_program_follows_lr_schedulers(make_opt, make_sch, tmp_path):
    """Every optimizer follows its closed-form scheduler in the program (Adam's step size and
    AdamW's decay included), and --help says so."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    optimizer = make_opt(model.parameters())
    graph = TrainGraph(model, nn.MSELoss(), (optimizer, make_sch(optimizer)))
    xx, y = poly_data()
    xs, ys = xx[:40] / 10, y[:40]
    graph(flow.tensor(xs[:8]), flow.tensor(ys[:8]))
    weights, _ = build_and_train(graph, xs, ys, 6, tmp_path)
    for s in range(6):
        graph(flow.tensor(xs[8 * (s % 5):8 * (s % 5) + 8]), flow.tensor(ys[8 * (s % 5):8 * (s % 5) + 8]))
    np.testing.assert_allclose(weights["model.0.weight"], model[0].weight.numpy(), rtol=1e-5, atol=1e-7)
    usage = run_binary(tmp_path / "out", "--help").stdout
    assert "the LR of\nevery optimizer follows its StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR" in usage


@pytest.mark.parametrize("make_opt", [lambda p: flow.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1),
                                      lambda p: flow.optim.Adam(p, lr=0.01)], ids=["sgd_dampening", "adam"])
def test_training_program_carries_a_dynamic_grad_scaler(make_opt, tmp_path):
    """A GradScaler's scale and growth tracker are graph state: the program skips overflowing
    steps and backs off / grows the scale exactly as the Python runtime does, and skipped steps
    do not count for SGD's first momentum step or Adam's bias corrections (saved in the weights)."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1), nn.Flatten(0, 1))
    graph = TrainGraph(model, nn.MSELoss(), make_opt(model.parameters()))
    graph.set_grad_scaler(flow.amp.GradScaler(init_scale=2.0 ** 120, backoff_factor=0.125, growth_interval=2))
    xx, y = poly_data()
    xs, ys = xx[:40] / 10, y[:40] * 1000      # gradients ~1e3: the scale overflows them now and then
    graph(flow.tensor(xs[:8]), flow.tensor(ys[:8]))
    assert graph._counter["skipped"] == 1     # saved after a skipped first step
    weights, _ = build_and_train(graph, xs, ys, 8, tmp_path)
    for s in range(8):
        graph(flow.tensor(xs[8 * (s % 5):8 * (s % 5) + 8]), flow.tensor(ys[8 * (s % 5):8 * (s % 5) + 8]))
    assert 1 < graph._counter["skipped"] < 8  # steps skipped and steps applied in the program's span
    for name in ("0.weight", "2.weight"):
        np.testing.assert_allclose(weights[f"model.{name}"], graph.state_dict()["model"][name].numpy(), rtol=1e-5,
                                   atol=1e-7)


# ------------------------------------------------------------------------ names from the graph
class _Named(nn.Module):
    """Parameters named as the caller says (state `<attribute>.<name>`)."""

    def __init__(self, **shapes):
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(flow.randn(*shape)))


class _TemplateNamesGraph(nn.Graph):
    """State whose C names, made the old way (`b.base` -> `b_base`), were locals of the GEMM
    templates (`a_base`, `b_base`, `c_base`) and of the copy and sort kernels (`in_base`, `k_begin`):
    the GEMM's kernel redeclared its own parameter and did not compile."""

    def __init__(self):
        super().__init__()
        self.a = _Named(base=(6, 8))
        self.b = _Named(base=(8, 5))
        self.c = _Named(base=(5,))
        self.k = _Named(begin=(5,))
        setattr(self, "in", _Named(base=(5, 3)))   # `in`: a Python keyword, a fine module name

    def build(self, x):
        y = (x @ self.a.base) @ self.b.base + self.c.base
        return (y * self.k.begin).relu() @ getattr(self, "in").base


def test_state_named_like_a_template_local_compiles_and_matches_eager(tmp_path):
    graph = _TemplateNamesGraph()
    x = flow.randn(4, 6)
    expected = graph.build(x).numpy()        # eager: build() on the eager modules
    np.testing.assert_allclose(graph(x).numpy(), expected, rtol=1e-5, atol=1e-5)   # emulator kernels
    flow.save(graph, tmp_path / "saved")
    np.save(tmp_path / "x.npy", x.numpy())
    for target in ("emulator", "cpu"):
        out = tmp_path / target
        aot.build(tmp_path / "saved", out, target=target)
        run_binary(out, "--input", tmp_path / "x.npy", "--out", out / "res")
        np.testing.assert_allclose(np.load(out / "res" / "output_0.npy"), expected, rtol=1e-5, atol=1e-5)
    source = (tmp_path / "emulator" / "program.cu").read_text()
    assert "const float* __restrict__ g_b_base" in source and "g_in_base" in source


def test_no_generated_identifier_but_a_graph_values_starts_with_its_prefix():
    """fused.GRAPH_VALUE_PREFIX marks the kernel parameters named after graph inputs and state; a
    template, a runtime header or a code string in flowgen/codegen using it for anything else could
    meet a user's name again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pattern = re.compile(rf"\b{GRAPH_VALUE_PREFIX}\w*")
    found = []
    for folder, suffixes in (("templates", (".j2",)), ("runtime_cpp", (".h",))):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if name.endswith(suffixes):
                with open(os.path.join(root, folder, name)) as f:
                    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", " ", f.read(), flags=re.S)   # Jinja's own names
                found += [(name, hit) for hit in pattern.findall(text)]
    for folder, _, files in os.walk(os.path.join(root, "flowgen", "codegen")):
        for name in sorted(n for n in files if n.endswith(".py")):
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                        and node.value != GRAPH_VALUE_PREFIX):
                    found += [(name, hit) for hit in pattern.findall(node.value)]
    assert found == []
