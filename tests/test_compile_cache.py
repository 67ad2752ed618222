"""The kernel build cache: identical bodies compiled once, hits across graph instances and
shapes, compiled variants kept by load_state_dict, and the progress line. The program cache:
a new process compiling the same graph loads its program, any change misses, a corrupt entry is
rebuilt, a graph using an op defined outside flowgen is not cached."""
import concurrent.futures
import ctypes
import io
import itertools
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen import aot
from flowgen.ir import graph as ir_graph
from flowgen.ir.graph import Node, Value
from flowgen.ops import registry
from flowgen.ops.lowering import Elementwise
from flowgen.runtime import cpu_compiler, kernel_cache, nvrtc, program_cache, progress
from flowgen.runtime.cpu_compiler import CpuModule, build_kernel_library
from graphs import InferGraph, TrainGraph


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLOWGEN_PROGRESS", "0")
    return tmp_path / "cache"


def _scale_kernel(name: str, path: str, factor: str) -> str:
    return (f"// {path}: scale\n"
            f'extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] *= {factor}; }}\n'
            f"FLOWGEN_EMU_KERNEL({name}, false)\n")


# Four kernels of different module paths: three share a body, one differs.
SOURCE = '#include "flowgen_cuda_prelude.h"\n\n' + "\n".join(
    [_scale_kernel("k0_a_scale", "a", "2.0f"), _scale_kernel("k1_b_scale", "b", "2.0f"),
     _scale_kernel("k2_c_scale", "c", "3.0f"), _scale_kernel("k3_d_scale", "d", "2.0f")])


def test_identical_bodies_compile_once_for_nvrtc(cache):
    build = nvrtc.compile_kernels(SOURCE, "sm_80")
    assert (build.stats.kernels, build.stats.distinct, build.stats.compiled) == (4, 2, 2)
    assert build.symbols["k0_a_scale"] == build.symbols["k1_b_scale"] == build.symbols["k3_d_scale"]
    assert build.symbols["k2_c_scale"] != build.symbols["k0_a_scale"]
    index, symbol = build.symbols["k2_c_scale"]
    assert symbol.startswith("k2_c_scale_") and symbol.encode() in build.artifacts[index].read_bytes()
    again = nvrtc.compile_kernels(SOURCE.replace("// b:", "// elsewhere:"), "sm_80")
    assert (again.stats.cached, again.stats.compiled, again.stats.chunks) == (2, 0, 0)


def test_identical_bodies_compile_once_for_the_emulator(cache):
    library, build = build_kernel_library(SOURCE)
    assert (build.stats.distinct, build.stats.compiled) == (2, 2)
    module = CpuModule(library, {name: symbol for name, (_, symbol) in build.symbols.items()})
    x = np.ones(4, np.float32)
    for name in ("k0_a_scale", "k1_b_scale", "k2_c_scale"):
        module.launch(name, (1, 1, 1), (4, 1, 1), 0, [ctypes.c_void_p(x.ctypes.data)])
    np.testing.assert_array_equal(x, np.full(4, 12.0, np.float32))


def _scale_by_every_kernel(library, build) -> np.ndarray:
    module = CpuModule(library, {name: symbol for name, (_, symbol) in build.symbols.items()})
    x = np.ones(4, np.float32)
    for name in build.symbols:
        module.launch(name, (1, 1, 1), (4, 1, 1), 0, [ctypes.c_void_p(x.ctypes.data)])
    return x


