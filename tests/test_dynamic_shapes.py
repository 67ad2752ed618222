"""Dynamic dimensions (issue 27): flow.Dim and graph.config.dynamic_shapes compile an inference
graph once for every size in range (flowgen/dims.py, codegen/dynamic.py); numbers equal eager's
at each size, nothing recompiles, and what cannot follow a size is refused with its reason."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.codegen.dynamic import DynamicShapeError, SizeExpr, _count, _fit, _ratio, _reciprocal
from flowgen.dims import Dim, sample_points, sample_sizes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import dynamic_fuzzer  # noqa: E402
from first_contact_cases import gpu_arch  # noqa: E402
from graphs import FirstOutput, InferGraph, TrainGraph  # noqa: E402
import gpt_char  # noqa: E402


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")


def _runs_like_eager(model, spec, inputs_at, sizes, rtol=1e-5, atol=1e-6):
    """The dynamic graph at each of `sizes` equals eager, from one compiled variant for the sizes
    from 2 up (a size of 1 has variants of its own: which Dims are 1)."""
    model.eval()
    graph = InferGraph(model)
    graph.config.dynamic_shapes(spec)
    variants = {}
    for size in sizes:
        inputs = inputs_at(size)
        got, want = graph(*inputs), model(*inputs)
        assert tuple(got.shape) == tuple(want.shape)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=rtol, atol=atol, err_msg=f"size {size}")
        ones = tuple(np.atleast_1d(size) == 1)
        assert variants.setdefault(ones, graph.compiled) is graph.compiled   # no recompile
    assert len(graph._variants) == len(variants)
    return graph


def test_mlp_at_any_batch_size():
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 48), nn.GELU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))
    batch = flow.Dim("batch", min=1, max=300)
    graph = _runs_like_eager(model, [{0: batch}], lambda n: [flow.randn(n, 20)], [7, 1, 300, 2, 129])
    source = graph.compiled.program.source
    assert "const long long dim_batch = flowgen_dims[0];" in source
    # the GEMMs choose eager's product by size at run time: fused multiply-add chains below
    # outputs * K = 2^18 (batch 300: 300 * 48 * 48 is above), sgemm above
    assert "flowgen_cpu::gemm(chain" in source


def test_convnet_with_batch_norm_and_depthwise_at_any_batch_size():
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    for m in model.modules():   # trained-looking statistics, so the folded BatchNorms do something
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(flow.randn(8) * 0.1)
            m.running_var.copy_(flow.rand(8) + 0.5)
    batch = flow.Dim("batch", min=1, max=16)
    _runs_like_eager(model, [{0: batch}], lambda n: [flow.randn(n, 3, 9, 9)], [3, 16, 1, 5])


def _gpt():
    flow.manual_seed(0)
    config = gpt_char.GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    return gpt_char.define(flow)(config)


def test_gpt_at_any_batch_and_sequence_length():
    """Two Dims at once; a sequence shorter than an earlier call's, then the longest (the
    position embedding is prepared once at the maximum)."""
    rng = np.random.default_rng(3)
    batch, seq = flow.Dim("batch", min=1, max=8), flow.Dim("seq", min=1, max=16)

    def tokens(size):
        return [flow.tensor(rng.integers(0, 32, size).astype(np.int64))]

    _runs_like_eager(FirstOutput(_gpt()), [{0: batch, 1: seq}], tokens, [(2, 3), (1, 1), (8, 16), (3, 16), (8, 2)])


def test_a_size_of_one_has_its_own_variant():
    """x[1:2] is one row of a batch of 2 or more and none of a batch of 1: the kernels fitted from
    sizes 2 up would return one row (tests/dynamic_fuzzer.py, seed 1027)."""

    class Second(nn.Module):
        def forward(self, x):
            return x[1:2].mean(dim=(2, 3)) * 2.0

    batch = flow.Dim("batch", min=1, max=6)
    graph = _runs_like_eager(Second(), [{0: batch}], lambda n: [flow.randn(n, 3, 5, 5)], [2, 1, 6, 1, 3])
    assert len(graph._variants) == 2


def test_sizes_out_of_range_and_tied_dims_are_refused():
    model = nn.Linear(4, 3).eval()
    batch = flow.Dim("batch", min=2, max=8)

    class Pair(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x, y):
            return self.model(x) + self.model(y)

    graph = Pair()
    graph.config.dynamic_shapes([{0: batch}, {0: batch}])
    with pytest.raises(ValueError, match=r"input 0 has size 9 at axis 0, which is Dim\('batch', min=2, max=8\): "
                                         r"allowed 2 to 8"):
        graph(flow.randn(9, 4), flow.randn(9, 4))
    with pytest.raises(ValueError, match=r"Dim\('batch', min=2, max=8\) is 3 at axis 0 of input 0 but 4 at axis 0 "
                                         r"of input 1: one Dim is one size"):
        graph(flow.randn(3, 4), flow.randn(4, 4))
    out = graph(flow.randn(3, 4), flow.randn(3, 4))
    assert tuple(out.shape) == (3, 3)
    with pytest.raises(ValueError, match="dynamic_shapes has 1 entries for 2 inputs"):
        graph.config.dynamic_shapes([{0: batch}])
        graph(flow.randn(3, 4), flow.randn(3, 4))
    # a size seen before is checked again against Dims declared anew
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=4, max=8)}] * 2)
    with pytest.raises(ValueError, match=r"input 0 has size 3 at axis 0, which is Dim\('batch', min=4, max=8\)"):
        graph(flow.randn(3, 4), flow.randn(3, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="batch"), "max is required"),
    (dict(name="batch", min=4, max=4), "needs 1 <= min < max"),
    (dict(name="batch size", max=4), "must be an identifier"),
    (dict(name="batch", max=4.5), "max must be an int"),
    # sizes 1 to 3: renderings at 2 alone (never at 1) cannot show how a size follows the Dim
    (dict(name="batch", max=3), "too few sizes .* give it a max of at least 4"),
])
def test_bad_dims_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Dim(**kwargs)


def test_what_cannot_follow_a_size_is_refused_with_its_reason():
    batch = flow.Dim("batch", min=1, max=8)

    # a mean over the dynamic batch divides by its count, a whole number fitted like the sizes;
    # two thirds of the batch is a float that no size fit gives
    class MeanOverBatch(nn.Module):
        def forward(self, x):
            return x.mean(dim=0) + x.sum(dim=0) * (x.shape[0] / 3.0)

    graph = InferGraph(MeanOverBatch())
    graph.config.dynamic_shapes([{0: batch}])
    with pytest.raises(DynamicShapeError, match=r"kernel k\d+_model_.*2\.6666\d*f? at the maximum sizes is .* at "
                                                r"batch=2: only sizes can follow a Dim"):
        graph(flow.randn(3, 4))

    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(dim=0)

    _runs_like_eager(Mean(), [{0: batch}], lambda n: [flow.randn(n, 4)], [3, 8, 2])
    # a flip along the batch reads rows by indices counted from its end: a constant of the maximum's
    class Flip(nn.Module):
        def forward(self, x):
            return x.flip(0) * 2.0

    graph = InferGraph(Flip())
    graph.config.dynamic_shapes([{0: batch}])
    with pytest.raises(DynamicShapeError, match="the constant .* holds other values at batch=2"):
        graph(flow.randn(3, 4))


def _train_at(sizes, use_graph, model_of, loss_of, spec):
    """Losses and final parameters of training steps at `sizes` (batch), as a graph with a
    dynamic batch or eagerly, from the same seed (dropout draws the same stream either way)."""
    flow.manual_seed(0)
    model = model_of()
    opt = flow.optim.Adam(model.parameters(), lr=0.01)
    graph = TrainGraph(model, loss_of, opt)
    graph.config.dynamic_shapes(spec)
    rng = np.random.default_rng(0)
    losses = []
    for n in sizes:
        x = flow.tensor(rng.standard_normal((n, 8)).astype(np.float32))
        y = flow.tensor(rng.integers(0, 3, n)) if loss_of is _cross_entropy else \
            flow.tensor(rng.standard_normal((n, 3)).astype(np.float32))
        if use_graph:
            losses.append(graph(x, y).numpy())
        else:
            opt.zero_grad()
            loss = loss_of(model(x), y)
            loss.backward()
            losses.append(loss.numpy())
            opt.step()
    return losses, [v.numpy().copy() for v in model.state_dict().values()], graph   # BatchNorm's statistics too


def _cross_entropy(out, y):
    return nn.functional.cross_entropy(out, y)


def _mse_and_l1(out, y):
    return ((out - y) ** 2).mean() + 0.1 * out.abs().mean()


@pytest.mark.parametrize("layers, loss_of", [
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3)), _cross_entropy),
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3)), _mse_and_l1),
    # no bias before BatchNorm: its gradient is zero but for rounding, which Adam would amplify
    (lambda: nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)),
     _cross_entropy)])
def test_training_at_any_batch_size(layers, loss_of):
    """One compile trains at every batch (a dataset's last, smaller batch): a mean divides by its
    count read at run time (a whole number in a float literal, fitted like the sizes), BatchNorm's
    running variance scales by n / (n - 1) computed from it, dropout draws eager's stream; losses,
    parameters and running statistics equal eager's."""
    batch = flow.Dim("batch", min=2, max=32)
    spec = [{0: batch}, {0: batch}]
    sizes = (5, 32, 2, 17, 5)
    got, got_params, graph = _train_at(sizes, True, layers, loss_of, spec)
    want, want_params, _ = _train_at(sizes, False, layers, loss_of, spec)
    assert len(graph._variants) == 1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_params, want_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_float_literals_that_are_counts_or_their_reciprocals():
    """A mean's count (96.0), its gradient's 1/n and BatchNorm's n / (n - 1) (float32 or float64,
    as flowgen writes them) are fitted; another float is not (a tenth, 1.5)."""
    assert _count("96.0") == (96, "double") and _count("96.0f") == (96, "float") and _count("9.6e1f") == (96, "float")
    assert _count("96") is None and _count("1.5f") is None and _count("3e30") is None
    assert _reciprocal("0.009523809887468815f") == (105, "float")   # np.float32(1 / 105)
    assert _reciprocal("0.007142857142857143") == (140, "double")
    assert _reciprocal("0.5f") == (2, "float") and _reciprocal("1.0322580337524414f") is None
    assert _reciprocal("0.1f") == (10, "float") and _reciprocal("0.30000001192092896f") is None
    assert _ratio("1.0322580337524414f") == (32, "float") and _ratio("2.0f") == (2, "float")   # 32/31, 2/1
    assert _ratio("1.0322580645161290") == (32, "double") and _ratio("1.03226") is None
    assert _ratio("1.5") == (3, "double") and _ratio("1.4f") is None and _ratio("0.5f") is None


def test_size_fits_and_their_c_expressions():
    dims = [Dim("b", min=1, max=10), Dim("s", min=1, max=6)]
    points = [[10, 6]] + sample_points(dims)                  # a grid: b in 2, 3, 4, 6, 10; s in 2, 3, 4, 6
    form = _fit([3 * b * 6 + 4 * s + 1 for b, s in points], points, [10, 6], dims, "x")
    assert form.c_expr(["dim_b", "dim_s"]) == "(4LL * dim_s + 18LL * dim_b + 1LL)"
    scores = _fit([2 * b * s * s for b, s in points], points, [10, 6], dims, "x")   # an attention's b * s * s
    assert scores.c_expr(["dim_b", "dim_s"]) == "(2LL * dim_b * dim_s * dim_s)" and scores.at([7, 5]) == 350
    assert SizeExpr(0, (((0,), 48),)).c_expr(["dim_b"]) == "(48LL * dim_b)"   # parenthesized: x / (48LL * dim_b)
    assert SizeExpr(-1, (((0,), 1),)).c_expr(["dim_b"]) == "(dim_b - 1LL)"
    assert _fit([7] * len(points), points, [10, 6], dims, "x") == 7
    with pytest.raises(DynamicShapeError, match="not a polynomial"):
        _fit([b ** 3 for b, _ in points], points, [10, 6], dims, "x")     # cubic
    with pytest.raises(DynamicShapeError, match="not a polynomial"):
        _fit([(b + 3) // 4 * 4 for b, _ in points], points, [10, 6], dims, "x")   # rounded up to a multiple of 4
    few = [[10], [2], [3]]                                     # three sizes of one Dim: a square is not checked
    with pytest.raises(DynamicShapeError, match="not a polynomial"):
        _fit([b * b for b, in few], few, [10], dims[:1], "x")
    assert sample_sizes(Dim("b", min=1, max=10)) == [2, 3, 4, 6]
    assert sample_sizes(Dim("b", min=1, max=4)) == [2, 3]


@pytest.mark.parametrize("seed", [1027, 1121, 1201])
def test_fuzz_programs_with_a_dynamic_batch(seed):
    """tests/dynamic_fuzzer.py's check on programs that found bugs (a slice emptied by a batch of
    1, a flip's constant indices): equal to graphs compiled per size, saved and loaded too, or
    refused."""
    assert dynamic_fuzzer.check(seed, saved=True).split(":")[0] in ("ok", "refused")


def test_gpt_sequence_past_a_chunk_of_keys():
    """The native attention pads the keys to whole chunks of 16 (a rounding no polynomial of the
    sizes gives): the kernel computes the padded length from the keys' count, so a sequence runs
    at every length up to the block size."""
    flow.manual_seed(0)
    config = gpt_char.GPTConfig(vocab_size=32, block_size=40, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    rng = np.random.default_rng(4)
    seq = flow.Dim("seq", min=2, max=40)
    _runs_like_eager(FirstOutput(gpt_char.define(flow)(config)), [{1: seq}],
                     lambda n: [flow.tensor(rng.integers(0, 32, (2, n)).astype(np.int64))], [17, 40, 2, 33, 16])


def _dynamic_cuda_graphs(monkeypatch, engine: str, with_gpt: bool):
    """A bf16 MLP on tensor cores (`engine`: mma.sync or wgmma) at batches 5..200 and a GPT with a
    dynamic batch and sequence in float32, on the 'cuda' device, against eager."""
    monkeypatch.setenv("FLOWGEN_TENSOR_CORE_CHECK", "always")
    flow.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()
    graph = InferGraph(mlp.to("cuda"))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=1, max=200)}])
    for n in (5, 200, 77, 130):
        x = flow.randn(n, 64)
        got = graph(x.to("cuda")).numpy().astype(np.float32)
        with flow.no_grad():
            want = mlp.to("cpu")(x).numpy()
        mlp.to("cuda")
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), f"batch {n}"
    kernels = graph.compiled.program.kernels
    assert [k.dynamic_grid is not None for k in kernels if f"bf16 {engine}" in k.comment] == [True, True]
    assert graph.compiled.executor.tensor_core_check is None
    if not with_gpt:
        return
    config = gpt_char.GPTConfig(vocab_size=37, block_size=48, n_layer=2, n_head=4, n_embd=64)
    gpt = gpt_char.define(flow)(config).eval()
    graph = InferGraph(FirstOutput(gpt).to("cuda"))
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=1, max=8), 1: flow.Dim("seq", min=1, max=48)}])
    for b, t in [(2, 5), (8, 48), (3, 17), (1, 9), (4, 1)]:
        ids = np.random.default_rng(t).integers(0, 37, (b, t))
        got = graph(flow.tensor(ids).to("cuda")).numpy()
        with flow.no_grad():
            want = gpt.to("cpu")(flow.tensor(ids))[0].numpy()
        gpt.to("cuda")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"batch {b}, seq {t}")
    assert any(k.dynamic_grid is not None for k in graph.compiled.program.kernels)


