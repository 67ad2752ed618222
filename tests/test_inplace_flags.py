"""`inplace=True` flags of nn.functional and nn modules: the input is overwritten and returned
(PyTorch/OneFlow), in eager code with autograd and inside nn.Graph.build()."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.nn import functional as F
from graphs import SumLossGraph

X = np.array([[-2.0, -0.5, 0.0, 0.7], [1.5, -3.0, 2.5, 4.0]], np.float32)

ACTIVATIONS = [
    ("relu", lambda x, ip: F.relu(x, inplace=ip)),
    ("relu6", lambda x, ip: F.relu6(x, inplace=ip)),
    ("hardtanh", lambda x, ip: F.hardtanh(x, -1.0, 2.0, inplace=ip)),
    ("leaky_relu", lambda x, ip: F.leaky_relu(x, 0.1, inplace=ip)),
    ("elu", lambda x, ip: F.elu(x, 0.5, inplace=ip)),
    ("silu", lambda x, ip: F.silu(x, inplace=ip)),
    ("hardsigmoid", lambda x, ip: F.hardsigmoid(x, inplace=ip)),
    ("hardswish", lambda x, ip: F.hardswish(x, inplace=ip)),
    ("mish", lambda x, ip: F.mish(x, inplace=ip)),
    ("rrelu", lambda x, ip: F.rrelu(x, inplace=ip)),
    ("dropout_p1", lambda x, ip: F.dropout(x, 1.0, inplace=ip)),
    ("_C.relu", lambda x, ip: flow._C.relu(x, inplace=ip)),
]
MODULES = [nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.LeakyReLU, nn.ELU,
           nn.Hardtanh]


@pytest.mark.parametrize("name,fn", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_functional_inplace_overwrites_and_returns_input(name, fn):
    expected = fn(flow.tensor(X), False).numpy()
    x = flow.tensor(X)
    out = fn(x, True)
    assert out is x
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("cls", MODULES, ids=[m.__name__ for m in MODULES])
def test_module_inplace_overwrites_input(cls):
    expected = cls()(flow.tensor(X)).numpy()
    x = flow.tensor(X)
    assert cls(inplace=True)(x) is x
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)


def test_dropout_inplace_module_and_functional():
    flow.manual_seed(3)
    expected = nn.Dropout(0.5)(flow.ones(4, 8)).numpy()
    flow.manual_seed(3)
    x = flow.ones(4, 8)
    assert nn.Dropout(0.5, inplace=True)(x) is x
    np.testing.assert_array_equal(x.numpy(), expected)
    assert set(np.unique(expected)) <= {0.0, 2.0} and (expected == 0).any()
    flow.manual_seed(3)
    y = flow.ones(4, 8)
    assert F.dropout(y, 0.5, inplace=True) is y
    np.testing.assert_array_equal(y.numpy(), expected)


@pytest.mark.parametrize("name,fn", [a for a in ACTIVATIONS if a[0] != "rrelu"],
                         ids=[a[0] for a in ACTIVATIONS if a[0] != "rrelu"])
def test_inplace_gradient_equals_out_of_place(name, fn):
    w = np.linspace(-1, 1, X.size, dtype=np.float32).reshape(X.shape)
    grads = []
    for inplace in (False, True):
        x = flow.tensor(X, requires_grad=True)
        h = flow.sigmoid(x) * 4.0 - 2.0        # a producer whose gradient reads its output
        y = fn(h, inplace)
        assert (y is h) == inplace
        (y * flow.tensor(w)).sum().backward()
        grads.append(x.grad.numpy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_inplace_on_leaf_requiring_grad_is_refused():
    x = flow.tensor(X, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        F.relu(x, inplace=True)
    with flow.no_grad():
        F.relu(x, inplace=True)
    np.testing.assert_array_equal(x.numpy(), np.maximum(X, 0))


def test_backward_refuses_an_op_whose_input_was_overwritten_later():
    x = flow.tensor(X, requires_grad=True)
    h = x * 2.0
    earlier = h * h                            # reads h before it is overwritten
    F.relu(h, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        (earlier + h).sum().backward()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        self.act(h)                            # result ignored: h itself is overwritten
        return F.leaky_relu(h, 0.2, inplace=True) * 1.0


def test_inplace_in_graph_equals_eager_with_training():
    flow.manual_seed(0)
    eager_net, graph_net = _Net(), _Net()
    graph_net.load_state_dict(eager_net.state_dict())
    eager_opt = flow.optim.SGD(eager_net.parameters(), lr=0.1)
    graph_opt = flow.optim.SGD(graph_net.parameters(), lr=0.1)

    train = SumLossGraph(graph_net, graph_opt)
    for _ in range(3):
        loss = eager_net(flow.tensor(X)).sum()
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        np.testing.assert_allclose(train(flow.tensor(X)).numpy(), loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(graph_net.fc.weight.numpy(), eager_net.fc.weight.numpy(), rtol=1e-5, atol=1e-6)


def test_inplace_on_graph_input_in_build():
    class G(nn.Graph):
        def build(self, x):
            y = x * 1.0
            F.relu(y, inplace=True)
            F.dropout(y, 0.3, training=False, inplace=True)
            F.hardtanh(y, 0.0, 1.0, inplace=True)
            return y

    y = G()(flow.tensor(X))
    np.testing.assert_allclose(y.numpy(), np.clip(X, 0, 1))
