"""LR schedulers beyond the basic ones: eager LR (and cycled momentum) sequences == PyTorch's, OneFlow's
schedulers by their formulas, lr_at == what eager computed. (Graphs and the standalone program:
tests/test_graph_optimizers.py; every closed form against eager and the program's C++:
tests/test_lr_formulas.py.)"""
import math

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim
from flowgen.optim import lr_scheduler as sched


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _optimizers(torch, cls="SGD", **kwargs):
    kwargs = kwargs or dict(lr=0.1, momentum=0.9)
    ours = getattr(optim, cls)([{"params": [nn.Parameter(flow.ones(1))]},
                                {"params": [nn.Parameter(flow.ones(1))], "lr": 0.3}], **kwargs)
    theirs = getattr(torch.optim, cls)([{"params": [torch.nn.Parameter(torch.ones(1))]},
                                        {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.3}], **kwargs)
    return ours, theirs


def _momentum(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


def _drive(ours, theirs, ours_opt, theirs_opt, steps=25, metrics=None):
    """Step both schedulers `steps` times; LRs (and momentum) equal at every step; returns our LRs."""
    lrs = []
    for k in range(steps):
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12, abs=1e-15), k
        for g, tg in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert g["lr"] == pytest.approx(tg["lr"], rel=1e-12, abs=1e-15)
            assert _momentum(g) == pytest.approx(_momentum(tg), rel=1e-12), k
        lrs.append(list(ours.get_last_lr()))
        ours_opt.step()
        theirs_opt.step()
        if metrics is None:
            ours.step()
            theirs.step()
        else:
            ours.step(metrics[k])
            theirs.step(metrics[k])
    return lrs


TORCH_SCHEDULERS = [
    ("PolynomialLR", dict(total_iters=7, power=2.0), {}),
    ("MultiplicativeLR", dict(lr_lambda=lambda e: 0.9 if e % 2 else 0.95), {}),
    ("CosineAnnealingWarmRestarts", dict(T_0=3, eta_min=0.01), {}),
    ("CosineAnnealingWarmRestarts", dict(T_0=2, T_mult=2), {}),
    ("OneCycleLR", dict(max_lr=[0.5, 1.0], total_steps=25), {}),
    ("OneCycleLR", dict(max_lr=0.4, epochs=5, steps_per_epoch=5, anneal_strategy="linear", three_phase=True,
                        pct_start=0.4, div_factor=10.0), {}),
    ("OneCycleLR", dict(max_lr=0.4, total_steps=30, cycle_momentum=False), {}),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=25, base_momentum=0.8, max_momentum=0.9),
     dict(cls="Adam", lr=0.01)),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, step_size_up=3), {}),
    ("CyclicLR", dict(base_lr=[0.01, 0.02], max_lr=0.1, step_size_up=2, step_size_down=4, mode="triangular2"), {}),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, step_size_up=3, mode="exp_range", gamma=0.9),
     dict(cls="Adam", lr=0.01)),
    ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, step_size_up=3, scale_fn=lambda x: 1 / x, cycle_momentum=False),
     {}),
]


@pytest.mark.parametrize("name,kwargs,opt", TORCH_SCHEDULERS)
def test_schedulers_match_torch_and_lr_at(torch, name, kwargs, opt):
    ours_opt, theirs_opt = _optimizers(torch, **opt)
    ours = getattr(sched, name)(ours_opt, **kwargs)
    theirs = getattr(torch.optim.lr_scheduler, name)(theirs_opt, **kwargs)
    lr_at = [ours.lrs_at(k) for k in range(25)]      # asked before stepping: computed ahead of time
    assert lr_at == _drive(ours, theirs, ours_opt, theirs_opt)


@pytest.mark.filterwarnings("ignore:The epoch parameter in `scheduler.step\\(\\)` was not necessary")
def test_stepping_to_an_epoch_matches_torch(torch):
    """step(epoch): fractional epochs of CosineAnnealingWarmRestarts, and OneCycleLR's momentum
    moves along with its LR (both as PyTorch)."""
    for name, kwargs in (("CosineAnnealingWarmRestarts", dict(T_0=2, T_mult=2, eta_min=0.01)),
                         ("OneCycleLR", dict(max_lr=0.5, total_steps=20))):
        ours_opt, theirs_opt = _optimizers(torch)
        ours = getattr(sched, name)(ours_opt, **kwargs)
        theirs = getattr(torch.optim.lr_scheduler, name)(theirs_opt, **kwargs)
        for epoch in (0.5, 1.25, 3, 7.5, None, None, 9, None):
            ours_opt.step()
            theirs_opt.step()
            ours.step(epoch)
            theirs.step(epoch)
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12), (name, epoch)
            assert [_momentum(g) for g in ours_opt.param_groups] == \
                pytest.approx([_momentum(g) for g in theirs_opt.param_groups], rel=1e-12)


