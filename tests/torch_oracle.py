"""PyTorch as a test-only oracle: tests using it skip cleanly when torch is not installed.

    from torch_oracle import get_torch, compare_with_torch
    torch = get_torch()            # pytest.importorskip("torch")
    compare_with_torch(lambda a, b: a @ b, lambda a, b: a @ b, x, y)

`compare_with_torch(flow_fn, torch_fn, *arrays, atol, rtol, grad=True)` runs both
functions on the same float32 inputs (integer/bool arrays pass as index tensors),
compares the forward results, backpropagates the same random upstream gradient
through both and compares every floating input's gradient.
"""
from __future__ import annotations

import numpy as np
import pytest

import flowgen as flow


def get_torch():
    return pytest.importorskip("torch")


def to_torch(a, requires_grad=False):
    torch = get_torch()
    a = np.asarray(a)
    t = torch.from_numpy(a.copy())
    if requires_grad:
        t.requires_grad_(True)
    return t


def _flow_tensor(a, requires_grad):
    a = np.asarray(a)
    return flow.tensor(a, dtype=flow.float32 if a.dtype.kind == "f" else None, requires_grad=requires_grad)


def compare_with_torch(flow_fn, torch_fn, *arrays, atol=1e-5, rtol=1e-4, grad=True, seed=0):
    torch = get_torch()
    arrays = [np.asarray(a, dtype=np.float32) if np.asarray(a).dtype.kind == "f" else np.asarray(a)
              for a in arrays]
    floating = [a.dtype.kind == "f" for a in arrays]
    f_in = [_flow_tensor(a, grad and fl) for a, fl in zip(arrays, floating)]
    t_in = [to_torch(a, grad and fl) for a, fl in zip(arrays, floating)]
    f_out = flow_fn(*f_in)
    t_out = torch_fn(*t_in)
    f_outs = list(f_out) if isinstance(f_out, (tuple, list)) else [f_out]
    t_outs = list(t_out) if isinstance(t_out, (tuple, list)) else [t_out]
    assert len(f_outs) == len(t_outs)
    for i, (fo, to) in enumerate(zip(f_outs, t_outs)):
        expected = to.detach().numpy()
        got = fo.numpy()
        assert tuple(got.shape) == tuple(expected.shape), f"output {i}: shape {got.shape} vs torch {expected.shape}"
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), atol=atol, rtol=rtol,
                                   err_msg=f"output {i} differs from torch")
    if not grad:
        return
    rng = np.random.default_rng(seed)
    f_total = t_total = None
    for fo, to in zip(f_outs, t_outs):
        if not fo.dtype.is_floating or not fo.requires_grad:
            continue
        r = rng.standard_normal(tuple(fo.shape)).astype(np.float32)
        fterm = (fo * flow.tensor(r)).sum()
        tterm = (to * torch.from_numpy(r)).sum()
        f_total = fterm if f_total is None else f_total + fterm
        t_total = tterm if t_total is None else t_total + tterm
    if f_total is None:
        return
    f_total.backward()
    t_total.backward()
    for i, (fi, ti, fl) in enumerate(zip(f_in, t_in, floating)):
        if not fl:
            continue
        expected = ti.grad.numpy() if ti.grad is not None else np.zeros(ti.shape, np.float32)
        got = fi.grad.numpy() if fi.grad is not None else np.zeros(fi.shape, np.float32)
        np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol, err_msg=f"gradient of input {i} differs")
