"""Optimizers inside nn.Graph: every option lowers exactly (graph == eager over several steps; eager
== PyTorch is tests/test_optim.py), OneFlow's group keys work, a user-written optimizer is traced,
the user's LR scheduler is left alone and gradient clipping inside build() clips; the new optimizers
(Adagrad, Adadelta, RMSprop, LAMB, LARS, FTRL) and schedulers in graphs and in a built program.
(The standalone program's LR schedules for SGD/Adam/AdamW: tests/test_deploy.py.)"""
import copy
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ir.trace import TraceError
from graphs import SumLossGraph, TrainGraph


def _model():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(flow.tensor(rng.standard_normal((8, 5)).astype(np.float32)),
             flow.tensor(3 * rng.standard_normal((8, 3)).astype(np.float32))) for _ in range(steps)]


def _assert_same_parameters(model, eager, rtol=1e-5, atol=1e-6):
    for name, value in eager.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=rtol, atol=atol,
                                   err_msg=name)


def _graph_and_eager(make_opts, steps=4, clip_in_eager=False, make_eager_opts=None, model=_model):
    """A model trained `steps` steps by a graph and by eager code with its own optimizers (from
    `make_eager_opts`, default `make_opts`: a list of optimizers or (optimizer, LR scheduler) pairs
    for a model); eager steps the schedulers, and calls `optimizer.clip_grad()` (OneFlow's API)
    where the graph clips inside its step."""
    flow.manual_seed(0)
    model = model()
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), *make_opts(model))
    pairs_e = [o if isinstance(o, tuple) else (o, None) for o in (make_eager_opts or make_opts)(eager)]
    for x, y in _batches(steps):
        got = graph(x, y)
        loss = nn.MSELoss()(eager(x), y)
        for opt, _ in pairs_e:
            opt.zero_grad()
        loss.backward()
        for opt, sch in pairs_e:
            if clip_in_eager:
                opt.clip_grad()
            opt.step()
            if sch is not None:
                sch.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=1e-5)
    _assert_same_parameters(model, eager)
    return graph


def _deep_model():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3))


def test_optimizer_options_lower_exactly_and_the_scheduler_is_left_alone():
    """Three optimizers, five groups, every option away from its default: one graph. As in OneFlow,
    the graph advances the LR scheduler given to add_optimizer itself: the scheduler object and
    the optimizer's lr stay as the user left them, the weights follow eager's stepped schedule."""
    made = []

    def make_opts(m):
        adamw = flow.optim.AdamW(m[6].parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.2, amsgrad=True)
        made.append(adamw)
        return [flow.optim.SGD([
                    {"params": m[0].parameters(), "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1,
                     "maximize": True},
                    {"params": m[2].parameters(), "momentum": 0.8, "nesterov": True, "maximize": True}], lr=0.05),
                flow.optim.Adam([
                    {"params": m[4].weight, "betas": (0.7, 0.9), "eps": 1e-4, "weight_decay": 0.05, "amsgrad": True,
                     "maximize": True},
                    {"params": m[4].bias, "lr": 0.02, "amsgrad": True}], lr=0.05),
                (adamw, flow.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5))]

    _graph_and_eager(make_opts, model=_deep_model)
    graph_adamw, eager_adamw = made
    assert graph_adamw.param_groups[0]["lr"] == 0.05 and eager_adamw.param_groups[0]["lr"] == 0.05 / 16


def test_add_optimizer_checks_its_arguments():
    model = _model()
    sgd = flow.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_sch StepLR schedules another optimizer than the SGD"):
        TrainGraph(model, nn.MSELoss(), (sgd, flow.optim.lr_scheduler.StepLR(flow.optim.SGD(model.parameters()), 1)))
    with pytest.raises(TypeError, match="add_optimizer: lr_sch is a str"):
        TrainGraph(model, nn.MSELoss(), (sgd, "cosine"))


