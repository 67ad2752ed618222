"""`nn.Linear`: y = x W^T + b."""
from __future__ import annotations

import math

from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_parameter((out_features, in_features), dtype=dtype, device=device)
        if bias:
            self.bias = new_parameter((out_features,), dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # PyTorch's default: kaiming_uniform(a=sqrt(5)) → U(±1/sqrt(fan_in)) for weight and bias.
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return NF.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
