"""Recurrent and attention layers against PyTorch with the same weights (issue 14: the layers
word_language_model and Transformer models use), and inside nn.Graph against eager."""
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import train_like_eager
from torch_oracle import get_torch

RNG = np.random.default_rng(11)


def _twin(flow_module, torch_module):
    """Copy the torch module's weights into the flowgen module (names must match exactly)."""
    state = {k: flow.tensor(v.detach().numpy()) for k, v in torch_module.state_dict().items()}
    flow_module.load_state_dict(state)
    return flow_module, torch_module


def _compare(flow_out, torch_out, atol=2e-5):
    fo = flow_out if isinstance(flow_out, (tuple, list)) else [flow_out]
    to = torch_out if isinstance(torch_out, (tuple, list)) else [torch_out]
    for f, t in zip(fo, to):
        if isinstance(f, (tuple, list)):
            _compare(f, t, atol)
        elif f is None:
            assert t is None
        else:
            np.testing.assert_allclose(f.numpy(), t.detach().numpy(), atol=atol, rtol=1e-4)


def _backward_and_compare_grads(fm, tm, f_out, t_out, atol=5e-5):
    torch = get_torch()
    r = RNG.standard_normal(tuple(f_out.shape)).astype(np.float32)
    (f_out * flow.tensor(r)).sum().backward()
    (t_out * torch.from_numpy(r)).sum().backward()
    tgrads = dict(tm.named_parameters())
    for name, p in fm.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), tgrads[name].grad.numpy(), atol=atol, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("kind, kwargs", [
    ("RNN", dict(num_layers=2)),
    ("RNN", dict(nonlinearity="relu", batch_first=True)),
    ("LSTM", dict(num_layers=2, bidirectional=True)),
    ("LSTM", dict(batch_first=True, bias=False)),
    ("GRU", dict(num_layers=2, bidirectional=True, batch_first=True)),
])
def test_recurrent_layers_match_torch(kind, kwargs):
    torch = get_torch()
    fm, tm = _twin(getattr(nn, kind)(3, 5, **kwargs), getattr(torch.nn, kind)(3, 5, **kwargs))
    assert [n for n, _ in fm.named_parameters()] == [n for n, _ in tm.named_parameters()]
    x = RNG.standard_normal((4, 2, 3)).astype(np.float32)
    f_out, f_state = fm(flow.tensor(x))
    t_out, t_state = tm(torch.from_numpy(x))
    _compare((f_out, f_state), (t_out, t_state))
    _backward_and_compare_grads(fm, tm, f_out, t_out)


def test_lstm_with_initial_state_and_unbatched_input_match_torch():
    torch = get_torch()
    fm, tm = _twin(nn.LSTM(3, 4, num_layers=2), torch.nn.LSTM(3, 4, num_layers=2))
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    h0 = RNG.standard_normal((2, 4)).astype(np.float32)
    c0 = RNG.standard_normal((2, 4)).astype(np.float32)
    _compare(fm(flow.tensor(x), (flow.tensor(h0), flow.tensor(c0))),
             tm(torch.from_numpy(x), (torch.from_numpy(h0), torch.from_numpy(c0))))


@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell", "GRUCell"])
def test_cells_match_torch(kind):
    torch = get_torch()
    fm, tm = _twin(getattr(nn, kind)(3, 4), getattr(torch.nn, kind)(3, 4))
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    _compare(fm(flow.tensor(x)), tm(torch.from_numpy(x)))


def test_multihead_attention_masks_and_weights_match_torch():
    torch = get_torch()
    fm, tm = _twin(nn.MultiheadAttention(8, 2, batch_first=True), torch.nn.MultiheadAttention(8, 2, batch_first=True))
    q = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    kv = RNG.standard_normal((2, 4, 8)).astype(np.float32)
    bool_mask = np.array([[False, True, False, False], [False, False, False, True], [True, False, False, False]])
    padding = np.array([[False, False, False, True], [False, False, False, False]])
    for kw in (dict(), dict(attn_mask=bool_mask, key_padding_mask=padding), dict(average_attn_weights=False),
               dict(attn_mask=np.where(bool_mask, -1.5, 0.0).astype(np.float32))):
        f_kw = {k: flow.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        t_kw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        _compare(fm(flow.tensor(q), flow.tensor(kv), flow.tensor(kv), **f_kw),
                 tm(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv), **t_kw))


