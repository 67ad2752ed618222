"""Optimizers inside nn.Graph: every option lowers exactly (graph == eager over several steps; eager
== PyTorch is tests/test_optim.py), OneFlow's group keys work, a user-written optimizer is traced,
the user's LR scheduler is left alone and gradient clipping inside build() clips. (The standalone
program's LR schedules for every optimizer: tests/test_deploy.py.)"""
import copy
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ir.trace import TraceError
from graphs import TrainGraph


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


def test_user_written_optimizer_is_traced_into_the_graph():
    """The graph traces MomentumSGD.step(); eager runs flowgen's SGD with momentum (== PyTorch's).
    Its options are constants of the traced step: changing one is refused, not ignored."""
    made = []

    def make_opts(m):
        made.append(MomentumSGD(m.parameters(), lr=0.02, momentum=0.9))
        return made[-1:]

    graph = _graph_and_eager(make_opts, make_eager_opts=lambda m: [flow.optim.SGD(m.parameters(), lr=0.02,
                                                                                  momentum=0.9)])
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


def test_adagrad_adadelta_rmsprop_lamb_lars_ftrl_lower_exactly():
    """Every new optimizer, options away from their defaults, in one graph == eager (whose
    optimizers match PyTorch or OneFlow's formulas: tests/test_optim.py); one follows a scheduler."""
    def make_opts(m):
        adagrad = flow.optim.Adagrad([m[0].weight], lr=0.05, lr_decay=0.1, weight_decay=0.05,
                                     initial_accumulator_value=0.2, eps=1e-6, maximize=False)
        return [(adagrad, flow.optim.lr_scheduler.ExponentialLR(adagrad, gamma=0.8)),
                flow.optim.Adadelta([m[0].bias], lr=0.5, rho=0.8, weight_decay=0.1, maximize=True),
                flow.optim.RMSprop([{"params": m[2].weight, "centered": True, "momentum": 0.5},
                                    {"params": m[2].bias, "weight_decay": 0.1, "lr_scale": 0.5}], lr=0.01, alpha=0.9),
                flow.optim.LAMB([{"params": m[4].weight}, {"params": m[4].bias, "adam_w_mode": False}], lr=0.02,
                                betas=(0.8, 0.9), weight_decay=0.1),
                flow.optim.LARS([m[6].weight], lr=0.5, momentum=0.8, weight_decay=0.01, trust_coefficient=0.02),
                flow.optim.FTRL([m[6].bias], lr=0.1, weight_decay=0.01, lambda1=0.01, lambda2=0.01, beta=0.1)]

    _graph_and_eager(make_opts, model=_deep_model)
