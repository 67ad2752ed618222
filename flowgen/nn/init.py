"""Weight initialisers (`nn.init.*_`): fill a tensor in place from flowgen's global RNG.

They draw from `flowgen.random.generator()`, so `flow.manual_seed(s)` makes
module construction reproducible. Inside `nn.Graph.build()`, on a graph tensor or a free
eager tensor, `uniform_`/`normal_` (and the initialisers built on them) are the Philox
random ops of `Tensor.uniform_`/`normal_`; the others refuse rather than freeze one draw.
The tensor keeps its NumPy buffer (graphs alias parameter memory); its version is bumped
so a graph re-uploads it.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import random as _random
from flowgen.ir.trace import TraceError
from flowgen.ops import registry
from flowgen.tensor import Tensor


def _in_graph(tensor: Tensor) -> bool:
    """Inside build(), on a graph value or a free eager tensor: a write must be a graph op."""
    tracer = registry._tracer_hook
    return tracer is not None and (tensor.is_lazy or tracer.is_free(tensor))


def _write(tensor: Tensor, values, name: str) -> Tensor:
    if _in_graph(tensor):
        raise TraceError(f"nn.init.{name} cannot run inside nn.Graph.build() on a graph tensor of shape "
                         f"{tuple(tensor.shape)}: it draws from NumPy at trace time, which would freeze one draw; "
                         f"nn.init.uniform_/normal_ (and kaiming_*/xavier_*, built on them) without generator= "
                         f"are graph ops, or initialise the tensor before calling the graph")
    dest = tensor.numpy_view()
    dest[...] = np.asarray(values).astype(dest.dtype, copy=False)
    tensor._version += 1
    return tensor


def _rng(generator):
    return _random.generator() if generator is None else generator


def calculate_gain(nonlinearity: str, param=None) -> float:
    """The recommended gain for an activation (same table as PyTorch)."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        if isinstance(slope, bool) or not isinstance(slope, (int, float)):
            raise ValueError(f"negative_slope {slope} is not a valid number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple:
    shape = tuple(tensor.shape)
    if len(shape) < 2:
        raise ValueError(f"fan in and fan out can not be computed for a tensor with fewer than 2 "
                         f"dimensions (got shape {shape})")
    receptive = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def _fan(tensor: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode {mode!r} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    if generator is None and _in_graph(tensor):
        return tensor.uniform_(a, b)      # the Philox random op: fresh numbers every call
    return _write(tensor, _rng(generator).uniform(a, b, size=tuple(tensor.shape)), "uniform_")


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    if generator is None and _in_graph(tensor):
        return tensor.normal_(mean, std)
    return _write(tensor, _rng(generator).normal(mean, std, size=tuple(tensor.shape)), "normal_")


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None) -> Tensor:
    """Normal(mean, std) redrawn until inside [a, b]."""
    rng = _rng(generator)
    out = rng.normal(mean, std, size=tuple(tensor.shape))
    bad = (out < a) | (out > b)
    while bad.any():
        out[bad] = rng.normal(mean, std, size=int(bad.sum()))
        bad = (out < a) | (out > b)
    return _write(tensor, out, "trunc_normal_")


def constant_(tensor: Tensor, val: float) -> Tensor:
    return _write(tensor, val, "constant_")


def zeros_(tensor: Tensor) -> Tensor:
    return _write(tensor, 0, "zeros_")


def ones_(tensor: Tensor) -> Tensor:
    return _write(tensor, 1, "ones_")


def eye_(tensor: Tensor) -> Tensor:
    if tensor.ndim != 2:
        raise ValueError("eye_ needs a 2-D tensor")
    return _write(tensor, np.eye(*tensor.shape), "eye_")


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / float(fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)), generator)


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator=None) -> Tensor:
    fan = _fan(tensor, mode)
    if fan == 0:
        return tensor  # an empty tensor has nothing to fill
    bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(fan)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator=None) -> Tensor:
    fan = _fan(tensor, mode)
    if fan == 0:
        return tensor
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(fan), generator)


# Old-style aliases (PyTorch kept them; OneFlow too).
uniform = uniform_
normal = normal_
constant = constant_
xavier_uniform = xavier_uniform_
xavier_normal = xavier_normal_
kaiming_uniform = kaiming_uniform_
kaiming_normal = kaiming_normal_
