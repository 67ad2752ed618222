"""scaled_dot_product_attention without dropout is one `attention` op (issue 11), masked or not, and
its gradient one `attention_backward` op: forward and backward against PyTorch, graph against eager
(inference and training), and the compiled programs' buffers, none of which holds the [L, S]
scores in either direction."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ops.registry import apply
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


# --------------------------------------------------------------------------
# the fused backward and masks (attention_backward, attn_mask)

class QKV(nn.Module):
    """q, k, v as parameters: SGD with lr 1 turns a graph step into the parameters' gradients."""

    def __init__(self, q, k, v, **sdpa):
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(flow.tensor(a)) for a in (q, k, v))
        self.sdpa = sdpa

    def forward(self, mask=None):
        return nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=mask, **self.sdpa)


class WeightedSumStep(nn.Graph):
    """loss = sum(attention * w); one SGD step with lr 1 (parameter -= gradient)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1.0))

    def build(self, w, *mask):
        out = self.model(*mask)
        loss = (out * w).sum()
        loss.backward()
        return out


def _mask(kind, shape, rng=RNG):
    """A bool mask (True = attend) or an additive float one (with -inf entries), with query row 1
    fully masked when `kind` ends in "_row"; drawn from `rng`."""
    keep = rng.random(shape) < 0.7
    if kind.endswith("_row"):
        keep[..., 1, :] = False
    if kind.startswith("bool"):
        return keep
    return np.where(keep, rng.standard_normal(shape), -np.inf).astype(np.float32)


TRAIN_CASES = [  # (id, (B, H, L, S, E, Ev), sdpa keywords, mask kind, mask shape)
    ("causal_e16", (2, 3, 5, 5, 16, 16), dict(is_causal=True), None, None),
    ("full_L_lt_S_e64", (2, 2, 4, 9, 64, 64), {}, None, None),
    ("causal_L_gt_S_e16", (1, 2, 7, 4, 16, 8), dict(is_causal=True, scale=0.3), None, None),
    ("bool_mask_batch_broadcast", (2, 3, 6, 7, 16, 16), {}, "bool", (2, 1, 6, 7)),
    ("bool_mask_fully_masked_row", (2, 2, 5, 6, 16, 16), {}, "bool_row", (5, 6)),
    ("float_mask_head_broadcast", (2, 3, 4, 6, 16, 16), {}, "float", (3, 4, 6)),
    ("float_mask_key_padding_row", (2, 2, 5, 7, 16, 16), {}, "float_row", (2, 1, 5, 7)),
    ("key_padding_e64", (2, 2, 5, 8, 64, 64), {}, "bool", (2, 1, 1, 8)),
]


def _train_case(case):
    _, (B, H, L, S, E, Ev), sdpa, kind, mask_shape = case
    q, k, v = _arrays((B, H, L, E), (B, H, S, E), (B, H, S, Ev))
    w = RNG.standard_normal((B, H, L, Ev)).astype(np.float32)
    mask = None if kind is None else _mask(kind, mask_shape)
    return (q, k, v), w, mask, sdpa


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_attention_graph_training_step_matches_eager_and_torch(case):
    """A graph step's output and q/k/v gradients (SGD lr 1) against eager flowgen and PyTorch; the
    backward is one attention_backward node and the graph holds no [L, S] buffer."""
    torch = get_torch()
    (q, k, v), w, mask, sdpa = _train_case(case)
    masks = () if mask is None else (flow.tensor(mask),)
    graph = WeightedSumStep(QKV(q, k, v, **sdpa))
    g_out = graph(flow.tensor(w), *masks).numpy()
    g_grads = [a - p.numpy() for a, p in zip((q, k, v), (graph.model.q, graph.model.k, graph.model.v))]

    eager = QKV(q, k, v, **sdpa)
    e_out = eager(*masks)
    (e_out * flow.tensor(w)).sum().backward()
    t_qkv = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    t_out = torch.nn.functional.scaled_dot_product_attention(
        *t_qkv, attn_mask=None if mask is None else torch.from_numpy(mask), **sdpa)
    t_out.backward(torch.from_numpy(w))

    np.testing.assert_allclose(g_out, e_out.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_out, t_out.detach().numpy(), rtol=1e-4, atol=1e-5)
    for name, g, e, t in zip("qkv", g_grads, (eager.q, eager.k, eager.v), t_qkv):
        # the graph's gradient is p - (p - g): exact up to one rounding at |p| ~ 1
        np.testing.assert_allclose(g, e.grad.numpy(), rtol=1e-5, atol=1e-6 * 4, err_msg=name)
        np.testing.assert_allclose(e.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=2e-5, err_msg=name)
    _check_no_scores(graph.compiled.program, *case[1][2:4])


def _check_no_scores(program, L, S, op="attention"):
    """The fused kernels run the attention both ways and no buffer of the program is [L, S]-sized
    (other than the user's mask, a graph input)."""
    ops = [op for k in program.kernels for op in k.ops]
    assert op in ops and f"{op}_backward" in ops
    assert not {"softmax", "matmul", "softmax_grad"} & set(ops), ops
    buffers = ({a.value for k in program.kernels for a in k.args} | set(program.plan.offsets)) - \
        set(program.graph.inputs)
    scores = [v for v in buffers if tuple(v.shape[-2:]) in ((L, S), (S, L))]
    assert not scores, f"[L, S] buffers: {[(v.name, v.shape) for v in scores]}"


def test_fully_masked_rows_give_zeros_like_torch():
    """A query row with no key to attend: output 0 and no gradient (PyTorch's SDPA), eager and in
    the composite path (dropout_p > 0 keeps the same rule; checked here with p = 0 via a float
    mask that requires grad)."""
    torch = get_torch()
    q, k, v = _arrays((2, 4, 8), (2, 5, 8), (2, 5, 3))
    mask = _mask("float_row", (4, 5))
    t_mask = torch.tensor(mask, requires_grad=True)
    t_out = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)),
                                                            attn_mask=t_mask)
    for requires_grad in (False, True):   # the attention op; the composite (the mask's gradient)
        f_mask = flow.tensor(mask, requires_grad=requires_grad)
        f_out = nn.functional.scaled_dot_product_attention(*(flow.tensor(a) for a in (q, k, v)), attn_mask=f_mask)
        assert np.all(f_out.numpy()[:, 1] == 0)
        np.testing.assert_allclose(f_out.numpy(), t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    g = RNG.standard_normal(t_out.shape).astype(np.float32)
    (f_out * flow.tensor(g)).sum().backward()
    t_out.backward(torch.from_numpy(g))
    got, want = f_mask.grad.numpy(), t_mask.grad.numpy()
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=1e-4, atol=1e-5)