def test_a_source_built_before_is_found_whole_until_an_artifact_is_gone(cache, monkeypatch):
    first = build_kernel_library(SOURCE)
    by_body = []
    build_bodies = kernel_cache._build_bodies
    monkeypatch.setattr(kernel_cache, "_build_bodies", lambda *args: by_body.append(1) or build_bodies(*args))
    library, again = build_kernel_library(SOURCE)
    assert not by_body and library == first[0] and again.symbols == first[1].symbols
    assert again.stats.as_dict() == {"kernels": 4, "distinct": 2, "cached": 2, "compiled": 0, "chunks": 0}
    np.testing.assert_array_equal(_scale_by_every_kernel(library, again), np.full(4, 24.0, np.float32))

    records = list((cache / "cpu-kernels" / "sources").iterdir())
    records[0].write_bytes(b'{"chunks": ["elsewhere"]')    # not a record flowgen wrote: built body by body
    assert build_kernel_library(SOURCE)[1].stats.cached == 2 and len(by_body) == 1
    for path in first[1].artifacts:                          # a chunk's artifact removed: compiled again
        path.unlink()
    library, rebuilt = build_kernel_library(SOURCE)
    assert len(by_body) == 2 and rebuilt.stats.compiled == 2
    np.testing.assert_array_equal(_scale_by_every_kernel(library, rebuilt), np.full(4, 24.0, np.float32))


def test_split_kernels_keeps_every_kernel_and_drops_header_comments():
    preamble, units = kernel_cache.split_kernels("// kernels.cu for MyGraph\n" + SOURCE)
    assert preamble == '#include "flowgen_cuda_prelude.h"\n'
    assert [u.name for u in units] == ["k0_a_scale", "k1_b_scale", "k2_c_scale", "k3_d_scale"]
    assert units[0].body() == units[1].body() != units[2].body()


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _train_graph(model):
    return TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _build_stats(graph):
    return graph.compiled.executor.backend.build.stats


def test_a_second_graph_instance_compiles_nothing(cache):
    x, y = flow.randn(4, 6), flow.randint(0, 3, (4,))
    flow.manual_seed(1)
    first = _train_graph(_mlp())
    flow.manual_seed(1)
    second = _train_graph(_mlp())
    assert first.name != second.name
    loss_first = float(first(x, y))
    assert _build_stats(first).compiled == _build_stats(first).distinct > 0
    loss_second = float(second(x, y))
    stats = _build_stats(second)
    assert stats.compiled == 0 and stats.cached == stats.distinct
    assert loss_second == loss_first


def test_a_shape_change_compiles_only_the_kernels_that_changed(cache):
    model = _mlp()
    graph = _train_graph(model)
    # The updates in kernels of their own (fused, they are the gradient GEMMs' epilogues, whose
    # inner size is the batch): those do not depend on the batch size.
    graph.config.allow_fuse_model_update_ops(False)
    graph(flow.randn(4, 6), flow.randint(0, 3, (4,)))
    x, y = flow.randn(5, 6), flow.randint(0, 3, (5,))
    expected = float(nn.CrossEntropyLoss()(model(x), y))
    loss = float(graph(x, y))
    stats = _build_stats(graph)
    assert 0 < stats.compiled < stats.distinct and stats.cached == stats.distinct - stats.compiled
    assert loss == pytest.approx(expected, rel=1e-5)


