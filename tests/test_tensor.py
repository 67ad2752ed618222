"""Tensor basics: creation, dtypes, printing, random streams, autograd mechanics."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowgen as flow
from flowgen import functional as F
from flowgen import random as frandom
from flowgen.tensor import INPLACE_METHODS, TENSOR_METHODS
from torch_oracle import get_torch


# ================================================================= creation
def test_tensor_from_data_and_default_dtypes():
    assert flow.tensor([1.0, 2.0]).dtype == flow.float32
    assert flow.tensor([1, 2]).dtype == flow.int64
    assert flow.tensor([True, False]).dtype == flow.bool
    assert flow.tensor(np.zeros(3)).dtype == flow.float64            # arrays keep their dtype (PyTorch)
    assert flow.tensor(np.zeros(3, np.int32)).dtype == flow.int32
    assert flow.tensor(np.zeros(3, np.float16)).dtype == flow.float16
    assert flow.tensor([1, 2], dtype=flow.float16).dtype == flow.float16
    assert flow.tensor([1.5], dtype="bfloat16").dtype == flow.bfloat16
    assert flow.tensor(3.5).shape == () and flow.tensor(3.5).item() == 3.5
    assert flow.tensor([]).shape == (0,)
    t = flow.tensor([[1, 2], [3, 4]], dtype=flow.float32, requires_grad=True)
    assert t.requires_grad and t.is_leaf and t.shape == (2, 2)
    with pytest.raises(RuntimeError, match="floating"):
        flow.tensor([1, 2], requires_grad=True)


def test_tensor_copies_data_and_from_numpy_shares():
    a = np.arange(4, dtype=np.float32)
    t = flow.tensor(a)
    a[0] = 9
    assert t[0].item() == 0
    u = flow.from_numpy(a)
    a[1] = 7
    assert u[1].item() == 7 and u.dtype == flow.float32
    assert flow.from_numpy(np.zeros(2)).dtype == flow.float64
    c = flow.tensor(t)
    assert c.numpy() is not t.numpy() and c.tolist() == t.tolist()
    assert flow.as_tensor(t) is t


def test_tensor_from_list_of_tensors():
    parts = [flow.tensor(1.0), flow.tensor(2.5)]
    assert flow.tensor(parts).tolist() == [1.0, 2.5]
    assert flow.tensor([flow.tensor([1, 2]), flow.tensor([3, 4])]).shape == (2, 2)


@pytest.mark.parametrize("fn,fill", [(flow.zeros, 0), (flow.ones, 1), (flow.empty, None)])
def test_fills(fn, fill):
    for args in ((2, 3), ((2, 3),), ([2, 3],), (flow.Size([2, 3]),)):
        t = fn(*args)
        assert t.shape == (2, 3) and t.dtype == flow.float32
        if fill is not None:
            assert (t.numpy() == fill).all()
    assert fn(4, dtype=flow.int64).dtype == flow.int64
    assert fn(2, requires_grad=True).requires_grad
    assert fn(()).shape == ()


def test_full_arange_linspace_eye():
    assert flow.full((2, 2), 7).dtype == flow.int64 and flow.full((2, 2), 7).tolist() == [[7, 7], [7, 7]]
    assert flow.full((2,), 0.5).dtype == flow.float32
    assert flow.full([3], True).dtype == flow.bool
    assert flow.arange(5).tolist() == [0, 1, 2, 3, 4] and flow.arange(5).dtype == flow.int64
    assert flow.arange(1, 7, 2).tolist() == [1, 3, 5]
    np.testing.assert_allclose(flow.arange(0, 1, 0.25).numpy(), [0, 0.25, 0.5, 0.75])
    assert flow.arange(0, 1, 0.25).dtype == flow.float32
    assert flow.arange(3, dtype=flow.float32).dtype == flow.float32
    np.testing.assert_allclose(flow.linspace(0, 1, 5).numpy(), [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_array_equal(flow.eye(3).numpy(), np.eye(3))


def test_like_functions():
    x = flow.randn(2, 3, dtype=flow.float16)
    for fn in (flow.zeros_like, flow.ones_like, flow.empty_like, flow.randn_like, flow.rand_like):
        y = fn(x)
        assert y.shape == (2, 3) and y.dtype == flow.float16
    assert flow.full_like(x, 3.0).numpy().astype(np.float32).tolist() == [[3.0] * 3] * 2
    assert flow.zeros_like(x, dtype=flow.int64).dtype == flow.int64
    assert F.zeros_like is flow.zeros_like and F.full_like is flow.full_like
    r = flow.randint_like(flow.zeros(100), 3)
    assert r.numpy().min() >= 0 and r.numpy().max() < 3


def test_random_creation_distributions_and_seed():
    flow.manual_seed(7)
    a = flow.randn(1000)
    flow.manual_seed(7)
    b = flow.randn(1000)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.dtype == flow.float32 and abs(float(a.mean())) < 0.15 and 0.85 < float(a.std()) < 1.15
    u = flow.rand(1000)
    assert u.numpy().min() >= 0 and u.numpy().max() < 1
    r = flow.randint(3, 9, (1000,))
    assert r.dtype == flow.int64 and r.numpy().min() == 3 and r.numpy().max() == 8
    assert flow.randint(4, (2, 2)).shape == (2, 2)
    assert flow.randint(0, 4, size=(3,)).shape == (3,)
    assert sorted(flow.randperm(6).tolist()) == list(range(6))
    assert flow.randn(2, 3, dtype=flow.bfloat16).dtype == flow.bfloat16
    assert not np.array_equal(flow.randn(5).numpy(), flow.randn(5).numpy())


def test_cuda_namespace_and_device():
    assert isinstance(flow.cuda.is_available(), bool)
    assert flow.device("cuda") == flow.device("cuda:0")
    t = flow.zeros(2, device="cuda")
    assert t.device.type == "cuda" and t.is_cuda
    assert t.cpu().device == flow.device("cpu")
    assert "device='cuda:0'" in repr(t)


# ================================================================= printing, conversion
def test_repr_oneflow_style():
    assert repr(flow.tensor([[1.0, 2.0]])) == "tensor([[1.0000, 2.0000]], dtype=flowgen.float32)"
    assert repr(flow.tensor([1, 2])) == "tensor([1, 2], dtype=flowgen.int64)"
    assert repr(flow.tensor(2.5)) == "tensor(2.5000, dtype=flowgen.float32)"
    assert repr(flow.tensor([1.5], dtype=flow.bfloat16)) == "tensor([1.5000], dtype=flowgen.bfloat16)"
    assert repr(flow.tensor([True])) == "tensor([ True], dtype=flowgen.bool)"
    assert "requires_grad=True" in repr(flow.ones(1, requires_grad=True))
    assert "grad_fn=<mul_backward>" in repr(flow.ones(1, requires_grad=True) * 2)
    assert repr(flow.zeros(2, 3).shape) == "flowgen.Size([2, 3])"
    assert flow.Size([2, 3]) == (2, 3) and flow.Size([2, 3]).numel() == 6
    assert repr(flow.float32) == "flowgen.float32"


def test_numpy_interop():
    x = flow.tensor([0.5, 1.0])
    s = np.sin(x)
    np.testing.assert_allclose(s, np.sin([0.5, 1.0]), rtol=1e-6)
    assert flow.tensor(np.sin(x)).dtype == flow.float32
    assert np.asarray(x, dtype=np.float64).dtype == np.float64
    assert x.numpy().dtype == np.float32 and x.tolist() == [0.5, 1.0]
    assert float(flow.tensor([2.5])) == 2.5 and int(flow.tensor(3)) == 3
    assert f"{flow.tensor(1.23456):.2f}" == "1.23"
    with pytest.raises(ValueError, match="one element"):
        flow.zeros(2).item()
    assert len(flow.zeros(4, 2)) == 4


def test_dtype_objects():
    from flowgen import dtype as dt
    assert flow.float is flow.float32 and flow.half is flow.float16 and flow.long is flow.int64
    assert flow.int is flow.int32
    assert dt.get("float16") is flow.float16 and dt.get(float) is flow.float32 and dt.get(bool) is flow.bool
    assert dt.promote(flow.int64, flow.float16) is flow.float16
    assert flow.bfloat16.ctype == "__nv_bfloat16" and flow.bfloat16.itemsize == 2
    assert flow.zeros(2).to(flow.bfloat16).numpy().dtype == flow.bfloat16.np_dtype


# ================================================================= methods
def test_every_tensor_method_is_a_functional():
    for name in TENSOR_METHODS | INPLACE_METHODS:
        assert callable(getattr(F, name, None)), name
        assert callable(getattr(flow.zeros(1), name)), name
    for name in INPLACE_METHODS:
        assert callable(getattr(flow.zeros(1), name + "_")), name


def test_functional_exports():
    for name in ("add", "sub", "mul", "div", "matmul", "cat", "stack", "where", "clone", "detach", "full_like",
                 "zeros_like", "ones_like", "reshape", "permute", "sum", "mean", "max", "min", "argmax",
                 "exp", "log", "relu", "gelu", "softmax", "split", "chunk", "masked_fill", "clamp", "pow",
                 "manual_seed", "tensor", "randn", "arange", "bmm", "mm", "var", "std", "transpose"):
        assert callable(getattr(flow, name)), name
    assert flow.sum is F.sum
    assert not hasattr(flow, "apply")


# ================================================================= random streams
def test_philox_known_answer_vectors():
    # Random123's published Philox4x32-10 known-answer vectors.
    words = frandom.philox4x32_10((0, 0, 0, 0), (0, 0))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    words = frandom.philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)
    assert [int(w) for w in words] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    words = frandom.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert [int(w) for w in words] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_uniform_stream_definition():
    seed, offset, n = 0x1234_5678_9ABC_DEF0, (3 << 32) + 17, 11
    u = frandom.philox_uniform(seed, offset, n)
    assert u.dtype == np.float32 and u.shape == (n,)
    for i in range(n):   # the docstring's per-element definition, one element at a time
        counter = (i >> 2, offset & 0xFFFFFFFF, offset >> 32, 0)
        r = int(frandom.philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32))[i & 3])
        assert u[i] == np.float32((r >> 8) * 2.0 ** -24)
    big = frandom.philox_uniform(5, 0, 100_000)
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.01
    # a prefix of a longer stream is the shorter stream; another offset is another stream
    np.testing.assert_array_equal(frandom.philox_uniform(5, 0, 10), big[:10])
    assert not np.array_equal(frandom.philox_uniform(5, 1, 10), big[:10])


def test_next_dropout_seed_advances_and_manual_seed_resets():
    flow.manual_seed(42)
    a = [frandom.next_dropout_seed() for _ in range(3)]
    assert a == [(42, 0), (42, 1), (42, 2)]
    flow.manual_seed(42)
    assert frandom.next_dropout_seed() == (42, 0)
    flow.manual_seed(-1)
    assert frandom.next_dropout_seed()[0] == 2 ** 64 - 1
    assert frandom.initial_seed() == 2 ** 64 - 1


# ================================================================= autograd
def test_grad_accumulates_and_retain_grad():
    x = flow.tensor([1.0, 2.0], requires_grad=True)
    (x * x).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 7.0])
    y = x * 2
    y.retain_grad()
    z = (y * y).sum()
    z.backward()
    np.testing.assert_allclose(y.grad.numpy(), 2 * y.numpy())
    w = x * 2
    (w * w).sum().backward()
    assert w.grad is None


def test_shared_gradient_buffers_are_not_aliased():
    a = flow.tensor([1.0, 2.0], requires_grad=True)
    b = flow.tensor([3.0, 4.0], requires_grad=True)
    (a + b).sum().backward()
    a.grad.zero_()
    assert b.grad.tolist() == [1.0, 1.0]


def test_no_grad_and_enable_grad():
    x = flow.tensor([1.0], requires_grad=True)
    with flow.no_grad():
        y = x * 2
        with flow.enable_grad():
            z = x * 2
    assert not y.requires_grad and y.grad_fn is None and z.requires_grad

    @flow.no_grad()
    def f(v):
        return v * 3

    assert not f(x).requires_grad
    assert flow.is_grad_enabled()


def test_detach_and_non_float_outputs():
    x = flow.tensor([1.0, -2.0], requires_grad=True)
    d = x.detach()
    assert not d.requires_grad
    d[0] = 5.0                              # detach shares storage, like torch
    assert x[0].item() == 5.0
    assert not (x > 0).requires_grad and not x.argmax().requires_grad
    y = (x * x.detach()).sum()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, -2.0])


def test_backward_errors_and_gradient_argument():
    x = flow.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x * x
    with pytest.raises(RuntimeError, match=r"scalar.*shape \(3,\)"):
        y.backward()
    y.backward(flow.tensor([1.0, 0.5, 0.0]))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0, 0.0])
    x.grad = None
    (x * x).backward(np.array([1.0, 1.0, 1.0], np.float32))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0, 6.0])
    with pytest.raises(RuntimeError, match="gradient shape"):
        (x * 2).backward(flow.ones(2))
    with pytest.raises(RuntimeError, match="does not require grad"):
        flow.ones(2).sum().backward()


def test_diamond_graph_and_reuse():
    x = flow.tensor([0.5, -1.5], requires_grad=True)
    a = x.exp()
    b = a * x + a.sin() * a
    b.sum().backward()
    xv = np.array([0.5, -1.5])
    ea = np.exp(xv)
    expected = ea * xv + ea + np.cos(ea) * ea * ea + np.sin(ea) * ea
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)


def test_autograd_matches_torch_on_a_small_mlp():
    torch = get_torch()
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((8, 5)).astype(np.float32)
    w1 = rng.standard_normal((5, 7)).astype(np.float32)
    w2 = rng.standard_normal((7, 3)).astype(np.float32)
    fx, f1, f2 = flow.tensor(xs), flow.tensor(w1, requires_grad=True), flow.tensor(w2, requires_grad=True)
    tx, t1, t2 = torch.tensor(xs), torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
    fl = (flow.gelu(fx @ f1) @ f2).tanh().pow(2).mean()
    tl = (torch.nn.functional.gelu(tx @ t1) @ t2).tanh().pow(2).mean()
    fl.backward()
    tl.backward()
    np.testing.assert_allclose(fl.item(), tl.item(), rtol=1e-5)
    np.testing.assert_allclose(f1.grad.numpy(), t1.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(f2.grad.numpy(), t2.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_float64_gradients_stay_float64():
    x = flow.tensor(np.array([1.0, 2.0]), dtype=flow.float64, requires_grad=True)
    (x * x).sum().backward()
    (x * x).sum().backward()
    assert x.grad.dtype == flow.float64
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 8.0])


# ================================================================= in-place
def test_inplace_ops_and_version():
    t = flow.zeros(3)
    v0 = t._version
    buf = t.numpy()
    t.add_(1).mul_(3).sub_(1).div_(2)
    assert t.tolist() == [1.0, 1.0, 1.0] and t.numpy() is buf and t._version > v0
    t += 1
    assert t.numpy() is buf and t.tolist() == [2.0, 2.0, 2.0]
    t.fill_(4)
    assert t.tolist() == [4.0, 4.0, 4.0]
    t.zero_()
    assert t.tolist() == [0.0, 0.0, 0.0]
    t.copy_(flow.tensor([1.0, 2.0, 3.0]))
    t.clamp_(max=2.0)
    assert t.tolist() == [1.0, 2.0, 2.0]
    i = flow.tensor([1, 2])
    i.add_(1.7)
    assert i.dtype == flow.int64


def test_augmented_assignment_under_autograd_keeps_gradients():
    w = flow.tensor([1.0, 2.0], requires_grad=True)
    h = w * 2
    h += w            # recorded: behaves as h = h + w
    h.sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [3.0, 3.0])
    with flow.no_grad():
        buf = w.numpy()
        w -= 0.5 * w.grad     # optimizer-style update: in place
    assert w.numpy() is buf and w.requires_grad and w.is_leaf
    np.testing.assert_allclose(w.numpy(), [-0.5, 0.5])


# ================================================================= 0-d tensors
@pytest.mark.parametrize("dtype", [flow.float32, flow.float64])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_a_0d_tensor(dtype, approximate):
    """A 0-d tensor goes through GELU and its gradient like any other (issue 9: the float64 erf
    of a 0-d array was a Python float)."""
    x = flow.tensor(0.5, dtype=dtype, requires_grad=True)
    y = flow.nn.functional.gelu(x, approximate=approximate)
    y.backward()
    assert y.shape == () and y.dtype == dtype and x.grad.shape == ()
    v = flow.nn.functional.gelu(flow.tensor([0.5], dtype=dtype), approximate=approximate)
    np.testing.assert_allclose(y.numpy(), v.numpy()[0], rtol=1e-6)
    expected = 0.5 * 0.5 * (1 + math.erf(0.5 / math.sqrt(2)))
    np.testing.assert_allclose(float(y.numpy()), expected, rtol=1e-3)
