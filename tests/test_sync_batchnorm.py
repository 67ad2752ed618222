"""SyncBatchNorm in one process: it is BatchNorm (eager and in a graph), and
`convert_sync_batchnorm` swaps the layers as PyTorch's does. Several ranks: tests/test_distributed.py
(tests/distributed/clip_syncbn_worker.py)."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.ops.registry import apply


def _net(sync: bool, momentum=0.1):
    flow.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                        nn.Sequential(nn.Conv2d(4, 3, 1), nn.BatchNorm2d(3, affine=False)))
    return nn.SyncBatchNorm.convert_sync_batchnorm(net) if sync else net


def _batches(steps=3):
    rng = np.random.default_rng(0)
    return [(flow.tensor(rng.standard_normal((4, 2, 5, 5)).astype(np.float32) * 2 + 1),
             flow.tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))) for _ in range(steps)]


def _train(net, use_graph: bool):
    optimizer = flow.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.MSELoss()

    class Train(nn.Graph):
        def __init__(self):
            super().__init__()
            self.net, self.loss_fn = net, loss_fn
            self.add_optimizer(optimizer)

        def build(self, x, y):
            loss = self.loss_fn(self.net(x), y)
            loss.backward()
            return loss

    graph = Train() if use_graph else None
    losses = []
    for x, y in _batches():
        if graph is not None:
            losses.append(float(graph(x, y)))
            continue
        loss = loss_fn(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    net.eval()
    return losses, net(_batches(1)[0][0]).numpy(), {k: v.numpy().copy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize(("use_graph", "momentum"), [(False, 0.1), (False, None), (True, 0.1)],
                         ids=["eager", "eager_cumulative", "graph"])
def test_sync_batchnorm_in_one_process_is_batchnorm(use_graph, momentum):
    losses, out, state = _train(_net(True, momentum), use_graph)
    ref_losses, ref_out, ref_state = _train(_net(False, momentum), use_graph)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        np.testing.assert_allclose(state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert state["1.num_batches_tracked"] == 3


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_names():
    net = _net(False)
    net[1].eval()
    before = dict(net.named_parameters()), dict(net.named_buffers())
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert [type(m).__name__ for m in converted.modules()] == [
        "Sequential", "Conv2d", "SyncBatchNorm", "ReLU", "Sequential", "Conv2d", "SyncBatchNorm"]
    assert list(dict(converted.named_parameters())) == list(before[0])
    assert list(dict(converted.named_buffers())) == list(before[1])
    assert all(p is before[0][name] for name, p in converted.named_parameters())
    assert all(b is before[1][name] for name, b in converted.named_buffers())
    bn = converted[3][1]
    assert (bn.num_features, bn.affine, bn.weight, bn.momentum, bn.eps) == (3, False, None, 0.1, 1e-5)
    assert not converted[1].training and converted[3][1].training
    assert repr(converted[1]) == "SyncBatchNorm(4, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"
    alone = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(5))
    assert type(alone) is nn.SyncBatchNorm and alone.num_features == 5


def test_convert_sync_batchnorm_state_dict_loads_into_torch():
    torch = pytest.importorskip("torch")
    ours = nn.SyncBatchNorm.convert_sync_batchnorm(_net(False))
    theirs = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Conv2d(4, 3, 1), torch.nn.BatchNorm2d(3, affine=False))))
    theirs.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in ours.state_dict().items()})
    assert list(theirs.state_dict()) == list(ours.state_dict())


def test_sync_batchnorm_refuses_process_groups_and_1d_inputs():
    with pytest.raises(NotImplementedError, match="process_group must be None"):
        nn.SyncBatchNorm(3, process_group=object())
    with pytest.raises(ValueError, match="SyncBatchNorm: expected at least 2D input"):
        nn.SyncBatchNorm(3)(flow.randn(3))


def test_sync_batch_norm_affine_on_one_rank_is_batch_norm_affine():
    """The op SyncBatchNorm uses on several ranks (its backward all-reduces the channel sums; on one
    rank the all_reduce is the identity): value and gradients equal batch_norm_affine's."""
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((3, 2, 4, 4)).astype(np.float32)
    g = rng.standard_normal(x0.shape).astype(np.float32)
    results = []
    for op in ("batch_norm_affine", "sync_batch_norm_affine"):
        x = flow.tensor(x0, requires_grad=True)
        w = flow.tensor(np.array([1.5, -0.5], np.float32).reshape(1, 2, 1, 1), requires_grad=True)
        b = flow.tensor(np.array([0.1, 0.2], np.float32).reshape(1, 2, 1, 1), requires_grad=True)
        mean = x.detach().mean((0, 2, 3), keepdim=True)
        invstd = flow.rsqrt(((x.detach() - mean) ** 2).mean((0, 2, 3), keepdim=True) + 1e-5)
        extra = ((flow.ones(1, 2, 1, 1) * 48.0,), {"world_size": 1}) if op.startswith("sync") else ((), {})
        y = apply(op, x, mean, invstd, w, b, *extra[0], **extra[1])
        (y * flow.tensor(g)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), w.grad.numpy(), b.grad.numpy()])
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