def test_chained_scheduler_matches_torch(torch):
    ours_opt, theirs_opt = _optimizers(torch)
    ts = torch.optim.lr_scheduler
    ours = sched.ChainedScheduler([sched.ConstantLR(ours_opt, factor=0.5, total_iters=4),
                                   sched.ExponentialLR(ours_opt, gamma=0.9)])
    theirs = ts.ChainedScheduler([ts.ConstantLR(theirs_opt, factor=0.5, total_iters=4),
                                  ts.ExponentialLR(theirs_opt, gamma=0.9)])
    lr_at = [ours.lrs_at(k) for k in range(12)]
    assert lr_at == _drive(ours, theirs, ours_opt, theirs_opt, steps=12)
    # multiplicative schedulers chained: the product of their factors (what a program computes)
    np.testing.assert_allclose([[ours.closed_form(g, k) for g in range(2)] for k in range(12)], lr_at, rtol=1e-12)
    assert not sched.ChainedScheduler([sched.CosineAnnealingLR(ours_opt, T_max=3)]).has_closed_form()
    state = ours.state_dict()
    assert [s["last_epoch"] for s in state["_schedulers"]] == [12, 12]


def test_reduce_lr_on_plateau_matches_torch_and_cannot_be_replayed(torch):
    metrics = [1.0, 0.9, 0.95, 0.93, 0.92, 0.91, 0.95, 0.99, 0.98, 0.97, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6]
    for kwargs in (dict(patience=1, factor=0.5), dict(mode="max", patience=0, cooldown=2, min_lr=[0.02, 0.05]),
                   dict(patience=1, threshold=0.05, threshold_mode="abs")):
        ours_opt, theirs_opt = _optimizers(torch)
        ours = sched.ReduceLROnPlateau(ours_opt, **kwargs)
        theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(theirs_opt, **kwargs)
        lrs = _drive(ours, theirs, ours_opt, theirs_opt, steps=len(metrics), metrics=metrics)
        assert lrs[-1] != lrs[0]                       # it did reduce
    with pytest.raises(ValueError, match="ReduceLROnPlateau: its LR depends on metrics"):
        ours.lr_at(3)


def test_cycling_momentum_needs_an_optimizer_with_momentum():
    opt = optim.Adagrad([nn.Parameter(flow.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="OneCycleLR: cycle_momentum=True needs an optimizer with momentum or "
                                         "betas, and Adagrad has neither"):
        sched.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    sched.CyclicLR(opt, base_lr=0.01, max_lr=0.1, cycle_momentum=False)


def _sgd(lr=0.1, groups=1):
    return optim.SGD([{"params": [nn.Parameter(flow.ones(1))], "lr": lr * (i + 1)} for i in range(groups)], lr=lr)


def _eager_lrs(scheduler, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr())
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def test_oneflow_cosine_decay_and_polynomial_lr():
    """OneFlow's formulas (oneflow/nn/optimizer/cosine_decay_lr.py, polynomial_lr.py)."""
    s = sched.CosineDecayLR(_sgd(groups=2), decay_steps=6, alpha=0.1)
    expected = [[b * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * min(e, 6) / 6)) + 0.1) for b in (0.1, 0.2)]
                for e in range(10)]
    np.testing.assert_allclose([s.lrs_at(e) for e in range(10)], expected, rtol=1e-12)
    np.testing.assert_allclose(_eager_lrs(s, 10), expected, rtol=1e-12)

    for cycle in (False, True):
        s = sched.PolynomialLR(_sgd(), decay_batch=4, end_learning_rate=0.01, power=2.0, cycle=cycle)
        lrs = [lr[0] for lr in _eager_lrs(s, 11)]
        def poly(e):
            period = 4 * math.ceil(max(e, 1) / 4) if cycle else 4
            return (0.1 - 0.01) * (1 - (e if cycle else min(e, 4)) / period) ** 2 + 0.01
        assert lrs == pytest.approx([poly(e) for e in range(11)], rel=1e-12)
        assert lrs[0] == pytest.approx(0.1) and lrs[4] == pytest.approx(0.01)
        assert (lrs[5] > lrs[4]) == cycle       # cycle restarts the decay with a longer period
    assert sched.PolynomialLR(_sgd(), decay_batch=3).end_learning_rate == 1e-4   # OneFlow's default


