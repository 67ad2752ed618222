"""flowgen.models: torchvision's module layout and state_dict, initialisation, and (with torch) numbers.

The expected state_dict names and shapes are kept in tests/data/*_state_dict.txt
(one "name<TAB>shape" line per entry, in state_dict order). With torch installed,
hand-built torch twins (tests/torch_vision_models.py; torchvision is never
imported) cross-check those lists and the eager forward/backward numbers.
"""
import ast
import math
import os

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.models import ConvBNActivation, InvertedResidual, MobileNetV2, ResNet, mobilenet_v2, resnet18

DATA = os.path.join(os.path.dirname(__file__), "data")


def kept_list(name):
    entries = []
    with open(os.path.join(DATA, name)) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                key, shape = line.rstrip("\n").split("\t")
                entries.append((key, tuple(ast.literal_eval(shape))))
    return entries


def layout(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


# ----------------------------------------------------------- structure
def test_mobilenet_v2_state_dict_matches_kept_list():
    expected = kept_list("mobilenet_v2_state_dict.txt")
    assert len(expected) == 314
    assert layout(mobilenet_v2()) == expected


def test_resnet18_state_dict_matches_kept_list():
    expected = kept_list("resnet18_state_dict.txt")
    assert len(expected) == 122
    assert layout(resnet18()) == expected


def test_mobilenet_v2_module_tree():
    model = mobilenet_v2(num_classes=10)
    assert isinstance(model, MobileNetV2) and model.last_channel == 1280
    assert len(model.features) == 19
    stem = model.features[0]
    assert type(stem).__name__ == "ConvBNActivation" and isinstance(stem, nn.Sequential)
    assert [type(m).__name__ for m in stem] == ["Conv2d", "BatchNorm2d", "ReLU6"]
    assert (stem[0].stride, stem[0].padding, stem[0].bias) == ((2, 2), (1, 1), None)
    block1 = model.features[1]                                  # t=1: no expansion conv
    assert isinstance(block1, InvertedResidual) and len(block1.conv) == 3
    assert block1.conv[0][0].groups == 32                       # depthwise
    block2 = model.features[2]
    assert [type(m).__name__ for m in block2.conv] == ["ConvBNActivation", "ConvBNActivation", "Conv2d",
                                                        "BatchNorm2d"]
    assert block2.conv[1][0].groups == 96 and block2.conv[1][0].stride == (2, 2)
    residual = [i for i, m in enumerate(model.features) if isinstance(m, InvertedResidual) and m.use_res_connect]
    assert residual == [3, 5, 6, 8, 9, 10, 12, 13, 15, 16]
    assert isinstance(model.features[18], ConvBNActivation) and model.features[18][0].kernel_size == (1, 1)
    assert [type(m).__name__ for m in model.classifier] == ["Dropout", "Linear"]
    assert model.classifier[0].p == 0.2 and model.classifier[1].out_features == 10
    assert "(0): ConvBNActivation(" in repr(model)


@pytest.mark.parametrize("width, first, last", [(0.25, 8, 1280), (0.5, 16, 1280), (1.4, 48, 1792)])
def test_mobilenet_v2_width_mult(width, first, last):
    model = mobilenet_v2(width_mult=width)
    assert model.features[0][0].out_channels == first
    assert model.last_channel == last and model.classifier[1].in_features == last


def test_resnet18_module_tree():
    model = resnet18(num_classes=10)
    assert isinstance(model, ResNet) and model.fc.out_features == 10
    assert type(model.layer1[0]).__name__ == "BasicBlock" and model.layer1[0].downsample is None
    ds = model.layer2[0].downsample
    assert [type(m).__name__ for m in ds] == ["Conv2d", "BatchNorm2d"] and ds[0].stride == (2, 2)
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.padding) == ((7, 7), (2, 2), (3, 3))
    assert (model.maxpool.kernel_size, model.maxpool.stride) in (((3, 3), (2, 2)), (3, 2))


def test_pretrained_is_refused_without_download():
    with pytest.raises(ValueError, match="downloads nothing"):
        mobilenet_v2(pretrained=True)
    with pytest.raises(ValueError, match="downloads nothing"):
        resnet18(pretrained=True)


