"""MobileNetV2 (Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", 2018).

Module tree and state_dict names match torchvision / flowvision::

    features.0            ConvBNActivation(3 -> 32, 3x3, stride 2): .0 Conv2d, .1 BatchNorm2d, .2 ReLU6
    features.1 .. 17      InvertedResidual: .conv = Sequential(
                              [ConvBNActivation 1x1 expand]   (only when expand_ratio != 1)
                              ConvBNActivation 3x3 depthwise (groups = hidden channels, stride s),
                              Conv2d 1x1 project (no bias), BatchNorm2d)
    features.18           ConvBNActivation(1x1 -> last_channel)
    classifier            Sequential(Dropout(p), Linear(last_channel, num_classes))

forward: features -> adaptive average pool to 1x1 -> flatten -> classifier.
"""
from __future__ import annotations

from typing import Callable

import flowgen.functional as F
from flowgen import nn
from flowgen.nn import functional as NF

__all__ = ["MobileNetV2", "ConvBNActivation", "ConvBNReLU", "InvertedResidual", "mobilenet_v2"]

# expand ratio t, output channels c, repeats n, first stride s (the paper's Table 2)
DEFAULT_SETTING = [
    [1, 16, 1, 1],
    [6, 24, 2, 2],
    [6, 32, 3, 2],
    [6, 64, 4, 2],
    [6, 96, 3, 1],
    [6, 160, 3, 2],
    [6, 320, 1, 1],
]


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of `divisor`, never more than 10% below `v`."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNActivation(nn.Sequential):
    """Conv2d (no bias, 'same'-style padding) -> norm -> activation, children named 0, 1, 2."""

    def __init__(self, in_planes: int, out_planes: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 norm_layer: Callable | None = None, activation_layer: Callable | None = None, dilation: int = 1):
        padding = (kernel_size - 1) // 2 * dilation
        norm_layer = nn.BatchNorm2d if norm_layer is None else norm_layer
        activation_layer = nn.ReLU6 if activation_layer is None else activation_layer
        super().__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, dilation=dilation, groups=groups,
                      bias=False),
            norm_layer(out_planes),
            activation_layer(inplace=True),
        )
        self.out_channels = out_planes


ConvBNReLU = ConvBNActivation


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int, norm_layer: Callable | None = None):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"InvertedResidual: stride should be 1 or 2, got {stride}")
        norm_layer = nn.BatchNorm2d if norm_layer is None else norm_layer
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers.append(ConvBNActivation(inp, hidden_dim, kernel_size=1, norm_layer=norm_layer))
        layers += [
            ConvBNActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim, norm_layer=norm_layer),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            norm_layer(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup
        self._is_cn = stride > 1

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, inverted_residual_setting=None,
                 round_nearest: int = 8, block: Callable | None = None, norm_layer: Callable | None = None,
                 dropout: float = 0.2):
        super().__init__()
        block = InvertedResidual if block is None else block
        norm_layer = nn.BatchNorm2d if norm_layer is None else norm_layer
        input_channel, last_channel = 32, 1280
        setting = DEFAULT_SETTING if inverted_residual_setting is None else inverted_residual_setting
        if len(setting) == 0 or any(len(row) != 4 for row in setting):
            raise ValueError(f"inverted_residual_setting should be a non-empty list of [t, c, n, s] rows, "
                             f"got {setting}")
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list = [ConvBNActivation(3, input_channel, stride=2, norm_layer=norm_layer)]
        for t, c, n, s in setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(block(input_channel, output_channel, s if i == 0 else 1, expand_ratio=t,
                                      norm_layer=norm_layer))
                input_channel = output_channel
        features.append(ConvBNActivation(input_channel, self.last_channel, kernel_size=1, norm_layer=norm_layer))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def _forward_impl(self, x):
        x = self.features(x)
        x = NF.adaptive_avg_pool2d(x, (1, 1))
        x = F.flatten(x, 1)
        return self.classifier(x)

    def forward(self, x):
        return self._forward_impl(x)


def mobilenet_v2(pretrained: bool = False, progress: bool = True, **kwargs) -> MobileNetV2:
    """MobileNetV2; keyword arguments go to `MobileNetV2` (num_classes, width_mult, dropout, ...).

    There are no pretrained weights to download: load a converted checkpoint with `load_state_dict`.
    """
    if pretrained:
        raise ValueError("mobilenet_v2(pretrained=True): flowgen downloads nothing; build the model and "
                         "load a checkpoint with model.load_state_dict(flow.load(path))")
    return MobileNetV2(**kwargs)
