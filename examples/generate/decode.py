"""One decoding step of `examples/gpt_char.py`'s GPT with a key/value cache, for any PyTorch-like
framework (flowgen or PyTorch itself), as `define(torch)` does for the model.

`define_decode_step(torch)(gpt)` wraps a GPT (its own modules and weights, nothing copied) in a
module whose forward takes one token, its position and the K/V caches of every layer, and returns
the next token's logits and the caches grown by this position's keys and values:

    token  int64 [1, 1]                        the token at position `pos`
    pos    int64 [1]                           its position: the caches' length, past
    caches float32 [1, n_head, past, head_dim] each: k_0, v_0, k_1, v_1, ... (positions 0..past-1)
    ->     logits float32 [1, vocab_size], then the caches [1, n_head, past + 1, head_dim], same order

The step appends this position's key and value to each cache (a `cat` on the position axis) and
attends to all of them, the way PyTorch code decodes: no mask, since every cached position is
visible from the newest. Built with `past` a dynamic dimension (`flow.Dim("past", min=1,
max=block_size - 1)`, examples/generate/build.py), one library serves every length and each call
costs what its length does: the attention reads past + 1 positions, not the block size.

A Dim's smallest size is 1, so a cache cannot be empty: position 0 has no step of its own. The
prompt is the job of the prefill (examples/generate/prefill.py), which takes all of the prompt's
tokens in one call and returns its last position's logits and the caches of its positions; the
step continues from there. Fed a sequence's tokens one at a time after the prefill of its start,
the logits equal those of the full (uncached) forward at each position, to float rounding:
position t sees exactly the keys and values of positions 0..t, as the causal mask gives it.

`pos` is an input, equal to past: the position embedding's row of this token (computing it in the
graph from the caches' length, `arange(past, past + 1)`, is refused by flowgen's dynamic shapes).
"""
from __future__ import annotations

from prefill import define_gpt_part   # examples/generate/prefill.py


def define_decode_step(torch):
    """The DecodeStep class for a PyTorch-like module `torch` (flowgen or PyTorch)."""
    F = torch.nn.functional

    class DecodeStep(define_gpt_part(torch)):

        def example_inputs(self, past: int) -> list:
            """Inputs at a cache length of `past` (zero caches, token 0 at position past): for tracing."""
            caches = [torch.zeros(1, self.n_head, past, self.head_dim) for _ in range(2 * len(self.gpt.transformer.h))]
            return [torch.zeros(1, 1, dtype=torch.long), torch.tensor([past], dtype=torch.long), *caches]

        def forward(self, token, pos, *caches):
            blocks = self.gpt.transformer.h
            if len(caches) != 2 * len(blocks):
                raise ValueError(f"DecodeStep: {len(blocks)} layers take {2 * len(blocks)} caches "
                                 f"(k_0, v_0, ...), got {len(caches)}")
            transformer = self.gpt.transformer
            x = transformer.drop(transformer.wte(token) + transformer.wpe(pos))   # [1, 1, C]
            grown = []
            for layer, block in enumerate(blocks):
                attn = block.attn
                q, k, v = attn.c_attn(block.ln_1(x)).split(self.n_embd, dim=2)
                q, k, v = (t.view(1, 1, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
                k_cache = torch.cat([caches[2 * layer], k], dim=2)       # [1, H, past + 1, D]
                v_cache = torch.cat([caches[2 * layer + 1], v], dim=2)
                y = F.scaled_dot_product_attention(q, k_cache, v_cache)  # every position so far is visible
                y = y.transpose(1, 2).contiguous().view(1, 1, self.n_embd)
                x = x + attn.resid_dropout(attn.c_proj(y))
                x = x + block.mlp(block.ln_2(x))
                grown += [k_cache, v_cache]
            logits = self.gpt.lm_head(transformer.ln_f(x))
            return (logits.view(1, -1), *grown)

    return DecodeStep
