"""The memory planner shares an output's buffer with a dying input only where the op declares that
pair safe (`Template(in_place=...)` on the op, `Kernel.in_place` on its kernel), and an internal
check that fails while compiling reaches the user as a FlowgenInternalError naming the graph.

Each case is a shape that makes an undeclared pair the same size, so only the declaration keeps
them apart: one class (the logits' gradient [N, 1] beside the incoming gradient [N]), an int32
label beside float32 losses, a LayerNorm whose per-call weight has as many elements as the
mean it writes. Before the declarations, the first two stopped compiling with a bare
AssertionError and the third gave wrong numbers (5.5 off).
"""
from __future__ import annotations

import numpy as np
import pytest

import flowgen as flow
import flowgen.codegen.program as program_mod
import flowgen.nn as nn
import flowgen.nn.functional as F
from torch_oracle import get_torch


def _ce_model():
    """A one-logit head: cross_entropy over one class is 0 with gradient 0, so a penalty on the
    weight makes the step move it (and leaves the logits to the cross-entropy alone)."""
    flow.manual_seed(0)
    return nn.Linear(4, 1)


def _one_class_loss(model, x, target):
    return F.cross_entropy(model(x), target) + 0.05 * (model.weight * model.weight).sum()


class _OneClassStep(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, target):
        loss = _one_class_loss(self.model, x, target)
        loss.backward()
        return loss


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    target = np.array([0, 0, -100, 0, 0, -100])   # ignored rows too: still one class
    return x, target


def _torch_one_class(weight, bias, x, target, steps):
    torch = get_torch()
    lin = torch.nn.Linear(4, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(weight))
        lin.bias.copy_(torch.from_numpy(bias))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(lin(torch.from_numpy(x)), torch.from_numpy(target)) \
            + 0.05 * (lin.weight * lin.weight).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, lin.weight.detach().numpy(), lin.bias.detach().numpy()


