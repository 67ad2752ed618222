"""examples/gpt_char.py (issue 11): a 2-layer, 64-wide GPT written as PyTorch users write it,
trained 20 steps with AdamW parameter groups, warm-up + cosine LR, gradient clipping inside
build(), dropout and weight tying. The graph's losses equal eager's; eager equals PyTorch running
the very same model code; generate() samples with top-k and multinomial."""
import os
import sys

import numpy as np

import flowgen as flow
from torch_oracle import get_torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt_char  # noqa: E402

STEPS = 20


def _config(dropout=0.1):
    return gpt_char.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=dropout)


def test_graph_training_equals_eager_with_dropout_clipping_and_schedule():
    _, eager = gpt_char.train(_config(), STEPS, batch=2, log=None)
    model, graph = gpt_char.train(_config(), STEPS, batch=2, use_graph=True, log=None)
    np.testing.assert_allclose(graph, eager, rtol=1e-5)
    assert eager[-1] < eager[0] - 0.3                    # it learns
    assert model.transformer.wte.weight is model.lm_head.weight


def test_eager_equals_pytorch_on_the_same_model_code():
    torch = get_torch()
    config = _config(dropout=0.0)
    corpus = gpt_char.Corpus()
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(0)
    ours = gpt_char.define(flow)(config)
    theirs = gpt_char.define(torch)(config)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    theirs.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in ours.state_dict().items()})
    opt_f = ours.configure_optimizer(0.1, 3e-3, (0.9, 0.95))
    opt_t = theirs.configure_optimizer(0.1, 3e-3, (0.9, 0.95))
    for x, y in corpus.batches(5, 2, config.block_size):
        _, lf = ours(x, y)
        _, lt = theirs(torch.from_numpy(x.numpy()), torch.from_numpy(y.numpy()))
        np.testing.assert_allclose(lf.item(), lt.item(), rtol=2e-5)
        for opt, loss, m, mod in ((opt_f, lf, ours, flow), (opt_t, lt, theirs, torch)):
            opt.zero_grad()
            loss.backward()
            mod.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
    # The attention's key bias has an exactly-zero gradient (softmax ignores a shift along keys), so
    # Adam's normalised step turns rounding noise there into steps of up to lr * (noise ratio): the
    # bound is a small fraction of one LR step (3e-3) rather than float32 rounding. Elements whose
    # gradient cancels to noise do the same (h.1's c_attn.weight[176, 21]: 7e-10 at step 1, its row's
    # median 4e-4; 3.5e-5 apart after 5 steps, 1% of a step).
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-4, atol=5e-5, err_msg=name)


def test_generate_samples_from_the_vocabulary():
    config = _config()
    corpus = gpt_char.Corpus()
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(1)
    model = gpt_char.define(flow)(config).eval()
    prompt = flow.tensor(corpus.ids[None, :5])
    out = model.generate(prompt, 20, temperature=0.8, top_k=5).numpy()
    assert out.shape == (1, 25) and (out[0, :5] == corpus.ids[:5]).all()
    assert out.min() >= 0 and out.max() < corpus.vocab_size


def test_a_decoding_step_as_a_graph_samples_what_eager_samples():
    """generate()'s step (forward, top-k filter, softmax, multinomial) as an nn.Graph over the
    block_size window: the same tokens as the eager step from the same seed."""
    config = _config()
    corpus = gpt_char.Corpus()
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(1)
    model = gpt_char.define(flow)(config).eval()

    def step(idx):
        logits, _ = model(idx)
        logits = logits[:, -1, :] / 0.8
        v, _ = flow.topk(logits, 5)
        logits = flow.where(logits < v[:, -1:], flow.full_like(logits, -float("inf")), logits)
        return flow.multinomial(flow.nn.functional.softmax(logits, dim=-1), num_samples=1)

    class DecodeStep(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, idx):
            return step(idx)

    graph = DecodeStep()
    eager_tokens, graph_tokens = [], []
    for seed in range(6):
        window = flow.tensor(corpus.ids[None, seed:seed + config.block_size])
        flow.manual_seed(100 + seed)
        eager_tokens.append(step(window).item())
        flow.manual_seed(100 + seed)
        graph_tokens.append(graph(window).item())
    assert graph_tokens == eager_tokens
