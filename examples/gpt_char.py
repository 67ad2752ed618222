"""A character-level GPT trained on a small text shipped with the repo, eagerly or as an nn.Graph.

The model is written the way PyTorch users write GPT-2 (nanoGPT's layout: token and position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, the output layer tied to
the token embedding), and trained the way they train it: AdamW with weight decay on the matrices
only, a linear warm-up then cosine LR, gradient clipping and dropout. `define(framework)` builds
the classes from any PyTorch-like module, so the same code runs on flowgen and (in the tests) on
PyTorch.

    python examples/gpt_char.py                  # 200 eager steps, then a sample
    python examples/gpt_char.py --graph          # the training step compiled as an nn.Graph
    python -m flowgen.distributed.launch --nproc_per_node 2 examples/gpt_char.py --graph --ddp

With `--ddp` each rank trains a DistributedDataParallel replica on its part of every batch (the
gradients averaged over the ranks before the clipping, as nanoGPT's DDP loop), which equals one
process on the whole batch.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import numpy as np

import flowgen as flow

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt")


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    bias: bool = True


def define(torch):
    """The GPT classes for a PyTorch-like module `torch` (flowgen or PyTorch itself)."""
    nn, F = torch.nn, torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.resid_dropout = nn.Dropout(config.dropout)
            self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, x):
            return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight   # weight tying
            self.apply(self._init_weights)
            for name, p in self.named_parameters():              # scaled init of the residual projections
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        @staticmethod
        def _init_weights(module):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets=None):
            _, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            if targets is None:
                return logits, None
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

        def configure_optimizer(self, weight_decay, learning_rate, betas, **options):
            """AdamW with weight decay on the matrices only; `options` go to AdamW (PyTorch: fused=True)."""
            params = [p for _, p in self.named_parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **options)

        @torch.no_grad()
        def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
            for _ in range(max_new_tokens):
                cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
                logits, _ = self(cond)
                logits = logits[:, -1, :] / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits = torch.where(logits < v[:, -1:], torch.full_like(logits, -float("inf")), logits)
                probs = F.softmax(logits, dim=-1)
                idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
            return idx

    return GPT


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warm-up to 1, then a cosine decay to 0.1 at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


class Corpus:
    """The text as character ids, with random (input, next-character target) windows."""

    def __init__(self, path: str = CORPUS):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.ids = np.array([self.chars.index(c) for c in text], dtype=np.int64)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batches(self, steps: int, batch: int, block: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            starts = rng.integers(0, len(self.ids) - block - 1, batch)
            window = np.stack([self.ids[s:s + block + 1] for s in starts])
            yield flow.tensor(window[:, :-1]), flow.tensor(window[:, 1:])

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def train(config: GPTConfig, steps: int, batch: int = 4, use_graph: bool = False, lr: float = 3e-3,
          warmup: int = 5, clip: float = 1.0, seed: int = 0, ddp: bool = False, log=print):
    """Train from a fixed seed; returns (model, losses). Eager and graph take the same steps. With
    `ddp`, this rank trains on its part of each batch and the losses are averaged over the ranks."""
    corpus = Corpus()
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(seed)
    model = define(flow)(config)
    optimizer = model.configure_optimizer(weight_decay=0.1, learning_rate=lr, betas=(0.9, 0.95))
    scheduler = flow.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, steps))
    rank, world = (flow.env.get_rank(), flow.env.get_world_size()) if ddp else (0, 1)
    if batch % world:
        raise ValueError(f"--ddp: the batch ({batch}) must split evenly over the {world} ranks")
    part = batch // world
    replica = flow.nn.parallel.DistributedDataParallel(model) if ddp else model

    class TrainStep(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = replica
            self.add_optimizer(optimizer, lr_sch=scheduler)

        def build(self, x, y):
            _, loss = self.model(x, y)
            loss.backward()
            flow.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            return loss

    step = TrainStep() if use_graph else None
    losses = []
    for k, (x, y) in enumerate(corpus.batches(steps, batch, config.block_size, seed)):
        x, y = x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]
        if step is not None:
            loss = step(x, y)
        else:
            _, loss = replica(x, y)
            optimizer.zero_grad()
            loss.backward()
            flow.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
        losses.append(loss.item() if not ddp else float(
            flow.distributed.collectives.world().all_reduce([loss.numpy()], "mean")[0]))
        if log is not None and (k % 20 == 0 or k == steps - 1):
            log(f"step {k:4d}  loss {losses[-1]:.4f}  lr {warmup_cosine(k, warmup, steps) * lr:.2e}")
    return model, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--graph", action="store_true", help="compile the training step as an nn.Graph")
    parser.add_argument("--ddp", action="store_true", help="data parallel over the launched ranks")
    args = parser.parse_args(argv)
    model, losses = train(GPTConfig(), args.steps, use_graph=args.graph, ddp=args.ddp,
                          log=print if flow.env.get_rank() == 0 else None)
    if flow.env.get_rank() != 0:
        return losses
    corpus = Corpus()
    model.eval()
    sample = model.generate(flow.tensor(corpus.ids[None, :8]), 80, temperature=0.8, top_k=10)
    print(f"first loss {losses[0]:.3f}, last loss {losses[-1]:.3f}")
    print("sample:", corpus.decode(sample.numpy()[0]))
    return losses


if __name__ == "__main__":
    main()
