"""Each LR scheduler's formula (optim/closed_form.py) is its one definition: for every scheduler
(composed ones included) the C++ a standalone program computes -- the formula's plain data from
passes/optimizer.lr_schedule, printed by closed_form.to_cpp, compiled with g++ -- equals the
Python closed form exactly, and both follow eager stepping (PyTorch's recursive updates, a few
ulps apart) for N steps."""
import json
import shutil
import subprocess

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim, serialization
from flowgen.codegen import aot
from flowgen.optim import closed_form
from flowgen.optim import lr_scheduler as sch
from flowgen.passes.optimizer import lr_schedule
from graphs import TrainGraph

STEPS = 20


def _sgd():
    return optim.SGD([{"params": [nn.Parameter(flow.ones(1))]},
                      {"params": [nn.Parameter(flow.ones(1))], "lr": 0.3, "lr_scale": 0.5}], lr=0.1, momentum=0.9)


SCHEDULERS = {
    "StepLR": lambda o: sch.StepLR(o, step_size=3, gamma=0.7),
    "MultiStepLR": lambda o: sch.MultiStepLR(o, milestones=[2, 5, 5], gamma=0.6),
    "MultiStepLR_none": lambda o: sch.MultiStepLR(o, milestones=[], gamma=0.6),
    "ExponentialLR": lambda o: sch.ExponentialLR(o, gamma=0.9),
    "ConstantLR": lambda o: sch.ConstantLR(o, factor=0.4, total_iters=3),
    "LinearLR": lambda o: sch.LinearLR(o, start_factor=0.25, end_factor=0.9, total_iters=6),
    "CosineAnnealingLR": lambda o: sch.CosineAnnealingLR(o, T_max=7, eta_min=0.001),
    "PolynomialLR": lambda o: sch.PolynomialLR(o, total_iters=7, power=2.0),
    "PolynomialLR_oneflow_cycle": lambda o: sch.PolynomialLR(o, decay_batch=4, end_learning_rate=0.01, power=2.0,
                                                             cycle=True),
    "CosineDecayLR": lambda o: sch.CosineDecayLR(o, decay_steps=6, alpha=0.1),
    "WarmRestarts": lambda o: sch.CosineAnnealingWarmRestarts(o, T_0=3, eta_min=0.01),
    "WarmRestarts_oneflow": lambda o: sch.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=0.01,
                                                                      decay_rate=0.5, restart_limit=3),
    "OneCycleLR": lambda o: sch.OneCycleLR(o, max_lr=[0.5, 1.0], total_steps=25, cycle_momentum=False),
    "OneCycleLR_three_phase_linear": lambda o: sch.OneCycleLR(o, max_lr=0.4, total_steps=24, anneal_strategy="linear",
                                                              three_phase=True, pct_start=0.4, cycle_momentum=False),
    "CyclicLR": lambda o: sch.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, cycle_momentum=False),
    "CyclicLR_triangular2": lambda o: sch.CyclicLR(o, base_lr=[0.01, 0.02], max_lr=0.1, step_size_up=2,
                                                   step_size_down=4, mode="triangular2", cycle_momentum=False),
    "CyclicLR_exp_range": lambda o: sch.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, mode="exp_range",
                                                 gamma=0.9, cycle_momentum=False),
    "ChainedScheduler": lambda o: sch.ChainedScheduler([sch.ConstantLR(o, factor=0.5, total_iters=4),
                                                        sch.ExponentialLR(o, gamma=0.9),
                                                        sch.MultiStepLR(o, milestones=[3, 7], gamma=0.5)]),
    "SequentialLR": lambda o: sch.SequentialLR(o, [sch.LinearLR(o, start_factor=0.2, total_iters=4),
                                                   sch.ExponentialLR(o, gamma=0.9)], milestones=[4]),
    "SequentialLR_three": lambda o: sch.SequentialLR(o, [sch.ConstantLR(o, factor=0.5, total_iters=2),
                                                         sch.CosineAnnealingLR(o, T_max=5, eta_min=0.01),
                                                         sch.StepLR(o, step_size=2, gamma=0.5)], milestones=[3, 8]),
    "WarmupLR": lambda o: sch.WarmupLR(sch.CosineDecayLR(o, decay_steps=10, alpha=0.1), warmup_factor=0.2,
                                       warmup_iters=3),
    "WarmupLR_constant_prefix": lambda o: sch.WarmupLR(sch.StepLR(o, step_size=2, gamma=0.5), warmup_factor=0.5,
                                                       warmup_iters=2, warmup_method="constant", warmup_prefix=True),
    "WarmupLR_alone": lambda o: sch.WarmupLR(o, warmup_factor=0.25, warmup_iters=4),
    "WarmupLR_of_sequential": lambda o: sch.WarmupLR(sch.SequentialLR(o, [sch.ConstantLR(o, factor=0.5, total_iters=2),
                                                                          sch.ExponentialLR(o, gamma=0.8)],
                                                                      milestones=[5]), warmup_iters=3),
}


