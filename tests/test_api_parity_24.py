"""API that published model files use (issue 24, item 5), against PyTorch: `flow.inference_mode`,
the rest of `nn.init` (orthogonal_, sparse_, dirac_, eye_, trunc_normal_), `flow.backends.cudnn`,
the device predicates of tensors and the optimizers' implementation keywords."""
import math
import threading
import warnings

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


# ------------------------------------------------------------------ inference_mode
def test_inference_mode_records_nothing_and_marks_its_tensors_as_pytorch(torch):
    for lib in (flow, torch):
        w = lib.ones(2, requires_grad=True)
        with lib.inference_mode():
            assert not lib.is_grad_enabled() and lib.is_inference_mode_enabled()
            y = w * 3
            made = lib.ones(2)
            with lib.inference_mode(False):     # ordinary tensors again, and recording back on
                assert lib.is_grad_enabled() and not lib.is_inference_mode_enabled()
                ordinary = w * 2
        assert lib.is_grad_enabled() and not lib.is_inference_mode_enabled()
        assert (y.requires_grad, y.grad_fn, y.is_inference(), made.is_inference()) == (False, None, True, True)
        assert ordinary.requires_grad and not ordinary.is_inference()
        assert not w.is_inference() and not (y + 1).is_inference() and not y.clone().is_inference()
        with pytest.raises(RuntimeError, match="Setting requires_grad=True on inference tensor outside InferenceMode"):
            made.requires_grad_(True)
        with lib.no_grad(), lib.inference_mode(False):
            assert lib.is_grad_enabled()        # InferenceMode(false) sets grad mode on, in both
    np.testing.assert_array_equal(y.numpy(), np.full(2, 3.0, np.float32))


def test_inference_mode_as_decorator_with_and_without_parentheses():
    @flow.inference_mode
    def bare(x):
        return x * 2, flow.is_inference_mode_enabled()

    @flow.inference_mode()
    def called(depth, x):
        inner = called(depth - 1, x) if depth else x * 2
        assert flow.is_inference_mode_enabled() and not flow.is_grad_enabled()
        return inner

    @flow.inference_mode(False)
    def ordinary(x):
        return x * 2

    x = flow.ones(3, requires_grad=True)
    out, enabled = bare(x)
    assert enabled and out.is_inference() and not out.requires_grad
    assert called(3, x).is_inference()      # recursion: each call restores what it found
    assert not flow.is_inference_mode_enabled() and flow.is_grad_enabled()
    assert ordinary(x).requires_grad and not ordinary(x).is_inference()
    with pytest.raises(TypeError, match="mode must be True or False"):
        flow.inference_mode("yes")


def test_inference_mode_is_per_thread():
    seen = []
    with flow.inference_mode():
        worker = threading.Thread(target=lambda: seen.append((flow.is_inference_mode_enabled(),
                                                              flow.ones(1).is_inference())))
        worker.start()
        worker.join()
    assert seen == [(False, False)]


