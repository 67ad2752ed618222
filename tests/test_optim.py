"""Optimizers, LR schedulers, gradient clipping and GradScaler: vs NumPy by hand and vs PyTorch."""
import math

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim
from flowgen.optim import lr_scheduler as sched


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


SHAPES = [(3, 4), (4,), ()]


def _run_pair(torch, make_ours, make_theirs, steps=6):
    """Drive both optimizers with the same gradients; compare parameters (and state) after every step."""
    init = _arrays(0, *SHAPES)
    ours = [nn.Parameter(flow.tensor(a)) for a in init]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in init]
    opt, topt = make_ours(ours), make_theirs(theirs)
    for step in range(steps):
        for p, tp, g in zip(ours, theirs, _arrays(step + 1, *SHAPES)):
            p.grad = flow.tensor(g)
            tp.grad = torch.tensor(g)
        opt.step()
        topt.step()
        for p, tp in zip(ours, theirs):
            np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    return opt, topt, ours, theirs


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.8, nesterov=True), dict(lr=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1), dict(lr=0.1, momentum=0.5, maximize=True),
    dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.1, maximize=True),
])
def test_sgd_matches_torch(torch, kwargs):
    opt, topt, ours, theirs = _run_pair(torch, lambda p: optim.SGD(p, **kwargs), lambda p: torch.optim.SGD(p, **kwargs))
    if kwargs.get("momentum"):
        for p, tp in zip(ours, theirs):
            np.testing.assert_allclose(opt.state[p]["momentum_buffer"].numpy(),
                                       topt.state[tp]["momentum_buffer"].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,kwargs", [
    ("Adam", dict(lr=0.01)), ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, amsgrad=True)), ("Adam", dict(lr=0.01, maximize=True)),
    ("AdamW", dict(lr=0.01)), ("AdamW", dict(lr=0.02, weight_decay=0.1, amsgrad=True)),
    ("Adam", dict(lr=0.01, betas=(0.7, 0.9), eps=1e-4, weight_decay=0.05, amsgrad=True, maximize=True)),
    ("AdamW", dict(lr=0.01, weight_decay=0.2, amsgrad=True, maximize=True)),
])
def test_adam_and_adamw_match_torch(torch, cls, kwargs):
    opt, topt, ours, theirs = _run_pair(torch, lambda p: getattr(optim, cls)(p, **kwargs),
                                        lambda p: getattr(torch.optim, cls)(p, **kwargs))
    for p, tp in zip(ours, theirs):
        assert opt.state[p]["step"] == int(topt.state[tp]["step"]) == 6
        for name in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(opt.state[p][name].numpy(), topt.state[tp][name].numpy(), rtol=1e-5,
                                       atol=1e-7)


def test_sgd_momentum_by_hand_and_buffer_identity():
    w0, g1, g2 = np.array([1.0, -2.0], np.float32), np.array([0.5, 0.5], np.float32), np.array([1.0, 0.0], np.float32)
    p = nn.Parameter(flow.tensor(w0))
    array, version = p.numpy_view(), p._version
    opt = optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
    p.grad = flow.tensor(g1)
    opt.step()
    d1 = g1 + 0.1 * w0                      # first step: buf = d (no dampening)
    w1 = w0 - 0.1 * d1
    np.testing.assert_allclose(p.numpy(), w1, rtol=1e-6)
    p.grad = flow.tensor(g2)
    opt.step()
    buf = 0.9 * d1 + 0.5 * (g2 + 0.1 * w1)
    np.testing.assert_allclose(p.numpy(), w1 - 0.1 * buf, rtol=1e-6)
    assert p.numpy_view() is array and p._version == version + 2  # same buffer, graphs see the change


def test_adam_by_hand():
    w, g = np.array([0.5], np.float32), np.array([2.0], np.float32)
    p = nn.Parameter(flow.tensor(w))
    opt = optim.Adam([p], lr=0.1)
    p.grad = flow.tensor(g)
    opt.step()
    m, v = 0.1 * g, 0.001 * g * g
    expected = w - 0.1 / (1 - 0.9) * m / (np.sqrt(v) / math.sqrt(1 - 0.999) + 1e-8)
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-6)


