"""Pooling layers (1-d ones run on the 2-d kernels)."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn.module import Module


class _MaxPool(Module):
    """Max pooling; `pool` is the functional of the layer's dimension."""

    pool = None

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding, self.dilation = padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, x):
        # self.__class__, not type(self): in a graph, forward runs on the module's Proxy (nn/graph/proxy.py)
        return self.__class__.pool(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                                   self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class MaxPool2d(_MaxPool):
    pool = staticmethod(NF.max_pool2d)


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override=None):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override

    def forward(self, x):
        kwargs = {"divisor_override": self.divisor_override} if self.divisor_override is not None else {}
        return NF.avg_pool2d(x, self.kernel_size, self.stride, self.padding, ceil_mode=self.ceil_mode,
                             count_include_pad=self.count_include_pad, **kwargs)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class _AdaptiveAvgPool(Module):
    """Average pooling to a given output size; `pool` is the functional of the layer's dimension."""

    pool = None

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return self.__class__.pool(x, self.output_size)   # self may be the module's graph Proxy

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveAvgPool2d(_AdaptiveAvgPool):
    pool = staticmethod(NF.adaptive_avg_pool2d)


class AdaptiveMaxPool2d(Module):
    def __init__(self, output_size, return_indices: bool = False):
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, x):
        return NF.adaptive_max_pool2d(x, self.output_size, self.return_indices)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class MaxPool1d(_MaxPool):
    pool = staticmethod(NF.max_pool1d)


class AvgPool1d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding, self.ceil_mode, self.count_include_pad = padding, ceil_mode, count_include_pad

    def forward(self, x):
        return NF.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool1d(_AdaptiveAvgPool):
    pool = staticmethod(NF.adaptive_avg_pool1d)


__all__ = ["MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "MaxPool1d", "AvgPool1d",
           "AdaptiveAvgPool1d"]
