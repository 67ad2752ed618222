"""Attention and Transformer layers with PyTorch's parameter names, shapes and masks.

`MultiheadAttention` projects with one packed ``in_proj_weight`` (or separate q/k/v weights when
the key/value widths differ) and runs the attention through `scaled_dot_product_attention`'s
formula; the encoder/decoder layers, stacks and `Transformer` compose it with Linear, LayerNorm
and Dropout. Everything is built from flowgen ops, so it trains eagerly and inside nn.Graph.

Mask conventions follow PyTorch: in `MultiheadAttention` a bool mask is True where attention is
*not* allowed (the opposite of `scaled_dot_product_attention`), a float mask is added.
"""
from __future__ import annotations

import copy
import math

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module, ModuleList
from flowgen.nn.modules._utils import new_parameter
from flowgen.nn.modules.dropout import Dropout
from flowgen.nn.modules.linear import Linear
from flowgen.nn.modules.normalization import LayerNorm
from flowgen.tensor import Tensor


def _as_additive(mask, like, name):
    """A bool "not allowed" mask as -inf/0, a float mask as is."""
    if mask is None:
        return None
    if mask.dtype == dt.bool_:
        return F.where(mask, float("-inf"), F.zeros_like(mask, dtype=like.dtype))
    if not mask.dtype.is_floating:
        raise TypeError(f"MultiheadAttention: {name} must be bool or floating, got {mask.dtype}")
    return mask


class MultiheadAttention(Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim=None, vdim=None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads})")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn are not supported yet")
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.head_dim = embed_dim // num_heads
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = new_parameter((3 * embed_dim, embed_dim), dtype=dtype, device=device)
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = new_parameter((embed_dim, embed_dim), dtype=dtype, device=device)
            self.k_proj_weight = new_parameter((embed_dim, self.kdim), dtype=dtype, device=device)
            self.v_proj_weight = new_parameter((embed_dim, self.vdim), dtype=dtype, device=device)
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = new_parameter((3 * embed_dim,), dtype=dtype, device=device)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)

    def _project(self, x, which: int):
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            weight = self.in_proj_weight[which * e:(which + 1) * e]
        else:
            weight = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[which]
        bias = self.in_proj_bias[which * e:(which + 1) * e] if self.in_proj_bias is not None else None
        return NF.linear(x, weight, bias)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        if is_causal and attn_mask is None:
            raise RuntimeError("MultiheadAttention: is_causal=True is a hint that attn_mask is the causal mask; "
                               "pass attn_mask too (nn.Transformer.generate_square_subsequent_mask)")
        unbatched = query.ndim == 2
        if unbatched:
            query, key, value = (F.unsqueeze(t, 1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = F.unsqueeze(key_padding_mask, 0)
        elif self.batch_first:
            query, key, value = (F.transpose(t, 0, 1) for t in (query, key, value))
        length, batch, _ = query.shape
        source = key.shape[0]
        heads, hd = self.num_heads, self.head_dim

        def split_heads(x, n):   # (n, batch, E) -> (batch, heads, n, head_dim)
            return F.permute(F.reshape(x, (n, batch, heads, hd)), (1, 2, 0, 3))

        q = split_heads(self._project(query, 0), length)
        k = split_heads(self._project(key, 1), source)
        v = split_heads(self._project(value, 2), source)
        mask = self._additive_mask(attn_mask, key_padding_mask, q, length, source)
        if not need_weights:   # no weights to return: the attention op (no [L, S] scores)
            out = NF.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hd),
                                                  dropout_p=self.dropout if self.training else 0.0)
            return self._merge_heads(out, length, batch, unbatched), None
        scores = F.matmul(q, F.transpose(k, -2, -1)) * (1.0 / math.sqrt(hd))
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, -1)
        if self.dropout > 0.0:
            weights = NF.dropout(weights, self.dropout, self.training)
        out = self._merge_heads(F.matmul(weights, v), length, batch, unbatched)
        if average_attn_weights:
            weights = F.mean(weights, 1)
        return out, (F.squeeze(weights, 0) if unbatched else weights)

    def _additive_mask(self, attn_mask, key_padding_mask, like, length, source):
        """attn_mask and key_padding_mask as one float mask added to the (batch, heads, L, S) scores
        (None without masks): (L, S), (batch, heads, L, S), (batch, 1, 1, S) or their sum."""
        batch, heads = like.shape[0], self.num_heads
        mask = _as_additive(attn_mask, like, "attn_mask")
        if mask is not None and mask.ndim == 3:   # (batch * heads, L, S)
            mask = F.reshape(mask, (batch, heads, length, source))
        padding = _as_additive(key_padding_mask, like, "key_padding_mask")
        if padding is not None:
            padding = F.reshape(padding, (batch, 1, 1, source))
            mask = padding if mask is None else mask + padding
        return mask

    def _merge_heads(self, out, length, batch, unbatched):
        """(batch, heads, length, head_dim) -> the output projection, in the caller's layout."""
        out = self.out_proj(F.reshape(F.permute(out, (2, 0, 1, 3)), (length, batch, self.embed_dim)))
        if unbatched:
            return F.squeeze(out, 1)
        return F.transpose(out, 0, 1) if self.batch_first else out

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


def _activation(activation):
    if callable(activation):
        return activation
    if activation == "relu":
        return NF.relu
    if activation == "gelu":
        return NF.gelu
    raise RuntimeError(f"activation should be relu/gelu or a callable, not {activation!r}")


class TransformerEncoderLayer(Module):
    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x


class TransformerDecoderLayer(Module):
    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **kw)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = _activation(activation)

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _mha_block(self, x, memory, attn_mask, key_padding_mask, is_causal):
        x = self.multihead_attn(x, memory, memory, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                need_weights=False, is_causal=is_causal)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False):
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x


class TransformerEncoder(Module):
    def __init__(self, encoder_layer, num_layers: int, norm=None, enable_nested_tensor: bool = True,
                 mask_check: bool = True):
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
        return self.norm(x) if self.norm is not None else x


class TransformerDecoder(Module):
    def __init__(self, decoder_layer, num_layers: int, norm=None):
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal: bool = False):
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                      tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
        return self.norm(x) if self.norm is not None else x


class Transformer(Module):
    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", custom_encoder=None, custom_decoder=None, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        layer_args = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                          layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first, bias=bias,
                          **kw)
        self.encoder = custom_encoder if custom_encoder is not None else TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, **layer_args), num_encoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw))
        self.decoder = custom_decoder if custom_decoder is not None else TransformerDecoder(
            TransformerDecoderLayer(d_model, nhead, **layer_args), num_decoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw))
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None, src_key_padding_mask=None,
                tgt_key_padding_mask=None, memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None,
                memory_is_causal: bool = False):
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                            memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """A float mask with -inf above the diagonal: position i may attend to j <= i."""
        target = dt.get(dtype) if dtype is not None else dt.float32
        mask = np.triu(np.full((sz, sz), -np.inf, dtype=target.np_dtype), 1)
        return Tensor(mask, dtype=target, device=device)


__all__ = ["MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
           "TransformerDecoder", "Transformer"]