def _train_losses_and_weights(seed):
    flow.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.Adam(model.parameters(), lr=0.01))
    x, y = flow.randn(4, 6), flow.randint(0, 3, (4,))
    losses = [graph(x, y).numpy() for _ in range(2)]
    return graph, losses, {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_emulator_optimisation_level_changes_compile_flags_not_numbers(cache, monkeypatch):
    graph2, losses2, weights2 = _train_losses_and_weights(3)
    monkeypatch.setenv("FLOWGEN_EMULATOR_OPT", "0")
    graph0, losses0, weights0 = _train_losses_and_weights(3)
    build = _build_stats(graph0)
    assert build.compiled == build.distinct > 0    # a different level is a different cache entry
    logs = {graph.name: [(a.parent / "compile.log").read_text().split("\n")[0].split()
                         for a in graph.compiled.executor.backend.build.artifacts] for graph in (graph0, graph2)}
    assert all("-O0" in log and "-O2" not in log for log in logs[graph0.name])
    assert all("-O2" in log for log in logs[graph2.name])
    np.testing.assert_array_equal(np.array(losses0), np.array(losses2))
    for name, value in weights2.items():
        np.testing.assert_array_equal(weights0[name], value, err_msg=name)
    monkeypatch.setenv("FLOWGEN_EMULATOR_OPT", "3")
    with pytest.raises(ValueError, match="FLOWGEN_EMULATOR_OPT='3'.*one of 0, 1, 2"):
        build_kernel_library(SOURCE)


def test_load_state_dict_keeps_the_compiled_variant(cache, tmp_path, capsys):
    x, y = flow.randn(4, 6), flow.randint(0, 3, (4,))
    graph = _train_graph(_mlp())
    graph.debug(0)
    graph(x, y)
    assert "building graph Done! Cost time: " in capsys.readouterr().out
    variant = graph.compiled
    flow.save(graph.state_dict(), tmp_path / "checkpoint")
    losses = [float(graph(x, y)) for _ in range(3)]

    graph.load_state_dict(flow.load(tmp_path / "checkpoint"))
    assert graph.compiled is variant
    assert [float(graph(x, y)) for _ in range(3)] == losses
    assert graph.compiled is variant
    assert "start building graph" not in capsys.readouterr().out
    flow.save(graph, tmp_path / "exported")      # seed 003's order: checkpoint, restore, export
    assert (tmp_path / "exported" / "graph.json").is_file()


def test_progress_lines_when_forced_and_none_when_quiet(cache, monkeypatch, capsys):
    monkeypatch.setenv("FLOWGEN_PROGRESS", "1")
    nvrtc.compile_kernels(SOURCE, "sm_80")
    lines = capsys.readouterr().err.splitlines()
    assert "flowgen: compile | nvrtc kernels 0/2 | " in lines[0] and "| done |" in lines[-1]

    monkeypatch.setenv("FLOWGEN_PROGRESS", "0")
    nvrtc.compile_kernels(SOURCE.replace("3.0f", "4.0f"), "sm_80")
    assert capsys.readouterr().err == ""


def test_progress_rewrites_one_line_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("FLOWGEN_PROGRESS", "always")
    stream = Terminal()
    line = progress.Progress("MyGraph_0", stream=stream)
    line.stage("g++ kernels", total=3)
    line.advance(2)
    line.close()
    text = stream.getvalue()
    assert "\n" not in text.rstrip("\n") and text.count("\r\033[K") >= 3
    assert "flowgen: MyGraph_0 | g++ kernels 2/3 | " in text and text.endswith("s\n")


def test_cached_objects_are_reused_without_running_gxx(cache, monkeypatch):
    build_kernel_library(SOURCE)

    def no_compiler(*args, **kwargs):
        raise AssertionError("g++ ran again for cached kernels")

    monkeypatch.setattr(cpu_compiler.subprocess, "run", no_compiler)
    library, build = build_kernel_library(SOURCE.replace("// a:", "// renamed module:"))
    assert library.is_file() and build.stats.compiled == 0


def test_flowgen_build_reuses_the_cached_device_and_host_builds(cache, tmp_path, monkeypatch):
    graph = InferGraph(nn.Linear(5, 2).eval())
    graph(flow.randn(3, 5))
    flow.save(graph, tmp_path / "saved")
    lines = []
    aot.build(tmp_path / "saved", tmp_path / "first", target="cuda", arch="sm_80", log=lines.append)
    assert "  compile host code      ..." in lines and not any("(cached)" in line for line in lines)

    def no_compiler(*args, **kwargs):
        raise AssertionError("a compiler ran again for a cached build")

    monkeypatch.setattr(aot.subprocess, "run", no_compiler)
    monkeypatch.setattr(nvrtc.nvrtc, "nvrtcCompileProgram", no_compiler)
    lines.clear()
    result = aot.build(tmp_path / "saved", tmp_path / "second", target="cuda", arch="sm_80", log=lines.append)
    assert any(line.startswith("  compile host code") and line.endswith("(cached)") for line in lines)
    assert result.binary.read_bytes() == (tmp_path / "first" / result.binary.name).read_bytes()
    assert os.access(result.binary, os.X_OK)


@pytest.mark.parametrize("kernels", ["emulator", "native"])
def test_cpu_program_links_the_kernels_its_graph_compiled(cache, tmp_path, monkeypatch, kernels):
    """After the graph ran on the emulator, `flowgen build --target cpu` compiles no kernel (it
    links the emulator's objects) and the program computes the graph's numbers; the commands in
    program.cu's header build OUT by hand into a program with the same numbers (with native
    kernels, the link line names OpenBLAS)."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", kernels)
    graph = InferGraph(nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)).eval())
    x = flow.randn(3, 5)
    expected = graph(x).numpy()
    flow.save(graph, tmp_path / "saved")
    np.save(tmp_path / "x.npy", x.numpy())
    lines = []
    result = aot.build(tmp_path / "saved", tmp_path / "out", target="cpu", log=lines.append)
    device_line = next(line for line in lines if line.startswith("  compile device code") and " s " in line)
    assert " 0 compiled in 0 chunk(s)" in device_line, device_line

    def run(binary, results):
        proc = subprocess.run([str(binary), "--input", str(tmp_path / "x.npy"), "--out", str(results)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return np.load(results / "output_0.npy")

    assert run(result.binary, tmp_path / "res").tobytes() == expected.tobytes()
    header = (tmp_path / "out" / "program.cu").read_text().split("#if defined", 1)[0]
    commands = [line.split(":", 1)[1].split() for line in header.splitlines()
                if line.startswith(("//   kernels:", "//   host:", "//   link:"))]
    assert [c[-1] for c in commands] == ["program_kernels.o", "program_host.o", result.binary.name]
    link = commands[-1]
    link[link.index("-o") + 1] = "by_hand"
    for command in commands:
        subprocess.run(command, cwd=tmp_path / "out", check=True, capture_output=True)
    assert run(tmp_path / "out" / "by_hand", tmp_path / "by_hand").tobytes() == expected.tobytes()


def test_concurrent_builds_of_the_same_kernels_share_the_cache(cache):
    start = threading.Barrier(2)

    def build(_):
        start.wait()
        return build_kernel_library(SOURCE)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(build, range(2)))
    x = np.ones(4, np.float32)
    for library, built in results:
        module = CpuModule(library, {name: symbol for name, (_, symbol) in built.symbols.items()})
        module.launch("k2_c_scale", (1, 1, 1), (4, 1, 1), 0, [ctypes.c_void_p(x.ctypes.data)])
    np.testing.assert_array_equal(x, np.full(4, 9.0, np.float32))
    assert not list(cache.rglob(".*.tmp")) and build_kernel_library(SOURCE)[1].stats.compiled == 0


# One training run in a new process: three steps of a small MLP; prints what the program cache
# did, the numbers and what graph.compiled shows (a graph on "cuda" runs its CUDA program on the
# emulator where no GPU is present). argv[1]: JSON of what to change (_BASE's keys):
# "instances" graphs are made before the one trained (its name is TrainGraph_<instances>), and
# "call_line" blank lines above its call move it (the source location of its backward nodes).
_TRAIN_IN_A_NEW_PROCESS = """
import dataclasses, json, sys
import flowgen as flow
import flowgen.nn as nn
from flowgen.passes import fusion
from flowgen.runtime import program_cache
from graphs import TrainGraph
run = json.loads(sys.argv[1])
if run["max_pointers"]:
    fusion.MULTI_MAX_POINTERS = run["max_pointers"]
flow.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(run["slope"]), nn.Linear(8, 3))
model.to(getattr(flow, run["dtype"])).to(run["device"])
make = lambda: TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
graph = [make() for _ in range(run["instances"] + 1)][-1]
graph.config.allow_fuse_add_to_output(run["fuse_add"])
next(iter(graph.model)).to(nn.graph.GraphModule).activation_checkpointing = run["checkpoint"]
graph.debug(run["debug"])
x = flow.randn(run["batch"], 6, dtype=getattr(flow, run["dtype"]), device=run["device"])
y = flow.randint(0, 3, (run["batch"],), device=run["device"])
losses = [float(graph(x, y)) for _ in range(3)]
program = graph.compiled.program
kernels = [repr(dataclasses.replace(k, in_place=sorted(map(repr, k.in_place))))  # a set: sorted
           for k in program.kernels + program.prepare]
