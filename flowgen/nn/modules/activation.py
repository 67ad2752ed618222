"""Activation layers: thin modules over the functional ops."""
from __future__ import annotations

from flowgen import functional as F
from flowgen.nn import functional as NF
from flowgen.nn import init as nn_init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter


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


class LogSigmoid(Module):
    def forward(self, x):
        return NF.logsigmoid(x)


class Softsign(Module):
    def forward(self, x):
        return NF.softsign(x)


class Tanhshrink(Module):
    def forward(self, x):
        return NF.tanhshrink(x)


class SELU(_InplaceActivation):
    def forward(self, x):
        return NF.selu(x, self.inplace)


class CELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, x):
        return NF.celu(x, self.alpha, self.inplace)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class Softshrink(Module):
    def __init__(self, lambd: float = 0.5):
        super().__init__()
        self.lambd = lambd

    def forward(self, x):
        return NF.softshrink(x, self.lambd)

    def extra_repr(self) -> str:
        return str(self.lambd)


class Hardshrink(Softshrink):
    def forward(self, x):
        return NF.hardshrink(x, self.lambd)


class Threshold(Module):
    def __init__(self, threshold: float, value: float, inplace: bool = False):
        super().__init__()
        self.threshold, self.value, self.inplace = threshold, value, inplace

    def forward(self, x):
        return NF.threshold(x, self.threshold, self.value, self.inplace)

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}, value={self.value}" + (", inplace=True" if self.inplace else "")


class GLU(Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return NF.glu(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmin(Softmax):
    def forward(self, x):
        return NF.softmin(x, self.dim)


class Softmax2d(Module):
    """Softmax over the channels of a (N, C, H, W) or (C, H, W) input."""

    def forward(self, x):
        if x.ndim not in (3, 4):
            raise ValueError(f"Softmax2d: expected input with 3 or 4 dims, got shape {tuple(x.shape)}")
        return NF.softmax(x, -3)


class PReLU(Module):
    """x where x > 0, else a * x with a learned slope `a`: one, or one per channel (num_parameters)."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device=None, dtype=None):
        super().__init__()
        self.num_parameters, self.init = num_parameters, init
        self.weight = new_parameter((num_parameters,), init, dtype, device)

    def reset_parameters(self) -> None:
        nn_init.constant_(self.weight, self.init)

    def forward(self, x):
        return NF.prelu(x, self.weight)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


__all__ = ["LogSigmoid", "Softsign", "Tanhshrink", "SELU", "CELU", "Softshrink", "Hardshrink", "Threshold", "GLU",
           "Softmin", "Softmax2d", "PReLU",
           "ReLU", "ReLU6", "SiLU", "Hardswish", "Hardsigmoid", "Mish", "LeakyReLU", "ELU", "Hardtanh", "Softplus",
           "GELU", "Sigmoid", "Tanh", "Softmax", "LogSoftmax"]
