"""`flow.one_embedding.Ftrl`, where OneFlow's code imports it (`from oneflow.one_embedding import Ftrl`):
an nn.Graph training with it matches OneFlow's FTRL formula computed in NumPy, and what flowgen's
one_embedding does not have (the embedding tables) is an AttributeError, not a stand-in."""
import numpy as np
import pytest

import flowgen as flow
from flowgen.one_embedding import Ftrl
from graphs import SumLossGraph


class _Scale(flow.nn.Module):
    def __init__(self, init):
        super().__init__()
        self.w = flow.nn.Parameter(flow.tensor(init))

    def forward(self, mask):
        return self.w * mask


def _ftrl_numpy(w, grads, lr, weight_decay, lr_power, acc0, lambda1, lambda2, beta):
    """OneFlow's ftrl_update (its test_graph_optim_ftrl.py reference), one step per gradient."""
    acc, z, out = np.full_like(w, acc0), np.zeros_like(w), []
    for g in grads:
        g = g + weight_decay * w
        new_acc = acc + g * g
        z = z + g - (new_acc ** lr_power - acc ** lr_power) / lr * w
        acc = new_acc
        w = np.where(np.abs(z) < lambda1, 0.0,
                     (np.sign(z) * lambda1 - z) / ((beta + new_acc ** lr_power) / lr + lambda2)).astype(np.float32)
        out.append(w)
    return out


@pytest.mark.parametrize("lr_power", [-0.5, 0.5])
def test_one_embedding_ftrl_trains_a_graph_by_oneflows_formula(lr_power):
    rng = np.random.default_rng(3)
    init = rng.uniform(size=10).astype(np.float32)
    grads = [rng.uniform(size=10).astype(np.float32) for _ in range(4)]
    options = dict(lr=0.5, weight_decay=0.1, lr_power=lr_power, initial_accumulator_value=0.1, lambda1=0.01,
                   lambda2=0.01, beta=1.0)
    model = _Scale(init)
    graph = SumLossGraph(model, Ftrl(model.parameters(), **options))
    got = []
    for g in grads:
        graph(flow.tensor(g))
        got.append(model.w.numpy().copy())
    want = _ftrl_numpy(init, grads, options["lr"], options["weight_decay"], lr_power,
                       options["initial_accumulator_value"], options["lambda1"], options["lambda2"], options["beta"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert flow.one_embedding.Ftrl is flow.optim.FTRL


def test_one_embedding_tables_are_not_stood_in_for():
    with pytest.raises(AttributeError, match="MultiTableEmbedding"):
        flow.one_embedding.MultiTableEmbedding