def test_attention_backward_refuses_a_float_mask_that_requires_grad():
    q, k, v = (flow.tensor(a, requires_grad=True) for a in _arrays((3, 4), (5, 4), (5, 2)))
    mask = flow.tensor(RNG.standard_normal((3, 5)).astype(np.float32), requires_grad=True)
    out, _ = apply("attention", q, k, v, mask, scale=0.5, causal=False)
    with pytest.raises(NotImplementedError, match="float attn_mask"):
        out.sum().backward()


@pytest.mark.parametrize("masks", ["key_padding", "attn_bool", "both"])
def test_multihead_attention_with_masks_uses_the_attention_op_and_matches_torch(masks):
    """need_weights=False with key_padding_mask and/or attn_mask: the fused op, eager and in a
    graph, against PyTorch."""
    torch = get_torch()
    fm = nn.MultiheadAttention(8, 2, batch_first=True)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    fm.load_state_dict({k: flow.tensor(v.detach().numpy()) for k, v in tm.state_dict().items()})
    q, kv = _arrays((2, 3, 8), (2, 5, 8))
    padding = np.zeros((2, 5), bool)
    padding[0, 3:] = True                                     # True = ignore (MultiheadAttention)
    attn = RNG.random((3, 5)) < 0.3
    attn[:, 0] = False
    kw = {"key_padding": dict(key_padding_mask=padding), "attn_bool": dict(attn_mask=attn),
          "both": dict(key_padding_mask=padding, attn_mask=attn)}[masks]
    t_out, _ = tm(*(torch.from_numpy(a) for a in (q, kv, kv)), need_weights=False,
                  **{n: torch.from_numpy(m) for n, m in kw.items()})
    f_kw = {n: flow.tensor(m) for n, m in kw.items()}
    f_out, _ = fm(*(flow.tensor(a) for a in (q, kv, kv)), need_weights=False, **f_kw)
    np.testing.assert_allclose(f_out.numpy(), t_out.detach().numpy(), rtol=1e-4, atol=1e-5)

    class MaskedAttention(nn.Graph):
        def __init__(self):
            super().__init__()
            self.mha = fm

        def build(self, x, y):
            return self.mha(x, y, y, need_weights=False, **f_kw)[0]

    graph = MaskedAttention()
    np.testing.assert_allclose(graph(flow.tensor(q), flow.tensor(kv)).numpy(), f_out.numpy(), rtol=1e-5,
                               atol=1e-6)
    assert any("attention" in k.ops for k in graph.compiled.program.kernels)


