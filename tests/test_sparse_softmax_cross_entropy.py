"""OneFlow's sparse_softmax_cross_entropy: `nn.functional.sparse_softmax_cross_entropy(labels, logits)`
and `flow._C.sparse_softmax_cross_entropy(logits, labels)`, classes along the last dim, no reduction,
every label a class (none ignored): against PyTorch's cross_entropy, eagerly and in a training graph."""
from __future__ import annotations

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
import flowgen.nn.functional as F
from torch_oracle import get_torch

torch = get_torch()


def _torch_loss(logits, labels):
    """PyTorch's cross_entropy with the classes moved to dim 1 (its layout), per element."""
    t = torch.from_numpy(logits)
    return torch.nn.functional.cross_entropy(t.reshape(-1, t.shape[-1]), torch.from_numpy(labels).long().reshape(-1),
                                             reduction="none").reshape(labels.shape)


def test_oneflow_docstring_example_both_argument_orders():
    logits = np.array([[2.0, -5.0, 0.5, -0.1], [0.0, 0.0, 1.9, 1.4], [-100.0, 100.0, -100.0, -100.0]], np.float32)
    labels = np.array([0, 3, 1], np.int32)
    out = F.sparse_softmax_cross_entropy(labels=flow.tensor(labels), logits=flow.tensor(logits))
    assert out.dtype == flow.float32 and tuple(out.shape) == (3,)
    np.testing.assert_allclose(out.numpy(), [2.9751e-01, 1.1448e+00, 0.0], rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(out.numpy(), _torch_loss(logits, labels).numpy(), rtol=1e-6, atol=1e-7)
    functional = flow._C.sparse_softmax_cross_entropy(flow.tensor(logits), flow.tensor(labels.astype(np.int64)))
    np.testing.assert_array_equal(functional.numpy(), out.numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classes_along_the_last_dim_values_and_gradients_equal_torch(dtype):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 5)).astype(dtype)
    labels = rng.integers(0, 5, (2, 3))
    upstream = rng.standard_normal((2, 3)).astype(dtype)
    x = flow.tensor(logits, requires_grad=True)
    out = F.sparse_softmax_cross_entropy(flow.tensor(labels), x)
    (out * flow.tensor(upstream)).sum().backward()
    tx = torch.from_numpy(logits).requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(tx.reshape(-1, 5), torch.from_numpy(labels).reshape(-1),
                                                 reduction="none").reshape(2, 3)
    (expected * torch.from_numpy(upstream)).sum().backward()
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-14)
    assert out.dtype == (flow.float32 if dtype == np.float32 else flow.float64)
    np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), **tol)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), **tol)


class CrossEntropyModule(nn.Module):
    """OneFlow's graph test: a zero parameter added to the logits, so after one SGD step of lr 1 the
    parameter is minus the logits' gradient."""

    def __init__(self, shape):
        super().__init__()
        self.param = nn.Parameter(flow.zeros(*shape))

    def forward(self, logits, labels):
        return flow._C.sparse_softmax_cross_entropy(logits + self.param, labels).mean()


class CrossEntropyGraph(nn.Graph):
    def __init__(self, module):
        super().__init__()
        self.m = module
        self.add_optimizer(flow.optim.SGD([module.param], lr=1.0))

    def build(self, logits, labels):
        loss = self.m(logits, labels)
        loss.backward()
        return loss


def test_training_graph_equals_eager_and_torch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 2, 6)).astype(np.float32)
    labels = rng.integers(0, 6, (4, 2)).astype(np.int32)
    module = CrossEntropyModule(logits.shape)
    loss = CrossEntropyGraph(module)(flow.tensor(logits), flow.tensor(labels))

    x = flow.tensor(logits, requires_grad=True)
    eager = F.sparse_softmax_cross_entropy(flow.tensor(labels), x).mean()
    eager.backward()
    tx = torch.from_numpy(logits).requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(tx.reshape(-1, 6), torch.from_numpy(labels).long().reshape(-1))
    expected.backward()
    np.testing.assert_allclose(float(loss.numpy()), float(eager.numpy()), rtol=1e-6)
    np.testing.assert_allclose(float(loss.numpy()), expected.item(), rtol=1e-6)
    np.testing.assert_allclose(-module.param.numpy(), x.grad.numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(-module.param.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-7)


class Loss(nn.Graph):
    def build(self, logits, labels):
        return F.sparse_softmax_cross_entropy(labels, logits)


@pytest.mark.parametrize("bad", [-100, -1, 4])
def test_a_label_outside_the_classes_is_refused_eagerly_and_in_a_graph(bad):
    """No label is ignored (cross_entropy's -100 is a class index error here)."""
    logits = flow.randn(3, 4)
    labels = flow.tensor(np.array([0, bad, 1]))
    with pytest.raises(IndexError, match=rf"sparse_softmax_cross_entropy: label {bad} is out of range \[0, 4\)"):
        F.sparse_softmax_cross_entropy(labels, logits)
    with pytest.raises(IndexError, match=rf"{bad}.* out of range \[0, 4\)"):
        Loss()(logits, labels)


def test_shapes_and_dtypes_are_checked():
    with pytest.raises(ValueError, match="labels of their shape without the last"):
        F.sparse_softmax_cross_entropy(flow.tensor([0, 1]), flow.randn(3, 4))
    with pytest.raises(ValueError, match="labels of their shape without the last"):
        F.sparse_softmax_cross_entropy(flow.tensor(1), flow.randn(4))
    with pytest.raises(TypeError, match="int32 or int64 labels"):
        F.sparse_softmax_cross_entropy(flow.randn(3), flow.randn(3, 4))