flow.save(graph, sys.argv[2])
print(json.dumps({"cache": graph.compiled.program_cache, "rejected": program_cache.STATS.rejected,
                  "losses": losses, "params": [p.numpy().tolist() for p in model.parameters()],
                  "shown": {"ir": str(graph.compiled.ir), "source": program.source, "plan": program.plan.describe(),
                            "kernels": kernels,
                            "locations": [n.loc for n in graph.compiled.ir.nodes],
                            "before_fusion": program.kernels_before_fusion,
                            "graph.json": open(sys.argv[2] + "/graph.json").read()}}))
"""
_BASE = {"batch": 4, "slope": 0.01, "fuse_add": True, "checkpoint": False, "debug": -1, "max_pointers": 0,
         "dtype": "float32", "device": "cpu", "instances": 0, "call_line": 0}


_SAVES = itertools.count()


def _train_in_a_new_process(cache_root, **change) -> dict:
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FLOWGEN_CACHE=str(cache_root), FLOWGEN_PROGRESS="0", FLOWGEN_EMULATE_CUDA="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")]))
    saved = cache_root.parent / f"saved-{os.getpid()}-{next(_SAVES)}"
    run = {**_BASE, **change}
    script = _TRAIN_IN_A_NEW_PROCESS.replace("\nlosses = ", "\n" * (run.pop("call_line") + 1) + "losses = ")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(run), str(saved)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "log": proc.stdout}


@pytest.fixture(scope="module")
def first_process(tmp_path_factory):
    """A cache that one process filled by compiling the base graph, and that process's numbers."""
    root = tmp_path_factory.mktemp("program-cache")
    return root, _train_in_a_new_process(root)