def test_oneflow_group_keys_lr_scale_clipping_and_bias_correction():
    """Per-group lr_scale, clip_grad_max_norm/clip_grad_norm_type (the graph clips inside its step;
    eager calls clip_grad()) and do_bias_correction, in one Adam with two groups."""
    def make_opts(m):
        return [flow.optim.Adam([
            {"params": m[0].parameters(), "lr_scale": 0.5, "clip_grad_max_norm": 0.5, "clip_grad_norm_type": 2.0},
            {"params": m[2].parameters(), "clip_grad_max_norm": 0.2, "clip_grad_norm_type": math.inf,
             "do_bias_correction": False}], lr=0.05)]

    flow.manual_seed(0)
    probe = _model()   # the clipping is active: both groups' gradient norms exceed their max_norm
    x, y = _batches(1)[0]
    nn.MSELoss()(probe(x), y).backward()
    assert nn.utils.clip_grad_norm_(probe[0].parameters(), 1e9).item() > 0.5
    assert nn.utils.clip_grad_norm_(probe[2].parameters(), 1e9, math.inf).item() > 0.2
    _graph_and_eager(make_opts, clip_in_eager=True)


class MomentumSGD(flow.optim.Optimizer):
    """SGD with momentum written as a user would: flowgen ops, in-place updates."""

    def __init__(self, params, lr, momentum):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @flow.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = flow.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                p.sub_(buf * group["lr"])


class SignMomentum(flow.optim.RuleOptimizer):
    """A user's optimizer written as a rule: the update of one parameter, with flowgen tensor ops."""

    def __init__(self, params, lr, beta):
        super().__init__(params, dict(lr=lr, beta=beta))

    def slot_names(self, group):
        return ("avg",)

    def update(self, group, w, g, slots, hypers):
        avg = slots["avg"] * group["beta"] + g * (1 - group["beta"])
        return w - hypers["lr"] * avg.sign(), {"avg": avg}


def test_user_written_optimizers_in_a_graph():
    """The graph traces MomentumSGD.step() (eager runs flowgen's SGD with momentum, == PyTorch's)
    and SignMomentum's update rule (eager runs the same rule). A traced step's options are
    constants: changing one is refused, not ignored; with lr_sch the rule follows the schedule."""
    made = []

    def make_opts(m):
        made.append(MomentumSGD(m[0].parameters(), lr=0.02, momentum=0.9))
        sign = SignMomentum(m[2].parameters(), lr=0.01, beta=0.8)
        return made[-1:] + [(sign, flow.optim.lr_scheduler.StepLR(sign, step_size=2, gamma=0.5))]

    def make_eager_opts(m):
        sign = SignMomentum(m[2].parameters(), lr=0.01, beta=0.8)
        return [flow.optim.SGD(m[0].parameters(), lr=0.02, momentum=0.9),
                (sign, flow.optim.lr_scheduler.StepLR(sign, step_size=2, gamma=0.5))]

    graph = _graph_and_eager(make_opts, make_eager_opts=make_eager_opts)
    made[0].param_groups[0]["lr"] = 0.01
    with pytest.raises(RuntimeError, match="MomentumSGD: parameter group 0 option 'lr' changed from 0.02 to 0.01"):
        graph(*_batches(1)[0])


def test_user_written_optimizer_refuses_python_state_and_lr_schedulers():
    x, y = _batches(1)[0]

    class CountingSGD(MomentumSGD):
        def step(self):
            for p in self.param_groups[0]["params"]:
                self.state[p]["step"] = self.state[p].setdefault("step", 0) + 1
            super().step()

    model = _model()
    with pytest.raises(TraceError, match=r"CountingSGD.step\(\) keeps Python values in its state"):
        TrainGraph(model, nn.MSELoss(), CountingSGD(model.parameters(), lr=0.1, momentum=0.9))(x, y)
    opt = MomentumSGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TraceError, match="MomentumSGD: .* cannot follow lr_sch=StepLR"):
        TrainGraph(model, nn.MSELoss(), (opt, flow.optim.lr_scheduler.StepLR(opt, step_size=1)))(x, y)


