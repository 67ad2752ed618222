"""flow.from_torch on real model families: Hugging Face GPT-2, BERT and Llama (RoPE, grouped-query
attention, RMSNorm, SiLU gating) and torchvision ResNet-18, MobileNetV3-small and a Vision
Transformer, each built from a small config with random weights (nothing is downloaded), imported
through torch.export and run eagerly: float32 outputs equal PyTorch's to 1e-5 of their scale.

Slow: BERT, ResNet-18, MobileNetV3, a Swin Transformer, MaxViT, and more families at tiny sizes
(Mistral with a sliding window, Qwen2, Phi, GPT-NeoX, Gemma, T5's encoder, DistilBERT; EfficientNet,
ConvNeXt, DenseNet, ShuffleNetV2, RegNet, MNASNet, SqueezeNet, AlexNet, VGG).

transformers / torchvision are optional: a test skips when its library does not import. The
fastest models (GPT-2, Llama, the ViT) run by default, the rest are marked slow."""
import numpy as np
import pytest

import flowgen as flow

torch = pytest.importorskip("torch")
# torch.export's own use of a pytree API it deprecated (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

RTOL = 1e-5


def _hf(*names):
    """The transformers classes `names`; skips when transformers, or a model module it imports
    lazily (a broken torchvision breaks them), does not import."""
    transformers = pytest.importorskip("transformers")
    try:
        return [getattr(transformers, name) for name in names]
    except Exception as e:  # noqa: BLE001 - any failure to import means: not available here
        pytest.skip(f"transformers.{names[-1]} does not import: {type(e).__name__}: {e}")


def _torchvision_models():
    try:   # a torchvision built for another torch raises RuntimeError (its C++ ops), not ImportError
        import torchvision.models
    except Exception as e:  # noqa: BLE001 - any failure to import means: not available here
        pytest.skip(f"torchvision does not import: {type(e).__name__}: {e}")
    return torchvision.models


def _check(model, args, kwargs=None, key=None):
    """Import `model` (eval mode) with the example arguments, run both, compare: |flow - torch| <=
    RTOL * max|torch| everywhere (a relative error at the output's scale)."""
    model.eval()
    kwargs = kwargs or {}
    imported = flow.from_torch(model, args, kwargs)
    got = imported(*[flow.from_dlpack(a) for a in args], **{k: flow.from_dlpack(v) for k, v in kwargs.items()})
    with torch.no_grad():
        expected = model(*args, **kwargs)
    if key is not None:
        got, expected = got[key], expected[key]
    expected = expected.numpy()
    scale = float(np.abs(expected).max())
    assert scale > 0, "the reference output is all zeros: the check would prove nothing"
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=RTOL * scale)
    return got


def _tokens(vocab, shape=(2, 8)):
    return torch.randint(0, vocab, shape)


# ------------------------------------------------------------------ Hugging Face transformers
def test_gpt2_lm_head():
    GPT2Config, GPT2LMHeadModel = _hf("GPT2Config", "GPT2LMHeadModel")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
                          bos_token_id=0, eos_token_id=0)
    _check(GPT2LMHeadModel(config), (_tokens(100),), key="logits")


def test_llama_gqa_rope_rmsnorm():
    LlamaConfig, LlamaForCausalLM = _hf("LlamaConfig", "LlamaForCausalLM")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=100, max_position_embeddings=32, use_cache=False,
                           bos_token_id=0, eos_token_id=0)
    assert config.num_key_value_heads < config.num_attention_heads and config.hidden_act == "silu"
    _check(LlamaForCausalLM(config), (_tokens(100),), key="logits")


@pytest.mark.slow
def test_bert_with_padding_mask():
    BertConfig, BertModel = _hf("BertConfig", "BertModel")
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          vocab_size=100, max_position_embeddings=32, use_cache=False)
    ids = _tokens(100)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0   # the second sequence is padded
    model = BertModel(config)
    _check(model, (ids,), {"attention_mask": mask}, key="last_hidden_state")
    _check(model, (ids,), key="pooler_output")


# ------------------------------------------------------------------ torchvision
def test_vision_transformer():
    models = _torchvision_models()
    torch.manual_seed(0)
    model = models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                     mlp_dim=64)
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)   # torchvision zero-initializes the head
    _check(model, (torch.randn(2, 3, 32, 32),))


@pytest.mark.slow
def test_resnet18():
    models = _torchvision_models()
    torch.manual_seed(0)
    _check(models.resnet18(weights=None), (torch.randn(1, 3, 32, 32),))


@pytest.mark.slow
def test_mobilenet_v3_small():
    models = _torchvision_models()
    torch.manual_seed(0)
    _check(models.mobilenet_v3_small(weights=None), (torch.randn(1, 3, 32, 32),))


# ------------------------------------------------------------------ the ops these models brought in
class _AdvancedIndexing(torch.nn.Module):
    """aten.index.Tensor with several index tensors: adjacent (broadcast dims in place), separated
    by a full slice (broadcast dims first), negative, int32, and all four dims (a causal mask's)."""

    def forward(self, x, i, j):
        a = x[i, j]                                   # [3, 5, 6]
        b = x[:, i[:, None], j.int()]                 # [3, 3, 3, 6]
        c = x[i, :, j]                                # [3, 4, 6]
        d = x[torch.arange(3)[:, None, None, None], torch.arange(4)[None, :, None, None],
              torch.arange(5)[None, None, :, None], torch.arange(6)[None, None, None, :]]
        return a.sum() + b.sum((0, 1)) + c.sum(1)[:, :1] + d[:, 0, 0, :]


