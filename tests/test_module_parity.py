"""nn modules, losses and nn.utils against PyTorch in float64 on their less common options: the same
weights (torch's state_dict loaded), forward outputs, running statistics and the gradients of inputs
and parameters. Each case here was a silent mismatch once."""
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import train_like_eager
from torch_oracle import get_torch

torch = get_torch()


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _assert_close(got, expected, what):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=1e-9,
                               atol=1e-12, err_msg=what)


def _grad(t):
    """A tensor's gradient as an array; zeros where none reached it."""
    return np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy()


def _compare(make, arrays, call=lambda m, *x: m(*x), steps=1):
    """make(torch.nn) and make(flowgen.nn) in float64 with torch's weights; `steps` calls of `call`
    on `arrays` (float ones require grad): outputs, input/parameter gradients, buffers equal."""
    tm, fm = make(torch.nn).double(), make(nn).double()
    fm.load_state_dict({k: flow.tensor(v.detach().numpy().copy()) for k, v in tm.state_dict().items()})
    for step in range(steps):
        floating = [np.asarray(a).dtype.kind == "f" for a in arrays]
        t_in = [torch.tensor(a, requires_grad=f) for a, f in zip(arrays, floating)]
        f_in = [flow.tensor(a, dtype=flow.float64 if f else None, requires_grad=f) for a, f in zip(arrays, floating)]
        t_out, f_out = _flat(call(tm, *t_in)), _flat(call(fm, *f_in))
        rng = np.random.default_rng(step)
        t_total = f_total = 0
        for i, (t, f) in enumerate(zip(t_out, f_out, strict=True)):
            _assert_close(f.numpy(), t.detach().numpy(), f"step {step}: output {i}")
            r = rng.standard_normal(tuple(t.shape))
            t_total, f_total = t_total + (t * torch.tensor(r)).sum(), f_total + (f * flow.tensor(r)).sum()
        t_total.backward()
        f_total.backward()
        for i, (t, f) in enumerate(zip(t_in, f_in)):
            if t.requires_grad:
                _assert_close(_grad(f), _grad(t), f"step {step}: gradient of input {i}")
        f_params = dict(fm.named_parameters())
        for name, p in tm.named_parameters():
            _assert_close(_grad(f_params[name]), _grad(p), f"step {step}: gradient of {name}")
            p.grad, f_params[name].grad = None, None
        f_buffers = dict(fm.named_buffers())
        for name, b in tm.named_buffers():
            _assert_close(f_buffers[name].numpy(), b.numpy(), f"step {step}: buffer {name}")


# ---------------------------------------------------------------------- losses

def _functional_pair(name, kwargs, arrays):
    """torch.nn.functional.<name> and flowgen's on the same float64 arrays: value and input gradients."""
    floating = [np.asarray(a).dtype.kind == "f" for a in arrays]
    t_in = [torch.tensor(a, requires_grad=f) for a, f in zip(arrays, floating)]
    f_in = [flow.tensor(a, dtype=flow.float64 if f else None, requires_grad=f) for a, f in zip(arrays, floating)]
    with pytest.warns(UserWarning):   # torch's deprecation of size_average / reduce
        t_out = getattr(torch.nn.functional, name)(*t_in, **kwargs)
    f_out = getattr(nn.functional, name)(*f_in, **kwargs)
    _assert_close(f_out.numpy(), t_out.detach().numpy(), f"{name}{kwargs}: value")
    r = np.random.default_rng(0).standard_normal(tuple(t_out.shape))
    (t_out * torch.tensor(r)).sum().backward()
    (f_out * flow.tensor(r)).sum().backward()
    for i, (t, f) in enumerate(zip(t_in, f_in)):
        if t.requires_grad:
            _assert_close(_grad(f), _grad(t), f"{name}{kwargs}: gradient of input {i}")


_RNG = np.random.default_rng(0)
_X, _Y = _RNG.standard_normal((5, 4)), _RNG.standard_normal((5, 4))
_P = _RNG.uniform(0.1, 1.0, (5, 4))
_CLASSES = np.array([0, 3, 2, 1, 2])
_LEGACY = [dict(size_average=False), dict(reduce=False), dict(size_average=True, reduce=True),
           dict(size_average=False, reduce=False)]


