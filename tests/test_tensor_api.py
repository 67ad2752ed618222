"""The PyTorch/OneFlow tensor API real model files use (issue 14): math, shape ops, sorting,
losses, containers, constructors, dtype rules and DLPack. Each against PyTorch (the test oracle);
composites also run inside an nn.Graph on the CPU emulator and must equal eager."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ops import registry
from graphs import InferGraph, train_like_eager
from torch_oracle import compare_with_torch, get_torch

RNG = np.random.default_rng(7)
X = RNG.standard_normal((3, 4, 5)).astype(np.float32)
Y = RNG.standard_normal((3, 4, 5)).astype(np.float32)


@pytest.mark.parametrize("name, flow_fn, torch_fn", [
    ("erf", lambda x: flow.erf(x), lambda x: x.erf()),
    ("erfinv", lambda x: flow.erfinv(x.tanh() * 0.999), lambda x: (x.tanh() * 0.999).erfinv()),
    ("log1p", lambda x: flow.log1p(x.abs()), lambda x: x.abs().log1p()),
    ("expm1", lambda x: x.expm1(), lambda x: x.expm1()),
    ("round", lambda x: flow.round(x * 4) + x, lambda x: (x * 4).round() + x),
    ("round_decimals", lambda x: flow.round(x, decimals=2), lambda x: x.round(decimals=2)),
    ("ceil_trunc_frac", lambda x: x.ceil() + x.trunc() * 2 + x.frac(), lambda x: x.ceil() + x.trunc() * 2 + x.frac()),
    ("atan2", lambda x: flow.atan2(x, x * x + 0.5), lambda x: x.atan2(x * x + 0.5)),
    ("fmod", lambda x: flow.fmod(x * 3, 0.7), lambda x: (x * 3).fmod(0.7)),
    ("remainder", lambda x: flow.remainder(x * 3, -0.7), lambda x: (x * 3).remainder(-0.7)),
    ("lerp", lambda x: flow.lerp(x, x * x, 0.3), lambda x: x.lerp(x * x, 0.3)),
    ("addcmul_addcdiv", lambda x: flow.addcdiv(flow.addcmul(x, x, x, value=0.5), x, x * x + 1, value=2),
     lambda x: x.addcmul(x, x, value=0.5).addcdiv(x, x * x + 1, value=2)),
    ("logsumexp", lambda x: x.logsumexp(1), lambda x: x.logsumexp(1)),
    ("logsumexp_keep", lambda x: flow.logsumexp(x * 50, (0, 2), keepdim=True),
     lambda x: (x * 50).logsumexp((0, 2), keepdim=True)),
    ("norm2", lambda x: x.norm(), lambda x: x.norm()),
    ("norm3_dim", lambda x: flow.norm(x, 3, dim=2), lambda x: x.norm(3, dim=2)),
    ("norm_inf", lambda x: flow.norm(x, float("inf"), dim=1), lambda x: x.norm(float("inf"), dim=1)),
    ("norm1", lambda x: flow.norm(x, 1, dim=(0, 1), keepdim=True), lambda x: x.norm(1, dim=(0, 1), keepdim=True)),
    ("tril", lambda x: x.tril(), lambda x: x.tril()),
    ("triu_diag", lambda x: flow.triu(x, 1) + flow.tril(x, -2), lambda x: x.triu(1) + x.tril(-2)),
    ("flip", lambda x: x.flip([0, 2]), lambda x: x.flip([0, 2])),
    ("roll", lambda x: flow.roll(x, (1, -2), (0, 2)), lambda x: x.roll((1, -2), (0, 2))),
    ("roll_flat", lambda x: flow.roll(x, 7), lambda x: x.roll(7)),
    ("diff", lambda x: flow.diff(x, 2, dim=1), lambda x: x.diff(2, dim=1)),
    ("movedim", lambda x: flow.movedim(x, (0, 1), (2, 0)), lambda x: x.movedim((0, 1), (2, 0))),
    ("unflatten", lambda x: x.unflatten(2, (1, 5)), lambda x: x.unflatten(2, (1, 5))),
    ("einsum_bmm", lambda x: flow.einsum("bij,bkj->bik", x, x), lambda x: get_torch().einsum("bij,bkj->bik", x, x)),
    ("einsum_implicit", lambda x: flow.einsum("ijk,jk", x, x[0]), lambda x: get_torch().einsum("ijk,jk", x, x[0])),
    ("einsum_trace_out", lambda x: flow.einsum("ijk->kj", x), lambda x: get_torch().einsum("ijk->kj", x)),
    ("einsum_ellipsis_bmm", lambda x: flow.einsum("...ij,...jk->...ik", x, x[0].t()),
     lambda x: get_torch().einsum("...ij,...jk->...ik", x, x[0].t())),
    ("einsum_ellipsis_broadcast", lambda x: flow.einsum("bij,...j->bi", x, x[:1, :1]),
     lambda x: get_torch().einsum("bij,...j->bi", x, x[:1, :1])),
    ("einsum_ellipsis_implicit", lambda x: flow.einsum("b...j,jk", x, x[0].t()),
     lambda x: get_torch().einsum("b...j,jk", x, x[0].t())),
    ("einsum_ellipsis_summed", lambda x: flow.einsum("...ij->ji", x), lambda x: get_torch().einsum("...ij->ji", x)),
    ("outer_addmm", lambda x: flow.addmm(flow.outer(x[0, :, 0], x[1, :, 0]), x[0], x[1].t(), beta=0.5, alpha=2),
     lambda x: get_torch().addmm(x[0, :, 0].outer(x[1, :, 0]), x[0], x[1].t(), beta=0.5, alpha=2)),
    ("baddbmm", lambda x: flow.baddbmm(x[:, :, :4], x, x.transpose(1, 2), alpha=0.5),
     lambda x: get_torch().baddbmm(x[:, :, :4], x, x.transpose(1, 2), alpha=0.5)),
    ("trace", lambda x: flow.trace(x[0]), lambda x: x[0].trace()),
    ("diagonal", lambda x: flow.diagonal(x, 1, 2, 1), lambda x: x.diagonal(1, 2, 1)),
    ("diagonal_below", lambda x: x.diagonal(-2, -1, 0), lambda x: x.diagonal(-2, -1, 0)),
    ("diagonal_empty", lambda x: flow.diagonal(x, 6, 1, 2), lambda x: x.diagonal(6, 1, 2)),
    ("diag_of_matrix", lambda x: flow.diag(x[0], -1), lambda x: x[0].diag(-1)),
    ("diag_of_vector", lambda x: flow.diag(x[0, 0], 2), lambda x: x[0, 0].diag(2)),
    ("diag_of_vector_below", lambda x: x[0, 0].diag(-3), lambda x: x[0, 0].diag(-3)),
])
def test_math_and_shape_ops_match_torch(name, flow_fn, torch_fn):
    compare_with_torch(flow_fn, torch_fn, X)


@pytest.mark.parametrize("name, flow_fn, torch_fn", [
    ("sort", lambda x: flow.sort(x, 1), lambda x: x.sort(1)),
    ("sort_desc", lambda x: x.sort(dim=2, descending=True), lambda x: x.sort(dim=2, descending=True)),
    ("topk", lambda x: x.topk(2, dim=1), lambda x: x.topk(2, dim=1)),
    ("topk_smallest", lambda x: flow.topk(x, 3, largest=False), lambda x: x.topk(3, largest=False)),
    ("cumsum", lambda x: x.cumsum(1), lambda x: x.cumsum(1)),
    ("cumprod", lambda x: flow.cumprod(x, 2), lambda x: x.cumprod(2)),
])
def test_order_ops_match_torch(name, flow_fn, torch_fn):
    compare_with_torch(flow_fn, torch_fn, X)


def test_sort_is_stable_with_ties_and_puts_nan_first_descending():
    torch = get_torch()
    a = np.array([[2.0, 1.0, 2.0, np.nan, 1.0, 2.0]], np.float32)
    for descending in (False, True):
        got = flow.sort(flow.tensor(a), descending=descending)
        want = torch.sort(torch.tensor(a), descending=descending, stable=True)
        np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
        np.testing.assert_array_equal(got.values.numpy(), want.values.numpy())
    np.testing.assert_array_equal(flow.argsort(flow.tensor(a)).numpy(), torch.argsort(torch.tensor(a), stable=True))


@pytest.mark.parametrize("name, flow_loss, torch_loss, nargs", [
    ("bce", lambda: nn.BCELoss(), lambda t: t.nn.BCELoss(), 2),
    ("kl_batchmean", lambda: nn.KLDivLoss(reduction="batchmean"), lambda t: t.nn.KLDivLoss(reduction="batchmean"), 2),
    ("kl_log_target", lambda: nn.KLDivLoss(reduction="sum", log_target=True),
     lambda t: t.nn.KLDivLoss(reduction="sum", log_target=True), 2),
    ("smooth_l1", lambda: nn.SmoothL1Loss(beta=0.4), lambda t: t.nn.SmoothL1Loss(beta=0.4), 2),
    ("huber", lambda: nn.HuberLoss(reduction="none", delta=0.3), lambda t: t.nn.HuberLoss(reduction="none", delta=0.3), 2),
    ("margin_ranking", lambda: nn.MarginRankingLoss(0.2), lambda t: t.nn.MarginRankingLoss(0.2), 3),
    ("cosine_embedding", lambda: nn.CosineEmbeddingLoss(0.1), lambda t: t.nn.CosineEmbeddingLoss(0.1), 3),
    ("triplet", lambda: nn.TripletMarginLoss(margin=2.0, p=1.5), lambda t: t.nn.TripletMarginLoss(margin=2.0, p=1.5), 3),
    ("triplet_swap", lambda: nn.TripletMarginLoss(swap=True), lambda t: t.nn.TripletMarginLoss(swap=True), 3),
])
def test_losses_match_torch(name, flow_loss, torch_loss, nargs):
    torch = get_torch()
    a = RNG.standard_normal((6, 5)).astype(np.float32)
    b = RNG.standard_normal((6, 5)).astype(np.float32)
    sign = np.where(RNG.standard_normal(6) > 0, 1.0, -1.0).astype(np.float32)
    if name == "bce":
        args, prep = (a, b), lambda m, x, y: (m.sigmoid(x), m.sigmoid(y).detach())
    elif name.startswith("kl"):
        args, prep = (a, b), lambda m, x, y: (m.log_softmax(x, 1), (m.log_softmax(y, 1) if "log" in name
                                                                    else m.softmax(y, 1)).detach())
    elif name == "margin_ranking":
        args, prep = (a[:, 0], b[:, 0], sign), lambda m, x, y, s: (x, y, s)
    elif name == "cosine_embedding":
        args, prep = (a, b, sign), lambda m, x, y, s: (x, y, s)
    elif name.startswith("triplet"):
        args, prep = (a, b, a * 0.5 + b), lambda m, x, y, z: (x, y, z)
    else:
        args, prep = (a, b), lambda m, x, y: (x, y)
    compare_with_torch(lambda *t: flow_loss()(*prep(flow, *t)), lambda *t: torch_loss(torch)(*prep(torch, *t)),
                       *args)
    assert nargs == len(args)


@pytest.mark.parametrize("name, flow_fn, torch_fn", [
    ("cosine_similarity", lambda x, y: nn.functional.cosine_similarity(x, y, dim=2),
     lambda x, y: get_torch().nn.functional.cosine_similarity(x, y, dim=2)),
    ("pairwise_distance", lambda x, y: nn.functional.pairwise_distance(x, y, p=3.0),
     lambda x, y: get_torch().nn.functional.pairwise_distance(x, y, p=3.0)),
    ("normalize", lambda x, y: nn.functional.normalize(x, dim=1) + y,
     lambda x, y: get_torch().nn.functional.normalize(x, dim=1) + y),
])
def test_similarity_functions_match_torch(name, flow_fn, torch_fn):
    compare_with_torch(flow_fn, torch_fn, X, Y)


@pytest.mark.parametrize("r", [2, 3])
def test_pixel_shuffle_roundtrip_matches_torch(r):
    x = RNG.standard_normal((2, 2 * r * r, 3, 2)).astype(np.float32)
    compare_with_torch(lambda t: nn.PixelShuffle(r)(t), lambda t: get_torch().nn.PixelShuffle(r)(t), x)
    compare_with_torch(lambda t: nn.PixelUnshuffle(r)(nn.PixelShuffle(r)(t)) * 2,
                       lambda t: get_torch().nn.PixelUnshuffle(r)(get_torch().nn.PixelShuffle(r)(t)) * 2, x)


class _Composites(nn.Module):
    """Graph-capable composites in one model: every one must equal eager inside nn.Graph."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.scales = nn.ParameterList([nn.Parameter(flow.ones(5) * 0.5), flow.full((5,), 2.0)])
        self.extra = nn.ParameterDict({"shift": nn.Parameter(flow.zeros(5) + 0.25)})

    def forward(self, x):
        h = self.proj(x) * self.scales[0] + self.extra["shift"]
        h = h.tril() + flow.roll(h, 1, 2).flip([1]) + flow.triu(h, 1) * self.scales[1]
        h = h + flow.logsumexp(h, 2, keepdim=True) + flow.einsum("bij,bkj->bik", h, h)[:, :, :1]
        h = h + nn.functional.normalize(h, dim=2) + flow.erf(h) + flow.atan2(h, h * h + 1)
        h = h + flow.remainder(h, 0.75) + flow.nan_to_num(flow.log(h))
        return h.norm(dim=2) + nn.functional.cosine_similarity(h, flow.flip(h, [2]), dim=2)