def test_param_groups_zero_grad_and_validation():
    a, b = nn.Parameter(flow.ones(2)), nn.Parameter(flow.ones(2))
    opt = optim.SGD([{"params": [a]}, {"params": b, "lr": 1.0}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 1.0]
    a.grad, b.grad = flow.ones(2), flow.ones(2)
    opt.step()
    np.testing.assert_allclose(a.numpy(), [0.9, 0.9])
    np.testing.assert_allclose(b.numpy(), [0.0, 0.0])
    opt.zero_grad(set_to_none=False)
    assert np.all(a.grad.numpy() == 0)
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    opt.step()  # parameters without gradients are skipped
    with pytest.raises(ValueError, match="more than one parameter group"):
        optim.SGD([{"params": [a]}, {"params": [a]}], lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD([a], lr=0.1, nesterov=True)
    assert "Parameter Group 1" in repr(opt) and "lr: 1.0" in repr(opt)


def test_state_dict_round_trip_resumes_identically():
    def train(opt_params, steps, opt=None):
        for step in range(steps):
            for p, g in zip(opt_params, _arrays(100 + step, *SHAPES)):
                p.grad = flow.tensor(g)
            opt.step()

    init = _arrays(0, *SHAPES)
    ref = [nn.Parameter(flow.tensor(a)) for a in init]
    ref_opt = optim.Adam(ref, lr=0.01)
    train(ref, 3, ref_opt)
    sd = ref_opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert sd["param_groups"][0]["params"] == [0, 1, 2] and sd["param_groups"][0]["lr"] == 0.01
    assert sd["state"][0]["step"] == 3 and tuple(sd["state"][0]["exp_avg"].shape) == (3, 4)

    resumed = [nn.Parameter(flow.tensor(p.numpy().copy())) for p in ref]
    new_opt = optim.Adam(resumed, lr=0.5)
    new_opt.load_state_dict(sd)
    assert new_opt.param_groups[0]["lr"] == 0.01 and new_opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert new_opt.state[resumed[0]]["exp_avg"] is not ref_opt.state[ref[0]]["exp_avg"]
    train(ref, 2, ref_opt)
    train(resumed, 2, new_opt)
    for a, b in zip(ref, resumed):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    bad = optim.Adam([resumed[0]], lr=0.1)
    with pytest.raises(ValueError, match="doesn't match the size"):
        bad.load_state_dict(sd)


def test_loads_a_torch_optimizer_state_dict(torch):
    init = _arrays(0, *SHAPES)
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in init]
    topt = torch.optim.SGD(tp, lr=0.1, momentum=0.9)
    for step in range(2):
        for p, g in zip(tp, _arrays(step, *SHAPES)):
            p.grad = torch.tensor(g)
        topt.step()
    tsd = topt.state_dict()
    converted = {"param_groups": tsd["param_groups"],
                 "state": {i: {k: v.numpy() if hasattr(v, "numpy") else v for k, v in s.items()}
                           for i, s in tsd["state"].items()}}
    ours = [nn.Parameter(flow.tensor(p.detach().numpy().copy())) for p in tp]
    opt = optim.SGD(ours, lr=1.0)
    opt.load_state_dict(converted)
    for p, t, g in zip(ours, tp, _arrays(9, *SHAPES)):
        p.grad, t.grad = flow.tensor(g), torch.tensor(g)
    opt.step()
    topt.step()
    for p, t in zip(ours, tp):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_param_group_keys_unknown_ones_are_refused():
    a = nn.Parameter(flow.ones(2))
    with pytest.raises(ValueError, match=r"SGD: parameter group 1 has unknown option 'lr_sclae' = 0.5"):
        optim.SGD([{"params": [nn.Parameter(flow.ones(1))]}, {"params": [a], "lr_sclae": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match="Adam: .*'do_bias_corection'"):
        optim.Adam([{"params": [a], "do_bias_corection": False}])
    with pytest.raises(ValueError, match="sets 'clip_grad_max_norm' without 'clip_grad_norm_type'"):
        optim.AdamW([{"params": [a], "clip_grad_max_norm": 1.0}])
    with pytest.raises(ValueError, match="clip_grad_max_norm = -1.0"):
        optim.SGD([{"params": [a], "clip_grad_max_norm": -1.0, "clip_grad_norm_type": 2}], lr=0.1)
    kept = optim.SGD([{"params": [a], "param_names": ["a"], "lr_scale": 0.5}], lr=0.1)   # PyTorch's label key
    assert kept.param_groups[0]["param_names"] == ["a"]


def test_lr_scale_do_bias_correction_and_clip_grad_by_hand():
    """OneFlow's group keys in eager: lr_scale multiplies the LR, do_bias_correction=False drops
    both corrections, clip_grad() clips each group that asks by its own joint norm."""
    w, b = nn.Parameter(flow.ones(3)), nn.Parameter(flow.ones(2))
    g_w, g_b = np.array([3.0, 4.0, 0.0], np.float32), np.array([0.1, 0.2], np.float32)
    opt = optim.Adam([{"params": [w], "lr_scale": 0.5, "clip_grad_max_norm": 1.0, "clip_grad_norm_type": 2.0},
                      {"params": [b], "lr": 0.3}], lr=0.1, betas=(0.5, 0.75), eps=1e-3, do_bias_correction=False)
    w.grad, b.grad = flow.tensor(g_w), flow.tensor(g_b)
    opt.clip_grad()
    clipped = g_w / (5.0 + 1e-6)                       # norm 5 > 1: scaled to norm 1; group 1 untouched
    np.testing.assert_allclose(w.grad.numpy(), clipped, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), g_b)
    opt.step()
    for p, g, lr in ((w, clipped, 0.05), (b, g_b, 0.3)):
        m, v = 0.5 * g, 0.25 * g * g                   # no bias correction
        np.testing.assert_allclose(p.numpy(), 1 - lr * m / (np.sqrt(v) + 1e-3), rtol=1e-6)
    with pytest.warns(UserWarning, match="no parameter group sets clip_grad_max_norm"):
        optim.SGD([b], lr=0.1).clip_grad()


# ------------------------------------------------------------------ schedulers
SCHEDULERS = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 5, 9], gamma=0.3)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=0.001)),
    ("LinearLR", dict(start_factor=0.25, total_iters=6)),
    ("ExponentialLR", dict(gamma=0.9)),
    ("ConstantLR", dict(factor=0.5, total_iters=4)),
    ("LambdaLR", dict(lr_lambda=lambda e: 1.0 / (1 + e))),
]


