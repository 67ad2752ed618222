"""`nn.utils`: gradient clipping.

Gradients are replaced, never scaled in place: eager autograd may hand the
same NumPy buffer to several tensors (an `add`'s two inputs get one gradient
array), so writing into one would scale the others too.

Inside `nn.Graph.build()`, after `loss.backward()`, the clipping functions work
on the step's gradients: the tracer differentiates the loss at that point, the
global norm becomes a reduction in the graph, the clipped gradients replace the
step's gradients (the scale runs in the update kernels), and the total norm is
a lazy tensor that `build()` may return.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import functional as F
from flowgen.ops import registry
from flowgen.tensor import Tensor


def _grads(parameters) -> list:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def _replace(grad: Tensor, array: np.ndarray) -> None:
    grad._data = np.array(array, dtype=grad.dtype.np_dtype, order="C")
    grad._version += 1


def _parameter_list(parameters) -> list:
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def clip_by_total_norm(grads: list, max_norm: float, norm_type: float) -> tuple:
    """(total norm, clipped gradients) for gradients given as flowgen tensors (lazy in a graph):
    the joint `norm_type`-norm, and each gradient times min(max_norm / (total + 1e-6), 1)."""
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        per_grad = [F.amax(F.abs(g)) for g in grads]
        total = per_grad[0]
        for part in per_grad[1:]:
            total = F.maximum(total, part)
    else:
        powered = [F.sum(F.abs(g) if norm_type == 1 else F.pow(F.abs(g), norm_type)) for g in grads]
        total = powered[0]
        for part in powered[1:]:
            total = total + part
        if norm_type != 1:
            total = F.pow(total, 1.0 / norm_type)
    coef = F.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, [g * coef for g in grads]


def _traced_step_gradients(parameters, name: str) -> dict:
    """Inside build(): {parameter: its lazy gradient} for the step being traced."""
    tracer = registry._tracer_hook
    grads = tracer.step_gradients(f"nn.utils.{name}")
    return {p: tracer.lazy(grads[tracer.state_of[id(p)].name]) for p in parameters
            if id(p) in tracer.state_of and tracer.state_of[id(p)].name in grads}


def _replace_traced_gradients(clipped: dict) -> None:
    tracer = registry._tracer_hook
    tracer.replace_step_gradients({tracer.state_of[id(p)].name: g._value for p, g in clipped.items()})


def _tracing(parameters) -> bool:
    return registry._tracer_hook is not None and any(p.is_lazy for p in parameters)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """Scale all gradients together so that their joint `norm_type`-norm is at most `max_norm`.

    Returns the total norm before clipping (a 0-d float32 tensor), as PyTorch. Inside
    `nn.Graph.build()` it clips the step's gradients and returns the norm as a lazy tensor.
    """
    parameters = _parameter_list(parameters)
    if _tracing(parameters):
        if error_if_nonfinite:
            raise RuntimeError("nn.utils.clip_grad_norm_(error_if_nonfinite=True) inside nn.Graph.build(): a "
                               "compiled step cannot raise; return the total norm and check it after the call")
        grads = _traced_step_gradients(parameters, "clip_grad_norm_")
        if not grads:
            return Tensor(np.float32(0.0))
        total, clipped = clip_by_total_norm(list(grads.values()), max_norm, norm_type)
        _replace_traced_gradients(dict(zip(grads, clipped)))
        return total
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
    """Clamp every gradient element into [-clip_value, clip_value] (inside `nn.Graph.build()`:
    the step's gradients)."""
    parameters = _parameter_list(parameters)
    if _tracing(parameters):
        grads = _traced_step_gradients(parameters, "clip_grad_value_")
        _replace_traced_gradients({p: F.clamp(g, -clip_value, clip_value) for p, g in grads.items()})
        return
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
