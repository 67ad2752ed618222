"""1-d/3-d and transposed convolution, 1-d pooling, BatchNorm3d and InstanceNorm1d/3d against
PyTorch with the same weights (issue 14: torchvision.ops.misc and audio/video models need them),
and a Conv1d/ConvTranspose2d model trained in nn.Graph against eager."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import train_like_eager
from torch_oracle import get_torch

RNG = np.random.default_rng(5)


def _twin(flow_module, torch_module):
    flow_module.load_state_dict({k: flow.tensor(v.detach().numpy()) for k, v in torch_module.state_dict().items()})
    return flow_module, torch_module


def _check(fm, tm, x, atol=1e-4):
    torch = get_torch()
    fx = flow.tensor(x, requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)
    fo, to = fm(fx), tm(tx)
    np.testing.assert_allclose(fo.numpy(), to.detach().numpy(), atol=atol, rtol=1e-4)
    r = RNG.standard_normal(tuple(fo.shape)).astype(np.float32)
    (fo * flow.tensor(r)).sum().backward()
    (to * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(fx.grad.numpy(), tx.grad.numpy(), atol=atol, rtol=1e-4)
    tparams = dict(tm.named_parameters())
    for name, p in fm.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), tparams[name].grad.numpy(), atol=atol, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("kind, args, kwargs, shape", [
    ("Conv1d", (4, 6, 3), dict(stride=2, padding=1, dilation=2), (2, 4, 11)),
    ("Conv1d", (4, 4, 3), dict(groups=2, padding="same", bias=False), (2, 4, 7)),
    ("Conv3d", (3, 4, (2, 3, 3)), dict(stride=(2, 1, 2), padding=(1, 1, 0), dilation=(2, 1, 1)), (2, 3, 6, 5, 6)),
    ("Conv3d", (4, 4, 3), dict(groups=2), (1, 4, 4, 4, 4)),
    ("ConvTranspose2d", (4, 6, 3), dict(stride=2, padding=1, output_padding=1), (2, 4, 5, 4)),
    ("ConvTranspose2d", (4, 2, (2, 3)), dict(groups=2, dilation=(1, 2)), (1, 4, 3, 3)),
    ("ConvTranspose1d", (3, 5, 4), dict(stride=3, padding=2, output_padding=2), (2, 3, 6)),
    ("MaxPool1d", (3,), dict(stride=2, padding=1), (2, 3, 9)),
    ("AvgPool1d", (2,), dict(stride=1, count_include_pad=False, padding=1), (2, 3, 7)),
    ("AdaptiveAvgPool1d", (4,), dict(), (2, 3, 8)),
    ("BatchNorm3d", (3,), dict(), (2, 3, 2, 3, 2)),
    ("InstanceNorm1d", (3,), dict(affine=True), (2, 3, 6)),
    ("InstanceNorm3d", (3,), dict(), (2, 3, 2, 3, 2)),
])
def test_layer_matches_torch(kind, args, kwargs, shape):
    torch = get_torch()
    fm, tm = _twin(getattr(nn, kind)(*args, **kwargs), getattr(torch.nn, kind)(*args, **kwargs))
    assert [n for n, _ in fm.named_parameters()] == [n for n, _ in tm.named_parameters()]
    _check(fm, tm, RNG.standard_normal(shape).astype(np.float32))
    if kind == "BatchNorm3d":   # running statistics follow too
        np.testing.assert_allclose(fm.running_var.numpy(), tm.running_var.numpy(), rtol=1e-5)


def test_unbatched_conv1d_matches_torch():
    torch = get_torch()
    fm, tm = _twin(nn.Conv1d(2, 3, 2), torch.nn.Conv1d(2, 3, 2))
    _check(fm, tm, RNG.standard_normal((2, 5)).astype(np.float32))


def test_conv1d_and_transposed_conv_train_in_a_graph_like_eager():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 4, 3, padding=1)
            self.pool = nn.MaxPool1d(2)
            self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)

        def forward(self, x):
            h = self.pool(flow.relu(self.conv(x)))          # (N, 4, 4)
            return self.up(h.unsqueeze(2)).flatten(1)      # (N, 2, 2, 8) -> (N, 32)

    flow.manual_seed(9)
    x = flow.tensor(RNG.standard_normal((3, 2, 8)).astype(np.float32))
    y = flow.tensor(RNG.standard_normal((3, 32)).astype(np.float32))
    train_like_eager(Net(), lambda ps: flow.optim.SGD(ps, lr=0.1), [(x, y)] * 3, loss_fn=nn.MSELoss())


@pytest.mark.parametrize("kwargs", [dict(kernel_size=2), dict(kernel_size=(2, 3), dilation=(1, 2), padding=1, stride=2)])
def test_unfold_and_fold_match_torch(kwargs):
    torch = get_torch()
    x = RNG.standard_normal((2, 3, 6, 7)).astype(np.float32)
    fu, tu = nn.Unfold(**kwargs), torch.nn.Unfold(**kwargs)
    _check(fu, tu, x)
    cols = tu(torch.from_numpy(x)).detach().numpy()
    _check(nn.Fold((6, 7), **kwargs), torch.nn.Fold((6, 7), **kwargs), cols)
