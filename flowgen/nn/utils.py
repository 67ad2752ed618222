"""`nn.utils`: gradient clipping.

Gradients are replaced, never scaled in place: eager autograd may hand the
same NumPy buffer to several tensors (an `add`'s two inputs get one gradient
array), so writing into one would scale the others too.

Inside `nn.Graph.build()`, after `loss.backward()`, the clipping functions work
on the step's gradients: the tracer differentiates the loss at that point, the
global norm becomes a reduction in the graph, the clipped gradients replace the
step's gradients (the scale runs in the update kernels), and the total norm is
a lazy tensor that `build()` may return. In a data-parallel graph the gradients
build() reads are already reduced over the ranks (passes/gradient_allreduce.py),
so the clip is the global batch's; with ZeRO stage 2 or 3 the sharded
parameters' gradients are this rank's pieces (passes/zero.py): the pieces are
clipped and their part of the norm is summed over the ranks.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.ops import registry
from flowgen.ops.registry import apply
from flowgen.passes.zero import regathered
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


def _total_norm(grads: list, norm_type: float, pieces: list = (), world_size: int = 1):
    """The joint `norm_type`-norm of `grads` (lazy in a graph) and of the reduced gradients whose
    pieces (ZeRO-2/3, this rank's) are `pieces`: their powered sums are added over the ranks."""
    if math.isinf(norm_type):
        if pieces:
            raise NotImplementedError(f"nn.utils.clip_grad_norm_(norm_type={norm_type}) inside build() with "
                                      "enable_zero(stage=2|3): the extremum over the ranks' gradient pieces is not "
                                      "supported; use a finite norm_type or stage=1")
        # inf: the largest |g|; -inf: the smallest (PyTorch's vector_norm). NaN propagates.
        extremum, pick = (F.amax, F.maximum) if norm_type > 0 else (F.amin, F.minimum)
        per_grad = [extremum(F.abs(g)) for g in grads]
        total = per_grad[0]
        for part in per_grad[1:]:
            total = pick(total, part)
        return total
    if norm_type == 0:
        raise NotImplementedError("nn.utils.clip_grad_norm_(norm_type=0) (a count of non-zero entries) is not "
                                  "supported in a graph; use a positive norm_type")
    parts = [_powered_sum(grads, norm_type)] if grads else []
    if pieces:
        parts.append(apply("all_reduce", _powered_sum(pieces, norm_type), op="sum", world_size=world_size))
    total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return total if norm_type == 1 else F.pow(total, 1.0 / norm_type)


def _powered_sum(grads: list, norm_type: float):
    powered = [F.sum(F.abs(g) if norm_type == 1 else F.pow(F.abs(g), norm_type)) for g in grads]
    total = powered[0]
    for part in powered[1:]:
        total = total + part
    return total


def _clip_coef(total, max_norm: float):
    return F.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_by_total_norm(grads: list, max_norm: float, norm_type: float) -> tuple:
    """(total norm, clipped gradients) for gradients given as flowgen tensors (lazy in a graph):
    the joint `norm_type`-norm, and each gradient times min(max_norm / (total + 1e-6), 1)."""
    total = _total_norm(grads, float(norm_type))
    coef = _clip_coef(total, max_norm)
    return total, [g * coef for g in grads]


def _traced_step_gradients(parameters, name: str) -> tuple:
    """Inside build(): ({parameter: its lazy gradient}, {parameter: (its lazy piece, every rank's
    piece size)} for the gradients ZeRO-2/3 reduce-scattered, passes/zero.py) for the step being traced."""
    tracer = registry._tracer_hook
    grads = tracer.step_gradients(f"nn.utils.{name}")
    names = {p: tracer.state_of[id(p)].name for p in parameters
             if id(p) in tracer.state_of and tracer.state_of[id(p)].name in grads}
    pieces = {p: (tracer.lazy(tracer.gradient_pieces[n][0]), tracer.gradient_pieces[n][1])
              for p, n in names.items() if n in tracer.gradient_pieces}
    return {p: tracer.lazy(grads[n]) for p, n in names.items()}, pieces


def _replace_traced_gradients(clipped: dict, pieces: dict) -> None:
    """The step's gradients become `clipped` ({parameter: gradient}) and, for the ZeRO-2/3 ones,
    `pieces` ({parameter: (piece, sizes)}): their gradient is the piece regathered."""
    tracer = registry._tracer_hook
    for p, (piece, sizes) in pieces.items():
        tracer.gradient_pieces[tracer.state_of[id(p)].name] = (piece._value, sizes)
        clipped[p] = regathered(piece, sizes, tuple(p.shape))
    tracer.replace_step_gradients({tracer.state_of[id(p)].name: g._value for p, g in clipped.items()})


def _tracing(parameters) -> bool:
    return registry._tracer_hook is not None and any(p.is_lazy for p in parameters)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """Scale all gradients together so that their joint `norm_type`-norm is at most `max_norm`.

    Returns the total norm before clipping (a 0-d tensor, float64 when a gradient is, else float32),
    as PyTorch. Inside
    `nn.Graph.build()` it clips the step's gradients and returns the norm as a lazy tensor.
    """
    parameters = _parameter_list(parameters)
    if _tracing(parameters):
        if error_if_nonfinite:
            raise RuntimeError("nn.utils.clip_grad_norm_(error_if_nonfinite=True) inside nn.Graph.build(): a "
                               "compiled step cannot raise; return the total norm and check it after the call")
        grads, pieces = _traced_step_gradients(parameters, "clip_grad_norm_")
        if not grads:
            return Tensor(np.float32(0.0), dtype=dt.float32)
        whole = {p: g for p, g in grads.items() if p not in pieces}
        world_size = len(next(iter(pieces.values()))[1]) if pieces else 1
        total = _total_norm(list(whole.values()), float(norm_type), [piece for piece, _ in pieces.values()],
                            world_size)
        coef = _clip_coef(total, max_norm)
        _replace_traced_gradients({p: g * coef for p, g in whole.items()},
                                  {p: (piece * coef, sizes) for p, (piece, sizes) in pieces.items()})
        return total
    grads = _grads(parameters)
    if not grads:   # PyTorch: torch.tensor(0.0), the default float
        return Tensor(np.float32(0.0), dtype=dt.float32)
    norm_type = float(norm_type)
    # As PyTorch: each gradient's norm, then the norm of those norms (np.linalg.norm: inf is the max,
    # -inf the min, 0 the count of non-zeros; NaN propagates), in float64 when a gradient is float64.
    norm_dtype = dt.float64 if any(g.dtype == dt.float64 for g in grads) else dt.float32
    real = norm_dtype.np_dtype.type
    arrays = [g.numpy_view().astype(real, copy=False).ravel() for g in grads]
    per_grad = np.array([np.linalg.norm(a, norm_type) if a.size else 0.0 for a in arrays], real)
    total = real(np.linalg.norm(per_grad, norm_type))
    if error_if_nonfinite and not np.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           f"so it cannot be clipped. To disable this error and scale the gradients by the "
                           f"non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = np.minimum(real(max_norm) / (total + real(1e-6)), real(1.0))
    for g in grads:
        _replace(g, g.numpy_view() * coef)
    return Tensor(np.asarray(total, real), dtype=norm_dtype)


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every gradient element into [-clip_value, clip_value] (inside `nn.Graph.build()`:
    the step's gradients)."""
    parameters = _parameter_list(parameters)
    if _tracing(parameters):
        grads, pieces = _traced_step_gradients(parameters, "clip_grad_value_")
        _replace_traced_gradients({p: F.clamp(g, -clip_value, clip_value) for p, g in grads.items() if p not in pieces},
                                  {p: (F.clamp(piece, -clip_value, clip_value), sizes)
                                   for p, (piece, sizes) in pieces.items()})
        return
    for g in _grads(parameters):
        _replace(g, np.clip(g.numpy_view(), -clip_value, clip_value))


def parameters_to_vector(parameters) -> Tensor:
    """The parameters flattened and concatenated, in their dtype (differentiable, as PyTorch's)."""
    return F.cat([F.reshape(p, (-1,)) for p in _parameter_list(parameters)])


def vector_to_parameters(vec: Tensor, parameters) -> None:
    flat, offset = vec.numpy_view(), 0
    for p in parameters:
        dest = p.numpy_view()
        dest[...] = flat[offset:offset + dest.size].reshape(dest.shape)
        p._version += 1
        offset += dest.size