def test_one_class_cross_entropy_training_graph_equals_eager_and_torch():
    model = _ce_model()
    eager = _ce_model()
    w0, b0 = model.weight.numpy().copy(), model.bias.numpy().copy()
    graph = _OneClassStep(model)
    opt = flow.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    x, target = _data()
    graph_losses, eager_losses = [], []
    for _ in range(3):
        graph_losses.append(float(graph(flow.tensor(x), flow.tensor(target)).numpy()))
        loss = _one_class_loss(eager, flow.tensor(x), flow.tensor(target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        eager_losses.append(float(loss.numpy()))
    torch_losses, torch_w, torch_b = _torch_one_class(w0, b0, x, target, 3)
    np.testing.assert_allclose(graph_losses, eager_losses, rtol=1e-6)
    np.testing.assert_allclose(graph_losses, torch_losses, rtol=1e-5)
    np.testing.assert_allclose(model.weight.numpy(), eager.weight.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model.weight.numpy(), torch_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bias.numpy(), torch_b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(model.weight.numpy(), w0)   # the step moved the weights

    # The declared pair still takes effect: the logits' gradient is written over the logits (the
    # incoming gradient, [6] like it, dies here too but is not declared).
    program = graph.compiled.program
    (ce_grad,) = [k for k in program.kernels if k.ops == ["cross_entropy_rows_grad"]]
    g, logits, _ = [a.value for a in ce_grad.args if a.ctype.startswith("const")]
    (dx,) = [a.value for a in ce_grad.args if not a.ctype.startswith("const")]
    assert program.plan.inplace.get(dx) is logits
    assert program.plan.offsets.get(dx) != program.plan.offsets.get(g)


class _Classify(nn.Graph):
    """Labels computed inside the graph as int32: the [N] labels have the [N] float32 losses' size."""

    def build(self, x):
        labels = (x.sum(1) > 0).to(flow.int32)
        return F.cross_entropy(x * 2.0, labels, reduction="none")


def test_cross_entropy_with_int32_labels_computed_in_the_graph_equals_eager_and_torch():
    torch = get_torch()
    x = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    got = _Classify()(flow.tensor(x)).numpy()
    labels = (x.sum(1) > 0).astype(np.int32)
    eager = F.cross_entropy(flow.tensor(x) * 2.0, flow.tensor(labels), reduction="none").numpy()
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(x) * 2.0, torch.from_numpy(labels).long(),
                                                 reduction="none").numpy()
    np.testing.assert_allclose(got, eager, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class _NormWithPerCallAffine(nn.Graph):
    """layer_norm over rows of 8 with weight and bias computed from the batch of 8 rows: mean and
    rstd ([8]) have the weight's and bias's size, and every row's thread reads all of weight and
    bias. The old planner placed mean over weight and rstd over bias."""

    def build(self, x):
        weight = x.mean(0) + 1.0
        bias = x.amax(0)
        return F.layer_norm(x, (8,), weight=weight, bias=bias) * 2.0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_layer_norm_with_per_call_weight_and_bias_equals_eager_and_torch(device, monkeypatch):
    """cpu: a thread per row; cuda (on the emulator without a GPU): a block per row."""
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    torch = get_torch()
    x = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
    got = _NormWithPerCallAffine()(flow.tensor(x).to(device)).numpy()
    fx = flow.tensor(x)
    eager = (F.layer_norm(fx, (8,), weight=fx.mean(0) + 1.0, bias=fx.amax(0)) * 2.0).numpy()
    tx = torch.from_numpy(x)
    expected = (torch.nn.functional.layer_norm(tx, (8,), weight=tx.mean(0) + 1.0, bias=tx.amax(0)) * 2.0).numpy()
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


class _OneElementRows(nn.Module):
    """Row kernels over rows of one element (softmax, log_softmax, LayerNorm over a size-1 dim):
    every output of each has its input's size, the shape that lets the planner reuse memory."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 1)
        self.norm = nn.LayerNorm(1)

    def forward(self, x):
        h = self.head(x)
        return (F.softmax(h * 3.0, 1) * h).sum() + (F.log_softmax(h * 0.5, 1) + h * h).sum() \
            + (self.norm(h + 1.0) * h).sum()


class _Train(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.05))

    def build(self, x):
        loss = self.model(x)
        loss.backward()
        return loss


def test_row_kernels_over_one_element_rows_train_like_eager():
    flow.manual_seed(1)
    model, eager = _OneElementRows(), _OneElementRows()
    eager.load_state_dict(model.state_dict())
    graph = _Train(model)
    opt = flow.optim.SGD(eager.parameters(), lr=0.05)
    x = flow.tensor(np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32))
    for _ in range(3):
        got = float(graph(x).numpy())
        loss = eager(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        np.testing.assert_allclose(got, float(loss.numpy()), rtol=1e-5)
    for p, q in zip(model.parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)
    program = graph.compiled.program
    written_in_place = {op for k in program.kernels for a in k.args if not a.ctype.startswith("const")
                        and getattr(a, "value", None) in program.plan.inplace for op in k.ops}
    assert {"softmax", "log_softmax"} <= written_in_place   # the shape does make the planner reuse


# ----------------------------------------------------------------------------------------------
# An internal check that fails is a flowgen bug, reported as one.

def _every_pair(kernel):
    """A broken planner input: every output of every kernel may take over every input."""
    outputs = [a.value for a in kernel.args if getattr(a, "value", None) is not None
               and not a.ctype.startswith("const")]
    inputs = [a.value for a in kernel.args if getattr(a, "value", None) is not None and a.ctype.startswith("const")]
    return frozenset((o, i) for o in outputs for i in inputs)


def test_a_broken_internal_invariant_is_reported_as_a_flowgen_bug_naming_the_graph(monkeypatch):
    monkeypatch.setattr(program_mod, "_planner_in_place", _every_pair)
    graph = _OneClassStep(_ce_model())
    x, target = _data()
    with pytest.raises(flow.FlowgenInternalError) as info:
        graph(flow.tensor(x), flow.tensor(target))
    error = info.value
    assert not isinstance(error, AssertionError)
    assert isinstance(error.__cause__, AssertionError)
    message = str(error)
    assert message.startswith(f"flowgen bug while compiling graph '{graph.name}' (codegen): ")
    assert "cross_entropy_rows_grad" in message and "would overwrite the memory of" in message
    assert "flowgen/codegen/program.py" in message and "declare_shared_memory" in message
    assert "not an error in your program: please report it" in message
    assert error.graph_name == graph.name


def test_the_users_own_assertion_in_build_stays_theirs():
    class Checked(nn.Graph):
        def build(self, x):
            assert x.shape[0] == 3, "a batch of 3 expected"
            return x * 2.0

    with pytest.raises(AssertionError, match="a batch of 3 expected") as info:
        Checked()(flow.ones(4, 2))
    assert not isinstance(info.value, flow.FlowgenInternalError)