def test_a_user_written_optimizer_as_a_graph_attribute_is_refused():
    class Holding(nn.Graph):
        def __init__(self, model):
            super().__init__()
            self.opt = MomentumSGD(model.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(AttributeError, match=r"'opt' is an optimizer: register it with self.add_optimizer\(opt\)"):
        Holding(_model())


CLIPS = [(0, 2.0, 0.1), (2, math.inf, 0.03), (4, 1.0, 0.3), (6, None, 0.02)]   # (layer, norm type, max)


def _clip(model):
    """nanoGPT's clipping after backward, a different norm per layer (None: clip_grad_value_);
    the total norms."""
    norms = []
    for layer, norm_type, max_norm in CLIPS:
        if norm_type is None:
            nn.utils.clip_grad_value_(model[layer].parameters(), max_norm)
        else:
            norms.append(nn.utils.clip_grad_norm_(model[layer].parameters(), max_norm, norm_type))
    return norms


class ClippingGraph(nn.Graph):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss, _clip(self.model)


def test_clip_grad_inside_build_clips_the_step():
    """clip_grad_norm_ (norms 2, inf, 1) and clip_grad_value_ in build(): graph == eager over
    several steps with every clip active; the returned total norms are graph outputs."""
    flow.manual_seed(0)
    model = _deep_model()
    eager = copy.deepcopy(model)
    graph = ClippingGraph(model, flow.optim.AdamW(model.parameters(), lr=0.05))
    opt_e = flow.optim.AdamW(eager.parameters(), lr=0.05)
    for x, y in _batches(4):
        loss, norms = graph(x, y)
        opt_e.zero_grad()
        nn.functional.mse_loss(eager(x), y).backward()
        assert np.abs(eager[6].weight.grad.numpy()).max() > CLIPS[-1][2]
        expected = _clip(eager)
        for got, total, (_, _, max_norm) in zip(norms, expected, CLIPS):
            assert total.item() > max_norm                       # the clipping is active
            np.testing.assert_allclose(got.numpy(), total.numpy(), rtol=1e-5)
        opt_e.step()
    _assert_same_parameters(model, eager)


def test_clip_grad_norm_inside_build_refuses_what_it_cannot_do():
    class NoBackward(ClippingGraph):
        def build(self, x, y):
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            return loss

    model = _deep_model()
    with pytest.raises(TraceError, match=r"nn.utils.clip_grad_norm_ in build\(\) needs the gradients: call "
                                         r"loss.backward\(\) before it"):
        NoBackward(model, flow.optim.SGD(model.parameters(), lr=0.1))(*_batches(1)[0])
    accumulating = ClippingGraph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    accumulating.config.set_gradient_accumulation_steps(2)
    with pytest.raises(TraceError, match="gradient clipping\\) with a GradScaler or gradient accumulation is not "
                                         "supported yet"):
        accumulating(*_batches(1)[0])


def _new_optimizers_and_schedulers(m):
    """Every new optimizer, options away from their defaults, each under one of the new LR
    schedulers (plus an SGD for the seventh), one optimizer per parameter or group."""
    sch, optim = flow.optim.lr_scheduler, flow.optim
    adagrad = optim.Adagrad([m[0].weight], lr=0.05, lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.2,
                            eps=1e-6)
    adadelta = optim.Adadelta([m[0].bias], lr=0.5, rho=0.8, weight_decay=0.1, maximize=True)
    rmsprop = optim.RMSprop([m[2].weight], lr=0.01, alpha=0.9, centered=True, momentum=0.5)
    sgd = optim.SGD([m[2].bias], lr=0.05, momentum=0.9)
    lamb = optim.LAMB([{"params": m[4].weight, "lr_scale": 0.5},
                       {"params": m[4].bias, "adam_w_mode": False, "weight_decay": 0.1}], lr=0.02, betas=(0.8, 0.9))
    lars = optim.LARS([m[6].weight], lr=0.5, momentum=0.8, weight_decay=0.01, trust_coefficient=0.02)
    ftrl = optim.FTRL([m[6].bias], lr=0.1, weight_decay=0.01, lambda1=0.01, lambda2=0.01, beta=0.1)
    return [(adagrad, sch.PolynomialLR(adagrad, total_iters=4, power=2.0)),
            (adadelta, sch.CosineAnnealingWarmRestarts(adadelta, T_0=2, T_mult=2, eta_min=0.001)),
            (rmsprop, sch.OneCycleLR(rmsprop, max_lr=0.05, total_steps=8, cycle_momentum=False)),
            (sgd, sch.MultiplicativeLR(sgd, lambda e: 0.7)),
            (lamb, sch.CyclicLR(lamb, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="triangular2",
                                cycle_momentum=False)),
            (lars, sch.WarmupLR(sch.CosineDecayLR(lars, decay_steps=5, alpha=0.1), warmup_iters=2)),
            (ftrl, sch.ChainedScheduler([sch.ConstantLR(ftrl, factor=0.5, total_iters=2),
                                         sch.ExponentialLR(ftrl, gamma=0.8)]))]


def test_new_optimizers_lower_exactly_and_follow_the_new_schedulers():
    """graph == eager over six steps (eager optimizers and schedulers match PyTorch or OneFlow's
    formulas: tests/test_optim.py, tests/test_schedulers.py)."""
    _graph_and_eager(_new_optimizers_and_schedulers, steps=6, model=_deep_model)


def test_graphs_refuse_what_they_cannot_replay_and_follow_reduce_lr_on_plateau_through_lr():
    """ReduceLROnPlateau needs metrics: refused as lr_sch, and stepped in Python it acts through
    the group's lr, which the graph reads every call. Momentum cycling is refused, not ignored, and
    so is any other option changed after compiling."""
    sch = flow.optim.lr_scheduler
    model = _model()
    sgd = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="ReduceLROnPlateau cannot be add_optimizer's lr_sch"):
        TrainGraph(model, nn.MSELoss(), (sgd, sch.ReduceLROnPlateau(sgd)))
    with pytest.raises(ValueError, match="OneCycleLR: cycle_momentum=True changes the optimizer's momentum every "
                                         "step, which a compiled graph keeps constant"):
        TrainGraph(model, nn.MSELoss(), (sgd, sch.OneCycleLR(sgd, max_lr=0.1, total_steps=5)))
    adam = flow.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="CyclicLR: cycle_momentum=True changes the optimizer's beta1"):
        TrainGraph(model, nn.MSELoss(), (adam, sch.ChainedScheduler([sch.CyclicLR(adam, 0.01, 0.1)])))

    plateaus = []

    def make_opts(m):
        opt = flow.optim.Adam(m.parameters(), lr=0.05)
        plateaus.append(sch.ReduceLROnPlateau(opt, patience=0, factor=0.5))
        return [opt]

    flow.manual_seed(0)
    model = _model()
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), *make_opts(model))
    opt_e = make_opts(eager)[0]
    for x, y in _batches(4):
        graph(x, y)
        opt_e.zero_grad()
        nn.MSELoss()(eager(x), y).backward()
        opt_e.step()
        for plateau in plateaus:
            plateau.step(10.0)        # never better than its best (10): halves the LR every step
    assert opt_e.param_groups[0]["lr"] == 0.05 / 8
    _assert_same_parameters(model, eager)
    graph_adam = graph._optimizers[0][0]
    sch.LambdaLR(graph_adam, lambda e: 1.0)   # made after compiling: its bookkeeping key (initial_lr) is no option
    graph(*_batches(1)[0])
    graph_adam.param_groups[0]["betas"] = (0.5, 0.999)   # e.g. a cycling scheduler stepped in Python
    with pytest.raises(RuntimeError, match=r"Adam: parameter group 0 option 'betas' changed from \(0.9, 0.999\) to "
                                           r"\(0.5, 0.999\) after nn.Graph compiled its update"):
        graph(*_batches(1)[0])


