"""Optimizers inside nn.Graph: every option lowers exactly (graph == eager over several steps; eager
== PyTorch is tests/test_optim.py), OneFlow's group keys work, a user-written optimizer is traced,
the user's LR scheduler is left alone, gradient clipping inside build() clips, and the standalone
program follows LR schedulers for every optimizer."""
import copy
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ir.trace import TraceError
from graphs import TrainGraph
from test_deploy import build_and_train, run_binary


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
    `make_eager_opts`, default `make_opts`: a list of optimizers for a model); eager calls
    `optimizer.clip_grad()` (OneFlow's API) where the graph clips inside its step."""
    flow.manual_seed(0)
    model = model()
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), *make_opts(model))
    opts_e = (make_eager_opts or make_opts)(eager)
    for x, y in _batches(steps):
        got = graph(x, y)
        loss = nn.MSELoss()(eager(x), y)
        for opt in opts_e:
            opt.zero_grad()
        loss.backward()
        for opt in opts_e:
            if clip_in_eager:
                opt.clip_grad()
            opt.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=1e-5)
    _assert_same_parameters(model, eager)
    return model, eager


def _deep_model():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3))


def test_optimizer_options_lower_exactly():
    """Three optimizers, five groups, every option away from its default: one graph."""
    def make_opts(m):
        return [flow.optim.SGD([
                    {"params": m[0].parameters(), "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1,
                     "maximize": True},
                    {"params": m[2].parameters(), "momentum": 0.8, "nesterov": True, "maximize": True}], lr=0.05),
                flow.optim.Adam([
                    {"params": m[4].weight, "betas": (0.7, 0.9), "eps": 1e-4, "weight_decay": 0.05, "amsgrad": True,
                     "maximize": True},
                    {"params": m[4].bias, "lr": 0.02, "amsgrad": True}], lr=0.05),
                flow.optim.AdamW(m[6].parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.2, amsgrad=True)]
    _graph_and_eager(make_opts, model=_deep_model)


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
    """The graph traces MomentumSGD.step(); eager runs flowgen's SGD with momentum (== PyTorch's)."""
    _graph_and_eager(lambda m: [MomentumSGD(m.parameters(), lr=0.02, momentum=0.9)],
                     make_eager_opts=lambda m: [flow.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)])


def test_user_written_optimizer_options_are_constants_and_python_state_is_refused():
    flow.manual_seed(0)
    model = _model()
    opt = MomentumSGD(model.parameters(), lr=0.02, momentum=0.9)
    graph = TrainGraph(model, nn.MSELoss(), opt)
    x, y = _batches(1)[0]
    graph(x, y)
    opt.param_groups[0]["lr"] = 0.01
    with pytest.raises(RuntimeError, match="MomentumSGD: parameter group 0 option 'lr' changed from 0.02 to 0.01"):
        graph(x, y)

    class CountingSGD(MomentumSGD):
        def step(self):
            for p in self.param_groups[0]["params"]:
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
            super().step()

    model = _model()
    with pytest.raises(TraceError, match=r"CountingSGD.step\(\) keeps Python values in its state"):
        TrainGraph(model, nn.MSELoss(), CountingSGD(model.parameters(), lr=0.1, momentum=0.9))(x, y)
    opt = MomentumSGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TraceError, match="MomentumSGD: .* cannot follow lr_sch=StepLR"):
        TrainGraph(model, nn.MSELoss(), (opt, flow.optim.lr_scheduler.StepLR(opt, step_size=1)))(x, y)


def test_graph_leaves_the_users_lr_scheduler_alone():
    """OneFlow's add_optimizer(optim, lr_sch=...): the graph advances the schedule itself; the
    scheduler object and the optimizer's lr stay as the user left them."""
    flow.manual_seed(0)
    model = _model()
    eager = copy.deepcopy(model)
    opt = flow.optim.SGD(model.parameters(), lr=0.1)
    sch = flow.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    graph = TrainGraph(model, nn.MSELoss(), (opt, sch))
    opt_e = flow.optim.SGD(eager.parameters(), lr=0.1)
    sch_e = flow.optim.lr_scheduler.StepLR(opt_e, step_size=1, gamma=0.5)
    for x, y in _batches(3):
        graph(x, y)
        opt_e.zero_grad()
        nn.MSELoss()(eager(x), y).backward()
        opt_e.step()
        sch_e.step()
    _assert_same_parameters(model, eager)
    assert sch.last_epoch == 0 and sch.get_last_lr() == [0.1] and opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="lr_sch StepLR schedules another optimizer"):
        TrainGraph(model, nn.MSELoss(), (flow.optim.SGD(model.parameters(), lr=0.1), sch))


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


def test_training_program_follows_lr_schedulers_for_adam(tmp_path):
    """The standalone program advances Adam + StepLR and AdamW + CosineAnnealingLR (two layers,
    two optimizers) as the graph does."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1), nn.Flatten(0, 1))
    adam = flow.optim.Adam(model[0].parameters(), lr=0.05)
    adamw = flow.optim.AdamW(model[2].parameters(), lr=0.05, weight_decay=0.1)
    graph = TrainGraph(model, nn.MSELoss(), (adam, flow.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)),
                       (adamw, flow.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=4, eta_min=0.001)))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5 * 8, 5)).astype(np.float32)
    ys = rng.standard_normal(5 * 8).astype(np.float32)
    graph(flow.tensor(xs[:8]), flow.tensor(ys[:8]))
    weights, _ = build_and_train(graph, xs, ys, 6, tmp_path)
    for s in range(6):
        graph(flow.tensor(xs[8 * (s % 5):8 * (s % 5) + 8]), flow.tensor(ys[8 * (s % 5):8 * (s % 5) + 8]))
    for name in ("model.0.weight", "model.2.weight"):
        np.testing.assert_allclose(weights[name], graph.state_dict()[name].numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    usage = run_binary(tmp_path / "out", "--help").stdout   # says so, as README does
    assert "the LR of\nevery optimizer follows its StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR" in usage
