"""Inside nn.Graph.build(), a module's forward runs on its Proxy, as in OneFlow: `self.layer` seen from
within a forward is the submodule's `flow.nn.graph.Proxy` (by attribute, index, key, or through a
Sequential), the module's own methods run on the proxy too, and `self.to(nn.graph.GraphModule)`
names the module in the graph. The numbers are the eager module's."""
from __future__ import annotations

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
import flowgen.nn.functional as F
from flowgen.nn.graph import GraphModule, Proxy


class Block(nn.Module):
    """Records what its forward sees of itself and its children (while the graph traces)."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen
        self.linear = nn.Linear(4, 4)
        self.shortcut = nn.Identity()
        self._path = "a user attribute named like the proxy's old internals"

    def forward(self, x):
        return self._forward_impl(x)

    def _forward_impl(self, x):   # a method of the module's class: runs on the proxy as forward does
        if self.seen is not None:
            graph_module = self.to(GraphModule) if isinstance(self, Proxy) else None
            self.seen.append({
                "self is proxy": isinstance(self, Proxy), "self is Block": isinstance(self, Block),
                "linear is proxy": isinstance(self.linear, Proxy), "linear is Linear": isinstance(self.linear, nn.Linear),
                "same proxy": self.linear is self.linear,
                "name": graph_module and graph_module.name_prefix + graph_module.name,
                "user _path": self._path})
        h = self.linear(x)
        if self.shortcut:   # a module without len() is true, proxy or not
            h = h + self.shortcut(x)
        return F.relu(h)


class Net(nn.Module):
    def __init__(self, seen=None):
        super().__init__()
        self.first = Block(seen)
        self.stack = nn.Sequential(Block(seen), Block(seen))
        self.blocks = nn.ModuleList([Block(seen)])
        self.named = nn.ModuleDict({"last": Block(seen)})
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.stack(self.first(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.named["last"](x))


class TrainNet(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def test_forward_sees_its_submodules_as_proxies_and_trains_like_eager():
    flow.manual_seed(0)
    seen = []
    model, eager = Net(seen), Net()
    eager.load_state_dict(model.state_dict())
    graph = TrainNet(model)
    opt = flow.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    x = flow.tensor(rng.standard_normal((3, 4)).astype(np.float32))
    y = flow.tensor(rng.standard_normal((3, 2)).astype(np.float32))
    for _ in range(3):
        got = float(graph(x, y).numpy())
        loss = F.mse_loss(eager(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        np.testing.assert_allclose(got, float(loss.numpy()), rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)

    # traced once: every block, reached by attribute, through a Sequential, a ModuleList and a ModuleDict
    assert [s["name"] for s in seen] == ["model.first", "model.stack.0", "model.stack.1", "model.blocks.0",
                                         "model.named.last"]
    for s in seen:
        assert s["self is proxy"] and s["self is Block"] and s["linear is proxy"] and s["linear is Linear"]
        assert s["same proxy"] and s["user _path"] == "a user attribute named like the proxy's old internals"


def test_eager_forward_sees_the_modules_themselves():
    seen = []
    Net(seen)(flow.randn(2, 4))
    assert seen and not any(s["self is proxy"] or s["linear is proxy"] for s in seen)


class Pools(nn.Module):
    """flowgen's layers run on their proxies too (pooling and padding read class attributes)."""

    def __init__(self):
        super().__init__()
        self.pad = nn.ZeroPad2d(1)
        self.pool = nn.MaxPool2d(2)
        self.adaptive = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.InstanceNorm2d(2)

    def forward(self, x):
        return self.adaptive(self.pool(self.norm(self.pad(x))))


class Infer(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def test_builtin_layers_in_a_graph_equal_eager_and_name_themselves_in_errors():
    model = Pools()
    x = flow.tensor(np.random.default_rng(1).standard_normal((2, 2, 6, 6)).astype(np.float32))
    np.testing.assert_allclose(Infer(model)(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"^ZeroPad2d: expected a 3-D or 4-D input"):
        Infer(nn.ZeroPad2d(1))(flow.ones(4, 4))


def test_forward_hooks_see_the_module_itself():
    model = nn.Linear(3, 3)
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(module) or out * 2.0)
    x = flow.randn(2, 3)
    np.testing.assert_allclose(Infer(model)(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert calls and all(m is model for m in calls)