def test_training_program_runs_new_optimizers_and_schedulers(tmp_path):
    """A built program: Adagrad (lr_decay), LAMB and RMSprop under OneCycleLR, WarmupLR around
    CosineDecayLR, CosineAnnealingWarmRestarts (with OneFlow's decay_rate and restart_limit), a ChainedScheduler, CyclicLR and OneFlow's cycling
    PolynomialLR: its weights after several steps == the graph's."""
    from test_deploy import build_and_train, poly_data

    sch = flow.optim.lr_scheduler
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1), nn.Flatten(0, 1))
    adagrad = flow.optim.Adagrad([model[0].weight], lr=0.1, lr_decay=0.2)
    lamb = flow.optim.LAMB([model[0].bias], lr=0.05, weight_decay=0.1)
    chained = flow.optim.SGD([model[2].weight], lr=0.05)
    rmsprop = flow.optim.RMSprop([model[2].bias], lr=0.01, momentum=0.5)
    sgd = flow.optim.SGD([model[4].weight], lr=0.05, momentum=0.9)
    adam = flow.optim.Adam([model[4].bias], lr=0.05)
    graph = TrainGraph(model, nn.MSELoss(),
                       (adagrad, sch.OneCycleLR(adagrad, max_lr=0.2, total_steps=12, cycle_momentum=False)),
                       (lamb, sch.WarmupLR(sch.CosineDecayLR(lamb, decay_steps=6, alpha=0.1), warmup_factor=0.2,
                                           warmup_iters=3)),
                       (rmsprop, sch.CosineAnnealingWarmRestarts(rmsprop, T_0=2, T_mult=2, decay_rate=0.5, restart_limit=2)),
                       (chained, sch.ChainedScheduler([sch.LinearLR(chained, start_factor=0.5, total_iters=4),
                                                       sch.MultiStepLR(chained, milestones=[2, 5], gamma=0.5)])),
                       (sgd, sch.CyclicLR(sgd, base_lr=0.01, max_lr=0.05, step_size_up=2, mode="exp_range",
                                          gamma=0.9, cycle_momentum=False)),
                       (adam, sch.PolynomialLR(adam, decay_batch=3, end_learning_rate=0.001, power=2.0,
                                               cycle=True)))
    xx, y = poly_data()
    xs, ys = xx[:40] / 10, y[:40]
    graph(flow.tensor(xs[:8]), flow.tensor(ys[:8]))
    weights, _ = build_and_train(graph, xs, ys, 7, tmp_path)
    for s in range(7):
        graph(flow.tensor(xs[8 * (s % 5):8 * (s % 5) + 8]), flow.tensor(ys[8 * (s % 5):8 * (s % 5) + 8]))
    for name, value in graph.state_dict()["model"].items():
        np.testing.assert_allclose(weights[f"model.{name}"], value.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_dynamic_grad_scaler_with_two_optimizers_is_refused():
    """PyTorch's GradScaler skips per optimizer; a graph would skip both together, so it refuses."""
    model = flow.nn.Sequential(flow.nn.Linear(3, 4), flow.nn.Linear(4, 1))
    first = flow.optim.SGD(model[0].parameters(), lr=0.1)
    second = flow.optim.Adam(model[1].parameters(), lr=0.1)

    step = SumLossGraph(model, first, second)
    step.set_grad_scaler(flow.amp.GradScaler())
    with pytest.raises(NotImplementedError, match="GradScaler with 2 optimizers"):
        step(flow.randn(2, 3))
    static = SumLossGraph(model, first, second)
    static.set_grad_scaler(flow.amp.StaticGradScaler(8.0))     # no skipping: fine
    assert np.isfinite(static(flow.randn(2, 3)).numpy())