def test_oneflow_warm_restarts_decay_rate_and_restart_limit():
    """OneFlow's CosineAnnealingWarmRestarts options (oneflow/nn/optimizer/
    cosine_annealing_warm_restarts.py): the peak decays by decay_rate per restart and the LR stays
    at eta_min after restart_limit restarts."""
    s = sched.CosineAnnealingWarmRestarts(_sgd(groups=2), T_0=2, T_mult=2, eta_min=0.01, decay_rate=0.5,
                                          restart_limit=2)
    def oneflow(base, step):   # its get_lr, T_mult > 1 branch
        epoch = math.floor(math.log(1 - step / 2 * (1 - 2), 2))
        steps, in_epoch = 2 ** epoch * 2, step - (1 - 2 ** epoch) / (1 - 2) * 2
        if epoch >= 2:
            return 0.01
        return 0.01 + (base * 0.5 ** epoch - 0.01) * 0.5 * (1 + math.cos(math.pi * in_epoch / steps))
    expected = [[oneflow(b, e) for b in (0.1, 0.2)] for e in range(10)]
    np.testing.assert_allclose(_eager_lrs(s, 10), expected, rtol=1e-12)
    np.testing.assert_allclose([s.lrs_at(e) for e in range(10)], expected, rtol=1e-12)
    assert expected[2][0] == pytest.approx(0.05) and expected[6][0] == 0.01


def test_oneflow_warmup_lr():
    """OneFlow's WarmupLR: linear warmup to where the wrapped scheduler is at warmup_iters, or a
    constant factor; warmup_prefix starts the wrapped schedule after warmup; no scheduler: base LR."""
    opt = _sgd(groups=2)
    inner = sched.CosineDecayLR(opt, decay_steps=10)
    s = sched.WarmUpLR(inner, warmup_factor=0.2, warmup_iters=3)
    lrs = _eager_lrs(s, 12)
    for g, base in enumerate((0.1, 0.2)):
        at3 = inner.closed_form(g, 3)
        for e in range(3):
            assert lrs[e][g] == pytest.approx(base * (0.2 + (at3 / base - 0.2) * e / 3), rel=1e-12)
        for e in range(3, 12):
            assert lrs[e][g] == pytest.approx(inner.closed_form(g, e), rel=1e-12)
    assert [s.lrs_at(e) for e in range(12)] == lrs

    state = s.state_dict()                     # plain data: the wrapped scheduler's state, no optimizer
    assert state["scheduler"]["decay_steps"] == 10 and "optimizer" not in state["scheduler"]
    resumed_opt = _sgd(groups=2)
    resumed = sched.WarmupLR(sched.CosineDecayLR(resumed_opt, decay_steps=3), warmup_factor=0.9, warmup_iters=1)
    resumed.load_state_dict(state)
    resumed.step()
    s.step()
    assert resumed.get_last_lr() == s.get_last_lr()

    prefix = sched.WarmupLR(sched.StepLR(_sgd(), step_size=2, gamma=0.5), warmup_factor=0.5, warmup_iters=2,
                            warmup_method="constant", warmup_prefix=True)
    assert [lr[0] for lr in _eager_lrs(prefix, 7)] == pytest.approx([0.05, 0.05, 0.1, 0.1, 0.05, 0.05, 0.025])
    alone = sched.WarmupLR(_sgd(), warmup_factor=0.25, warmup_iters=4)
    assert [lr[0] for lr in _eager_lrs(alone, 6)] == pytest.approx([0.025, 0.04375, 0.0625, 0.08125, 0.1, 0.1])
    with pytest.raises(ValueError, match="WarmupLR: the wrapped MultiplicativeLR has no closed form"):
        sched.WarmupLR(sched.MultiplicativeLR(_sgd(), lambda e: 0.5))
    with pytest.raises(ValueError, match="WarmupLR: the wrapped OneCycleLR cycles the momentum"):
        opt = _sgd()
        sched.WarmupLR(sched.OneCycleLR(optim.SGD(opt.param_groups[0]["params"], momentum=0.9), 0.1, 10))
    with pytest.raises(ValueError, match="WarmupLR: warmup_method must be 'linear' or 'constant', got 'cos'"):
        sched.WarmupLR(_sgd(), warmup_method="cos")


def test_scheduler_group_keys_survive_an_optimizer_state_dict_and_a_resume(torch):
    """OneCycleLR writes initial_lr, max_lr, min_lr and the momentum bounds into the groups (as
    PyTorch's does): an optimizer state dict with them loads, and the resumed schedule continues."""
    ours_opt, theirs_opt = _optimizers(torch)
    ours = sched.OneCycleLR(ours_opt, max_lr=0.5, total_steps=12)
    theirs = torch.optim.lr_scheduler.OneCycleLR(theirs_opt, max_lr=0.5, total_steps=12)
    _drive(ours, theirs, ours_opt, theirs_opt, steps=5)
    resumed_opt, _ = _optimizers(torch)
    resumed_opt.load_state_dict(ours_opt.state_dict())
    resumed_opt.load_state_dict(theirs_opt.state_dict())      # PyTorch's saved groups load too
    resumed = sched.OneCycleLR(resumed_opt, max_lr=0.5, total_steps=12, last_epoch=4)
    resumed.load_state_dict(ours.state_dict())
    assert resumed.get_last_lr() == ours.get_last_lr()
    _drive(resumed, theirs, resumed_opt, theirs_opt, steps=6)