@pytest.mark.parametrize("legacy", _LEGACY, ids=str)
@pytest.mark.parametrize("name, arrays", [
    ("mse_loss", [_X, _Y]), ("l1_loss", [_X, _Y]), ("smooth_l1_loss", [_X, _Y]),
    ("cross_entropy", [_X, _CLASSES]), ("nll_loss", [_X, _CLASSES]), ("kl_div", [_X, _P]),
    ("binary_cross_entropy_with_logits", [_X, _P]), ("binary_cross_entropy", [_P, _P[::-1].copy()]),
    ("margin_ranking_loss", [_X[0], _Y[0], np.array([1.0, -1.0, 1.0, -1.0])]),
    ("cosine_embedding_loss", [_X, _Y, np.array([1.0, -1.0, 1.0, -1.0, 1.0])]),
    ("triplet_margin_loss", [_X, _Y, _P]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_legacy_size_average_and_reduce_set_the_reduction(name, arrays, legacy):
    """The deprecated size_average= / reduce= flags override reduction= as in PyTorch (they were
    ignored: mse_loss(size_average=False) returned the mean, 1.43 instead of the sum 28.6)."""
    _functional_pair(name, legacy, arrays)


@pytest.mark.parametrize("make, message", [
    (lambda: nn.HuberLoss(delta=0.0), r"huber_loss: delta must be > 0 .* got 0.0"),
    (lambda: nn.HuberLoss(delta=-1.0), r"huber_loss: delta must be > 0 .* got -1.0"),
    (lambda: nn.SmoothL1Loss(beta=-0.5), r"smooth_l1_loss: beta must be >= 0 .* got -0.5"),
])
def test_huber_and_smooth_l1_refuse_what_torch_refuses(make, message):
    """delta <= 0 / beta < 0 raise, naming the loss and value (they returned 0 and a negative loss)."""
    x = flow.tensor(np.ones(3))
    with pytest.raises(ValueError, match=message):
        make()(x, flow.zeros(3))


# ---------------------------------------------------------------------- norms of zero vectors, cosine similarity

def _zero_row(a):
    a = a.copy()
    a[1] = 0.0
    return a


@pytest.mark.parametrize("flow_fn, torch_fn", [
    (lambda a, b: nn.functional.normalize(a, dim=1), lambda a, b: torch.nn.functional.normalize(a, dim=1)),
    (lambda a, b: nn.functional.normalize(a, p=3, dim=1), lambda a, b: torch.nn.functional.normalize(a, p=3, dim=1)),
    (lambda a, b: flow.norm(a, dim=1) + flow.norm(b, p=1.5, dim=0).sum(),
     lambda a, b: torch.norm(a, dim=1) + torch.norm(b, p=1.5, dim=0).sum()),
    (lambda a, b: nn.functional.cosine_similarity(a, b), lambda a, b: torch.nn.functional.cosine_similarity(a, b)),
    (lambda a, b: nn.functional.cosine_similarity(a * 1e-5, b * 1e-5),
     lambda a, b: torch.nn.functional.cosine_similarity(a * 1e-5, b * 1e-5)),
    (lambda a, b: nn.functional.cosine_similarity(a * 1e-5, b, eps=1e-3),
     lambda a, b: torch.nn.functional.cosine_similarity(a * 1e-5, b, eps=1e-3)),
    (lambda a, b: nn.functional.pairwise_distance(a, a * 1.0, eps=0.0),
     lambda a, b: torch.nn.functional.pairwise_distance(a, a * 1.0, eps=0.0)),
], ids=["normalize", "normalize_p3", "norm", "cosine", "cosine_small_norms", "cosine_eps", "pairwise_zero"])
def test_norms_of_zero_vectors_and_cosine_similarity(flow_fn, torch_fn):
    """A zero vector's 2-/p-norm has gradient 0, as PyTorch (sqrt'(0) = inf made normalize's and
    norm's gradients NaN); cosine_similarity clamps each norm at eps (it clamped their product:
    0.023 for torch's 0.53 at norms 2e-5)."""
    rng = np.random.default_rng(6)
    a, b = _zero_row(rng.standard_normal((3, 4))), rng.standard_normal((3, 4))
    t_in = [torch.tensor(v, requires_grad=True) for v in (a, b)]
    f_in = [flow.tensor(v, dtype=flow.float64, requires_grad=True) for v in (a, b)]
    t_out, f_out = torch_fn(*t_in), flow_fn(*f_in)
    _assert_close(f_out.numpy(), t_out.detach().numpy(), "value")
    r = rng.standard_normal(tuple(t_out.shape))
    (t_out * torch.tensor(r)).sum().backward()
    (f_out * flow.tensor(r)).sum().backward()
    for i, (t, f) in enumerate(zip(t_in, f_in)):
        _assert_close(_grad(f), _grad(t), f"gradient of input {i}")


class _UnitRows(nn.Module):
    """A linear layer whose rows, some of them zero (a ReLU of negative inputs), are normalised."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        h = nn.functional.relu(self.linear(x))
        return nn.functional.normalize(h, dim=1) + nn.functional.cosine_similarity(h, h.flip(0) + 0.5)[:, None]


def test_zero_norm_gradient_in_a_graph_step_equals_eager():
    """The same composite in a graph training step (emulator): graph == eager, no NaN."""
    flow.manual_seed(0)
    x = np.random.default_rng(7).standard_normal((6, 4)).astype(np.float32)
    x[2] = -10.0    # with positive weights and a zero bias, every pre-activation of this row is negative
    model = _UnitRows()
    with flow.no_grad():
        model.linear.weight.copy_(flow.abs(model.linear.weight))
        model.linear.bias.copy_(flow.zeros(3))
    assert (nn.functional.relu(model.linear(flow.tensor(x))).numpy()[2] == 0).all()
    train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=0.1), [(flow.tensor(x), flow.zeros(6, 3))] * 2,
                     loss_fn=nn.MSELoss())
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())


# ---------------------------------------------------------------------- normalisation

def test_instance_norm_momentum_none_keeps_the_running_stats():
    """InstanceNorm(track_running_stats=True, momentum=None): PyTorch passes momentum 0, so the
    running statistics never move (flowgen used 0.1: eval outputs 0.41 off after two steps)."""
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5))

    def train_train_eval(m, x):
        m.train()
        outs = [m(x), m(x * 2 + 1)]
        m.eval()
        return outs + [m(x)]

    _compare(lambda lib: lib.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=None), [x],
             call=train_train_eval)


# ---------------------------------------------------------------------- gradient clipping

def _parameters(lib, grads):
    params = []
    for g in grads:
        p = lib.nn.Parameter(lib.zeros(g.shape, dtype=lib.float64))
        p.grad = lib.tensor(g.copy(), dtype=lib.float64)
        params.append(p)
    return params


_GRADS = [np.random.default_rng(3).standard_normal(s) for s in [(3, 4), (5,), (2, 2)]]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.5, 3.0, 0.0, math.inf, -math.inf])
@pytest.mark.parametrize("max_norm", [0.01, 100.0])
def test_clip_grad_norm_matches_torch_in_float64(norm_type, max_norm):
    """norm_type=-inf is the smallest |g| (it was the largest: total 3.32 for torch's 0.024), and
    float64 gradients are clipped in float64 (the norm was float32: 1.3e-7 relative off)."""
    t_params, f_params = _parameters(torch, _GRADS), _parameters(flow, _GRADS)
    t_total = torch.nn.utils.clip_grad_norm_(t_params, max_norm, norm_type)
    f_total = nn.utils.clip_grad_norm_(f_params, max_norm, norm_type)
    assert f_total.dtype == flow.float64
    _assert_close(f_total.numpy(), t_total.numpy(), "total norm")
    for i, (t, f) in enumerate(zip(t_params, f_params)):
        _assert_close(f.grad.numpy(), t.grad.numpy(), f"gradient {i}")


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_nan_gradient_is_non_finite(norm_type):
    """A NaN gradient element makes the inf-norm NaN too (Python's max() dropped it: the norm was
    3.32, error_if_nonfinite did not raise and the other gradients were clipped by it)."""
    grads = [g.copy() for g in _GRADS]
    grads[1][2] = np.nan
    with pytest.raises(RuntimeError, match=f"total norm of order {norm_type} .* is non-finite"):
        nn.utils.clip_grad_norm_(_parameters(flow, grads), 1.0, norm_type, error_if_nonfinite=True)
    t_params, f_params = _parameters(torch, grads), _parameters(flow, grads)
    t_total = torch.nn.utils.clip_grad_norm_(t_params, 1.0, norm_type)
    with np.errstate(invalid="ignore"):
        f_total = nn.utils.clip_grad_norm_(f_params, 1.0, norm_type)
    assert np.isnan(f_total.numpy()) and np.isnan(t_total.numpy())
    for t, f in zip(t_params, f_params):
        np.testing.assert_array_equal(np.isnan(f.grad.numpy()), np.isnan(t.grad.numpy()))


class _ClipGraph(nn.Graph):
    def __init__(self, model, norm_type):
        super().__init__()
        self.model, self.norm_type = model, norm_type
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.5))

    def build(self, x, y):
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss, nn.utils.clip_grad_norm_(self.model.parameters(), 0.05, self.norm_type)


def test_clip_grad_norm_minus_inf_in_a_graph_step_equals_eager():
    """clip_grad_norm_(norm_type=-inf) in build(): the smallest |g| (the graph took the largest),
    graph == eager == torch on the emulator; norm_type=0 in a graph is refused by name."""
    flow.manual_seed(0)
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    model = nn.Linear(3, 2)
    t_model = torch.nn.Linear(3, 2)
    t_model.load_state_dict({k: torch.tensor(v.numpy()) for k, v in model.state_dict().items()})
    eager = nn.Linear(3, 2)
    eager.load_state_dict(model.state_dict())
    _, g_norm = _ClipGraph(model, -math.inf)(flow.tensor(x), flow.tensor(y))
    nn.functional.mse_loss(eager(flow.tensor(x)), flow.tensor(y)).backward()
    e_norm = nn.utils.clip_grad_norm_(eager.parameters(), 0.05, -math.inf)
    torch.nn.functional.mse_loss(t_model(torch.tensor(x)), torch.tensor(y)).backward()
    t_norm = torch.nn.utils.clip_grad_norm_(t_model.parameters(), 0.05, -math.inf)
    np.testing.assert_allclose(g_norm.numpy(), t_norm.numpy(), rtol=1e-5)
    np.testing.assert_allclose(e_norm.numpy(), t_norm.numpy(), rtol=1e-5)
    with flow.no_grad():
        for p in eager.parameters():
            p.copy_(p - p.grad * 0.5)
    for name, value in eager.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match=r"clip_grad_norm_\(norm_type=0\)"):
        _ClipGraph(nn.Linear(3, 2), 0.0)(flow.tensor(x), flow.tensor(y))
