"""Hand-built PyTorch twins of flowgen.models (test oracle only; torchvision is never imported).

Written from the published architectures with torchvision's module names, so a
flowgen model's state_dict copies into them key by key.
"""
from __future__ import annotations

import numpy as np


def _torch():
    import pytest

    return pytest.importorskip("torch")


def _make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def torch_mobilenet_v2(num_classes=1000, width_mult=1.0, setting=None, dropout=0.2):
    torch = _torch()
    nn = torch.nn

    def cba(inp, out, k=3, stride=1, groups=1):
        return nn.Sequential(nn.Conv2d(inp, out, k, stride, (k - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(out), nn.ReLU6())

    class Block(nn.Module):
        def __init__(self, inp, out, stride, t):
            super().__init__()
            hidden = int(round(inp * t))
            self.res = stride == 1 and inp == out
            layers = [cba(inp, hidden, k=1)] if t != 1 else []
            layers += [cba(hidden, hidden, stride=stride, groups=hidden), nn.Conv2d(hidden, out, 1, bias=False),
                       nn.BatchNorm2d(out)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.res else self.conv(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            rows = setting or [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
                               [6, 160, 3, 2], [6, 320, 1, 1]]
            c_in = _make_divisible(32 * width_mult)
            self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
            feats = [cba(3, c_in, stride=2)]
            for t, c, n, s in rows:
                c_out = _make_divisible(c * width_mult)
                for i in range(n):
                    feats.append(Block(c_in, c_out, s if i == 0 else 1, t))
                    c_in = c_out
            feats.append(cba(c_in, self.last_channel, k=1))
            self.features = nn.Sequential(*feats)
            self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(torch.flatten(x, 1))

    return Net()


def torch_resnet18(num_classes=1000):
    torch = _torch()
    nn = torch.nn

    class Basic(nn.Module):
        def __init__(self, inp, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inp, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = None
            if stride != 1 or inp != planes:
                self.downsample = nn.Sequential(nn.Conv2d(inp, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

        def forward(self, x):
            out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            inp = 64
            for i, planes in enumerate([64, 128, 256, 512]):
                stride = 1 if i == 0 else 2
                setattr(self, f"layer{i + 1}", nn.Sequential(Basic(inp, planes, stride), Basic(planes, planes, 1)))
                inp = planes
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return Net()


def copy_into_torch(flow_model, torch_model, dtype=None):
    """Copy every state_dict entry of a flowgen model into its torch twin (names must match exactly)."""
    torch = _torch()
    src = {k: v.numpy() for k, v in flow_model.state_dict().items()}
    dst = torch_model.state_dict()
    assert list(src) == list(dst), "state_dict names differ"
    torch_model.load_state_dict({k: torch.from_numpy(np.array(src[k])).to(dst[k].dtype) for k in dst})
    if dtype is not None:
        torch_model.to(dtype)
    return torch_model
