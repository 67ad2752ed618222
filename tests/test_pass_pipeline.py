"""The compile pipeline is one list of passes over the step: each timed, dumped and verified."""
import copy
import re

import numpy as np

import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.nn.graph import compiled as compiled_mod
from flowgen.passes.pipeline import step_passes
from graphs import TrainGraph


def _train_graph():
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _dump_after(out: str, name: str) -> str:
    """What debug(2) printed after pass `name`: its line and the IR up to the next pass."""
    return re.search(rf"\(PASS:{name}\) [^\n]*\n(.*?)(?=\(PASS:)", out, re.S).group(0)


def test_debug_2_dumps_the_ir_after_each_stage_of_the_step(capsys):
    graph = _train_graph()
    graph.debug(2)
    graph(flow.randn(8, 5), flow.randn(8, 3))
    out = capsys.readouterr().out
    after_autodiff = _dump_after(out, "autodiff")
    assert "# model.0.backward" in after_autodiff and "# optim0" not in after_autodiff
    after_optimizer = _dump_after(out, "lower_optimizers")
    assert "state %model.0.weight.momentum_buffer: f32[7,5] optim" in after_optimizer
    assert re.search(r"= sub\(%model\.0\.weight, %t\d+\) +# optim0\.group0\.sgd", after_optimizer)
    assert "update %model.0.weight <- %t" in after_optimizer
    # Stages that do not apply to a one-rank graph without ZeRO or a pipeline say so.
    for name in ("gradient_all_reduce", "combine_outputs", "zero", "pipeline_split", "random_streams"):
        assert f"(PASS:{name}) no change" in out


def test_every_pass_of_the_list_is_timed_in_order(capsys):
    graph = _train_graph()
    graph.debug(1)
    graph(flow.randn(8, 5), flow.randn(8, 3))
    logged = re.findall(r"^\(PASS:(\w+)\) .* ms$", capsys.readouterr().out, re.M)
    assert logged == [name for name, _ in step_passes(None, graph.config)]
    assert logged[:4] == ["autodiff", "gradient_all_reduce", "combine_outputs", "lower_optimizers"]


def test_a_broken_pass_in_the_list_is_named_by_verification(monkeypatch):
    """A pass slipped into the list after optimizer lowering that retypes an update: the compile
    refuses it as a flowgen bug naming that pass, instead of writing a float64 into a float32."""
    def retype_first_update(step):
        ir = step.ir.copy_with()
        name, value = ir.updates[0]
        wrong = copy.copy(value)
        wrong.dtype = flow.float64
        ir.updates = [(name, wrong)] + ir.updates[1:]
        return step.with_ir(ir)

    def with_broken_pass(*args, **kwargs):
        passes = step_passes(*args, **kwargs)
        at = [name for name, _ in passes].index("lower_optimizers") + 1
        return passes[:at] + [("retype_first_update", retype_first_update)] + passes[at:]

    monkeypatch.setattr(compiled_mod, "step_passes", with_broken_pass)
    with pytest.raises(flow.FlowgenInternalError, match="after pass retype_first_update: .* does not match"):
        _train_graph()(flow.randn(8, 5), flow.randn(8, 3))


def test_a_weights_transpose_and_its_transpose_back_leave_no_copy_kernel():
    """compose_permutes: the input gradient's GEMM reads a Linear's weight transposed back, so only
    the forward GEMM's transpose is left, which it reads in place: no permute kernel in the step,
    and training equals eager."""
    graph = _train_graph()
    flow.manual_seed(1)
    x, y = flow.randn(8, 5), flow.randn(8, 3)
    losses = [float(graph(x, y)) for _ in range(3)]
    assert not [k.name for k in graph.compiled.program.kernels if k.ops == ["permute"]]
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for want in losses:
        loss = nn.MSELoss()(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(float(loss) - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("inner,outer", [((1, 2, 0), (2, 0, 1)), ((1, 0, 2), (2, 1, 0)), ((0, 2, 1), (0, 2, 1))])
def test_permutes_of_permutes_compose(inner, outer):
    """permute(permute(x, p), q) reads x once, with the composed dims (or is x where they cancel);
    a permute the step returns keeps its own node."""
    class Twice(nn.Graph):
        def build(self, x):
            y = x.permute(*inner)
            return y.permute(*outer) * 2, y

    x = flow.randn(2, 3, 4)
    graph = Twice()
    got, inner_out = graph(x)
    np.testing.assert_array_equal(got.numpy(), x.numpy().transpose(inner).transpose(outer) * 2)
    np.testing.assert_array_equal(inner_out.numpy(), x.numpy().transpose(inner))
    permutes = [n for n in graph.compiled.ir.nodes if n.op == "permute"]
    assert all(producer.op != "permute" for n in permutes
               for producer in [graph.compiled.ir.producers().get(n.inputs[0])] if producer is not None)


def test_cse_renames_the_outputs_and_updates_it_merges():
    """Values computed alike are one node after cse: two returned ones, and the gradients of two
    backward() calls through the same product (the fuzzer's seed 400359), whose sum the optimizer's
    update reads. The step's outputs and state updates name the node kept."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(flow.randn(3))

    class Twice(nn.Graph):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x):
            h = x * self.model.p
            loss, aux = (h * h).mean(), (h * h).mean() * 0.1
            loss.backward(retain_graph=True)
            aux.backward()
            return (x * 2).sum(0), (x * 2).sum(0)

    x = flow.randn(4, 3)
    model = Scale()
    start = model.p.numpy().copy()
    a, b = Twice(model)(x)
    np.testing.assert_allclose(a.numpy(), (x.numpy() * 2).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(b.numpy(), a.numpy())
    grad = 1.1 * 2 * (x.numpy() ** 2 * start).sum(0) / x.numpy().size   # d/dp of 1.1 * mean((x p)^2)
    np.testing.assert_allclose(model.p.numpy(), start - 0.1 * grad, rtol=1e-5)