def test_a_new_process_loads_the_compiled_program_and_computes_the_same(first_process):
    root, first = first_process
    assert first["cache"] == "miss"
    again = _train_in_a_new_process(root)
    assert again["cache"] == "hit"
    assert again["losses"] == first["losses"] and again["params"] == first["params"]
    assert again["shown"] == first["shown"]


def test_another_instance_called_from_another_line_hits_and_shows_what_a_fresh_build_shows(first_process,
                                                                                            tmp_path):
    """The instance name and the source locations are not in the key: the loaded program takes the
    caller's, so graph.compiled, flow.save and the numbers are those of a fresh build."""
    root, first = first_process
    moved = {"instances": 2, "call_line": 3}
    loaded = _train_in_a_new_process(root, **moved)
    fresh = _train_in_a_new_process(tmp_path / "fresh-cache", **moved)
    assert (loaded["cache"], fresh["cache"]) == ("hit", "miss")
    assert loaded["shown"] == fresh["shown"]
    assert loaded["losses"] == fresh["losses"] == first["losses"] and loaded["params"] == first["params"]
    assert loaded["shown"]["ir"].startswith("graph TrainGraph_2(") and first["shown"]["ir"].startswith(
        "graph TrainGraph_0(")
    assert loaded["shown"]["locations"] != first["shown"]["locations"]


def test_a_cuda_graph_has_entries_of_its_own_target(first_process):
    root, first = first_process
    cuda = _train_in_a_new_process(root, device="cuda")
    again = _train_in_a_new_process(root, device="cuda")
    assert (cuda["cache"], again["cache"]) == ("miss", "hit")
    assert again["shown"] == cuda["shown"] and again["shown"]["source"] != first["shown"]["source"]
    assert again["losses"] == cuda["losses"] and again["params"] == cuda["params"]
    np.testing.assert_allclose(cuda["losses"], first["losses"], rtol=1e-5)


