"""Bring a PyTorch model to flowgen: a Hugging Face GPT-2 (a tiny config with random weights, nothing
is downloaded) imported with `flow.from_torch`, run eagerly and compiled in an `nn.Graph`, both
compared with PyTorch's logits. Without transformers, a small hand-written PyTorch GPT stands in.

    PYTHONPATH=. python examples/from_torch.py
"""
import numpy as np
import torch

import flowgen as flow


def torch_model():
    """(model, example token ids, name): a GPT-2 language model if transformers imports, else a
    one-block PyTorch GPT written out."""
    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config), torch.randint(0, 100, (2, 16)), "Hugging Face GPT2LMHeadModel"
    except Exception:  # noqa: BLE001 - transformers absent or broken: the hand-written model
        return HandWrittenGPT(), torch.randint(0, 100, (2, 16)), "hand-written PyTorch GPT"


class HandWrittenGPT(torch.nn.Module):
    def __init__(self, vocab=100, block=32, width=64, heads=4):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(block, width)
        self.ln1, self.ln2, self.ln_f = (torch.nn.LayerNorm(width) for _ in range(3))
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        x = x + self.mlp(self.ln2(x))
        return {"logits": self.head(self.ln_f(x))}


class Inference(flow.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, idx):
        return self.model(idx)["logits"]


def main():
    net, idx, name = torch_model()
    net.eval()
    model = flow.from_torch(net, (idx,))        # torch.export, then each ATen op as a flowgen op
    with torch.no_grad():
        expected = net(idx)["logits"].numpy()
    tokens = flow.from_dlpack(idx)
    eager = model(tokens)["logits"].numpy()
    graph = Inference(model)(tokens).numpy()
    print(f"{name}: logits {tuple(expected.shape)}")
    for what, got in (("eager", eager), ("nn.Graph", graph)):
        print(f"  {what:9s} max |flowgen - torch| = {np.abs(got - expected).max():.2e}  "
              f"(max |torch| = {np.abs(expected).max():.2f})")
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


if __name__ == "__main__":
    main()