def test_the_cuda_targets_kernels_launch_grids_from_the_sizes(cuda_graph_target, monkeypatch):
    """The cuda target's kernels (on the GPU, or the CPU emulator: FLOWGEN_EMULATE_CUDA=1), whose
    launch grids follow the sizes (blocks over rows, a GEMM's row tiles, attention's tiles per
    slice): the executor computes each grid from the call's sizes (codegen/dynamic.py GridSize),
    and every size renders the forms chosen at the maximum (tile shapes, tensor-core GEMMs). The
    tensor-core check is off for a dynamic step (its SIMT references would be rendered at the
    maximum sizes), even where asked for on the emulator."""
    engine = "wgmma" if cuda_graph_target == "gpu" and gpu_arch() == "sm_90" else "mma.sync"
    _dynamic_cuda_graphs(monkeypatch, engine, with_gpt=True)


def test_warpgroup_mma_kernels_launch_grids_from_the_sizes(sm90_graph_target, monkeypatch):
    _dynamic_cuda_graphs(monkeypatch, "wgmma", with_gpt=False)


def test_reductions_over_a_dynamic_axis_keep_the_maximums_form(cuda_graph_target):
    """A sum, a max and a softmax over the dynamic batch on the cuda target's kernels: their block
    sizes and splits are chosen at the maximum batch (the forms at smaller ones would differ), so
    one program takes every batch."""
    class OverBatch(nn.Module):
        def forward(self, x):
            return x.sum(dim=0) + x.amax(dim=0) + x.softmax(dim=0)[0] + x.var(dim=0)

    model = OverBatch()
    graph = InferGraph(model.to("cuda"))
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=2, max=3000)}])
    for n in (3000, 2, 37, 1100):
        x = flow.randn(n, 48)
        np.testing.assert_allclose(graph(x.to("cuda")).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=f"batch {n}")
    assert len(graph._variants) == 1


def test_a_value_named_alike_at_another_size_keeps_its_own_shape_for_its_form(cuda_graph_target):
    """A step traced at a smaller size may give a name to a value of another rank than the
    maximum's (a roll and flip over the batch, dynamic_fuzzer seed 33069): its kernel's form is
    chosen for its own shape, and what does not fit is refused, not a crash in the renderer."""
    class RollFlip(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.w = nn.BatchNorm1d(6), nn.Parameter(flow.randn(6, 3))

        def forward(self, x):
            h = self.norm(x)
            rolled = flow.roll(h, (2, -2), (1, 0))
            return flow.cumsum(flow.matmul(flow.flip(flow.where(rolled < x, rolled, x), [1, 0]), self.w), dim=1)

    model = RollFlip().eval()
    graph = InferGraph(model.to("cuda"))
    graph.config.dynamic_shapes([{0: flow.Dim("batch", min=1, max=9)}])
    with pytest.raises(DynamicShapeError):
        graph(flow.randn(4, 6).to("cuda"))
