"""Finite-difference gradient check for eager flowgen functions (used by test_ops_nn.py).

`check_grad(fn, arrays, wrt)` evaluates ``fn`` on float64 tensors built from
``arrays`` (integer arrays stay index tensors), backpropagates a random
upstream gradient R, and compares each requested input's gradient with
central differences of ``sum(fn(...) * R)``.
"""
from __future__ import annotations

import numpy as np

import flowgen as flow
from flowgen import dtype as dt
from flowgen.tensor import Tensor


def _tensor(a, requires_grad=False):
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return Tensor(a.astype(np.float64), dtype=dt.float64, requires_grad=requires_grad)
    return Tensor(a, dtype=dt.from_numpy(a.dtype))


def check_grad(fn, arrays, wrt=None, eps=1e-6, atol=1e-5, rtol=1e-4, seed=0):
    arrays = [np.array(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f" else np.asarray(a) for a in arrays]
    if wrt is None:
        wrt = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
    inputs = [_tensor(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
    out = fn(*inputs)
    rng = np.random.default_rng(seed)
    upstream = rng.standard_normal(tuple(out.shape))
    out.backward(Tensor(upstream, dtype=dt.float64))

    def objective(arrs):
        with flow.no_grad():
            res = fn(*[_tensor(a) for a in arrs])
        return float(np.sum(res.numpy().astype(np.float64) * upstream))

    for i in wrt:
        analytic = inputs[i].grad
        assert analytic is not None, f"input {i} got no gradient"
        analytic = analytic.numpy()
        numeric = np.zeros_like(arrays[i])
        flat = numeric.reshape(-1)
        for k in range(arrays[i].size):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[i].reshape(-1)[k] += eps
            minus[i].reshape(-1)[k] -= eps
            flat[k] = (objective(plus) - objective(minus)) / (2 * eps)
        np.testing.assert_allclose(analytic, numeric, atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {i} disagrees with finite differences")
