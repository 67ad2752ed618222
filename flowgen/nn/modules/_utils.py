"""Small helpers shared by the layer definitions."""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.nn.parameter import Parameter
from flowgen.tensor import Tensor


def new_tensor(shape, fill=0.0, dtype=None, device=None) -> Tensor:
    """A constant tensor for a parameter or buffer (its values are set by `reset_parameters`)."""
    target = dt.get(dtype) if dtype is not None else dt.float32
    return Tensor(np.full(tuple(shape), fill, dtype=target.np_dtype), dtype=target, device=device)


def new_parameter(shape, fill=0.0, dtype=None, device=None) -> Parameter:
    return Parameter(new_tensor(shape, fill, dtype, device))


def pair(value, name: str = "argument") -> tuple:
    """2 → (2, 2); (1, 2) → (1, 2)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
        return tuple(int(v) for v in value)
    return (int(value), int(value))
