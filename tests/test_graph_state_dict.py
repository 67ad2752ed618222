"""graph.state_dict() in OneFlow's layout: modules nested by name, optimizer slots as
"<parameter path>-<slot>", "System-Train-TrainStep"; flowgen's extras under "System-..." keys."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from tests.graphs import TrainGraph


def _setup(seed):
    flow.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.2), nn.Tanh(), nn.Linear(6, 1), nn.Flatten(0, 1))
    sgd = flow.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    adam = flow.optim.Adam(model[3].parameters(), lr=0.01, amsgrad=True)
    return TrainGraph(model, nn.MSELoss(), sgd, (adam, flow.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)))


def _batches(n):
    rng = np.random.default_rng(0)
    return [(flow.tensor(rng.standard_normal((8, 3)).astype(np.float32)),
             flow.tensor(rng.standard_normal(8).astype(np.float32))) for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A graph saved after 3 steps, and the losses of 3 more steps without interruption."""
    batches = _batches(6)
    graph = _setup(seed=0)
    for b in batches[:3]:
        graph(*b)
    state = graph.state_dict()
    flat = {f"model.{k}": v for k, v in state["model"].items()}   # what earlier flowgen versions saved
    (sgd, _), (adam, schedule) = graph._optimizers
    flat.update({"_optimizer0": sgd.state_dict(), "_optimizer1": adam.state_dict(),
                 "_lr_scheduler1": schedule.state_dict(), "_step": 3,
                 "_rng_state": state["System-Random-State"]})
    path = tmp_path_factory.mktemp("ckpt")
    flow.save(state, path / "new")
    flow.save(flat, path / "flat")
    arrays = {"0.weight": state["model"]["0.weight"].numpy().copy(), "v": state["model.3.weight-v"].numpy().copy(),
              "m": state["model.3.weight-m"].numpy().copy()}   # state_dict() tensors share memory with the graph
    uninterrupted = [float(graph(*b).numpy()) for b in batches[3:]]
    return {"state": state, "arrays": arrays, "new": path / "new", "flat": path / "flat", "batches": batches,
            "uninterrupted": uninterrupted}


def test_state_dict_uses_oneflows_names(trained):
    state = trained["state"]
    assert sorted(state) == [
        "System-LRScheduler1", "System-Optimizer0", "System-Optimizer1", "System-Random-State",
        "System-Train-SkippedSteps", "System-Train-TrainStep", "loss_fn", "model",
        "model.0.bias-momentum", "model.0.weight-momentum",                       # SGD
        "model.3.bias-m", "model.3.bias-max_v", "model.3.bias-v",                 # Adam
        "model.3.weight-m", "model.3.weight-max_v", "model.3.weight-v"]
    assert sorted(state["model"]) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert state["System-Train-TrainStep"].dtype == flow.int64 and state["System-Train-TrainStep"].numpy()[0] == 3
    assert state["System-Optimizer1"]["param_state"] == {"model.3.weight": {"step": 3}, "model.3.bias": {"step": 3}}
    assert state["System-Optimizer0"]["param_groups"][0]["params"] == ["model.0.weight", "model.0.bias"]


def test_flow_save_and_load_round_trip_the_nested_dict(trained):
    loaded = flow.load(trained["new"])
    assert sorted(loaded) == sorted(trained["state"])
    np.testing.assert_array_equal(loaded["model"]["0.weight"].numpy(), trained["arrays"]["0.weight"])
    np.testing.assert_array_equal(loaded["model.3.weight-v"].numpy(), trained["arrays"]["v"])
    assert loaded["System-Optimizer1"] == trained["state"]["System-Optimizer1"]
    assert loaded["System-LRScheduler1"]["last_epoch"] == trained["state"]["System-LRScheduler1"]["last_epoch"]


@pytest.mark.parametrize("layout", ["new", "flat"])
def test_resume_is_bit_identical_from_either_layout(trained, layout):
    resumed = _setup(seed=123)   # other weights and random position: everything must come from the file
    resumed.load_state_dict(flow.load(trained[layout]))
    assert [float(resumed(*b).numpy()) for b in trained["batches"][3:]] == trained["uninterrupted"]


def test_strict_loading_names_unknown_and_missing_keys(trained):
    state = dict(flow.load(trained["new"]))
    state["model.0.weight-velocity"] = state.pop("model.0.weight-momentum")
    del state["System-Random-State"]
    graph = _setup(seed=1)
    with pytest.raises(RuntimeError, match=r"unexpected key 'model.0.weight-velocity'(.|\n)*"
                                           r"missing key 'System-Random-State'"):
        graph.load_state_dict(state)
    graph.load_state_dict(state, strict=False)   # the rest loads
    np.testing.assert_array_equal(graph.model[0].weight.numpy(), trained["arrays"]["0.weight"])
    with pytest.raises(RuntimeError, match="unexpected key '_optimizer7'"):     # the flat layout too
        graph.load_state_dict({**flow.load(trained["flat"]), "_optimizer7": {}})


def test_a_checkpoint_with_oneflows_keys_only_loads_with_strict_false(trained):
    """OneFlow's own state dict has no System-Optimizer keys: Adam's step count comes from the train step."""
    state = {k: v for k, v in flow.load(trained["new"]).items()
             if not k.startswith("System-") or k == "System-Train-TrainStep"}
    graph = _setup(seed=2)
    graph.load_state_dict(state, strict=False)
    adam = graph._optimizers[1][0]
    assert adam.state[graph.model[3].weight]["step"] == 3
    np.testing.assert_array_equal(adam.state[graph.model[3].weight]["exp_avg"].numpy(),
                                  trained["arrays"]["m"])
    assert graph.state_dict()["System-Train-TrainStep"].numpy()[0] == 3


def test_resume_with_a_dynamic_grad_scaler_restores_its_scale():
    """The GradScaler's scale and growth tracker travel in "System-GradScaler": a resumed run takes
    the steps (and skips) an uninterrupted one takes."""
    def setup():
        flow.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1), nn.Flatten(0, 1))
        graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        graph.set_grad_scaler(flow.amp.GradScaler(init_scale=2.0 ** 125, growth_interval=1))
        return graph

    batches = _batches(10)
    graph = setup()
    for b in batches[:4]:
        graph(*b)
    state = graph.state_dict()
    assert state["System-GradScaler"]["scale"] != 2.0 ** 125        # it grew, overflowed and backed off
    saved = {k: (v.numpy().copy() if isinstance(v, flow.Tensor) else v) for k, v in state.items()}
    uninterrupted = [float(graph(*b).numpy()) for b in batches[4:]]

    resumed = setup()
    resumed.load_state_dict({k: (flow.tensor(v) if isinstance(v, np.ndarray) else v) for k, v in saved.items()})
    assert [float(resumed(*b).numpy()) for b in batches[4:]] == uninterrupted
