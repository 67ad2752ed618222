"""scaled_dot_product_attention without a mask or dropout is one `attention` op (issue 11): its
forward and backward against PyTorch, graph against eager (inference and training), and the
compiled forward's buffers, none of which holds the [L, S] scores."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import InferGraph, train_like_eager
from torch_oracle import get_torch

RNG = np.random.default_rng(23)
SHAPES = [  # (query, key, value): L != S both ways, odd sizes, value width != key width, no batch dims
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)),
    ((1, 2, 9, 5), (1, 2, 4, 5), (1, 2, 4, 3)),
    ((3, 6, 4), (3, 6, 4), (3, 6, 4)),
    ((7, 3), (11, 3), (11, 5)),
]


def _arrays(*shapes):
    return [RNG.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + "_S" + str(s[1][-2]))
def test_attention_matches_torch_forward_and_backward(shapes, causal):
    torch = get_torch()
    q, k, v = _arrays(*shapes)
    g = RNG.standard_normal(shapes[0][:-1] + shapes[2][-1:]).astype(np.float32)
    fq, fk, fv = (flow.tensor(a, requires_grad=True) for a in (q, k, v))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    f_out = nn.functional.scaled_dot_product_attention(fq, fk, fv, is_causal=causal, scale=0.4)
    t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=0.4)
    np.testing.assert_allclose(f_out.numpy(), t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    (f_out * flow.tensor(g)).sum().backward()
    t_out.backward(torch.from_numpy(g))
    for name, f, t in (("q", fq, tq), ("k", fk, tk), ("v", fv, tv)):
        np.testing.assert_allclose(f.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_attention_float64_matches_torch():
    torch = get_torch()
    q, k, v = (RNG.standard_normal(s) for s in ((2, 5, 4), (2, 8, 4), (2, 8, 3)))
    got = nn.functional.scaled_dot_product_attention(flow.tensor(q), flow.tensor(k), flow.tensor(v), is_causal=True,
                                                     scale=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)),
                                                           is_causal=True, scale=0.5)
    assert got.dtype == flow.float64
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-13)


class Attention(nn.Module):
    """One causal self-attention block, GPT-style: qkv projection, heads, SDPA, output projection."""

    def __init__(self, width=12, heads=3, causal=True):
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (a.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for a in self.qkv(x).split(c, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_graph_equals_eager_and_never_holds_the_scores(causal):
    flow.manual_seed(3)
    model = Attention(causal=causal).eval()
    x = flow.tensor(RNG.standard_normal((2, 7, 12)).astype(np.float32))
    graph = InferGraph(model)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    kernels = graph.compiled.program.kernels
    assert any("attention" in k.ops for k in kernels)
    buffers = {a.value for k in kernels for a in k.args}
    scores = [v for v in buffers if tuple(v.shape[-2:]) == (7, 7)]
    assert not scores, f"[L, S] buffers in the forward: {[(v.name, v.shape) for v in scores]}"


def test_attention_trains_in_a_graph_like_eager():
    flow.manual_seed(4)
    model = nn.Sequential(Attention(), nn.Flatten(), nn.Linear(7 * 12, 5))
    batches = [(flow.tensor(RNG.standard_normal((3, 7, 12)).astype(np.float32)),
                flow.tensor(RNG.integers(0, 5, (3,)))) for _ in range(3)]
    # SGD, not Adam: the key bias's gradient is 0 up to rounding (softmax ignores a per-row shift),
    # and Adam would blow that rounding noise up to full-size steps
    train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=0.1, momentum=0.9), batches, loss_rtol=1e-4)


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_without_weights_or_masks_matches_torch(batch_first):
    """need_weights=False, no masks, no dropout: MultiheadAttention runs the attention op."""
    torch = get_torch()
    fm = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    fm.load_state_dict({k: flow.tensor(v.detach().numpy()) for k, v in tm.state_dict().items()})
    q, kv = _arrays((2, 3, 8), (2, 5, 8)) if batch_first else _arrays((3, 2, 8), (5, 2, 8))
    f_out, f_w = fm(flow.tensor(q), flow.tensor(kv), flow.tensor(kv), need_weights=False)
    t_out, t_w = tm(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv), need_weights=False)
    assert f_w is None and t_w is None
    np.testing.assert_allclose(f_out.numpy(), t_out.detach().numpy(), rtol=1e-4, atol=1e-5)
    f_out.sum().backward()
    t_out.sum().backward()
    t_grads = dict(tm.named_parameters())
    for name, p in fm.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), t_grads[name].grad.numpy(), rtol=1e-3, atol=5e-5, err_msg=name)


def test_unmasked_transformer_encoder_graph_uses_the_attention_op():
    flow.manual_seed(6)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()
    x = flow.tensor(RNG.standard_normal((2, 5, 8)).astype(np.float32))
    graph = InferGraph(model)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)
    assert sum("attention" in k.ops for k in graph.compiled.program.kernels) == 2
