"""The prefill of `examples/gpt_char.py`'s GPT: a prompt in one call, for any PyTorch-like
framework (flowgen or PyTorch itself), as `define(torch)` does for the model.

`define_prefill(torch)(gpt)` wraps a GPT (its own modules and weights, nothing copied) in a module
whose forward takes the prompt's tokens and returns the logits of the token after them and the K/V
caches of every layer, which the decoding step (examples/generate/decode.py) continues from:

    tokens int64 [1, seq]                      the prompt, positions 0..seq-1 (1 <= seq <= block_size)
    ->     logits float32 [1, vocab_size]      the next token's: the last position's
           caches float32 [1, n_head, seq, head_dim] each: k_0, v_0, k_1, v_1, ...

It is the model's forward, each block's attention written out (the trained Linear and LayerNorm
modules called as the block calls them) so that its keys and values come out too: the causal
attention over the prompt, then the final LayerNorm and the output layer on the last position
only. Built with `seq` a dynamic dimension (`flow.Dim("seq", min=1, max=block_size)`,
examples/generate/build.py), one library takes any prompt up to the block size.

Why a graph of its own: the decoding step appends to caches of at least one position (a Dim's
smallest size is 1), so the empty caches before position 0 cannot go through it; and a prompt in
one call is one pass over all of its positions, not one call per token.
"""
from __future__ import annotations


def define_gpt_part(torch):
    """The base of the prefill and the decoding step (decode.py) for a PyTorch-like module `torch`:
    a module holding a GPT and its attention's sizes."""

    class GPTPart(torch.nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt
            config = gpt.config
            self.block_size = config.block_size
            self.n_head, self.n_embd = config.n_head, config.n_embd
            self.head_dim = config.n_embd // config.n_head

    return GPTPart


def define_prefill(torch):
    """The Prefill class for a PyTorch-like module `torch` (flowgen or PyTorch)."""
    F = torch.nn.functional

    class Prefill(define_gpt_part(torch)):

        def example_inputs(self, seq: int) -> list:
            """A prompt of `seq` zero tokens: for tracing."""
            return [torch.zeros(1, seq, dtype=torch.long)]

        def forward(self, tokens):
            seq = tokens.size(1)
            transformer = self.gpt.transformer
            positions = torch.arange(0, seq, dtype=torch.long, device=tokens.device)
            x = transformer.drop(transformer.wte(tokens) + transformer.wpe(positions))   # [1, seq, C]
            caches = []
            for block in transformer.h:
                attn = block.attn
                q, k, v = attn.c_attn(block.ln_1(x)).split(self.n_embd, dim=2)
                q, k, v = (t.view(1, seq, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [1, H, seq, D]
                y = y.transpose(1, 2).contiguous().view(1, seq, self.n_embd)
                x = x + attn.resid_dropout(attn.c_proj(y))
                x = x + block.mlp(block.ln_2(x))
                caches += [k, v]
            logits = self.gpt.lm_head(transformer.ln_f(x[:, -1:, :]))   # the last position only
            return (logits.view(1, -1), *caches)

    return Prefill
