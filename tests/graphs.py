"""The two graphs most tests and benchmarks need (run a model, or train it one step), and the
graph-vs-eager training check built on them."""
import copy

import numpy as np

import flowgen.nn as nn


class InferGraph(nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


class FirstOutput(nn.Module):
    """`model`'s first output where it returns several (a GPT's logits beside its loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out[0] if isinstance(out, tuple) else out


class SumLossGraph(nn.Graph):
    """A training step on model(x).sum(), the smallest loss that trains every parameter."""

    def __init__(self, model, *optimizers):
        super().__init__()
        self.model = model
        for opt in optimizers:
            self.add_optimizer(opt)

    def build(self, x):
        loss = self.model(x).sum()
        loss.backward()
        return loss


class MeanSquareGraph(SumLossGraph):
    """A training step on mean(model(x) ** 2), returning (loss, model(x))."""

    def build(self, x):
        out = self.model(x)
        loss = (out * out).mean()
        loss.backward()
        return loss, out


class TrainGraph(nn.Graph):
    def __init__(self, model, loss_fn, *optimizers):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        for opt in optimizers:   # an optimizer, or (optimizer, lr scheduler)
            if isinstance(opt, tuple):
                self.add_optimizer(opt[0], lr_sch=opt[1])
            else:
                self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def train_like_eager(model, make_opt, batches, loss_fn=None, make_sch=None, loss_rtol=1e-5, loss_atol=0.0):
    """Graph training steps on `batches` ((x, y) pairs) beside the same steps in eager (a deep copy
    of `model`, with its own optimizer and, from `make_sch`, LR scheduler): equal losses each step
    and equal parameters and buffers after; returns (graph, graph optimizer, eager optimizer)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    eager = copy.deepcopy(model)
    opt_g, opt_e = make_opt(model.parameters()), make_opt(eager.parameters())
    sch_e = make_sch(opt_e) if make_sch else None
    graph = TrainGraph(model, loss_fn, (opt_g, make_sch(opt_g)) if make_sch else opt_g)
    for x, y in batches:
        got = graph(x, y)
        loss = loss_fn(eager(x), y)
        opt_e.zero_grad()
        loss.backward()
        opt_e.step()
        if sch_e:
            sch_e.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=loss_rtol, atol=loss_atol)
    for name, value in eager.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    return graph, opt_g, opt_e