@pytest.mark.parametrize("change", [{"batch": 5}, {"dtype": "float64"}, {"slope": 0.2}, {"fuse_add": False},
                                    {"checkpoint": True}, {"max_pointers": 16}],
                         ids=["input shape", "dtype", "op attribute", "graph config", "module config",
                              "patched compiler constant"])
def test_a_changed_graph_misses_the_program_cache(first_process, change):
    root, first = first_process
    changed = _train_in_a_new_process(root, **change)
    assert changed["cache"] == "miss"
    if not {"batch", "dtype", "slope"} & change.keys():     # the same computation, compiled differently
        np.testing.assert_allclose(changed["losses"], first["losses"], rtol=1e-6)
    else:
        assert changed["losses"] != first["losses"]


def test_graph_debug_runs_the_passes_instead_of_loading_them(first_process):
    root, first = first_process
    debugged = _train_in_a_new_process(root, debug=1)
    assert debugged["cache"] == "off" and "(PASS:fusion)" in debugged["log"]
    assert debugged["losses"] == first["losses"]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_corrupt_program_cache_entry_is_rebuilt(first_process, damage):
    root, first = first_process
    entries = list((root / "programs").glob("*.pkl"))
    for entry in entries:
        data = bytearray(entry.read_bytes())
        if damage == "truncated":    # what a writer that died mid-way would leave without the rename
            del data[len(data) // 2:]
        else:
            data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    rebuilt = _train_in_a_new_process(root)
    assert (rebuilt["cache"], rebuilt["rejected"]) == ("miss", 1)
    assert rebuilt["losses"] == first["losses"] and rebuilt["params"] == first["params"]
    assert rebuilt["shown"] == first["shown"]
    again = _train_in_a_new_process(root)
    assert (again["cache"], again["rejected"]) == ("hit", 0) and again["shown"] == first["shown"]


def _relu_ir(name: str, loc: str):
    x, y = Value("x", (3,), flow.float32), Value("y", (3,), flow.float32)
    return ir_graph.Graph(name, inputs=[x], nodes=[Node("relu", [x], [y], loc=loc)], outputs=[y])


def test_a_loaded_result_takes_the_callers_name_and_locations(cache):
    first = _relu_ir("ReluGraph_0", "a.py:1")
    result, status = program_cache.cached(first, {}, lambda: (first.name, first.nodes[0].loc, first.outputs[0]))
    assert status == "miss"
    second = _relu_ir("ReluGraph_7", "b.py:2")
    result, status = program_cache.cached(second, {}, lambda: None)
    assert status == "hit" and result == ("ReluGraph_7", "b.py:2", second.outputs[0])
    assert result[2] is second.outputs[0]
    other = _relu_ir("ReluGraph_0", "a.py:1")
    other.nodes[0].attrs["note"] = "x"      # another key; its result spells the name out: not stored
    stored = program_cache.STATS.stored
    assert program_cache.cached(other, {}, lambda: f"{other.name}.relu")[1] == "miss"
    assert program_cache.STATS.stored == stored
    assert program_cache.cached(other, {}, lambda: "ReluGraph_01 FLAG_ReluGraph_0x")[1] == "miss"   # not the name
    assert program_cache.STATS.stored == stored + 1


def test_a_graph_using_an_op_defined_outside_flowgen_is_not_program_cached(cache):
    """Its code is not in flowgen's source fingerprint, so the cache could not see it change."""
    if "test_compile_cache_triple" not in registry.REGISTRY:
        registry.defop("test_compile_cache_triple", infer=lambda a: registry.TensorMeta(a.shape, a.dtype),
                       ref=lambda a: a * 3, lowering=Elementwise("{0} * 3.0f"))
    graph = flow.nn.Graph.trace(lambda x: registry.apply("test_compile_cache_triple", x))
    x = flow.randn(3, 4)
    np.testing.assert_array_equal(graph(x).numpy(), x.numpy() * 3)
    assert graph.compiled.program_cache == "off"
