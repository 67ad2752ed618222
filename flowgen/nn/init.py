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
import warnings

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


def _calculate_correct_fan(tensor: Tensor, mode: str) -> int:
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


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None) -> Tensor:
    """Normal(mean, std) truncated to [a, b] (absolute bounds, not multiples of std), sampled
    exactly as PyTorch does: where [a, b] holds over 30% of the normal's mass, normal draws
    redrawn until inside; otherwise uniform draws on [a, b], each kept with probability
    pdf(x) / max pdf on [a, b] (which also works with `mean` far outside [a, b])."""
    if not a < b:
        raise ValueError(f"nn.init.trunc_normal_: the bounds must have a < b, got a={a}, b={b}")
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn("mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
                      "The distribution of values may be incorrect.", stacklevel=2)
    rng, shape = _rng(generator), tuple(tensor.shape)
    # The bounds as the tensor's dtype holds them: a draw kept in float64 stays inside once stored.
    low, high = (float(np.asarray(v, tensor.dtype.np_dtype)) for v in (a, b))
    if _norm_cdf((b - mean) / std) - _norm_cdf((a - mean) / std) > 0.3:
        out = rng.normal(mean, std, size=shape)
        pending = (out < low) | (out > high)
        while pending.any():
            out[pending] = rng.normal(mean, std, size=int(pending.sum()))
            pending = (out < low) | (out > high)
    else:
        mode = max(a, min(mean, b))
        log_peak = -0.5 * ((mode - mean) / std) ** 2
        out = rng.uniform(a, b, size=shape)
        pending = np.log(rng.uniform(size=shape)) > -0.5 * ((out - mean) / std) ** 2 - log_peak
        while pending.any():
            candidates = rng.uniform(a, b, size=int(pending.sum()))
            kept = np.log(rng.uniform(size=candidates.size)) <= -0.5 * ((candidates - mean) / std) ** 2 - log_peak
            where = np.flatnonzero(pending)[kept]
            out.flat[where] = candidates[kept]
            pending.flat[where] = False
    return _write(tensor, out, "trunc_normal_")


def constant_(tensor: Tensor, val: float) -> Tensor:
    return _write(tensor, val, "constant_")


def zeros_(tensor: Tensor) -> Tensor:
    return _write(tensor, 0, "zeros_")


def ones_(tensor: Tensor) -> Tensor:
    return _write(tensor, 1, "ones_")


def eye_(tensor: Tensor) -> Tensor:
    """The identity matrix (ones on the main diagonal of a 2-D tensor of any shape)."""
    if tensor.ndim != 2:
        raise ValueError(f"nn.init.eye_: only tensors with 2 dimensions are supported, got shape "
                         f"{tuple(tensor.shape)}")
    return _write(tensor, np.eye(*tensor.shape), "eye_")


def dirac_(tensor: Tensor, groups: int = 1) -> Tensor:
    """A conv weight [out, in, *kernel] (3-, 4- or 5-D) that passes its input through: in each of
    `groups` groups of output channels, output channel d reads input channel d at the kernel's
    centre, for d < min(out / groups, in); everything else is 0 (PyTorch's dirac_)."""
    if tensor.ndim not in (3, 4, 5):
        raise ValueError(f"nn.init.dirac_: only tensors with 3, 4, or 5 dimensions are supported, got shape "
                         f"{tuple(tensor.shape)}")
    shape = tuple(tensor.shape)
    if shape[0] % groups != 0:
        raise ValueError(f"nn.init.dirac_: dim 0 ({shape[0]}) must be divisible by groups ({groups})")
    per_group = shape[0] // groups
    centre = tuple(size // 2 for size in shape[2:])
    out = np.zeros(shape)
    for g in range(groups):
        for d in range(min(per_group, shape[1])):
            out[(g * per_group + d, d) + centre] = 1
    return _write(tensor, out, "dirac_")


def orthogonal_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    """A (semi-)orthogonal matrix times `gain` (Saxe et al. 2013), the trailing dimensions
    flattened: rows orthonormal when there are fewer rows than columns, else columns. As PyTorch:
    the Q of a QR factorisation of a normal matrix, each column's sign set so that R's diagonal
    is positive, which makes Q uniform (Haar) over the orthogonal matrices (Mezzadri 2006)."""
    if tensor.ndim < 2:
        raise ValueError(f"nn.init.orthogonal_: only tensors with 2 or more dimensions are supported, got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.numel() == 0:
        return tensor
    rows = tensor.shape[0]
    cols = tensor.numel() // rows
    flattened = _rng(generator).normal(0.0, 1.0, size=(rows, cols))
    if rows < cols:
        flattened = flattened.T
    q, r = np.linalg.qr(flattened)
    q *= np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return _write(tensor, (q * gain).reshape(tuple(tensor.shape)), "orthogonal_")


def sparse_(tensor: Tensor, sparsity: float, std: float = 0.01, generator=None) -> Tensor:
    """A 2-D tensor of Normal(0, std) values with ceil(sparsity * rows) zeros in each column, at
    rows drawn at random (Martens 2010; PyTorch's sparse_)."""
    if tensor.ndim != 2:
        raise ValueError(f"nn.init.sparse_: only tensors with 2 dimensions are supported, got shape "
                         f"{tuple(tensor.shape)}")
    rows, cols = tuple(tensor.shape)
    zeros_per_column = math.ceil(sparsity * rows)
    rng = _rng(generator)
    out = rng.normal(0.0, std, size=(rows, cols))
    for col in range(cols):
        out[rng.permutation(rows)[:zeros_per_column], col] = 0
    return _write(tensor, out, "sparse_")


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / float(fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator=None) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)), generator)


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator=None) -> Tensor:
    fan = _calculate_correct_fan(tensor, mode)
    if fan == 0:
        return tensor  # an empty tensor has nothing to fill
    bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(fan)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator=None) -> Tensor:
    fan = _calculate_correct_fan(tensor, mode)
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
orthogonal = orthogonal_
sparse = sparse_
dirac = dirac_
eye = eye_