def _eager_lrs(scheduler, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(list(scheduler.get_last_lr()))
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", SCHEDULERS)
def test_closed_form_follows_eager_steps(name):
    scheduler = SCHEDULERS[name](_sgd())
    closed = [[scheduler.closed_form(g, e) for g in range(2)] for e in range(STEPS)]
    np.testing.assert_allclose(_eager_lrs(scheduler, STEPS), closed, rtol=1e-12, atol=1e-15)


def _program_lrs(schedules: list, steps: int, tmp_path) -> np.ndarray:
    """The LR of every schedule (passes/optimizer.lr_schedule's data) at graph calls 0..steps-1,
    computed by C++ as the standalone program does (codegen/aot.py): scale * formula at t + offset."""
    body = []
    for i, schedule in enumerate(schedules):
        data = json.loads(json.dumps(schedule))     # as graph.json stores it
        body.append(f"    {{ const double e = (double)(t + {data['offset']}LL); std::printf(\"%.17g\\n\", "
                    f"{data['scale']!r} * {closed_form.to_cpp(data['formula'], 'e')}); }}")
    source = tmp_path / "lrs.cpp"
    source.write_text("#include <algorithm>\n#include <cmath>\n#include <cstdio>\nint main() {\n"
                      f"  for (long long t = 0; t < {steps}; ++t) {{\n" + "\n".join(body) + "\n  }\n}\n")
    subprocess.run(["g++", "-std=c++17", "-O0", str(source), "-o", str(tmp_path / "lrs")], check=True)
    out = subprocess.run([str(tmp_path / "lrs")], capture_output=True, text=True, check=True).stdout
    return np.array([float(v) for v in out.split()]).reshape(steps, len(schedules))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_program_lr_equals_the_closed_form_and_eager(tmp_path):
    """Every scheduler and parameter group (the second with OneFlow's lr_scale): C++ == Python's
    closed form (the same operations in the same order, bit for bit), and ~ eager; one scheduler
    stepped before the graph takes it, so its program starts at an offset."""
    cases, schedules = [], []
    for name, make in SCHEDULERS.items():
        scheduler = make(_sgd())
        ahead = 3 if name == "StepLR" else 0
        for _ in range(ahead):
            scheduler.optimizer.step()
            scheduler.step()
        for g, group in enumerate(scheduler.optimizer.param_groups):
            schedule = lr_schedule(scheduler, group, g)
            assert schedule["kind"] == "lr_" + type(scheduler).__name__, name
            assert schedule["offset"] == ahead
            schedules.append(schedule)
            cases.append((name, scheduler, g, group.get("lr_scale", 1.0)))
    program = _program_lrs(schedules, STEPS, tmp_path)
    for column, (name, scheduler, g, scale) in enumerate(cases):
        offset = scheduler.last_epoch
        closed = [scale * scheduler.closed_form(g, offset + t) for t in range(STEPS)]
        assert program[:, column].tolist() == closed, (name, g)
        eager = [scale * scheduler.lr_at(offset + t, g) for t in range(STEPS)]
        np.testing.assert_allclose(program[:, column], eager, rtol=1e-12, atol=1e-15, err_msg=f"{name} group {g}")


def test_schedules_that_run_python_keep_the_saved_lr():
    """A formula that calls the user's Python (LambdaLR, a CyclicLR scale_fn) evaluates in Python
    but has no C++; schedulers without a formula (MultiplicativeLR, a ChainedScheduler of a
    non-multiplicative one) neither: the program keeps the saved LR."""
    for make in (lambda o: sch.LambdaLR(o, lambda e: 0.5 ** e),
                 lambda o: sch.CyclicLR(o, 0.01, 0.1, step_size_up=2, scale_fn=lambda x: 1 / x, cycle_momentum=False),
                 lambda o: sch.MultiplicativeLR(o, lambda e: 0.9),
                 lambda o: sch.ChainedScheduler([sch.CosineAnnealingLR(o, T_max=3)])):
        scheduler = make(_sgd())
        schedule = lr_schedule(scheduler, scheduler.optimizer.param_groups[0], 0)
        assert schedule["kind"] == "constant"
        assert schedule["note"].startswith(type(scheduler).__name__), schedule
    lambda_lr = sch.LambdaLR(_sgd(), lambda e: 0.5 ** e)
    assert lambda_lr.closed_form(1, 3) == 0.3 * 0.5 ** 3
    with pytest.raises(ValueError, match="the LR formula calls Python"):
        closed_form.to_data(lambda_lr.formula(0, closed_form.EPOCH))


def test_a_malformed_formula_is_refused_with_a_reason():
    assert closed_form.to_cpp(["mul", 0.5, ["cos", ["epoch"]]], "e") == "(0.5 * std::cos(e))"
    for data, message in ((["tan", ["epoch"]], "unknown operation 'tan' in an LR formula"),
                          (["add", 1.0], "'add' takes 2 operands, got 1"),
                          ("e", "malformed LR formula 'e'"),
                          (["mul", True, 1.0], "malformed LR formula True")):
        with pytest.raises(ValueError, match=message):
            closed_form.to_cpp(data, "e")
    with pytest.raises(TypeError, match="an LR formula has no truth value"):
        bool(closed_form.EPOCH >= 3)


def _rewrite_graph_json(directory, doc):
    doc = {k: v for k, v in doc.items() if k != "graph_sha256"}
    (directory / "graph.json").write_text(json.dumps(serialization.with_self_hash(doc, "graph_sha256")))


def test_a_saved_graph_with_a_malformed_formula_does_not_build(tmp_path):
    """graph.json's formula is what the program computes: an unknown operation in it (a newer
    flowgen's, or a hand edit), or no formula (an older flowgen's schedule), stops `flowgen build`
    with the state's name, before any compiler runs."""
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    opt = optim.SGD(model.parameters(), lr=0.1)
    graph = TrainGraph(model, nn.MSELoss(), (opt, sch.StepLR(opt, step_size=2, gamma=0.5)))
    graph(flow.randn(4, 3), flow.randn(4))
    flow.save(graph, tmp_path / "saved")
    doc = json.loads((tmp_path / "saved" / "graph.json").read_text())
    lr_state = next(s for s in doc["state"] if s.get("schedule", {}).get("kind") == "lr_StepLR")
    assert closed_form.to_cpp(lr_state["schedule"]["formula"], "e") == "(0.1 * std::pow(0.5, std::floor(e / 2.0)))"
    lr_state["schedule"]["formula"] = ["tan", ["epoch"]]
    _rewrite_graph_json(tmp_path / "saved", doc)
    with pytest.raises(aot.BuildError, match=r"state optim0.group0.lr: malformed lr_StepLR schedule \(ValueError: "
                                             r"unknown operation 'tan' in an LR formula"):
        aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")
    lr_state["schedule"] = {"kind": "lr_StepLR", "base": 0.1, "step_size": 2, "gamma": 0.5, "offset": 0}  # older
    _rewrite_graph_json(tmp_path / "saved", doc)
    with pytest.raises(aot.BuildError, match="its lr_StepLR schedule has no formula .* save the graph again"):
        aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")


def test_saving_a_schedule_the_program_cannot_follow_warns(tmp_path):
    """flow.save says when the standalone program will keep the saved LR instead of the schedule."""
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    opt = optim.SGD(model.parameters(), lr=0.1)
    graph = TrainGraph(model, nn.MSELoss(), (opt, sch.LambdaLR(opt, lambda e: 0.5 ** e)))
    graph(flow.randn(4, 3), flow.randn(4))
    with pytest.warns(UserWarning, match="LambdaLR runs Python code to compute the LR: a standalone program"):
        flow.save(graph, tmp_path / "saved")