@pytest.mark.parametrize("equation, shapes", [("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 2)]),
                                               ("bij,...j->bi", [(2, 3, 4), (2, 1, 4)]),
                                               ("k...,...->...k", [(2, 3, 1), (4,)]),
                                               ("...ij,...jk", [(3, 4, 5), (1, 5, 2)]),
                                               ("ii->i", [(4, 4)]), ("iij,jk", [(3, 3, 2), (2, 4)]),
                                               ("b...ii->b...i", [(2, 3, 4, 4)]), ("iji,jij->j", [(3, 2, 3), (2, 3, 2)])])
def test_einsum_with_ellipsis_or_repeated_labels_matches_torch_and_runs_in_a_graph(equation, shapes):
    torch = get_torch()
    arrays = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    eager = flow.einsum(equation, *[flow.tensor(a) for a in arrays]).numpy()
    np.testing.assert_allclose(eager, torch.einsum(equation, *[torch.tensor(a) for a in arrays]).numpy(),
                               rtol=1e-5, atol=1e-5)

    class Einsum(nn.Graph):
        def build(self, *operands):
            return flow.einsum(equation, *operands)

    np.testing.assert_allclose(Einsum()(*[flow.tensor(a) for a in arrays]).numpy(), eager, rtol=1e-5, atol=1e-6)


def test_erfinv_in_a_graph_equals_eager_and_trunc_normal_fills_in_place():
    values = np.concatenate([np.linspace(-1, 1, 41), [1e-30, -0.999999, 0.9999999, 1.5, -2.0]]).astype(np.float32)

    class Erfinv(nn.Graph):
        def build(self, x):
            return flow.erfinv(x)

    eager = flow.erfinv(flow.tensor(values)).numpy()
    np.testing.assert_array_equal(Erfinv()(flow.tensor(values)).numpy(), eager)
    np.testing.assert_allclose(eager, get_torch().erfinv(get_torch().tensor(values)).numpy(), rtol=2e-7, atol=0)
    w = flow.empty(2000)
    flow.manual_seed(0)
    w.uniform_(-0.9, 0.9).erfinv_()
    assert w.numpy().min() > -1.17 and w.numpy().max() < 1.17 and abs(w.numpy().mean()) < 0.05


def test_einsum_repeated_label_over_dims_of_different_sizes_is_refused():
    with pytest.raises(ValueError, match="label 'i' is repeated in term 'ii'"):
        flow.einsum("ii->i", flow.tensor(X[0]))


def test_einsum_stray_dot_is_refused():
    with pytest.raises(ValueError, match="not part of a single ellipsis"):
        flow.einsum("i.j", flow.tensor(X[0]))


def test_composites_run_in_a_graph_equal_to_eager():
    model = _Composites()
    x = flow.tensor(X)
    eager = model(x).numpy()
    graph = InferGraph(model)
    got = graph(x).numpy()
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5)
    assert [n for n, _ in model.named_parameters()] == ["proj.weight", "proj.bias", "scales.0", "scales.1",
                                                         "extra.shift"]


