"""The compile pipeline is one list of passes over the step: each timed, dumped and verified."""
import copy
import re

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
