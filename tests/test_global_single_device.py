"""Global tensors and modules on one device (world size 1), as OneFlow's single-device graph tests
use them: `Module.to_global`, global parameters in a compiled graph, NumPy ranks, `flow.sbp.broadcast()`."""
from __future__ import annotations

import numpy as np
import pytest

import flowgen as flow


class Scale(flow.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = flow.nn.Parameter(flow.tensor(5.0))

    def forward(self, x):
        return x * self.weight + 1.0


class TrainStep(flow.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.m = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x):
        loss = self.m(x)
        loss.backward()
        return loss


def test_sbp_called_is_the_sbp_itself():
    assert flow.sbp.broadcast() == flow.sbp.broadcast
    assert flow.sbp.partial_sum() == flow.sbp.partial_sum
    assert flow.sbp.split(1)() == flow.sbp.split(1)


def test_placement_takes_numpy_ranks():
    p = flow.placement("cpu", np.array(range(flow.env.get_world_size())))
    assert p.ranks == [0] and all(type(r) is int for r in p.ranks)
    assert flow.placement("cpu", [np.int64(0)]) == flow.placement("cpu", [0])
    assert flow.placement("cuda", 0).ranks == [0]
    with pytest.raises(ValueError, match="hierarch"):
        flow.placement("cpu", np.array([[0]]))


def test_module_to_global_makes_new_global_parameters_and_buffers():
    bn = flow.nn.BatchNorm1d(3)
    old_weight = bn.weight
    placement = flow.placement("cpu", ranks=[0])
    assert bn.to_global(placement, flow.sbp.broadcast) is bn
    assert bn.weight is not old_weight and isinstance(bn.weight, flow.nn.Parameter)
    assert bn.weight.is_global and bn.weight.requires_grad and bn.weight.placement == placement
    assert bn.running_mean.is_global and bn.running_mean.sbp == (flow.sbp.broadcast,)
    np.testing.assert_array_equal(bn.weight.numpy(), np.ones(3, np.float32))
    bn.to_local()
    assert bn.weight.is_local and bn.running_var.is_local
    np.testing.assert_array_equal(bn.running_var.numpy(), np.ones(3, np.float32))


def test_module_to_global_keeps_shared_parameters_shared():
    a, b = flow.nn.Linear(2, 2), flow.nn.Linear(2, 2)
    b.weight = a.weight
    model = flow.nn.Sequential(a, b).to_global(flow.placement("cpu", [0]), flow.sbp.broadcast)
    assert model[0].weight is model[1].weight


def test_to_global_puts_the_component_on_the_placements_device():
    x = flow.tensor([1.0, 2.0]).to_global(flow.placement("cuda", [0]), flow.sbp.broadcast)
    assert x.to_local().device.type == "cuda"


def test_graph_trains_global_parameters_like_eager_local_ones():
    eager = Scale()
    sgd = flow.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for i in range(3):
        loss = eager(flow.tensor(i * 1.0))
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        expected.append(loss.numpy())

    placement = flow.placement("cpu", ranks=[0])
    model = Scale().to_global(placement=placement, sbp=flow.sbp.broadcast)
    step = TrainStep(model)
    for i in range(3):
        out = step(flow.tensor(i * 1.0).to_global(placement=placement, sbp=flow.sbp.broadcast))
        assert out.is_global
        np.testing.assert_allclose(out.to_local().numpy(), expected[i], rtol=1e-6)
    # the trained value is read back through the global parameter
    np.testing.assert_allclose(model.weight.numpy(), eager.weight.numpy(), rtol=1e-6)


def test_graph_runs_a_global_batchnorm_on_a_split_batch():
    bn = flow.nn.BatchNorm1d(6).eval()
    bn.running_mean.copy_(flow.tensor(np.arange(6, dtype=np.float32)))
    x = flow.randn(1, 6, 2)
    expected = bn(x).numpy()
    bn.to_global(flow.placement.all("cpu"), flow.sbp.broadcast)

    class Eval(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.bn = bn

        def build(self, x):
            return self.bn(x)

    y = Eval()(x.to_global(placement=flow.placement.all("cpu"), sbp=flow.sbp.split(0)))
    assert y.size() == (1, 6, 2)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_graph_refuses_split_global_parameters():
    model = Scale()
    model.weight = flow.nn.Parameter(flow.tensor([5.0]))
    model.to_global(flow.placement("cpu", [0]), flow.sbp.split(0))
    with pytest.raises(NotImplementedError, match="broadcast only"):
        TrainStep(model)(flow.tensor([1.0]))


# ---------------------------------------------------------------- eager ops on global tensors

PLACEMENT = flow.placement("cpu", [0])


def _global(arr, sbp, requires_grad=False):
    t = flow.tensor(arr).to_global(PLACEMENT, sbp)
    return t.requires_grad_() if requires_grad else t


def test_eager_ops_on_broadcast_tensors_give_broadcast_results():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    ga, gb = _global(a, flow.sbp.broadcast), _global(b, flow.sbp.broadcast)
    out = flow.nn.functional.gelu(flow.matmul(ga, gb) * 2.0 + 1.0).mean()
    local = flow.nn.functional.gelu(flow.matmul(flow.tensor(a), flow.tensor(b)) * 2.0 + 1.0).mean()
    assert out.is_global and out.sbp == (flow.sbp.broadcast,)
    np.testing.assert_allclose(out.numpy(), local.numpy(), rtol=1e-6)
    copy = ga.clone()
    assert copy.sbp == (flow.sbp.broadcast,) and np.array_equal(copy.to_local().numpy(), a)


def test_eager_sbp_deduction_of_split_and_partial_sum_results():
    rng = np.random.default_rng(1)
    x, w, bias = (rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3, 5), (3,)))
    xs, wb = _global(x, flow.sbp.split(0)), _global(w, flow.sbp.broadcast)
    assert (xs + _global(bias, flow.sbp.broadcast)).sbp == (flow.sbp.split(0),)
    assert flow.matmul(xs, wb).sbp == (flow.sbp.split(0),)
    assert xs.sum(dim=1).sbp == (flow.sbp.split(0),)
    total = xs.sum()
    assert total.sbp == (flow.sbp.partial_sum,)
    np.testing.assert_allclose(total.numpy(), x.sum(), rtol=1e-6)
    assert (total * 3.0).sbp == (flow.sbp.partial_sum,)           # linear in the partial_sum operand
    assert flow.exp(total).sbp == (flow.sbp.broadcast,)           # not linear: summed first
    np.testing.assert_allclose(flow.exp(total).numpy(), np.exp(x.sum()), rtol=1e-5)
    xk, wk = _global(x, flow.sbp.split(1)), _global(w, flow.sbp.split(0))
    product = flow.matmul(xk, wk)                                 # split along k: partial sums
    assert product.sbp == (flow.sbp.partial_sum,)
    np.testing.assert_allclose(product.numpy(), x @ w, rtol=1e-5)