class _Stacked(nn.Module):
    """Layers kept as a ParameterList of matrices."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ParameterList([nn.Parameter(flow.randn(5, 5) * 0.3) for _ in range(2)])

    def forward(self, x):
        for w in self.layers:
            x = flow.tanh(x @ w)
        return flow.log_softmax(x, -1)


def test_training_through_parameter_containers_in_a_graph_equals_eager():
    flow.manual_seed(3)
    x = flow.tensor(X[0])
    kl = nn.KLDivLoss(reduction="batchmean")
    train_like_eager(_Stacked(), lambda ps: flow.optim.SGD(ps, lr=0.5), [(x, flow.softmax(x, -1))] * 3, loss_fn=kl)


def test_an_op_without_a_lowering_is_refused_inside_a_graph(monkeypatch):
    op = registry.OpDef("eager_twice", infer=lambda x: x, ref=lambda x: 2 * x)
    monkeypatch.setitem(registry.REGISTRY, op.name, op)

    class G(nn.Graph):
        def build(self, x):
            return registry.apply("eager_twice", x)

    np.testing.assert_array_equal(registry.apply("eager_twice", flow.tensor(X)).numpy(), 2 * X)
    with pytest.raises(NotImplementedError, match="eager_twice runs in eager mode only"):
        G()(flow.tensor(X))


def test_allclose_and_equal_are_python_bools():
    a = flow.tensor(X)
    assert flow.allclose(a, a + 1e-9) is True and flow.equal(a, a.clone()) is True
    assert flow.equal(a, a[:1]) is False and not a.allclose(a + 1)


def test_dtype_rules_and_constructors_follow_pytorch():
    torch = get_torch()
    f64 = np.arange(3, dtype=np.float64)
    assert flow.tensor(f64).dtype == flow.float64            # arrays keep their dtype
    assert flow.tensor(np.float64(1.5)).dtype == flow.float64
    assert flow.tensor([1.5, 2.0]).dtype == flow.float32     # Python floats: the default float
    assert flow.Tensor(f64).dtype == flow.float32             # the legacy constructor is float32, as torch's
    src = np.ones(3, np.float32)
    t = flow.Tensor(src)
    src[0] = 7.0
    assert t.numpy()[0] == 1.0                                # Tensor(ndarray) copies
    assert tuple(flow.Tensor(2, 3).shape) == (2, 3) and tuple(flow.Tensor(flow.Size([4])).shape) == (4,)
    assert tuple(flow.Tensor().shape) == (0,)
    x = flow.tensor(X)
    z = x.new_zeros(2, 3)
    assert z.dtype == flow.float32 and tuple(z.shape) == (2, 3) and not z.numpy().any()
    assert x.new_full((2,), 3.0).numpy().tolist() == [3.0, 3.0] and x.new_ones((1,), dtype=flow.int64).dtype == flow.int64
    assert x.new_tensor([1, 2]).dtype == flow.float32
    assert x.stride() == torch.tensor(X).stride() and x.is_contiguous() and x.element_size() == 4
    assert x.double().dtype == flow.float64 and x.is_floating_point() and x.nelement() == X.size


def test_dlpack_and_array_interop_share_memory_on_the_cpu():
    torch = get_torch()
    x = flow.tensor(X)
    t = torch.from_dlpack(x)
    np.testing.assert_array_equal(t.numpy(), X)
    t[0, 0, 0] = 42.0                                          # zero-copy: the flowgen tensor sees it
    assert x.numpy()[0, 0, 0] == 42.0
    back = flow.from_dlpack(torch.arange(4.0))
    assert back.dtype == flow.float32 and back.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    np.testing.assert_array_equal(torch.tensor(flow.tensor(Y)).numpy(), Y)   # through __array__
    with pytest.raises(BufferError, match="bfloat16"):
        flow.tensor(X).to(flow.bfloat16).__dlpack__()


def test_oneflow_and_pytorch_keyword_spellings():
    x = flow.tensor(X)
    assert tuple(x.reshape(shape=(5, 12)).shape) == (5, 12) and tuple(x.view(size=(60,)).shape) == (60,)
    assert tuple(x.permute(dims=(2, 0, 1)).shape) == (5, 3, 4)
    assert tuple(x[:, :1].expand(size=(3, 4, 5)).shape) == (3, 4, 5)
    assert tuple(x.repeat(sizes=(1, 2, 1)).shape) == (3, 8, 5)
    assert tuple(flow.zeros(size=(2, 3)).shape) == (2, 3) and tuple(flow.ones(size=[4]).shape) == (4,)
    assert tuple(flow.empty(size=(1,)).shape) == (1,)
    assert not x.is_global and x.is_local
    with pytest.raises(TypeError, match="unexpected keyword argument 'shap'"):
        x.reshape(shap=(60,))
    with pytest.raises(TypeError, match="twice"):
        x.reshape(60, shape=(60,))


def test_load_state_dict_takes_pytorch_tensors():
    torch = get_torch()
    t = torch.nn.Linear(3, 2)
    m = nn.Linear(3, 2)
    m.load_state_dict(t.state_dict())
    np.testing.assert_array_equal(m.weight.numpy(), t.weight.detach().numpy())
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    # torch's random init can make an output cancel to ~1e-2 from O(1) terms: its error is absolute
    # (a few float32 ulps of the terms), not relative, and BLAS and flowgen sum in different orders.
    np.testing.assert_allclose(m(flow.tensor(x)).numpy(), t(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_one_hot_refuses_out_of_range_classes_in_eager_and_in_graphs():
    with pytest.raises(IndexError, match=r"one_hot: class 3 is out of range \[0, 3\)"):
        nn.functional.one_hot(flow.tensor([0, 3]), 3)

    class G(nn.Graph):
        def build(self, labels):
            return nn.functional.one_hot(labels, 3)

    graph = G()
    np.testing.assert_array_equal(graph(flow.tensor([2, 0])).numpy(), [[0, 0, 1], [1, 0, 0]])
    with pytest.raises(IndexError, match="out of range"):
        graph(flow.tensor([1, 7]))


def test_multinomial_draws_follow_the_weights_reproducibly():
    weights = flow.tensor([[0.1, 0.0, 0.6, 0.3], [2.0, 2.0, 2.0, 2.0]])
    flow.manual_seed(4)
    draws = flow.multinomial(weights, 40000, replacement=True).numpy()
    freq = np.stack([np.bincount(row, minlength=4) / 40000 for row in draws])
    np.testing.assert_allclose(freq, [[0.1, 0.0, 0.6, 0.3], [0.25] * 4], atol=0.012)   # ~5 sigma
    flow.manual_seed(4)
    np.testing.assert_array_equal(flow.multinomial(weights, 40000, replacement=True).numpy(), draws)
    picks = flow.multinomial(weights, 3)                      # without replacement: distinct, never weight 0
    assert picks.dtype == flow.int64 and tuple(picks.shape) == (2, 3)
    for row in picks.numpy():
        assert len(set(row.tolist())) == 3
    assert 1 not in picks.numpy()[0]
    firsts = np.array([flow.multinomial(weights[0], 1).item() for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(firsts, minlength=4) / 4000, [0.1, 0.0, 0.6, 0.3], atol=0.03)
    with pytest.raises(RuntimeError, match="without replacement"):
        flow.multinomial(weights, 4)
    with pytest.raises(RuntimeError, match="element < 0"):
        flow.multinomial(flow.tensor([0.5, -0.1]), 1)


def test_multinomial_without_replacement_in_a_graph_draws_what_eager_draws():
    weights = flow.tensor([[0.1, 0.0, 0.6, 0.3, 0.2], [2.0, 2.0, 2.0, 2.0, 0.0]])

    class Draw(nn.Graph):
        def build(self, w):
            return flow.multinomial(w, 3)

    graph = Draw()
    for seed in range(3):
        flow.manual_seed(seed)
        eager = flow.multinomial(weights, 3).numpy()
        flow.manual_seed(seed)
        np.testing.assert_array_equal(graph(weights).numpy(), eager)
        assert 1 not in eager[0] and 4 not in eager[1]


def test_oneflow_functional_namespace_computes_what_its_names_say():
    x = flow.tensor([[-2.0, 1.0, 3.0], [0.5, -1.0, 2.0]])
    w = flow.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, -1.0]])
    np.testing.assert_allclose(flow._C.matmul(x, w, transpose_b=True, alpha=2.0).numpy(),
                               2.0 * x.numpy() @ w.numpy().T, rtol=1e-6)
    np.testing.assert_allclose(flow._C.matmul(x, w, transpose_a=True).numpy(), x.numpy().T @ w.numpy(), rtol=1e-6)
    np.testing.assert_allclose(flow._C.rrelu(x).numpy(), np.where(x.numpy() >= 0, x.numpy(),
                                                                  x.numpy() * (1 / 8 + 1 / 3) / 2), rtol=1e-6)
    assert tuple(flow._C.flatten(flow.zeros(2, 3, 4), 1).shape) == (2, 12)
    np.testing.assert_allclose(flow._C.relu(x).numpy(), np.maximum(x.numpy(), 0))
    logits, label = x.numpy(), np.array([2, 0])
    expected = -(logits - np.log(np.exp(logits).sum(1, keepdims=True)))[np.arange(2), label]
    np.testing.assert_allclose(flow._C.sparse_softmax_cross_entropy(x, flow.tensor(label)).numpy(), expected,
                               rtol=1e-5)
    with pytest.raises(AttributeError, match="flowgen._C"):
        flow._C.fused_scale_tril_softmax_mask_scale


def test_rand_and_randn_take_size_by_keyword():
    assert tuple(flow.rand(size=(2, 3)).shape) == (2, 3) and tuple(flow.randn(size=[4]).shape) == (4,)
    with pytest.raises(TypeError, match="sizes twice"):
        flow.rand(2, size=(2,))


def test_permuted_tensors_report_the_layout_of_a_view_until_contiguous():
    x = flow.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    y = x.transpose(0, 1)
    assert not y.is_contiguous() and y.stride() == (1, 3)
    z = y.contiguous()
    assert z.is_contiguous() and z.stride() == (2, 1)
    np.testing.assert_array_equal(z.numpy(), x.numpy().T)
    back = z.transpose(0, 1)                       # OneFlow's test_graph_non_contiguous_tensors pattern
    assert not back.is_contiguous() and back.permute(1, 0).is_contiguous()
    assert not nn.Parameter(back).is_contiguous()
    w = flow.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    (w.t().contiguous() * flow.tensor([[1.0, 10.0], [100.0, 1000.0]])).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [[1.0, 100.0], [10.0, 1000.0]])