def test_index_with_several_tensors():
    x = torch.randn(3, 4, 5, 6)
    i, j = torch.tensor([0, 2, -1]), torch.tensor([1, -3, 0])
    module = _AdvancedIndexing()
    imported = flow.from_torch(module, (x, i, j))
    got = imported(*(flow.from_dlpack(t) for t in (x, i, j)))
    np.testing.assert_allclose(got.numpy(), module(x, i, j).numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError, match="out of bounds"):
        imported(*(flow.from_dlpack(t) for t in (x, torch.tensor([0, 3, 1]), j)))


@pytest.mark.slow
def test_from_torch_example(capsys):
    """examples/from_torch.py (GPT-2, or its hand-written stand-in): eager and nn.Graph logits match."""
    import runpy
    from pathlib import Path
    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "from_torch.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "eager" in out and "nn.Graph" in out


class _SwinOps(torch.nn.Module):
    """What a Swin Transformer's shifted windows export to: constant_pad_nd (padding and cropping),
    slice_scatter / select_scatter (its attention mask built by slice assignment), fmod, remainder."""

    def forward(self, x):
        padded = torch.nn.functional.pad(x, (1, 2, 0, 3), value=0.5) + torch.nn.functional.pad(x, (-1, 4, 1, 2))
        mask = torch.zeros_like(padded)
        mask[:, :, 1:5:2] = padded[:, :, :2] * 2
        mask[:, 0] = 1.0
        i = torch.arange(-7, 8)
        rests = torch.fmod(i, 3) + torch.remainder(i, 4) + torch.fmod(i, 2.5) + torch.fmod(i, torch.tensor([2, -3]).repeat(8)[:15])
        return (mask + torch.fmod(padded, 0.3) + torch.remainder(padded, 0.7) + torch.fmod(padded, mask + 1.5)
                + rests[:8].float())


def test_swin_ops():
    x = torch.randn(2, 3, 4, 5)
    module = _SwinOps()
    got = flow.from_torch(module, (x,))(flow.from_dlpack(x))
    np.testing.assert_allclose(got.numpy(), module(x).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_swin_transformer():
    models = _torchvision_models()
    torch.manual_seed(0)
    model = models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                   window_size=[4, 4], num_classes=10)
    _check(model, (torch.randn(1, 3, 32, 32),))


# ------------------------------------------------------------------ more families (slow): tiny configs
_TOKENS_CONFIG = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                      use_cache=False)
MORE_CAUSAL_LMS = {   # transformers class names -> config keywords
    ("MistralConfig", "MistralForCausalLM"): dict(hidden_size=64, num_key_value_heads=2, sliding_window=4),
    ("Qwen2Config", "Qwen2ForCausalLM"): dict(hidden_size=64, num_key_value_heads=2),
    ("PhiConfig", "PhiForCausalLM"): dict(hidden_size=64),
    ("GPTNeoXConfig", "GPTNeoXForCausalLM"): dict(hidden_size=64),
    ("GemmaConfig", "GemmaForCausalLM"): dict(hidden_size=64, num_key_value_heads=1, head_dim=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("names", list(MORE_CAUSAL_LMS), ids=lambda names: names[1])
def test_more_causal_lms(names):
    config_class, model_class = _hf(*names)
    torch.manual_seed(0)
    model = model_class(config_class(**_TOKENS_CONFIG, **MORE_CAUSAL_LMS[names]))
    _check(model, (_tokens(100),), key="logits")


@pytest.mark.slow
def test_t5_encoder_and_distilbert():
    T5Config, T5EncoderModel, DistilBertConfig, DistilBertModel = _hf("T5Config", "T5EncoderModel",
                                                                      "DistilBertConfig", "DistilBertModel")
    torch.manual_seed(0)
    ids = _tokens(100)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    t5 = T5EncoderModel(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100))
    _check(t5, (ids,), {"attention_mask": mask}, key="last_hidden_state")
    distilbert = DistilBertModel(DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=100))
    _check(distilbert, (ids,), {"attention_mask": mask}, key="last_hidden_state")


MORE_VISION_MODELS = {   # torchvision builder -> (keywords, input size)
    "efficientnet_b0": ({}, 64), "convnext_tiny": ({}, 64), "densenet121": ({}, 64),
    "shufflenet_v2_x0_5": ({}, 64), "regnet_y_400mf": ({}, 64), "mnasnet0_5": ({}, 64),
    "squeezenet1_0": ({}, 64), "alexnet": ({}, 64), "vgg11": ({}, 32),
}


@pytest.mark.slow
@pytest.mark.parametrize("builder", list(MORE_VISION_MODELS))
def test_more_vision_models(builder):
    models = _torchvision_models()
    torch.manual_seed(0)
    keywords, size = MORE_VISION_MODELS[builder]
    _check(getattr(models, builder)(weights=None, **keywords), (torch.randn(1, 3, size, size),))


@pytest.mark.slow
def test_maxvit():
    models = _torchvision_models()
    torch.manual_seed(0)
    model = models.MaxVit(input_size=(64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32],
                          block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=10)
    _check(model, (torch.randn(1, 3, 64, 64),))
