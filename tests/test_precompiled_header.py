"""The precompiled header of the emulator's kernel chunks (runtime/precompiled_header.py): built
once a cache has compiled a few chunks without it, then loaded by every chunk with that preamble;
another one for edited headers; rebuilt when it is gone; a damaged one falls back to the plain
headers; the numbers never depend on it."""
import ctypes
import subprocess

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.runtime import cpu_compiler, precompiled_header
from flowgen.runtime.cpu_compiler import CpuModule, build_kernel_library
from flowgen.runtime.toolchain import CompileError, runtime_cpp_dir
from graphs import TrainGraph


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLOWGEN_PROGRESS", "0")
    return tmp_path / "cache"


@pytest.fixture
def precompile_at_once(monkeypatch):
    """The .gch is built by the first chunk that would use it."""
    monkeypatch.setattr(precompiled_header, "PLAIN_COMPILES_BEFORE_BUILD", 0)


def scale_source(factor: float, body: str = "x[threadIdx.x] *= {factor}f;") -> str:
    """A kernels.cu of one kernel: each factor is a body (a chunk) of its own."""
    return ('#include "flowgen_cuda_prelude.h"\n\n'
            f'extern "C" __global__ void k0_scale(float* x) {{ {body.format(factor=factor)} }}\n'
            "FLOWGEN_EMU_KERNEL(k0_scale, false)\n")


def compile_and_scale(factor: float) -> str:
    """Build scale_source(factor), check that its kernel scales by `factor`; the chunk's g++ command."""
    library, build = build_kernel_library(scale_source(factor))
    module = CpuModule(library, {name: symbol for name, (_, symbol) in build.symbols.items()})
    x = np.arange(4, dtype=np.float32)
    module.launch("k0_scale", (1, 1, 1), (4, 1, 1), 0, [ctypes.c_void_p(x.ctypes.data)])
    np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32) * np.float32(factor))
    (artifact,) = build.artifacts
    return (artifact.parent / "compile.log").read_text().splitlines()[0]


def precompiled(cache) -> list:
    return sorted(cache.glob("cpu-pch/*/preamble.h.gch"))


def test_the_header_is_precompiled_after_a_few_plain_compiles_then_reused(cache, monkeypatch):
    for factor in range(precompiled_header.PLAIN_COMPILES_BEFORE_BUILD):
        assert "-include" not in compile_and_scale(factor + 2.0)
    assert precompiled(cache) == []

    command = compile_and_scale(10.0)
    (gch,) = precompiled(cache)
    assert f"-include {gch.parent / 'preamble.h'}" in command
    assert (gch.parent / "preamble.h").read_text() == '#include "flowgen_cuda_prelude.h"\n'

    built = gch.stat().st_mtime_ns
    commands = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: commands.append(command) or run(command, **kw))
    assert f"-include {gch.parent / 'preamble.h'}" in compile_and_scale(11.0)
    assert gch.stat().st_mtime_ns == built
    assert [c for c in commands if "c++-header" in c] == [] and len(commands) == 2   # the chunk and the link


def test_edited_headers_get_a_header_of_their_own(cache, tmp_path, monkeypatch, precompile_at_once):
    compile_and_scale(2.0)
    (first,) = precompiled(cache)
    edited = tmp_path / "runtime_cpp"
    edited.mkdir()
    for header in runtime_cpp_dir().iterdir():
        (edited / header.name).write_bytes(header.read_bytes())
    with open(edited / "flowgen_emu.h", "a") as f:
        f.write("\n// edited\n")
    monkeypatch.setattr(cpu_compiler, "runtime_cpp_dir", lambda: edited)
    command = compile_and_scale(3.0)
    (second,) = set(precompiled(cache)) - {first}
    assert f"-I{edited} " in command and f"-include {second.parent / 'preamble.h'}" in command


def test_a_missing_header_is_built_again(cache, precompile_at_once):
    compile_and_scale(2.0)
    (gch,) = precompiled(cache)
    gch.unlink()
    assert f"-include {gch.parent / 'preamble.h'}" in compile_and_scale(3.0)
    assert precompiled(cache) == [gch]


def test_a_damaged_header_falls_back_to_the_plain_headers_for_good(cache, precompile_at_once):
    compile_and_scale(2.0)
    (gch,) = precompiled(cache)
    gch.write_bytes(gch.read_bytes()[:100_000])     # a truncated file: g++ cannot read it
    assert "-include" not in compile_and_scale(3.0)  # compiled again without it, and computes
    assert precompiled(cache) == []
    assert "precompiled header" in (gch.parent / "failed").read_text()
    assert "-include" not in compile_and_scale(4.0)  # not built again under that key
    assert precompiled(cache) == []


def test_a_kernel_that_fails_to_compile_keeps_the_header(cache, precompile_at_once):
    compile_and_scale(2.0)
    with pytest.raises(CompileError, match="undeclared_name"):
        build_kernel_library(scale_source(3.0, body="x[threadIdx.x] *= undeclared_name;"))
    (gch,) = precompiled(cache)
    assert not (gch.parent / "failed").exists()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                                      nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def train_native(cache_dir, monkeypatch) -> tuple:
    """Two training steps of ConvNet with native kernels on a fresh cache: the losses and the
    parameters after, as bytes, and the preamble of the chunks' precompiled header (or None)."""
    monkeypatch.setenv("FLOWGEN_CACHE", str(cache_dir))
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")
    flow.manual_seed(0)
    model = ConvNet()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    numbers = []
    for _ in range(2):
        x = flow.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32))
        y = flow.tensor(rng.integers(0, 4, 4).astype(np.int64))
        numbers.append(graph(x, y).numpy().tobytes())
    numbers += [value.numpy().tobytes() for _, value in sorted(model.state_dict().items())]
    headers = sorted(cache_dir.glob("cpu-pch/*/preamble.h.gch"))
    return numbers, [h.with_suffix("").read_text() for h in headers]


def test_native_kernels_compute_the_same_with_and_without_the_header(tmp_path, monkeypatch):
    plain, none = train_native(tmp_path / "cold", monkeypatch)
    assert none == []    # a first small graph compiles without building it
    monkeypatch.setattr(precompiled_header, "PLAIN_COMPILES_BEFORE_BUILD", 0)
    with_header, preambles = train_native(tmp_path / "precompiled", monkeypatch)
    assert preambles == ['#include "flowgen_cuda_prelude.h"\n#include "flowgen_cpu.h"\n']
    assert with_header == plain