def _pair_of_optimizers(torch, lr=0.1):
    ours = optim.SGD([{"params": [nn.Parameter(flow.ones(1))]}, {"params": [nn.Parameter(flow.ones(1))], "lr": 0.3}],
                     lr=lr, momentum=0.9)
    theirs = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))]},
                              {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.3}], lr=lr, momentum=0.9)
    return ours, theirs


def _drive(ours_sched, theirs_sched, ours_opt, theirs_opt, steps=25):
    lrs = []
    for _ in range(steps):
        assert ours_sched.get_last_lr() == pytest.approx(theirs_sched.get_last_lr(), rel=1e-12, abs=1e-15)
        assert [g["lr"] for g in ours_opt.param_groups] == ours_sched.get_last_lr()
        lrs.append(list(ours_sched.get_last_lr()))
        ours_opt.step()
        theirs_opt.step()
        ours_sched.step()
        theirs_sched.step()
    return lrs


@pytest.mark.parametrize("name,kwargs", SCHEDULERS)
def test_schedulers_match_torch_and_lr_at(torch, name, kwargs):
    ours_opt, theirs_opt = _pair_of_optimizers(torch)
    ours = getattr(sched, name)(ours_opt, **kwargs)
    theirs = getattr(torch.optim.lr_scheduler, name)(theirs_opt, **kwargs)
    lr_at = [ours.lrs_at(k) for k in range(25)]  # asked before stepping: computed ahead of time
    lrs = _drive(ours, theirs, ours_opt, theirs_opt)
    assert lr_at == lrs  # exactly what eager mode used on each iteration
    assert ours.lr_at(24, group=1) == lrs[24][1]


def test_sequential_lr_warmup_then_cosine_matches_torch(torch):
    ours_opt, theirs_opt = _pair_of_optimizers(torch)
    ours = sched.SequentialLR(ours_opt, [sched.LinearLR(ours_opt, start_factor=0.1, total_iters=4),
                                         sched.CosineAnnealingLR(ours_opt, T_max=10)], milestones=[5])
    ts = torch.optim.lr_scheduler
    theirs = ts.SequentialLR(theirs_opt, [ts.LinearLR(theirs_opt, start_factor=0.1, total_iters=4),
                                          ts.CosineAnnealingLR(theirs_opt, T_max=10)], milestones=[5])
    lr_at = [ours.lr_at(k) for k in range(30)]
    lrs = _drive(ours, theirs, ours_opt, theirs_opt, steps=30)
    assert lr_at == [lr[0] for lr in lrs]


