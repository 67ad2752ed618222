"""Activation layers: thin modules over the functional ops."""
from __future__ import annotations

from flowgen import functional as F
from flowgen.nn import functional as NF
from flowgen.nn.module import Module


class _InplaceActivation(Module):
    # inplace=True: the input tensor is overwritten and returned (PyTorch), nn.functional's flags.
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class ReLU(_InplaceActivation):
    def forward(self, x):
        return NF.relu(x, self.inplace)


class ReLU6(_InplaceActivation):
    def forward(self, x):
        return NF.relu6(x, self.inplace)


class SiLU(_InplaceActivation):
    def forward(self, x):
        return NF.silu(x, self.inplace)


class Hardswish(_InplaceActivation):
    def forward(self, x):
        return NF.hardswish(x, self.inplace)


class Hardsigmoid(_InplaceActivation):
    def forward(self, x):
        return NF.hardsigmoid(x, self.inplace)


class Mish(_InplaceActivation):
    def forward(self, x):
        return NF.mish(x, self.inplace)


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False):
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, x):
        return NF.leaky_relu(x, self.negative_slope, self.inplace)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace else "")


class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, x):
        return NF.elu(x, self.alpha, self.inplace)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class Hardtanh(Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        super().__init__()
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, x):
        return NF.hardtanh(x, self.min_val, self.max_val, self.inplace)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}" + (", inplace=True" if self.inplace else "")


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, x):
        return NF.softplus(x, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return NF.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


def _default_softmax_dim(ndim: int) -> int:
    # PyTorch's legacy rule for Softmax(dim=None).
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return NF.softmax(x, self.dim if self.dim is not None else _default_softmax_dim(x.ndim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    def forward(self, x):
        return NF.log_softmax(x, self.dim if self.dim is not None else _default_softmax_dim(x.ndim))


__all__ = ["ReLU", "ReLU6", "SiLU", "Hardswish", "Hardsigmoid", "Mish", "LeakyReLU", "ELU", "Hardtanh", "Softplus",
           "GELU", "Sigmoid", "Tanh", "Softmax", "LogSoftmax"]