def test_initialisation_follows_torchvision():
    flow.manual_seed(0)
    model = mobilenet_v2()
    w = model.features[18][0].weight.numpy()                   # (1280, 320, 1, 1): fan_out = 1280
    assert abs(w.mean()) < 1e-3 and w.std() == pytest.approx(math.sqrt(2.0 / 1280), rel=0.02)
    dw = model.features[17].conv[1][0].weight.numpy()          # depthwise (960, 1, 3, 3): fan_out = 960 * 9
    assert dw.std() == pytest.approx(math.sqrt(2.0 / (960 * 9)), rel=0.05)
    bn = model.features[5].conv[1][1]
    assert np.all(bn.weight.numpy() == 1) and np.all(bn.bias.numpy() == 0)
    assert np.all(bn.running_var.numpy() == 1) and int(bn.num_batches_tracked.item()) == 0
    fc = model.classifier[1]
    assert fc.weight.numpy().std() == pytest.approx(0.01, rel=0.02) and np.all(fc.bias.numpy() == 0)
    r = resnet18()
    assert r.layer4[1].conv2.weight.numpy().std() == pytest.approx(math.sqrt(2.0 / (512 * 9)), rel=0.02)


def test_eager_forward_shapes_and_train_step():
    flow.manual_seed(0)
    model = mobilenet_v2(width_mult=0.25, num_classes=10)
    x = flow.randn(2, 3, 32, 32)
    model.eval()
    assert tuple(model(x).shape) == (2, 10)
    model.train()
    loss = nn.CrossEntropyLoss()(model(x), flow.tensor(np.array([1, 7])))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert int(model.features[0][1].num_batches_tracked.item()) == 1


# ---------------------------------------------------------------- torch
def _randomise_bn_stats(model, seed=1):
    """Non-trivial running statistics and affine terms, so eval mode really uses them."""
    rng = np.random.default_rng(seed)
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("running_mean"):
            state[k] = rng.normal(0, 0.1, v.shape).astype(np.float32)
        elif k.endswith("running_var"):
            state[k] = rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
        elif k.endswith(".bias") and v.ndim == 1 and "classifier" not in k and "fc" not in k:
            state[k] = rng.normal(0, 0.1, v.shape).astype(np.float32)
    model.load_state_dict(state, strict=False)


def test_torch_twins_have_the_kept_layout():
    from torch_vision_models import torch_mobilenet_v2, torch_resnet18

    pytest.importorskip("torch")
    assert layout(torch_mobilenet_v2()) == kept_list("mobilenet_v2_state_dict.txt")
    assert layout(torch_resnet18()) == kept_list("resnet18_state_dict.txt")


@pytest.mark.parametrize("arch", ["mobilenet_v2", "resnet18"])
def test_eval_forward_matches_torch(arch):
    torch = pytest.importorskip("torch")
    from torch_vision_models import copy_into_torch, torch_mobilenet_v2, torch_resnet18

    flow.manual_seed(0)
    if arch == "mobilenet_v2":
        model, twin = mobilenet_v2(width_mult=0.25), torch_mobilenet_v2(width_mult=0.25)
    else:
        model, twin = resnet18(), torch_resnet18()
    _randomise_bn_stats(model)
    model.eval()
    copy_into_torch(model, twin, torch.float64).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    got = model(flow.tensor(x)).numpy()
    with torch.no_grad():
        expected = twin(torch.from_numpy(x).double()).numpy()
    assert got.shape == (1, 1000)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_train_step_gradients_match_torch():
    """Training mode (batch statistics, running-stat update) forward + backward of a small MobileNetV2."""
    torch = pytest.importorskip("torch")
    from torch_vision_models import copy_into_torch, torch_mobilenet_v2

    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 1, 2]]
    flow.manual_seed(0)
    model = mobilenet_v2(width_mult=0.25, num_classes=10, inverted_residual_setting=setting, dropout=0.0)
    twin = copy_into_torch(model, torch_mobilenet_v2(10, 0.25, setting, dropout=0.0), torch.float64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    loss = nn.CrossEntropyLoss()(model(flow.tensor(x)), flow.tensor(y))
    loss.backward()
    tloss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x).double()), torch.from_numpy(y))
    tloss.backward()
    assert float(loss.numpy()) == pytest.approx(tloss.item(), rel=1e-5)
    tparams = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        g, tg = p.grad.numpy(), tparams[name].grad.numpy()
        np.testing.assert_allclose(g, tg, rtol=1e-3, atol=1e-4 * np.abs(tg).max() + 1e-7, err_msg=name)
    tstate = twin.state_dict()
    for name, v in model.state_dict().items():
        if "running" in name or "num_batches" in name:
            np.testing.assert_allclose(v.numpy(), tstate[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
