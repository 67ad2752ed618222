"""Convolutions: `nn.Conv1d/2d/3d` and `nn.ConvTranspose1d/2d` (stride, dilation, groups, and
PyTorch's padding modes: 'zeros', or 'reflect'/'replicate'/'circular' as an `F.pad` before an
unpadded conv; the transposed ones take 'zeros' only, as in PyTorch).

Conv1d, Conv3d and the transposed ones are built on the 2-d conv ops (see nn.functional).
"""
from __future__ import annotations

import math

from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter, pair


PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _check_padding_mode(name: str, padding_mode: str, transposed: bool) -> None:
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"{name}: padding_mode must be one of {list(PADDING_MODES)}, got {padding_mode!r}")
    if transposed and padding_mode != "zeros":
        raise ValueError(f"{name}: only 'zeros' padding mode is supported (got {padding_mode!r}), as in PyTorch")


def _mode_padding(padding, kernel_size, dilation) -> tuple:
    """F.pad's list (last dim first, left then right) for a conv's padding in a non-zeros mode;
    'same' puts the odd element on the right, as PyTorch."""
    pads = []
    for d in reversed(range(len(kernel_size))):
        if padding == "valid":
            left = right = 0
        elif padding == "same":
            total = dilation[d] * (kernel_size[d] - 1)
            left, right = total // 2, total - total // 2
        else:
            left = right = padding[d]
        pads += [left, right]
    return tuple(pads)


def _padded_input(module, x):
    """`x` padded in the module's non-zeros padding mode (the conv then runs with padding 0)."""
    return NF.pad(x, _mode_padding(module.padding, module.kernel_size, module.dilation), mode=module.padding_mode)


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        super().__init__()
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels ({in_channels}) and out_channels ({out_channels}) must both "
                             f"be divisible by groups ({groups})")
        _check_padding_mode("Conv2d", padding_mode, False)
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
        if self.padding_mode != "zeros":
            return NF.conv2d(_padded_input(self, x), self.weight, self.bias, stride=self.stride, padding=0,
                             dilation=self.dilation, groups=self.groups)
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


class _ConvNd(Module):
    """Conv1d/Conv3d/ConvTranspose*: weight/bias layout and init as PyTorch, forward by the functional."""

    def __init__(self, name, dims, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                 padding_mode, transposed, output_padding=0, device=None, dtype=None):
        super().__init__()
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must both "
                             f"be divisible by groups ({groups})")
        _check_padding_mode(name, padding_mode, transposed)

        def tup(v):
            return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * dims

        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = tup(kernel_size), tup(stride), tup(dilation)
        self.padding = padding if isinstance(padding, str) else tup(padding)
        self.output_padding = tup(output_padding)
        self.padding_mode, self.transposed = padding_mode, transposed
        shape = (in_channels, out_channels // groups) if transposed else (out_channels, in_channels // groups)
        self.weight = new_parameter(shape + self.kernel_size, dtype=dtype, device=device)
        if bias:
            self.bias = new_parameter((out_channels,), dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = Conv2d.reset_parameters

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * len(self.kernel_size):
            s += f", padding={self.padding}"
        if self.dilation != (1,) * len(self.kernel_size):
            s += f", dilation={self.dilation}"
        if self.transposed and self.output_padding != (0,) * len(self.kernel_size):
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s


class Conv1d(_ConvNd):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__("Conv1d", 1, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, padding_mode, False, device=device, dtype=dtype)

    def forward(self, x):
        if self.padding_mode != "zeros":
            return NF.conv1d(_padded_input(self, x), self.weight, self.bias, self.stride[0], 0, self.dilation[0],
                             self.groups)
        padding = self.padding if isinstance(self.padding, str) else self.padding[0]
        return NF.conv1d(x, self.weight, self.bias, self.stride[0], padding, self.dilation[0], self.groups)


class Conv3d(_ConvNd):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None):
        if isinstance(padding, str):
            raise NotImplementedError("Conv3d: string padding ('same'/'valid') is not supported yet; pass ints")
        super().__init__("Conv3d", 3, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, padding_mode, False, device=device, dtype=dtype)

    def forward(self, x):
        if self.padding_mode != "zeros":
            return NF.conv3d(_padded_input(self, x), self.weight, self.bias, self.stride, 0, self.dilation,
                             self.groups)
        return NF.conv3d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ConvTranspose1d(_ConvNd):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None):
        super().__init__("ConvTranspose1d", 1, in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, True, output_padding, device=device, dtype=dtype)

    def forward(self, x, output_size=None):
        if output_size is not None:
            raise NotImplementedError("ConvTranspose1d: output_size= is not supported; use output_padding")
        return NF.conv_transpose1d(x, self.weight, self.bias, self.stride[0], self.padding[0],
                                   self.output_padding[0], self.groups, self.dilation[0])


class ConvTranspose2d(_ConvNd):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None):
        super().__init__("ConvTranspose2d", 2, in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, True, output_padding, device=device, dtype=dtype)

    def forward(self, x, output_size=None):
        if output_size is not None:
            raise NotImplementedError("ConvTranspose2d: output_size= is not supported; use output_padding")
        return NF.conv_transpose2d(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                   self.groups, self.dilation)