def test_scheduler_state_dict_resume():
    def make():
        opt = optim.SGD([nn.Parameter(flow.ones(1))], lr=1.0)
        return opt, sched.MultiStepLR(opt, milestones=[3, 6], gamma=0.5)

    opt, s = make()
    for _ in range(4):
        opt.step()
        s.step()
    state = s.state_dict()
    assert "optimizer" not in state and state["last_epoch"] == 4 and "_replay" not in state
    opt2, s2 = make()
    opt2.load_state_dict(opt.state_dict())
    s2.load_state_dict(state)
    for _ in range(4):
        opt.step(), s.step(), opt2.step(), s2.step()
        assert s.get_last_lr() == s2.get_last_lr()
    assert s2.get_last_lr() == [0.25] and s2.lr_at(7) == 0.25 and s2.lr_at(2) == 1.0


def test_lr_at_does_not_touch_the_optimizer():
    opt = optim.SGD([nn.Parameter(flow.ones(1))], lr=1.0)
    s = sched.StepLR(opt, step_size=1, gamma=0.5)
    assert s.lr_at(10) == 0.5 ** 10
    assert opt.param_groups[0]["lr"] == 1.0 and s.last_epoch == 0


# ---------------------------------------------------------------- clipping
def test_clip_grad_norm_matches_torch(torch):
    grads = _arrays(3, *SHAPES)
    ours = [nn.Parameter(flow.zeros(*s)) for s in SHAPES]
    theirs = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for norm_type, max_norm in [(2.0, 1.0), (1.0, 0.5), (math.inf, 0.3), (2.0, 100.0)]:
        for p, t, g in zip(ours, theirs, grads):
            p.grad, t.grad = flow.tensor(g), torch.tensor(g)
        total = nn.utils.clip_grad_norm_(ours, max_norm, norm_type)
        ttotal = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
        assert total.item() == pytest.approx(ttotal.item(), rel=1e-6)
        for p, t in zip(ours, theirs):
            np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_by_hand_and_shared_gradient_buffers():
    a, b = nn.Parameter(flow.ones(2)), nn.Parameter(flow.ones(2))
    (a + b).sum().backward()  # eager autograd may hand both parameters one gradient buffer
    total = nn.utils.clip_grad_norm_([a, b], max_norm=1.0)
    assert total.item() == pytest.approx(2.0)
    coef = 1.0 / (2.0 + 1e-6)
    np.testing.assert_allclose(a.grad.numpy(), [coef, coef], rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), [coef, coef], rtol=1e-6)  # scaled once, not twice
    nn.utils.clip_grad_value_([a], 0.1)
    np.testing.assert_allclose(a.grad.numpy(), [0.1, 0.1])


# -------------------------------------------------------------- GradScaler
def test_grad_scaler_scales_unscales_and_skips_inf_steps():
    p = nn.Parameter(flow.tensor([1.0, 2.0]))
    opt = optim.SGD([p], lr=0.1)
    scaler = flow.amp.GradScaler(init_scale=8.0, growth_interval=2)
    loss = (p * p).sum()
    scaled = scaler.scale(loss)
    assert scaled.item() == pytest.approx(8 * 5.0)
    scaled.backward()
    np.testing.assert_allclose(p.grad.numpy(), [16.0, 32.0])
    scaler.step(opt)
    np.testing.assert_allclose(p.numpy(), [1.0 - 0.2, 2.0 - 0.4], rtol=1e-6)  # unscaled gradient used
    scaler.update()
    assert scaler.get_scale() == 8.0
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()

    before = p.numpy().copy()
    p.grad = flow.tensor([np.inf, 1.0])
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    assert scaler.step(opt) is None
    np.testing.assert_array_equal(p.numpy(), before)  # skipped
    scaler.update()
    assert scaler.get_scale() == 4.0 and scaler.state_dict()["_growth_tracker"] == 0

    for _ in range(2):
        p.grad = flow.tensor([1.0, 1.0])
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 8.0  # grew after growth_interval clean steps
    fresh = flow.amp.GradScaler()
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state_dict() == scaler.state_dict()
    off = flow.amp.GradScaler(enabled=False)
    assert off.scale(loss) is loss and off.get_scale() == 1.0


