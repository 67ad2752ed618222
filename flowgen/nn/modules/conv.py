"""`nn.Conv2d` (zero padding; stride, dilation, groups)."""
from __future__ import annotations

import math

from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter, pair


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        super().__init__()
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels ({in_channels}) and out_channels ({out_channels}) must both "
                             f"be divisible by groups ({groups})")
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv2d: padding_mode={padding_mode!r} is not supported; only 'zeros'")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.dilation = pair(dilation, "dilation")
        self.groups = groups
        self.padding_mode = padding_mode
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"Conv2d: padding must be 'same', 'valid' or ints, got {padding!r}")
            if padding == "same" and self.stride != (1, 1):
                raise ValueError("Conv2d: padding='same' is not supported for strided convolutions")
            self.padding = padding
        else:
            self.padding = pair(padding, "padding")
        self.weight = new_parameter((out_channels, in_channels // groups, *self.kernel_size), dtype=dtype,
                                    device=device)
        if bias:
            self.bias = new_parameter((out_channels,), dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return NF.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                         dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s
