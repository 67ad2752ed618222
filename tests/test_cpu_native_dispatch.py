"""The cpu target's one table of native renderers (codegen/cpu/ NATIVE_RENDERERS), keyed as the
CUDA renderers (codegen/kernels/ RENDERERS): a family's ops without a native kernel (softmax and
log_softmax beside cross-entropy rows, gather beside embedding, scatter_add beside index_add,
pools other than max-pool gradients) keep their emulated kernels, with eager's numbers."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen.cpu import NATIVE_RENDERERS
from flowgen.codegen.kernels import RENDERERS


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")


def test_native_renderers_are_keyed_as_the_cuda_renderers():
    assert set(NATIVE_RENDERERS) <= set(RENDERERS)


def test_ops_of_a_native_family_without_a_native_kernel_stay_emulated():
    index = flow.tensor(np.array([[0, 2, 1], [3, 3, 0]]))

    def outputs(a, img):
        return (a.softmax(dim=1), a.log_softmax(dim=1), flow.gather(a, 1, index),
                flow.zeros(2, 4).scatter_add(1, index, a[:, :3]),
                flow.nn.functional.interpolate(img, scale_factor=2, mode="nearest"))

    class Outputs(nn.Graph):
        def build(self, a, img):
            return outputs(a, img)

    rng = np.random.default_rng(0)
    a = flow.tensor(rng.standard_normal((2, 4)).astype(np.float32))
    img = flow.tensor(rng.standard_normal((1, 2, 6, 6)).astype(np.float32))
    graph = Outputs()
    for got, want in zip(graph(a, img), outputs(a, img)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    kernels = graph.compiled.program.kernels
    for op in ("softmax", "log_softmax", "gather", "scatter_add", "upsample_nearest2d"):
        emulated = [k for k in kernels if op in k.ops]
        assert emulated and not any(k.native for k in emulated), (op, [(k.name, k.native) for k in kernels])


def test_forward_pools_run_natively_with_the_emulated_kernels_numbers(monkeypatch):
    """Max (and its indices), average (count_include_pad off, ceil_mode) and adaptive average pools
    as native kernels: every output computed by the emulated kernel's code (_pool2d_window.j2), a NaN
    in a window included, so the same bits."""

    class Pools(nn.Graph):
        def build(self, x):
            F = flow.nn.functional
            values, indices = F.max_pool2d(x, 2, stride=1, dilation=2, return_indices=True)
            return (F.max_pool2d(x, 3, stride=2, padding=1), F.avg_pool2d(x, 3, stride=2, padding=1,
                                                                             count_include_pad=False),
                    F.avg_pool2d(x, 2, stride=2, ceil_mode=True), F.adaptive_avg_pool2d(x, (3, 2)), values, indices)

    x = np.random.default_rng(1).standard_normal((3, 4, 9, 7)).astype(np.float32)
    x[0, 0, 0, 0] = np.nan
    results = {}
    for mode in ("emulator", "native"):
        monkeypatch.setenv("FLOWGEN_CPU_KERNELS", mode)
        graph = Pools()
        results[mode] = [t.numpy() for t in graph(flow.tensor(x))]
        pools = [k for k in graph.compiled.program.kernels if any("pool" in op for op in k.ops)]
        assert len(pools) == 6 and all(k.native == (mode == "native") for k in pools)   # indices: a kernel of its own
    for emulated, native in zip(results["emulator"], results["native"]):
        np.testing.assert_array_equal(native, emulated)


@pytest.mark.parametrize("mode", ["native", "emulator"])
def test_an_empty_batch_of_a_fused_gemm_launches_nothing(mode, monkeypatch):
    """x[1:2] of a batch of 1 is empty: the fused GEMM after it has no output element, and no
    kernel (its grid would be 0 blocks, which a GPU refuses; the tile chooser divided by zero).
    tests/dynamic_fuzzer.py seed 5034."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", mode)

    class Empty(nn.Graph):
        def build(self, x):
            h = x[1:2]
            return flow.matmul(h, h.transpose(1, 2)).softmax(dim=-1) * 0.25, x.sum()

    x = flow.randn(1, 5, 4)
    graph = Empty()
    (got, total), (want, want_total) = graph(x), Empty.build(None, x)
    assert tuple(got.shape) == tuple(want.shape) == (0, 5, 5)
    np.testing.assert_allclose(total.numpy(), want_total.numpy(), rtol=1e-6)
    assert not any("matmul" in op for k in graph.compiled.program.kernels for op in k.ops)


@pytest.mark.parametrize("mode", ["native", "emulator"])
def test_reductions_and_gemms_over_nothing(mode, monkeypatch):
    """A sum or mean over an empty axis, and a GEMM with K = 0, have outputs (zeros, NaN) but no
    work per output: a native loop's grain divided by that 0 (undefined: g++ made it an illegal
    instruction, SIGILL; tests/dynamic_fuzzer.py seed 5058)."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", mode)

    class Nothing(nn.Graph):
        def build(self, x):
            h = x[4:5]                                              # no rows from a batch of 4
            h3 = flow.stack([h, h.tanh()], dim=0).transpose(1, 2)   # [2, 8, 0]
            return (flow.einsum("bij,bkj->bik", h3 + 1.0, h3), flow.matmul(h3 + 2.0, h3.transpose(1, 2)) + 1.0,
                    (h3 * 3).sum(dim=2), (h3 * 3).mean(dim=2))

    x = flow.randn(4, 8)
    for got, want in zip(Nothing()(x), Nothing.build(None, x)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
