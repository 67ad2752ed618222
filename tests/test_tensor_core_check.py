"""The safety net (flowgen/runtime/tensor_core_check.py): a graph's first step checks its tensor-core
kernels against the SIMT kernels of the same nodes on the same data, caches the verdict, and on a
mismatch warns and runs the SIMT kernels instead. On a GPU it is on by default; here it runs on the
emulator (FLOWGEN_TENSOR_CORE_CHECK=always, 'cuda' graphs rendered for sm_90), where a wrong
tensor-core result is injected by overwriting part of a tensor-core kernel's output after it runs.
"""
import ctypes
import json

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from first_contact_cases import U_BF16, gpu_arch
from flowgen.codegen.kernel import BufferArg
from flowgen.runtime import tensor_core_check
from flowgen.runtime.executor import CpuBackend
from graphs import InferGraph

pytestmark = pytest.mark.skipif(gpu_arch() is not None, reason="the injection patches the emulator's launches")


@pytest.fixture
def checked(monkeypatch, tmp_path):
    """'cuda' graphs on the emulator, rendered for sm_90, checked on their first step; verdicts in a
    fresh cache."""
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA_ARCH", "sm_90")
    monkeypatch.setenv("FLOWGEN_TENSOR_CORE_CHECK", "always")
    monkeypatch.setattr(tensor_core_check, "cache_dir", lambda: tmp_path)
    return tmp_path


def mlp():
    flow.manual_seed(0)
    return nn.Sequential(nn.Linear(72, 136), nn.ReLU(), nn.Linear(136, 40))


def run(model, x, calls=2):
    """(outputs of `calls` calls of an AMP inference graph on 'cuda', the graph)."""
    graph = InferGraph(model.to("cuda"))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    return [graph(x.to("cuda")).numpy().astype(np.float64) for _ in range(calls)], graph


@pytest.fixture
def wrong_tensor_cores(monkeypatch):
    """Every tensor-core kernel of a program writes 3.0 over the first element of its first output
    (a bf16 0x4040) after it runs; the corrupted kernel names are collected."""
    corrupted = []
    prepare = CpuBackend.prepare

    def corrupting(self, kernel, args, module=None):
        launch = prepare(self, kernel, args, module)
        if module is not None or not tensor_core_check.TENSOR_CORE_KERNEL.search(kernel.comment):
            return launch
        first_output = next(i for i, a in enumerate(kernel.args)
                            if isinstance(a, BufferArg) and not a.ctype.startswith("const"))

        def wrong():
            launch()
            ctypes.memset(args[first_output].value, 0x40, 2)
            corrupted.append(kernel.name)
        return wrong

    monkeypatch.setattr(CpuBackend, "prepare", corrupting)
    return corrupted


def test_clean_tensor_core_kernels_pass_and_the_verdict_is_cached(checked):
    x = flow.randn(50, 72)
    (first, second), graph = run(mlp(), x)
    report = graph.compiled.executor.tensor_core_check
    assert report["groups"] == len(report["checked"]) > 0 and report["cached"] == 0 and report["mismatches"] == []
    assert all("bf16 wgmma" in c["what"] and c["ok"] for c in report["checked"])
    assert report["seconds"] >= report["prepare_s"] > 0        # its first-call cost
    assert len(list(checked.glob("tensor-core-check/*.json"))) == report["groups"]
    np.testing.assert_array_equal(first, second)
    again = run(mlp(), x, calls=1)[1].compiled.executor.tensor_core_check
    assert again["cached"] == report["groups"] and again["checked"] == []


def test_a_wrong_tensor_core_result_warns_and_the_graph_runs_the_simt_kernel(checked, wrong_tensor_cores):
    x = flow.randn(50, 72)
    want = mlp()(x).numpy().astype(np.float64)
    with pytest.warns(RuntimeWarning, match=r"tensor-core kernel k\d+_\w+ \(.*bf16 wgmma.*\) disagrees with the SIMT "
                                            r"kernel .* largest error .* the graph runs the SIMT kernel instead"):
        (first, second), graph = run(mlp(), x)
    report = graph.compiled.executor.tensor_core_check
    assert report["mismatches"] and all(not m["ok"] for m in report["mismatches"])
    assert {m["kernels"][0] for m in report["mismatches"]} == set(wrong_tensor_cores)   # each caught, named
    # The first call continued with the SIMT results, later calls run the SIMT kernels: both near eager
    # (two bf16 GEMMs: inputs and outputs rounded to 8 bits), the corruption (3.0) nowhere
    for out in (first, second):
        np.testing.assert_allclose(out, want, rtol=0, atol=16 * U_BF16 * np.abs(want).max())
    assert len(wrong_tensor_cores) == len(report["mismatches"])   # no tensor-core kernel ran after the first step
    verdicts = [json.loads(p.read_text()) for p in checked.glob("tensor-core-check/*.json")]
    assert sorted(v["ok"] for v in verdicts) == [False] * len(report["mismatches"])
    # A new graph with the same kernels: the cached verdict, no second check, the SIMT kernels from the start
    with pytest.warns(RuntimeWarning, match=r"\(cached verdict\)"):
        (out,), again = run(mlp(), x, calls=1)
    cached = again.compiled.executor.tensor_core_check
    assert cached["checked"] == [] and cached["cached"] == report["groups"]
    np.testing.assert_allclose(out, want, rtol=0, atol=16 * U_BF16 * np.abs(want).max())
    assert len(wrong_tensor_cores) == len(report["mismatches"])


def test_the_check_is_off_with_0_and_on_only_gpus_by_default(checked, monkeypatch):
    x = flow.randn(50, 72)
    monkeypatch.setenv("FLOWGEN_TENSOR_CORE_CHECK", "0")
    assert run(mlp(), x, calls=1)[1].compiled.executor.tensor_core_check is None
    monkeypatch.delenv("FLOWGEN_TENSOR_CORE_CHECK")
    assert run(mlp(), x, calls=1)[1].compiled.executor.tensor_core_check is None   # the emulator: not checked
    monkeypatch.setenv("FLOWGEN_TENSOR_CORE_CHECK", "yes")
    with pytest.raises(ValueError, match="FLOWGEN_TENSOR_CORE_CHECK='yes'"):
        run(mlp(), x, calls=1)
