"""One decoding step of `examples/gpt_char.py`'s GPT with a key/value cache, for any PyTorch-like
framework (flowgen or PyTorch itself), as `define(torch)` does for the model.

`define_decode_step(torch)(gpt)` wraps a GPT (its own modules and weights, nothing copied) in a
module whose forward takes one token and its position and the K/V caches of every layer, and
returns the next token's logits and the caches with this position's keys and values written in:

    token  int64 [1, 1]                 the token at position `pos`
    pos    int64 [1]                    0 <= pos < block_size
    caches float32 [1, n_head, block_size, head_dim] each: k_0, v_0, k_1, v_1, ...
    ->     logits float32 [1, vocab_size], then the updated caches in the same order

The caches have a fixed capacity, the model's block size: the step writes this position's key and
value where `arange(block_size) == pos` (a `where`, not an indexed store) and attends to the
positions `<= pos` (a boolean mask), so one compiled step serves every sequence length up to the
block size, with `pos` the only thing that changes. The work is that of the full capacity (the
attention always reads block_size positions, the later ones masked out); flowgen has no symbolic
dimensions yet that would let it shrink with `pos`.

Fed the tokens of a sequence one at a time from pos 0, the logits equal those of the full
(uncached) forward at each position, to float rounding: position t sees exactly the keys and values
of positions 0..t, as the causal mask gives it.
"""
from __future__ import annotations


def define_decode_step(torch):
    """The DecodeStep class for a PyTorch-like module `torch` (flowgen or PyTorch)."""
    nn, F = torch.nn, torch.nn.functional

    class DecodeStep(nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt
            config = gpt.config
            self.capacity = config.block_size
            self.n_head, self.n_embd = config.n_head, config.n_embd
            self.head_dim = config.n_embd // config.n_head

        def cache_shape(self) -> tuple:
            return (1, self.n_head, self.capacity, self.head_dim)

        def empty_caches(self) -> list:
            """Zeroed caches for a new sequence: k_0, v_0, k_1, v_1, ..."""
            return [torch.zeros(*self.cache_shape()) for _ in range(2 * len(self.gpt.transformer.h))]

        def forward(self, token, pos, *caches):
            blocks = self.gpt.transformer.h
            if len(caches) != 2 * len(blocks):
                raise ValueError(f"DecodeStep: {len(blocks)} layers take {2 * len(blocks)} caches "
                                 f"(k_0, v_0, ...), got {len(caches)}")
            transformer = self.gpt.transformer
            x = transformer.drop(transformer.wte(token) + transformer.wpe(pos))   # [1, 1, C]
            positions = torch.arange(0, self.capacity, dtype=torch.long, device=token.device)
            this_slot = (positions == pos).view(1, 1, self.capacity, 1)   # where pos's key/value go
            visible = (positions <= pos).view(1, 1, 1, self.capacity)    # the causal mask at pos
            updated = []
            for layer, block in enumerate(blocks):
                attn = block.attn
                q, k, v = attn.c_attn(block.ln_1(x)).split(self.n_embd, dim=2)
                q, k, v = (t.view(1, 1, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
                k_cache = torch.where(this_slot, k, caches[2 * layer])       # k [1, H, 1, D] broadcast
                v_cache = torch.where(this_slot, v, caches[2 * layer + 1])
                y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible)
                y = y.transpose(1, 2).contiguous().view(1, 1, self.n_embd)
                x = x + attn.resid_dropout(attn.c_proj(y))
                x = x + block.mlp(block.ln_2(x))
                updated += [k_cache, v_cache]
            logits = self.gpt.lm_head(transformer.ln_f(x))
            return (logits.view(1, -1), *updated)

    return DecodeStep