# --------------------------------------------------------------------------
# dropout inside the kernels (attention_dropout): F.dropout's Philox mask over [..., L, S]

def _composite_sdpa(q, k, v, mask, dropout_p, scale):
    """softmax -> F.dropout -> @ v from flowgen ops (what the fused op must equal)."""
    scores = flow.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = flow.where(mask, scores, float("-inf"))
    return nn.functional.dropout(flow.softmax(scores, -1), dropout_p) @ v


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 5, 7)], ids=["no_mask", "bool_mask"])
def test_attention_dropout_equals_the_composite_with_the_same_seed(mask_shape):
    q, k, v = _arrays((2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 8))
    mask = None if mask_shape is None else flow.tensor(_mask("bool", mask_shape))
    g = flow.tensor(RNG.standard_normal((2, 3, 5, 8)).astype(np.float32))
    results = []
    for fused in (True, False):
        flow.manual_seed(17)
        ts = [flow.tensor(a, requires_grad=True) for a in (q, k, v)]
        out = nn.functional.scaled_dot_product_attention(*ts, attn_mask=mask, dropout_p=0.25) if fused \
            else _composite_sdpa(*ts, mask, 0.25, 0.25)
        (out * g).sum().backward()
        results.append([out.numpy()] + [t.grad.numpy() for t in ts])
    undropped = nn.functional.scaled_dot_product_attention(*(flow.tensor(a) for a in (q, k, v)), attn_mask=mask)
    assert np.abs(results[0][0] - undropped.numpy()).max() > 0.1     # the dropout did something
    for name, a, b in zip(["out", "q", "k", "v"], *results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_attention_dropout_trains_in_a_graph_like_eager():
    """Three graph steps (a fresh Philox offset each) equal three eager steps from the same seed,
    outputs and parameters; the graph runs the fused dropout kernels and holds no [L, S] buffer."""
    q, k, v = _arrays((2, 2, 6, 16), (2, 2, 6, 16), (2, 2, 6, 16))
    w = flow.tensor(RNG.standard_normal((2, 2, 6, 16)).astype(np.float32))
    graph = WeightedSumStep(QKV(q, k, v, dropout_p=0.2, is_causal=True))
    eager = QKV(q, k, v, dropout_p=0.2, is_causal=True)
    opt = flow.optim.SGD(eager.parameters(), lr=1.0)
    flow.manual_seed(5)
    got = [graph(w).numpy() for _ in range(3)]
    flow.manual_seed(5)
    for step in range(3):
        out = eager()
        opt.zero_grad()
        (out * w).sum().backward()
        opt.step()
        np.testing.assert_allclose(got[step], out.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    for name in "qkv":
        np.testing.assert_allclose(getattr(graph.model, name).numpy(), getattr(eager, name).numpy(), rtol=1e-5,
                                   atol=1e-5, err_msg=name)
    _check_no_scores(graph.compiled.program, 6, 6, op="attention_dropout")