def test_grad_scaler_matches_torch_scale_sequence(torch):
    ours = flow.amp.GradScaler(init_scale=1024.0, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    theirs.scale(torch.ones(()))  # torch creates its scale lazily, on the first scale()
    p, tp = nn.Parameter(flow.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt, topt = optim.SGD([p], lr=0.1), torch.optim.SGD([tp], lr=0.1)
    for bad in [False, False, False, True, False, True, False, False, False]:
        g = np.array([np.nan if bad else 1.0, 2.0], np.float32)
        p.grad, tp.grad = flow.tensor(g), torch.tensor(g)
        ours.step(opt)
        theirs.step(topt)
        ours.update()
        theirs.update()
        assert ours.get_scale() == theirs.get_scale()
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-6)


def test_loading_a_state_dict_refuses_options_this_optimizer_lacks(torch):
    """PyTorch's implementation switches load while off; an option with an effect flowgen lacks is refused."""
    p, tp = nn.Parameter(flow.ones(2)), torch.nn.Parameter(torch.ones(2))
    for cls in ("Adam", "AdamW"):
        getattr(optim, cls)([p]).load_state_dict(getattr(torch.optim, cls)([tp]).state_dict())
    saved = torch.optim.Adam([tp], decoupled_weight_decay=True).state_dict()
    with pytest.raises(ValueError, match="Adam.load_state_dict: parameter group 0 has option "
                                         "'decoupled_weight_decay' = True"):
        optim.Adam([p]).load_state_dict(saved)
    saved = optim.SGD([{"params": [p], "lr_scale": 0.5}], lr=0.1).state_dict()
    saved["param_groups"][0]["nesterov_typo"] = True
    with pytest.raises(ValueError, match="'nesterov_typo' = True, which SGD does not have"):
        optim.SGD([p], lr=0.1).load_state_dict(saved)


@pytest.mark.parametrize("cls,kwargs", [
    ("Adagrad", dict(lr=0.1)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.3, eps=1e-6,
                     maximize=True)),
    ("Adadelta", dict()), ("Adadelta", dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1, maximize=True)),
    ("RMSprop", dict(lr=0.01)), ("RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-4, momentum=0.8, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, centered=True, momentum=0.5, maximize=True)),
    ("RMSprop", dict(lr=0.02, centered=True)),
])
def test_adagrad_adadelta_rmsprop_match_torch(torch, cls, kwargs):
    opt, topt, ours, theirs = _run_pair(torch, lambda p: getattr(optim, cls)(p, **kwargs),
                                        lambda p: getattr(torch.optim, cls)(p, **kwargs))
    for p, tp in zip(ours, theirs):
        assert opt.state[p]["step"] == int(topt.state[tp]["step"]) == 6
        for name, value in topt.state[tp].items():
            if name != "step":
                np.testing.assert_allclose(opt.state[p][name].numpy(), value.numpy(), rtol=1e-5, atol=1e-7,
                                           err_msg=name)


@pytest.mark.parametrize("cls,kwargs", [("Adagrad", dict(lr=0.1, lr_decay=0.1)), ("Adadelta", dict(lr=0.5)),
                                        ("RMSprop", dict(lr=0.01, momentum=0.5, centered=True))])
def test_loads_a_torch_state_dict_of_the_new_optimizers(torch, cls, kwargs):
    """Same state names and step counts as PyTorch: a PyTorch state dict resumes exactly."""
    init = _arrays(0, *SHAPES)
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in init]
    topt = getattr(torch.optim, cls)(tp, **kwargs)
    for step in range(2):
        for p, g in zip(tp, _arrays(step, *SHAPES)):
            p.grad = torch.tensor(g)
        topt.step()
    tsd = topt.state_dict()
    converted = {"param_groups": tsd["param_groups"],
                 "state": {i: {k: v.numpy() for k, v in s.items()} for i, s in tsd["state"].items()}}
    ours = [nn.Parameter(flow.tensor(p.detach().numpy().copy())) for p in tp]
    opt = getattr(optim, cls)(ours, lr=1.0)
    opt.load_state_dict(converted)
    for p, t, g in zip(ours, tp, _arrays(9, *SHAPES)):
        p.grad, t.grad = flow.tensor(g), torch.tensor(g)
    opt.step()
    topt.step()
    for p, t in zip(ours, tp):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-6, atol=1e-7)


