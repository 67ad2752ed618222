"""Finite-difference gradient checking for flowgen functions (float64 central differences).

    from gradcheck import check_grad
    check_grad(lambda a, b: (a * b).sum(1), np_a, np_b)

`check_grad(fn, *inputs, atol=1e-5, rtol=1e-3, eps=1e-6, wrt=None, seed=0)`:

* ``inputs`` are NumPy arrays, lists, scalars or flowgen tensors. Floating ones are
  converted to float64 tensors; integer/bool ones are passed as tensors of their
  dtype (indices, masks). Non-array Python objects (ints, tuples...) pass through.
* ``wrt`` lists the input positions to check; by default every floating input
  (or, if some inputs are tensors with ``requires_grad=True``, exactly those).
* ``fn`` returns a tensor or a tuple of tensors; non-floating outputs are ignored.
  A fixed random upstream gradient R is backpropagated and compared with central
  differences of ``sum(fn(x) * R)``, all in float64.

Returns the analytic gradients (NumPy arrays, one per checked input, in order);
raises AssertionError naming the input, the worst element and both values.
"""
from __future__ import annotations

import numbers

import numpy as np

import flowgen as flow
from flowgen import dtype as dt
from flowgen.tensor import Tensor


def _as_array(x):
    if isinstance(x, Tensor):
        return x.numpy().copy()
    if isinstance(x, (np.ndarray, list)) or isinstance(x, numbers.Number) and not isinstance(x, bool):
        return np.array(x)
    return None


def _to_tensor(a, requires_grad=False):
    if a.dtype.kind == "f" or a.dtype == dt.bfloat16.np_dtype:
        return Tensor(a.astype(np.float64), dtype=dt.float64, requires_grad=requires_grad)
    return Tensor(a, dtype=dt.from_numpy(a.dtype) if a.dtype != np.bool_ else dt.bool_)


def _outputs(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, Tensor) and o.dtype.is_floating]


def check_grad(fn, *inputs, atol=1e-5, rtol=1e-3, eps=1e-6, wrt=None, seed=0):
    arrays = [_as_array(x) for x in inputs]
    floating = [i for i, a in enumerate(arrays) if a is not None and (a.dtype.kind == "f" or a.dtype.kind == "V")]
    if wrt is None:
        marked = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
        wrt = marked or floating
    wrt = list(wrt)
    for i in wrt:
        if i not in floating:
            raise ValueError(f"check_grad: input {i} is not floating point and cannot be checked")
    arrays = [a.astype(np.float64) if i in floating else a for i, a in enumerate(arrays)]

    def build(arrs, grad_for=()):
        return [x if a is None else _to_tensor(a, requires_grad=i in grad_for)
                for i, (x, a) in enumerate(zip(inputs, arrs))]

    args = build(arrays, wrt)
    outs = _outputs(fn(*args))
    if not outs:
        raise ValueError("check_grad: fn returned no floating-point tensor")
    rng = np.random.default_rng(seed)
    upstream = [rng.standard_normal(tuple(o.shape)) for o in outs]
    total = None
    for o, r in zip(outs, upstream):
        term = (o * Tensor(r, dtype=dt.float64)).sum()
        total = term if total is None else total + term
    total.backward()

    def objective(arrs):
        with flow.no_grad():
            res = _outputs(fn(*build(arrs)))
        return float(sum(np.sum(o.numpy().astype(np.float64) * r) for o, r in zip(res, upstream)))

    grads = []
    for i in wrt:
        analytic = args[i].grad
        analytic = np.zeros_like(arrays[i]) if analytic is None else analytic.numpy().astype(np.float64)
        assert analytic.shape == arrays[i].shape, (
            f"check_grad: gradient of input {i} has shape {analytic.shape}, input has {arrays[i].shape}")
        numeric = np.zeros_like(arrays[i])
        flat = numeric.reshape(-1)
        for k in range(arrays[i].size):
            plus = list(arrays)
            minus = list(arrays)
            plus[i] = arrays[i].copy()
            minus[i] = arrays[i].copy()
            plus[i].reshape(-1)[k] += eps
            minus[i].reshape(-1)[k] -= eps
            flat[k] = (objective(plus) - objective(minus)) / (2 * eps)
        err = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
        if err.size and err.max() > 0:
            k = int(np.argmax(err))
            idx = np.unravel_index(k, err.shape)
            raise AssertionError(
                f"check_grad: input {i} (shape {arrays[i].shape}) gradient mismatch at {idx}: "
                f"analytic {analytic[idx]:.8g} vs numeric {numeric[idx]:.8g}\n"
                f"analytic:\n{analytic}\nnumeric:\n{numeric}")
        grads.append(analytic)
    return grads