def test_generate_under_inference_mode_equals_no_grad(torch):
    """A language model's `generate` decorated with @torch.inference_mode (Llama's), as published."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))

    @flow.inference_mode()
    def generate(tokens, steps):
        for _ in range(steps):
            logits = model(tokens)[:, -1, :]
            tokens = flow.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens

    start = flow.tensor([[1, 2, 3]])
    out = generate(start, 4)
    with flow.no_grad():
        expected = start
        for _ in range(4):
            expected = flow.cat([expected, model(expected)[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    assert out.is_inference()
    np.testing.assert_array_equal(out.numpy(), expected.numpy())


# ------------------------------------------------------------------ nn.init
def test_orthogonal_is_orthogonal_for_tall_wide_and_conv_shapes(torch):
    for shape, gain in (((5, 3), 1.0), ((3, 5), 2.0), ((4, 2, 3, 3), 0.5), ((6, 6), 1.0)):
        w = flow.empty(*shape)
        assert nn.init.orthogonal_(w, gain=gain) is w
        flat = w.numpy().reshape(shape[0], -1).astype(np.float64)
        gram = flat @ flat.T if flat.shape[0] <= flat.shape[1] else flat.T @ flat
        np.testing.assert_allclose(gram, gain ** 2 * np.eye(min(flat.shape)), atol=1e-5)
    with pytest.raises(ValueError, match="2 or more dimensions"):
        nn.init.orthogonal_(flow.empty(4))


def test_orthogonal_is_uniform_over_orthogonal_matrices_as_torchs(torch):
    """Haar-distributed: without the sign fix, QR's first column always leans one way (q[0,0] < 0
    from LAPACK's Householder), so its mean is far from 0. The moments match PyTorch's sample."""
    flow.manual_seed(1)
    torch.manual_seed(1)
    draws, n = 1500, 4
    ours = np.stack([nn.init.orthogonal_(flow.empty(n, n)).numpy() for _ in range(draws)])
    theirs = np.stack([torch.nn.init.orthogonal_(torch.empty(n, n)).numpy() for _ in range(draws)])
    for sample in (ours, theirs):
        assert abs(sample[:, 0, 0].mean()) < 4 * math.sqrt(1 / n / draws)       # E[q00] = 0
        assert abs((sample ** 2).mean() - 1 / n) < 0.01                       # E[q_ij^2] = 1/n
        assert abs(np.linalg.det(sample).mean()) < 0.1                          # det +1 and -1 equally
    assert abs(ours[:, 0, 0].mean() - theirs[:, 0, 0].mean()) < 8 * math.sqrt(1 / n / draws)


def test_orthogonal_is_reproducible_with_manual_seed():
    flow.manual_seed(7)
    first = nn.init.orthogonal_(flow.empty(3, 4)).numpy()
    flow.manual_seed(7)
    np.testing.assert_array_equal(first, nn.init.orthogonal_(flow.empty(3, 4)).numpy())


def test_sparse_zeros_per_column_and_value_scale_as_torch(torch):
    rows, cols, sparsity, std = 50, 40, 0.3, 0.02
    ours = nn.init.sparse_(flow.empty(rows, cols), sparsity, std=std).numpy()
    theirs = torch.nn.init.sparse_(torch.empty(rows, cols), sparsity, std=std).numpy()
    for sample in (ours, theirs):
        assert ((sample == 0).sum(axis=0) == math.ceil(sparsity * rows)).all()
        assert abs(sample[sample != 0].std() / std - 1) < 0.1
    first_rows = [set(np.flatnonzero(ours[:, c] == 0)) for c in range(cols)]
    assert len({frozenset(r) for r in first_rows}) > 1                       # drawn per column
    with pytest.raises(ValueError, match="only tensors with 2 dimensions"):
        nn.init.sparse_(flow.empty(2, 3, 4), 0.1)


@pytest.mark.parametrize("shape,groups", [((4, 3, 5), 1), ((6, 4, 3, 3), 2), ((3, 5, 2, 4), 1),
                                          ((4, 2, 3, 3, 3), 2), ((6, 2, 3, 3), 3)])
def test_dirac_equals_torch(torch, shape, groups):
    ours = nn.init.dirac_(flow.empty(*shape), groups).numpy()
    theirs = torch.nn.init.dirac_(torch.empty(*shape), groups).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_dirac_conv_passes_its_input_through():
    conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
    nn.init.dirac_(conv.weight)
    x = flow.randn(2, 3, 5, 5)
    np.testing.assert_allclose(conv(x).numpy(), x.numpy(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.init.dirac_(flow.empty(5, 2, 3, 3), groups=2)


def test_eye_equals_torch(torch):
    for shape in ((3, 5), (5, 3), (4, 4)):
        np.testing.assert_array_equal(nn.init.eye_(flow.empty(*shape)).numpy(),
                                      torch.nn.init.eye_(torch.empty(*shape)).numpy())
    with pytest.raises(ValueError, match="only tensors with 2 dimensions"):
        nn.init.eye_(flow.empty(2, 2, 2))


def _truncated_normal_moments(mean, std, a, b):
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: (1 + math.erf(x / math.sqrt(2))) / 2           # noqa: E731
    mass = cdf(beta) - cdf(alpha)
    shift = (pdf(alpha) - pdf(beta)) / mass
    variance = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / mass - shift ** 2
    return mean + std * shift, std * math.sqrt(variance)


@pytest.mark.parametrize("mean,std,a,b", [(0.0, 1.0, -2.0, 2.0),     # most of the mass: normal draws
                                          (0.5, 0.2, 0.0, 0.3),     # a tail: uniform draws, kept by pdf
                                          (0.0, 1.0, 2.0, 3.0)])
def test_trunc_normal_matches_the_truncated_distribution_and_torch(torch, mean, std, a, b):
    n = 20000
    ours = nn.init.trunc_normal_(flow.empty(n), mean, std, a, b).numpy()
    theirs = torch.nn.init.trunc_normal_(torch.empty(n), mean, std, a, b).numpy()
    expected_mean, expected_std = _truncated_normal_moments(mean, std, a, b)
    for sample in (ours, theirs):
        assert sample.min() >= a and sample.max() <= b
        assert abs(sample.mean() - expected_mean) < 5 * expected_std / math.sqrt(n)
        assert abs(sample.std() / expected_std - 1) < 0.03
    # the shape of the distribution, not just two moments: the deciles agree with PyTorch's
    np.testing.assert_allclose(np.quantile(ours, np.linspace(0.1, 0.9, 9)),
                               np.quantile(theirs, np.linspace(0.1, 0.9, 9)), atol=0.03 * (b - a))


def test_trunc_normal_with_the_mean_far_outside_the_bounds_warns_and_finishes(torch):
    with pytest.warns(UserWarning, match="mean is more than 2 std from"):
        out = nn.init.trunc_normal_(flow.empty(2000), mean=10.0, std=1.0, a=-1.0, b=1.0).numpy()
    assert out.min() >= -1 and out.max() <= 1
    assert out.mean() > 0.8    # piled up against b: the density rises toward the mean
    with pytest.raises(ValueError, match="a < b"):
        nn.init.trunc_normal_(flow.empty(2), a=1.0, b=-1.0)


def test_init_private_fan_helpers_as_torch(torch):
    w, tw = flow.empty(8, 3, 5, 5), torch.empty(8, 3, 5, 5)
    assert nn.init._calculate_fan_in_and_fan_out(w) == torch.nn.init._calculate_fan_in_and_fan_out(tw)
    for mode in ("fan_in", "fan_out"):
        assert nn.init._calculate_correct_fan(w, mode) == torch.nn.init._calculate_correct_fan(tw, mode)
    assert nn.init.orthogonal is nn.init.orthogonal_ and nn.init.dirac is nn.init.dirac_


# ------------------------------------------------------------------ backends.cudnn
class _Affine(flow.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def test_cudnn_benchmark_turns_the_conv_search_on_for_graphs_made_afterwards(monkeypatch):
    cudnn = flow.backends.cudnn
    assert (cudnn.benchmark, cudnn.deterministic, cudnn.enabled, cudnn.allow_tf32) == (False, False, True, False)
    model = nn.Linear(2, 2)
    before = _Affine(model)
    monkeypatch.setattr(cudnn, "benchmark", True)
    after = _Affine(model)
    assert not before.config.cudnn_conv_heuristic_search_algo
    assert after.config.cudnn_conv_heuristic_search_algo
    monkeypatch.setattr(cudnn, "enabled", False)      # PyTorch without cuDNN has nothing to time
    assert not _Affine(model).config.cudnn_conv_heuristic_search_algo
    monkeypatch.setattr(cudnn, "deterministic", True)
    assert not cudnn.is_available() and cudnn.version() is None


@pytest.mark.parametrize("name,value,error,message", [
    ("benchmark_limit", 4, AttributeError, "no setting 'benchmark_limit'"),
    ("benchmark", 1, TypeError, "must be True or False"),
    ("allow_tf32", True, NotImplementedError, r"graph.config.allow_tf32\(True\)"),
])
def test_cudnn_refuses_what_it_cannot_honour(name, value, error, message):
    with pytest.raises(error, match=message):
        setattr(flow.backends.cudnn, name, value)
    assert flow.backends.cudnn.benchmark is False


def test_a_cpu_graph_made_under_cudnn_benchmark_says_the_search_has_no_effect_and_computes_as_eager(monkeypatch):
    monkeypatch.setattr(flow.backends.cudnn, "benchmark", True)
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU())
    graph = _Affine(model)
    x = flow.randn(1, 2, 5, 5)
    with pytest.warns(UserWarning, match="enable_cudnn_conv_heuristic_search_algo has no effect on the cpu"):
        out = graph(x)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ device predicates
def test_device_predicates_match_a_torch_cpu_tensor(torch):
    ours, theirs = flow.ones(2), torch.ones(2)
    names = ("is_cpu", "is_cuda", "is_xpu", "is_mps", "is_ipu", "is_mtia", "is_maia", "is_xla", "is_vulkan",
             "is_meta", "is_mkldnn", "is_sparse", "is_sparse_csr", "is_quantized", "is_nested")
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}
    assert ours.is_cpu is True and ours.is_xpu is False and ours.is_mps is False
    assert not flow.backends.mps.is_available() and not flow.backends.mps.is_built()


# ------------------------------------------------------------------ optimizer implementation keywords
OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "LAMB", "LARS", "FTRL"]
HINTS = [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(capturable=True),
         dict(foreach=None, fused=None, capturable=False, differentiable=False)]


def _steps(cls, **kwargs):
    rng = np.random.default_rng(0)
    params = [nn.Parameter(flow.tensor(rng.standard_normal(s).astype(np.float32))) for s in ((3, 2), (2,))]
    opt = getattr(optim, cls)(params, lr=0.1, **kwargs)
    for _ in range(3):
        for p in params:
            p.grad = flow.tensor(rng.standard_normal(tuple(p.shape)).astype(np.float32))
        opt.step()
    return opt, [p.numpy() for p in params]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_every_optimizer_takes_the_implementation_keywords_without_changing_its_numbers(cls):
    _, plain = _steps(cls)
    for hints in HINTS:
        opt, hinted = _steps(cls, **hints)
        for got, want in zip(hinted, plain):
            np.testing.assert_array_equal(got, want)
        group = opt.param_groups[0]
        assert {k: group[k] for k in hints} == hints     # kept in the groups, as PyTorch keeps them


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_differentiable_true_is_refused_naming_the_optimizer(cls):
    p = nn.Parameter(flow.ones(2))
    with pytest.raises(NotImplementedError, match=rf"^{cls}: differentiable=True is not supported"):
        getattr(optim, cls)([p], lr=0.1, differentiable=True)
    with pytest.raises(NotImplementedError, match=rf"^{cls}: parameter group 1: differentiable=True"):
        getattr(optim, cls)([{"params": [nn.Parameter(flow.ones(1))]}, {"params": [p], "differentiable": True}],
                            lr=0.1)
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        getattr(optim, cls)([p], lr=0.1, foreach=True, fused=True)
    with pytest.raises(TypeError, match=r"foreach='yes'; expected True, False or None"):
        getattr(optim, cls)([p], lr=0.1, foreach="yes")


@pytest.mark.parametrize("cls,kwargs", [("SGD", dict(lr=0.1, momentum=0.9)), ("Adam", dict(lr=0.01)),
                                        ("RMSprop", dict(lr=0.01, momentum=0.5))])
def test_foreach_optimizers_match_torch_foreach_and_its_state_dict_loads(torch, cls, kwargs):
    rng = np.random.default_rng(3)
    init = [rng.standard_normal(s).astype(np.float32) for s in ((3, 2), (2,))]
    ours = [nn.Parameter(flow.tensor(a)) for a in init]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in init]
    opt = getattr(optim, cls)(ours, foreach=True, **kwargs)
    topt = getattr(torch.optim, cls)(theirs, foreach=True, **kwargs)
    for _ in range(3):
        for p, tp in zip(ours, theirs):
            g = rng.standard_normal(tuple(p.shape)).astype(np.float32)
            p.grad, tp.grad = flow.tensor(g), torch.tensor(g)
        opt.step()
        topt.step()
    for p, tp in zip(ours, theirs):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    saved = topt.state_dict()
    assert saved["param_groups"][0]["foreach"] is True
    fresh = getattr(optim, cls)([nn.Parameter(flow.tensor(a)) for a in init], **kwargs)
    fresh.load_state_dict({"param_groups": saved["param_groups"],
                           "state": {i: {k: v.numpy() for k, v in s.items()} for i, s in saved["state"].items()}})
    assert fresh.param_groups[0]["foreach"] is True
    saved["param_groups"][0]["differentiable"] = True
    with pytest.raises(NotImplementedError, match=rf"{cls}: load_state_dict: parameter group 0: differentiable=True"):
        fresh.load_state_dict(saved)


def test_a_graph_trains_with_the_keywords_as_eager_and_saves_them(tmp_path):
    flow.manual_seed(0)
    eager_model = nn.Linear(3, 2)
    graph_model = nn.Linear(3, 2)
    graph_model.load_state_dict(eager_model.state_dict())
    eager_opt = optim.Adam(eager_model.parameters(), lr=0.1)
    graph_opt = optim.Adam(graph_model.parameters(), lr=0.1, foreach=True, capturable=True)

    class Train(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = graph_model
            self.add_optimizer(graph_opt)

        def build(self, x):
            loss = self.model(x).square().mean()
            loss.backward()
            return loss

    graph, x = Train(), flow.randn(4, 3)
    for _ in range(3):
        loss = graph(x)
        eager_loss = eager_model(x).square().mean()
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        np.testing.assert_allclose(loss.numpy(), eager_loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(graph_model.weight.numpy(), eager_model.weight.numpy(), rtol=1e-5, atol=1e-6)
    flow.save(graph.state_dict(), str(tmp_path / "ckpt"))
    groups = flow.load(str(tmp_path / "ckpt"))["System-Optimizer0"]["param_groups"]
    assert (groups[0]["foreach"], groups[0]["fused"], groups[0]["capturable"]) == (True, None, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = Train()
        resumed.load_state_dict(flow.load(str(tmp_path / "ckpt")))