def _one_step(opt_cls, w, g, steps=1, **kwargs):
    p = nn.Parameter(flow.tensor(w))
    opt = opt_cls([p], **kwargs)
    for _ in range(steps):
        p.grad = flow.tensor(g)
        opt.step()
    return p.numpy(), opt.state[p]


def test_lamb_by_hand():
    """OneFlow's LAMB: the Adam direction u scaled by ||w|| / ||u||, decoupled or L2 weight decay."""
    w, g = np.array([0.5, -1.0, 2.0], np.float32), np.array([0.3, 0.1, -0.2], np.float32)
    for adam_w_mode in (True, False):
        got, state = _one_step(optim.LAMB, w, g, steps=2, lr=0.1, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.2,
                               adam_w_mode=adam_w_mode)
        x, m, v = w.astype(np.float64), 0.0, 0.0
        for t in (1, 2):
            d = g + 0.2 * x if not adam_w_mode else g
            m, v = 0.8 * m + 0.2 * d, 0.9 * v + 0.1 * d * d
            u = (m / (1 - 0.8 ** t)) / (np.sqrt(v) / np.sqrt(1 - 0.9 ** t) + 1e-3)
            ratio = np.linalg.norm(x) / np.linalg.norm(u)
            x = x - 0.1 * ratio * (u + 0.2 * x if adam_w_mode else u)
        np.testing.assert_allclose(got, x, rtol=1e-5)
        np.testing.assert_allclose(state["exp_avg"].numpy(), m, rtol=1e-5)
    zero, _ = _one_step(optim.LAMB, np.zeros(2, np.float32), np.ones(2, np.float32), lr=0.1)
    np.testing.assert_allclose(zero, -0.1 * np.ones(2), rtol=1e-5)   # ||w|| = 0: ratio 1
    with pytest.raises(ValueError, match="LAMB: amsgrad=True is not supported"):
        optim.LAMB([nn.Parameter(flow.ones(1))], amsgrad=True)


def test_lars_by_hand():
    w, g = np.array([3.0, 4.0], np.float32), np.array([0.6, 0.8], np.float32)
    got, state = _one_step(optim.LARS, w, g, steps=2, lr=0.5, momentum=0.9, weight_decay=0.1, epsilon=1e-3,
                           trust_coefficient=0.02)
    x, buf = w.astype(np.float64), 0.0
    for _ in range(2):
        local = 0.5 * 0.02 * np.linalg.norm(x) / (1e-3 + np.linalg.norm(g) + 0.1 * np.linalg.norm(x))
        buf = 0.9 * buf - local * g
        x = x + buf - local * 0.1 * x
    np.testing.assert_allclose(got, x, rtol=1e-5)
    np.testing.assert_allclose(state["momentum_buffer"].numpy(), buf, rtol=1e-5)


def test_ftrl_by_hand():
    """OneFlow's FTRL (ftrl_update kernel): acc^lr_power, L1 zeroes coordinates with |z| < lambda1."""
    w, g = np.array([0.5, -0.2, 0.05], np.float32), np.array([0.4, -0.3, 0.01], np.float32)
    got, state = _one_step(optim.Ftrl, w, g, steps=2, lr=0.1, weight_decay=0.05, lr_power=-0.5,
                           initial_accumulator_value=0.2, lambda1=0.05, lambda2=0.01, beta=0.3)
    x, acc, z = w.astype(np.float64), np.full(3, 0.2), np.zeros(3)
    for _ in range(2):
        d = g + 0.05 * x
        new_acc = acc + d * d
        z = z + d - (new_acc ** -0.5 - acc ** -0.5) / 0.1 * x
        acc = new_acc
        x = np.where(np.abs(z) >= 0.05, (np.sign(z) * 0.05 - z) / ((0.3 + acc ** -0.5) / 0.1 + 0.01), 0.0)
    assert x[2] == 0 and x[0] != 0           # the L1 threshold is active on one coordinate only
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["z"].numpy(), z, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="FTRL: lr must be > 0"):
        optim.FTRL([nn.Parameter(flow.ones(1))], lr=0.0)