def test_eager_ops_refuse_what_they_cannot_lay_out():
    xs = _global(np.ones((4, 3), np.float32), flow.sbp.split(0))
    with pytest.raises(NotImplementedError, match=r"reshape.*split\(dim=0\)"):
        xs.reshape(12)
    with pytest.raises(RuntimeError, match="global and local tensors are mixed"):
        xs + flow.ones(4, 3)


def test_eager_autograd_delivers_global_grads_in_the_parameters_sbp():
    """OneFlow's eager data parallelism on one rank: a split batch, a broadcast parameter; the
    parameter's gradient (a partial_sum over the batch) arrives all-reduced as broadcast."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    local_w = flow.nn.Parameter(flow.tensor(w))
    local_x = flow.tensor(x).requires_grad_()
    (flow.matmul(local_x, local_w.transpose(0, 1)) + local_w.sum()).sum().backward()

    global_w = flow.nn.Parameter(_global(w, flow.sbp.broadcast))
    global_x = _global(x, flow.sbp.split(0), requires_grad=True)
    (flow.matmul(global_x, global_w.transpose(0, 1)) + global_w.sum()).sum().backward()
    assert global_w.grad.is_global and global_w.grad.sbp == (flow.sbp.broadcast,)
    assert global_x.grad.sbp == (flow.sbp.split(0),)
    np.testing.assert_allclose(global_w.grad.numpy(), local_w.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(global_x.grad.numpy(), local_x.grad.numpy(), rtol=1e-5)

    opt = flow.optim.SGD([global_w], lr=0.1)
    opt.step()
    flow.optim.SGD([local_w], lr=0.1).step()
    assert global_w.sbp == (flow.sbp.broadcast,)
    np.testing.assert_allclose(global_w.numpy(), local_w.numpy(), rtol=1e-6)
