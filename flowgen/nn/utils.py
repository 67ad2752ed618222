"""`nn.utils`: gradient clipping.

Gradients are replaced, never scaled in place: eager autograd may hand the
same NumPy buffer to several tensors (an `add`'s two inputs get one gradient
array), so writing into one would scale the others too.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen.tensor import Tensor


def _grads(parameters) -> list:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def _replace(grad: Tensor, array: np.ndarray) -> None:
    grad._data = np.array(array, dtype=grad.dtype.np_dtype, order="C")
    grad._version += 1


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """Scale all gradients together so that their joint `norm_type`-norm is at most `max_norm`.

    Returns the total norm before clipping (a 0-d float32 tensor), as PyTorch.
    """
    grads = _grads(parameters)
    if not grads:
        return Tensor(np.float32(0.0))
    norm_type = float(norm_type)
    arrays = [g.numpy_view().astype(np.float32, copy=False).ravel() for g in grads]
    if math.isinf(norm_type):
        per_grad = [np.abs(a).max() if a.size else np.float32(0) for a in arrays]
        total = np.float32(max(per_grad))
    else:
        per_grad = np.array([np.linalg.norm(a, norm_type) if a.size else 0.0 for a in arrays], np.float32)
        total = np.float32(np.linalg.norm(per_grad, norm_type))
    if error_if_nonfinite and not np.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           f"so it cannot be clipped. To disable this error and scale the gradients by the "
                           f"non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = np.float32(min(np.float32(max_norm) / (total + np.float32(1e-6)), np.float32(1.0)))
    for g in grads:
        _replace(g, g.numpy_view() * coef)
    return Tensor(np.asarray(total, np.float32))


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every gradient element into [-clip_value, clip_value]."""
    for g in _grads(parameters):
        _replace(g, np.clip(g.numpy_view(), -clip_value, clip_value))


def parameters_to_vector(parameters) -> Tensor:
    return Tensor(np.concatenate([p.numpy_view().ravel() for p in parameters]))


def vector_to_parameters(vec: Tensor, parameters) -> None:
    flat, offset = vec.numpy_view(), 0
    for p in parameters:
        dest = p.numpy_view()
        dest[...] = flat[offset:offset + dest.size].reshape(dest.shape)
        p._version += 1
        offset += dest.size
