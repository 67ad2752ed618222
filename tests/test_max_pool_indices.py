"""max_pool1d/2d(return_indices=True) and nn.MaxPool1d/2d(return_indices=True): PyTorch's int64
flat indices into each (n, c) plane, in eager code and in graphs; gradients flow through the values."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.nn import functional as F

CASES_2D = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1)),
    dict(kernel_size=3, stride=2, ceil_mode=True),
]


def _input(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[5] = x.reshape(-1)[6]      # a tie: the first maximum is taken
    return x


def _expected_indices_2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    torch = pytest.importorskip("torch")
    _, idx = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel_size, stride, padding, dilation,
                                            ceil_mode, return_indices=True)
    return idx.numpy()


@pytest.mark.parametrize("kw", CASES_2D)
def test_max_pool2d_indices_match_pytorch(kw):
    x = _input((2, 3, 7, 8))
    values, indices = F.max_pool2d(flow.tensor(x), return_indices=True, **kw)
    assert indices.dtype == flow.int64
    np.testing.assert_array_equal(values.numpy(), F.max_pool2d(flow.tensor(x), **kw).numpy())
    np.testing.assert_array_equal(indices.numpy(), _expected_indices_2d(x, **kw))
    # each index points at its maximum
    flat = x.reshape(2, 3, -1)
    gathered = np.take_along_axis(flat, indices.numpy().reshape(2, 3, -1), axis=2).reshape(values.shape)
    np.testing.assert_array_equal(gathered, values.numpy())


def test_max_pool_indices_unbatched_and_1d():
    x = _input((3, 6, 6))
    values, indices = nn.MaxPool2d(2, return_indices=True)(flow.tensor(x))
    assert tuple(indices.shape) == (3, 3, 3)
    np.testing.assert_array_equal(indices.numpy(), _expected_indices_2d(x[None], 2)[0])
    seq = np.array([[[1.0, 3.0, 2.0, 5.0, 5.0, 0.0, -1.0]]], np.float32)
    values, indices = nn.MaxPool1d(2, stride=2, padding=1, return_indices=True)(flow.tensor(seq))
    np.testing.assert_array_equal(values.numpy(), [[[1.0, 3.0, 5.0, 0.0]]])
    np.testing.assert_array_equal(indices.numpy(), [[[0, 1, 3, 5]]])
    values, indices = F.max_pool1d(flow.tensor(seq[0]), 3, return_indices=True)
    np.testing.assert_array_equal(indices.numpy(), [[1, 3]])


def test_gradient_flows_through_values():
    x = _input((1, 2, 4, 4))
    grads = []
    for return_indices in (False, True):
        t = flow.tensor(x, requires_grad=True)
        out = F.max_pool2d(t, 2, return_indices=return_indices)
        values = out[0] if return_indices else out
        (values * 2.0).sum().backward()
        grads.append(t.grad.numpy())
    np.testing.assert_array_equal(grads[1], grads[0])


@pytest.mark.parametrize("kw", CASES_2D)
def test_graph_equals_eager(kw):
    x = _input((2, 3, 7, 8), seed=1)

    class Pool(nn.Graph):
        def build(self, x):
            values, indices = F.max_pool2d(x, return_indices=True, **kw)
            return values, indices, F.max_pool1d(x.flatten(2), 3, return_indices=True)[1]

    values, indices, indices_1d = Pool()(flow.tensor(x))
    ev, ei = F.max_pool2d(flow.tensor(x), return_indices=True, **kw)
    assert indices.dtype == flow.int64
    np.testing.assert_array_equal(values.numpy(), ev.numpy())
    np.testing.assert_array_equal(indices.numpy(), ei.numpy())
    np.testing.assert_array_equal(indices_1d.numpy(),
                                  F.max_pool1d(flow.tensor(x).flatten(2), 3, return_indices=True)[1].numpy())