def test_multihead_attention_with_different_key_value_widths_matches_torch():
    torch = get_torch()
    fm, tm = _twin(nn.MultiheadAttention(6, 3, kdim=4, vdim=5), torch.nn.MultiheadAttention(6, 3, kdim=4, vdim=5))
    q = RNG.standard_normal((3, 2, 6)).astype(np.float32)
    k = RNG.standard_normal((5, 2, 4)).astype(np.float32)
    v = RNG.standard_normal((5, 2, 5)).astype(np.float32)
    f_out = fm(flow.tensor(q), flow.tensor(k), flow.tensor(v))
    t_out = tm(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    _compare(f_out, t_out)
    _backward_and_compare_grads(fm, tm, f_out[0], t_out[0])


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_matches_torch(norm_first):
    torch = get_torch()
    kw = dict(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=16, dropout=0.0,
              batch_first=True, norm_first=norm_first, activation="gelu")
    fm, tm = _twin(nn.Transformer(**kw), torch.nn.Transformer(**kw))
    src = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    tgt = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    f_mask = nn.Transformer.generate_square_subsequent_mask(3)
    t_mask = torch.nn.Transformer.generate_square_subsequent_mask(3)
    np.testing.assert_array_equal(f_mask.numpy(), t_mask.numpy())
    f_out = fm(flow.tensor(src), flow.tensor(tgt), tgt_mask=f_mask, tgt_is_causal=True)
    t_out = tm(torch.from_numpy(src), torch.from_numpy(tgt), tgt_mask=t_mask, tgt_is_causal=True)
    _compare(f_out, t_out, atol=5e-5)
    _backward_and_compare_grads(fm, tm, f_out, t_out, atol=2e-4)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(attn_mask="bool"), dict(attn_mask="float"),
                                dict(scale=0.3), dict(enable_gqa=True)])
def test_scaled_dot_product_attention_matches_torch(kw):
    torch = get_torch()
    q = RNG.standard_normal((2, 4, 3, 8)).astype(np.float32)
    k = RNG.standard_normal((2, 2 if kw.get("enable_gqa") else 4, 5, 8)).astype(np.float32)
    v = RNG.standard_normal(k.shape).astype(np.float32)
    masks = {"bool": RNG.standard_normal((3, 5)) > -0.5, "float": RNG.standard_normal((3, 5)).astype(np.float32)}
    f_kw = {n: flow.tensor(masks[x]) if n == "attn_mask" else x for n, x in kw.items()}
    t_kw = {n: torch.from_numpy(masks[x]) if n == "attn_mask" else x for n, x in kw.items()}
    fq, fk, fv = (flow.tensor(a, requires_grad=True) for a in (q, k, v))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    f_out = nn.functional.scaled_dot_product_attention(fq, fk, fv, **f_kw)
    t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **t_kw)
    _compare(f_out, t_out)
    f_out.sum().backward()
    t_out.sum().backward()
    for f, t in ((fq, tq), (fk, tk), (fv, tv)):
        np.testing.assert_allclose(f.grad.numpy(), t.grad.numpy(), atol=2e-5, rtol=1e-4)


def test_lstm_language_model_trains_in_a_graph_like_eager():
    """word_language_model's shape: Embedding -> LSTM -> Linear, cross-entropy, SGD; graph == eager."""
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Embedding(11, 6)
            self.rnn = nn.LSTM(6, 7, num_layers=2)
            self.decoder = nn.Linear(7, 11)

        def forward(self, tokens):
            out, _ = self.rnn(self.encoder(tokens))
            return self.decoder(out).reshape(-1, 11)

    flow.manual_seed(5)
    tokens = flow.tensor(RNG.integers(0, 11, (4, 2)))
    targets = flow.tensor(RNG.integers(0, 11, (8,)))
    train_like_eager(LM(), lambda ps: flow.optim.SGD(ps, lr=0.5), [(tokens, targets)] * 3)


def test_transformer_encoder_runs_in_a_graph_like_eager():
    flow.manual_seed(2)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()
    x = flow.tensor(RNG.standard_normal((2, 5, 8)).astype(np.float32))
    mask = nn.Transformer.generate_square_subsequent_mask(5)

    class Infer(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return self.model(x, mask=mask, is_causal=True)

    np.testing.assert_allclose(Infer()(x).numpy(), model(x, mask=mask, is_causal=True).numpy(), rtol=1e-5,
                               atol=1e-5)
