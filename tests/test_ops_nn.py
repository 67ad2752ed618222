"""NN primitive ops (flowgen/ops/nn_ops.py) and flow.nn.functional.

Every op: forward against a plain NumPy loop (or torch), gradients against
finite differences, and — with torch installed — forward and gradients
against torch for the configurations the compiler must support.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn.functional as F
from flowgen import dtype as dt
from flowgen.ops.registry import apply
from flowgen.tensor import Tensor

from gradcheck import check_grad

try:
    import torch
    import torch.nn.functional as TF
except ImportError:  # torch is a test-only oracle; the NumPy-loop tests still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch (test-only oracle) is not installed")

RNG = np.random.default_rng(1234)


# --------------------------------------------------------------------------- helpers

def ft(a, requires_grad=False, dtype=None):
    a = np.asarray(a)
    if dtype is None:
        dtype = dt.from_numpy(a.dtype)
    return Tensor(a, dtype=dtype, requires_grad=requires_grad)


def randn(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def compare_torch(flow_fn, torch_fn, arrays, wrt=(), rtol=1e-6, atol=1e-8, upstream=True):
    """Run both functions on the same arrays; compare outputs and gradients for inputs in `wrt`."""
    f_in = [ft(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
    t_in = [torch.tensor(a, requires_grad=i in wrt) for i, a in enumerate(arrays)]
    f_out = flow_fn(*f_in)
    t_out = torch_fn(*t_in)
    np.testing.assert_allclose(f_out.numpy(), t_out.detach().numpy(), rtol=rtol, atol=atol, err_msg="forward")
    if wrt:
        g = RNG.standard_normal(tuple(t_out.shape)).astype(np.asarray(arrays[wrt[0]]).dtype)
        f_out.backward(ft(g))
        t_out.backward(torch.tensor(g))
        for i in wrt:
            np.testing.assert_allclose(f_in[i].grad.numpy(), t_in[i].grad.numpy(), rtol=rtol, atol=atol,
                                       err_msg=f"gradient of input {i}")
    return f_out, t_out


# --------------------------------------------------------------------------- softmax

def _softmax_loop(x, dim):
    x = np.moveaxis(x, dim, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        e = np.exp(row - row.max())
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, dim)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_log_softmax_forward_and_grad(dim):
    x = randn(3, 4, 5)
    expected = _softmax_loop(x, dim)
    np.testing.assert_allclose(F.softmax(ft(x), dim).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(ft(x), dim).numpy(), np.log(expected), rtol=1e-10, atol=1e-12)
    check_grad(lambda t: F.softmax(t, dim), x)
    check_grad(lambda t: F.log_softmax(t, dim), x)


def test_softmax_is_stable_for_large_inputs():
    x = np.array([[1000.0, 1000.0, -1000.0]], np.float32)
    out = F.softmax(ft(x), 1).numpy()
    np.testing.assert_allclose(out, [[0.5, 0.5, 0.0]])
    assert np.isfinite(F.log_softmax(ft(x), 1).numpy()[0, :2]).all()


@needs_torch
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_softmax_vs_torch(dim):
    x = randn(2, 3, 6).astype(np.float32)
    compare_torch(lambda t: F.softmax(t, dim), lambda t: TF.softmax(t, dim), [x], wrt=(0,), rtol=1e-5, atol=1e-6)
    compare_torch(lambda t: F.log_softmax(t, dim), lambda t: TF.log_softmax(t, dim), [x], wrt=(0,),
                  rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- gather family

def test_gather_forward_and_grad():
    x = randn(3, 5)
    index = RNG.integers(0, 5, size=(3, 4))
    out = apply("gather", ft(x), ft(index), dim=1).numpy()
    for i, j in np.ndindex(index.shape):
        assert out[i, j] == x[i, index[i, j]]
    index0 = RNG.integers(0, 3, size=(2, 5))
    out0 = F.gather(ft(x), 0, ft(index0)).numpy()
    for i, j in np.ndindex(index0.shape):
        assert out0[i, j] == x[index0[i, j], j]
    check_grad(lambda t, ix: F.gather(t, 1, ix), x, index, wrt=[0])   # repeated indices accumulate
    check_grad(lambda t, ix: F.gather(t, 0, ix), x, index0, wrt=[0])


def test_scatter_add_and_index_add_forward_and_grad():
    index = RNG.integers(0, 4, size=(3, 6))
    src = randn(3, 6)
    out = apply("scatter_add", ft(index), ft(src), shape=(3, 4), dim=1).numpy()
    expected = np.zeros((3, 4))
    for i, j in np.ndindex(index.shape):
        expected[i, index[i, j]] += src[i, j]
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    check_grad(lambda s, ix: apply("scatter_add", ix, s, shape=(3, 4), dim=1), src, index, wrt=[0])

    idx = np.array([2, 0, 2, 1])
    src2 = randn(5, 4, 2)
    out2 = apply("index_add", ft(idx), ft(src2), shape=(5, 3, 2), dim=1).numpy()
    expected2 = np.zeros((5, 3, 2))
    for k, i in enumerate(idx):
        expected2[:, i] += src2[:, k]
    np.testing.assert_allclose(out2, expected2, rtol=1e-12)
    check_grad(lambda s, ix: apply("index_add", ix, s, shape=(5, 3, 2), dim=1), src2, idx, wrt=[0])


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_index_select_forward_and_grad(dim):
    x = randn(4, 3, 5)
    idx = RNG.integers(0, x.shape[dim], size=6)
    out = F.index_select(ft(x), dim, ft(idx)).numpy()
    np.testing.assert_array_equal(out, np.take(x, idx, axis=dim))
    check_grad(lambda t, ix: F.index_select(t, dim, ix), x, idx, wrt=[0])


def test_embedding_forward_grad_and_padding_idx():
    w = randn(6, 3)
    idx = np.array([[0, 2, 5], [2, 2, 1]])
    out = F.embedding(ft(idx), ft(w)).numpy()
    for i, j in np.ndindex(idx.shape):
        np.testing.assert_array_equal(out[i, j], w[idx[i, j]])
    check_grad(lambda ix, t: F.embedding(ix, t), idx, w, wrt=[1])
    wt = ft(w, requires_grad=True)
    F.embedding(ft(idx), wt, padding_idx=2).backward(ft(np.ones((2, 3, 3))))
    g = wt.grad.numpy()
    np.testing.assert_array_equal(g[2], 0.0)
    np.testing.assert_array_equal(g[:, 0], [1, 1, 0, 0, 0, 1])
    # negative padding_idx counts from the end
    wt2 = ft(w, requires_grad=True)
    F.embedding(ft(idx), wt2, padding_idx=-1).backward(ft(np.ones((2, 3, 3))))
    np.testing.assert_array_equal(wt2.grad.numpy()[5], 0.0)


def test_embedding_backward_op_and_its_grad():
    idx = np.array([1, 3, 1, 0])
    grad = randn(4, 2)
    out = apply("embedding_backward", ft(grad), ft(idx), num_weights=5, padding_idx=3).numpy()
    expected = np.zeros((5, 2))
    for k, i in enumerate(idx):
        if i != 3:
            expected[i] += grad[k]
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    check_grad(lambda g, ix: apply("embedding_backward", g, ix, num_weights=5, padding_idx=3), grad, idx, wrt=[0])


def test_index_errors_are_readable():
    with pytest.raises(IndexError, match="out of bounds"):
        F.embedding(ft(np.array([0, 7])), ft(randn(4, 2)))
    with pytest.raises(IndexError, match="out of bounds"):
        F.gather(ft(randn(2, 3)), 1, ft(np.array([[0, 3]])))


@needs_torch
def test_gather_index_select_embedding_vs_torch():
    x = randn(4, 6).astype(np.float32)
    index = RNG.integers(0, 6, size=(4, 3))
    compare_torch(lambda a, i: F.gather(a, 1, i), lambda a, i: torch.gather(a, 1, i), [x, index], wrt=(0,),
                  rtol=1e-6)
    idx = RNG.integers(0, 4, size=5)
    compare_torch(lambda a, i: F.index_select(a, 0, i), lambda a, i: torch.index_select(a, 0, i), [x, idx],
                  wrt=(0,), rtol=1e-6)
    ids = RNG.integers(0, 4, size=(2, 7))
    compare_torch(lambda i, w: F.embedding(i, w, padding_idx=1), lambda i, w: TF.embedding(i, w, padding_idx=1),
                  [ids, x], wrt=(1,), rtol=1e-6)


# --------------------------------------------------------------------------- conv2d

def _conv2d_loop(x, w, stride, padding, dilation, groups):
    N, C, H, W = x.shape
    O, Cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    OH = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    OW = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((N, O, OH, OW))
    Og = O // groups
    for n, o, i, j in itertools.product(range(N), range(O), range(OH), range(OW)):
        g = o // Og
        acc = 0.0
        for c, a, b in itertools.product(range(Cg), range(kh), range(kw)):
            acc += xp[n, g * Cg + c, i * sh + a * dh, j * sw + b * dw] * w[o, c, a, b]
        out[n, o, i, j] = acc
    return out


CONV_CONFIGS = [
    # (N, C, H, W, O, k, stride, padding, dilation, groups, bias)
    (2, 3, 7, 6, 4, 3, 1, 0, 1, 1, True),
    (2, 3, 7, 6, 4, 3, 1, 1, 1, 1, False),
    (2, 4, 8, 8, 6, 3, 2, 1, 1, 1, True),
    (1, 4, 9, 7, 4, 3, 2, 2, 1, 2, True),
    (2, 4, 8, 8, 8, 3, 1, 1, 1, 2, False),
    (2, 6, 8, 8, 6, 3, 1, 1, 1, 6, True),     # depthwise
    (2, 6, 9, 9, 6, 3, 2, 1, 1, 6, False),    # depthwise, strided (MobileNet)
    (1, 3, 8, 8, 6, 3, 1, 1, 1, 3, True),     # depthwise with channel multiplier 2
    (2, 3, 9, 9, 4, 3, 1, 2, 2, 1, True),     # dilation 2
    (2, 4, 10, 9, 4, 3, 2, 2, 2, 4, True),    # depthwise, dilated, strided
    (2, 5, 6, 6, 7, 1, 1, 0, 1, 1, True),     # 1x1 (pointwise)
    (2, 4, 6, 6, 6, 1, 2, 0, 1, 2, False),    # 1x1 strided grouped
    (1, 2, 5, 8, 3, (2, 3), (1, 2), (1, 0), (2, 1), 1, True),  # rectangular everything
    (1, 1, 6, 6, 3, 3, 1, 1, 1, 1, True),     # single input channel
]


def _conv_args(cfg):
    N, C, H, W, O, k, s, p, d, g, bias = cfg
    k = k if isinstance(k, tuple) else (k, k)
    x = randn(N, C, H, W)
    w = randn(O, C // g, *k)
    b = randn(O)
    return x, w, b, s, p, d, g, bias


@pytest.mark.parametrize("cfg", CONV_CONFIGS[:10:3] + CONV_CONFIGS[-3:])
def test_conv2d_forward_matches_loop(cfg):
    x, w, b, s, p, d, g, _ = _conv_args(cfg)
    pair = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731
    expected = _conv2d_loop(x, w, pair(s), pair(p), pair(d), g)
    out = F.conv2d(ft(x), ft(w), None, s, p, d, g).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cfg", [CONV_CONFIGS[i] for i in (1, 3, 5, 7, 9, 11, 12)])
def test_conv2d_grads_finite_differences(cfg):
    N, C, H, W, O, k, s, p, d, g, bias = cfg
    k = k if isinstance(k, tuple) else (k, k)
    x = randn(1, C, min(H, 6), min(W, 6))
    w = randn(O, C // g, *k)
    b = randn(O)
    check_grad(lambda a, ww, bb: F.conv2d(a, ww, bb, s, p, d, g), x, w, b)


@pytest.mark.parametrize("cfg", [CONV_CONFIGS[i] for i in (2, 5, 8)])
def test_conv2d_second_order_ops(cfg):
    N, C, H, W, O, k, s, p, d, g, _ = cfg
    x = randn(1, C, 6, 6)
    w = randn(O, C // g, k, k)
    a = dict(stride=(s, s), padding=(p, p), dilation=(d, d), groups=g)
    gy = apply("conv2d", ft(x), ft(w), **a).numpy()
    gy = randn(*gy.shape)
    check_grad(lambda gg, ww: apply("conv2d_grad_input", gg, ww, input_shape=x.shape, **a), gy, w)
    check_grad(lambda gg, xx: apply("conv2d_grad_weight", gg, xx, weight_shape=w.shape, **a), gy, x)


@needs_torch
@pytest.mark.parametrize("cfg", CONV_CONFIGS)
def test_conv2d_vs_torch(cfg):
    x, w, b, s, p, d, g, bias = _conv_args(cfg)
    x, w, b = x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)
    if bias:
        compare_torch(lambda a, ww, bb: F.conv2d(a, ww, bb, s, p, d, g),
                      lambda a, ww, bb: TF.conv2d(a, ww, bb, s, p, d, g), [x, w, b], wrt=(0, 1, 2),
                      rtol=2e-4, atol=2e-5)
    else:
        compare_torch(lambda a, ww: F.conv2d(a, ww, None, s, p, d, g),
                      lambda a, ww: TF.conv2d(a, ww, None, s, p, d, g), [x, w], wrt=(0, 1), rtol=2e-4, atol=2e-5)


@needs_torch
@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_conv2d_same_padding_and_unbatched_vs_torch():
    x = randn(2, 3, 7, 7).astype(np.float32)
    w = randn(4, 3, 4, 3).astype(np.float32)   # even kernel height: asymmetric 'same' padding
    compare_torch(lambda a, ww: F.conv2d(a, ww, padding="same"), lambda a, ww: TF.conv2d(a, ww, padding="same"),
                  [x, w], wrt=(0, 1), rtol=2e-4, atol=2e-5)
    compare_torch(lambda a, ww: F.conv2d(a, ww, padding=1), lambda a, ww: TF.conv2d(a, ww, padding=1),
                  [x[0], w], wrt=(0, 1), rtol=2e-4, atol=2e-5)


def test_conv2d_errors():
    with pytest.raises(RuntimeError, match="channels"):
        F.conv2d(ft(randn(1, 3, 5, 5)), ft(randn(2, 4, 3, 3)))
    with pytest.raises(RuntimeError, match="groups"):
        F.conv2d(ft(randn(1, 4, 5, 5)), ft(randn(3, 2, 3, 3)), groups=2)
    with pytest.raises(RuntimeError, match="smaller than"):
        F.conv2d(ft(randn(1, 1, 2, 2)), ft(randn(1, 1, 3, 3)))


# --------------------------------------------------------------------------- pooling

def _distinct(*shape):
    """Values without ties (max pooling's gradient is only defined without them)."""
    return RNG.permutation(np.prod(shape)).reshape(shape).astype(np.float64) / 7.0 - 3.0


def _max_pool_loop(x, k, s, p, d, out_hw):
    N, C, H, W = x.shape
    out = np.full((N, C) + out_hw, -np.inf)
    for n, c, i, j in itertools.product(range(N), range(C), range(out_hw[0]), range(out_hw[1])):
        for a, b in itertools.product(range(k[0]), range(k[1])):
            r, q = i * s[0] - p[0] + a * d[0], j * s[1] - p[1] + b * d[1]
            if 0 <= r < H and 0 <= q < W:
                out[n, c, i, j] = max(out[n, c, i, j], x[n, c, r, q])
    return out


POOL_CONFIGS = [
    # kernel, stride, padding, dilation, ceil_mode
    (2, 2, 0, 1, False),
    (3, 2, 1, 1, False),
    (3, 2, 1, 1, True),
    (3, 1, 1, 1, False),
    (2, 2, 1, 1, True),
    (3, 2, 0, 2, False),
    (3, 1, 1, 2, True),      # dilated, padded, ceil_mode
    (3, 3, 1, 1, True),
    ((2, 3), (1, 2), (1, 1), (1, 1), False),
]


@pytest.mark.parametrize("cfg", POOL_CONFIGS)
def test_max_pool2d_forward_loop_and_grad(cfg):
    k, s, p, d, ceil = cfg
    x = _distinct(2, 2, 7, 8)
    out = F.max_pool2d(ft(x), k, s, p, d, ceil).numpy()
    pair = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731
    np.testing.assert_array_equal(out, _max_pool_loop(x, pair(k), pair(s), pair(p), pair(d), out.shape[2:]))
    check_grad(lambda t: F.max_pool2d(t, k, s, p, d, ceil), x, eps=1e-7)


@needs_torch
@pytest.mark.parametrize("cfg", POOL_CONFIGS)
def test_max_pool2d_vs_torch(cfg):
    k, s, p, d, ceil = cfg
    x = randn(2, 3, 9, 8).astype(np.float32)
    x[0, 0, :2, :2] = 1.5   # a tie: the gradient goes to the first maximum, as in PyTorch
    # atol: overlapping windows sum float32 gradients of O(1) in another order than torch
    compare_torch(lambda t: F.max_pool2d(t, k, s, p, d, ceil), lambda t: TF.max_pool2d(t, k, s, p, d, ceil),
                  [x], wrt=(0,), rtol=1e-6, atol=1e-6)


AVG_CONFIGS = [
    # kernel, stride, padding, ceil_mode, count_include_pad
    (2, 2, 0, False, True),
    (3, 2, 1, False, True),
    (3, 2, 1, False, False),
    (3, 2, 1, True, True),
    (3, 2, 1, True, False),
    (2, 3, 1, True, False),
    ((3, 2), (2, 1), (1, 0), False, True),
]


@pytest.mark.parametrize("cfg", AVG_CONFIGS)
def test_avg_pool2d_grad_finite_differences(cfg):
    k, s, p, ceil, cip = cfg
    x = randn(1, 2, 7, 6)
    check_grad(lambda t: F.avg_pool2d(t, k, s, p, ceil, cip), x)
    pooled = F.avg_pool2d(ft(x), k, s, p, ceil, cip)
    gy = randn(*pooled.shape)
    attrs = dict(kernel_size=k if isinstance(k, tuple) else (k, k), stride=s if isinstance(s, tuple) else (s, s),
                 padding=p if isinstance(p, tuple) else (p, p), ceil_mode=ceil, count_include_pad=cip)
    check_grad(lambda g: apply("avg_pool2d_grad", g, input_shape=x.shape, **attrs), gy)


def test_avg_pool2d_forward_loop():
    x = randn(1, 2, 5, 5)
    out = F.avg_pool2d(ft(x), 3, 2, 1, count_include_pad=False).numpy()
    for c, i, j in itertools.product(range(2), range(3), range(3)):
        rows = slice(max(2 * i - 1, 0), min(2 * i + 2, 5))
        cols = slice(max(2 * j - 1, 0), min(2 * j + 2, 5))
        np.testing.assert_allclose(out[0, c, i, j], x[0, c, rows, cols].mean(), rtol=1e-12)


@needs_torch
@pytest.mark.parametrize("cfg", AVG_CONFIGS)
def test_avg_pool2d_vs_torch(cfg):
    k, s, p, ceil, cip = cfg
    x = randn(2, 3, 9, 8).astype(np.float32)
    compare_torch(lambda t: F.avg_pool2d(t, k, s, p, ceil, cip), lambda t: TF.avg_pool2d(t, k, s, p, ceil, cip),
                  [x], wrt=(0,), rtol=1e-5, atol=1e-6)


@needs_torch
def test_avg_pool2d_divisor_override_vs_torch():
    x = randn(1, 2, 6, 6).astype(np.float32)
    compare_torch(lambda t: F.avg_pool2d(t, 3, 2, 1, divisor_override=4),
                  lambda t: TF.avg_pool2d(t, 3, 2, 1, divisor_override=4), [x], wrt=(0,), rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("in_hw,out_hw", [((8, 8), (1, 1)), ((8, 6), (4, 3)), ((7, 5), (3, 3)),
                                          ((5, 7), (2, 4)), ((6, 6), (None, 4))])
def test_adaptive_avg_pool2d_vs_torch(in_hw, out_hw):
    x = randn(2, 3, *in_hw).astype(np.float32)
    compare_torch(lambda t: F.adaptive_avg_pool2d(t, out_hw), lambda t: TF.adaptive_avg_pool2d(t, out_hw),
                  [x], wrt=(0,), rtol=1e-5, atol=1e-6)


def test_adaptive_avg_pool2d_non_divisible_grad():
    x = randn(1, 2, 5, 7)
    check_grad(lambda t: F.adaptive_avg_pool2d(t, (3, 4)), x)
    gy = randn(1, 2, 3, 4)
    check_grad(lambda g: apply("adaptive_avg_pool2d_grad", g, input_shape=x.shape, output_size=(3, 4)), gy)


def test_adaptive_avg_pool2d_lowers_to_avg_pool_when_divisible():
    from flowgen.ops import registry

    seen = []

    def hook(op, tensors, attrs):
        seen.append(op.name)
        raise StopIteration

    lazy = Tensor(_value=type("V", (), {"shape": (1, 2, 8, 8), "dtype": dt.float32})())
    previous = registry.set_tracer_hook(hook)
    try:
        for size in ((2, 2), (3, 3)):
            with pytest.raises(StopIteration):
                F.adaptive_avg_pool2d(lazy, size)
    finally:
        registry.set_tracer_hook(previous)
    assert seen == ["avg_pool2d", "adaptive_avg_pool2d"]


def test_pool_errors():
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        F.max_pool2d(ft(randn(1, 1, 5, 5)), 2, 1, 2)


# --------------------------------------------------------------------------- upsampling

UPSAMPLE_CASES = [
    dict(scale_factor=2, mode="nearest"),
    dict(size=(7, 5), mode="nearest"),
    dict(scale_factor=1.5, mode="nearest"),
    dict(scale_factor=(2, 3), mode="nearest"),
    dict(size=(3, 2), mode="nearest"),
    dict(scale_factor=2, mode="bilinear", align_corners=False),
    dict(scale_factor=2, mode="bilinear", align_corners=True),
    dict(size=(7, 9), mode="bilinear", align_corners=False),
    dict(size=(7, 9), mode="bilinear", align_corners=True),
    dict(scale_factor=1.7, mode="bilinear", align_corners=False),
    dict(size=(2, 3), mode="bilinear", align_corners=False),
    dict(size=(1, 1), mode="bilinear", align_corners=True),
]


@needs_torch
@pytest.mark.parametrize("kwargs", UPSAMPLE_CASES)
def test_interpolate_vs_torch(kwargs):
    x = randn(2, 3, 4, 5).astype(np.float32)
    compare_torch(lambda t: F.interpolate(t, **kwargs), lambda t: TF.interpolate(t, **kwargs), [x], wrt=(0,),
                  rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("kwargs", [dict(size=(7, 3), mode="bilinear", align_corners=True),
                                    dict(scale_factor=1.5, mode="bilinear", align_corners=False)])
def test_bilinear_float64_uses_float64_source_coordinates_like_torch(kwargs):
    """PyTorch computes linear source coordinates in the accumulation type: float64 inputs agree
    to float64 rounding (float32 coordinates were 1e-7 off)."""
    x = randn(2, 3, 5, 4)
    compare_torch(lambda t: F.interpolate(t, **kwargs), lambda t: TF.interpolate(t, **kwargs), [x], wrt=(0,),
                  rtol=1e-13, atol=1e-14)


def test_upsample_nearest_forward_loop_and_grads():
    x = randn(1, 2, 3, 4)
    out = F.interpolate(ft(x), scale_factor=2).numpy()
    for i, j in itertools.product(range(6), range(8)):
        np.testing.assert_array_equal(out[0, :, i, j], x[0, :, i // 2, j // 2])
    check_grad(lambda t: F.interpolate(t, size=(5, 7)), x)
    check_grad(lambda t: F.interpolate(t, size=(5, 7), mode="bilinear", align_corners=False), x)
    check_grad(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=True), x)
    gy = randn(1, 2, 5, 7)
    check_grad(lambda g: apply("upsample_bilinear2d_grad", g, input_shape=x.shape, size=(5, 7),
                               align_corners=False, scales=None), gy)
    check_grad(lambda g: apply("upsample_nearest2d_grad", g, input_shape=x.shape, size=(5, 7), scales=None), gy)


# --------------------------------------------------------------------------- dropout

def test_dropout_is_deterministic_and_matches_philox():
    from flowgen.random import philox_uniform

    x = randn(64, 65).astype(np.float32)
    a = apply("dropout", ft(x), p=0.3, seed=42, offset=7).numpy()
    b = apply("dropout", ft(x), p=0.3, seed=42, offset=7).numpy()
    np.testing.assert_array_equal(a, b)
    c = apply("dropout", ft(x), p=0.3, seed=42, offset=8).numpy()
    assert (a != c).any()
    u = philox_uniform(42, 7, x.size).reshape(x.shape)
    keep = u >= np.float32(0.3)
    expected = np.where(keep, x / (np.float32(1) - np.float32(0.3)), np.float32(0))
    np.testing.assert_array_equal(a, expected)   # bit for bit


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_mask_fraction_and_scale(p):
    x = np.ones((200, 250), np.float32)
    out = apply("dropout", ft(x), p=p, seed=3, offset=0).numpy()
    dropped = (out == 0).mean()
    assert abs(dropped - p) < 0.01
    np.testing.assert_allclose(out[out != 0], 1.0 / (1.0 - p), rtol=1e-6)
    assert abs(out.mean() - 1.0) < 0.03


def test_dropout_grad_uses_the_same_mask():
    x = randn(10, 12).astype(np.float32)
    t = ft(x, requires_grad=True)
    y = apply("dropout", t, p=0.4, seed=11, offset=2)
    g = randn(10, 12).astype(np.float32)
    y.backward(ft(g))
    np.testing.assert_array_equal(t.grad.numpy(), apply("dropout", ft(g), p=0.4, seed=11, offset=2).numpy())
    np.testing.assert_array_equal(t.grad.numpy() == 0, y.numpy() == 0)


def test_functional_dropout_seeding_and_eval():
    x = randn(8, 9).astype(np.float32)
    flow.random.manual_seed(5)
    a1, a2 = F.dropout(ft(x), 0.5).numpy(), F.dropout(ft(x), 0.5).numpy()
    flow.random.manual_seed(5)
    b1, b2 = F.dropout(ft(x), 0.5).numpy(), F.dropout(ft(x), 0.5).numpy()
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert (a1 != a2).any()           # successive calls draw fresh masks
    np.testing.assert_array_equal(F.dropout(ft(x), 0.5, training=False).numpy(), x)
    np.testing.assert_array_equal(F.dropout(ft(x), 1.0).numpy(), 0 * x)


def test_dropout_expression_convention():
    from flowgen.ops.lowering import Elementwise
    from flowgen.ops.registry import get_op

    lowering = get_op("dropout").lowering
    assert isinstance(lowering, Elementwise)
    for part in ("{0}", "{p}", "{seed}", "{offset}", "{idx}", "flowgen_philox_uniform"):
        assert part in lowering.expr


# --------------------------------------------------------------------------- losses

def _loss_inputs(shape=(5, 4)):
    x = randn(*shape).astype(np.float32)
    target = RNG.integers(0, shape[1], size=(shape[0],) + shape[2:])
    return x, target


@needs_torch
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_vs_torch(reduction, weighted, smoothing):
    x, target = _loss_inputs((6, 5))
    target[1] = target[4] = -100      # ignored
    w = RNG.uniform(0.5, 2.0, 5).astype(np.float32)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    if weighted:
        compare_torch(lambda a, t, ww: F.cross_entropy(a, t, ww, **kw),
                      lambda a, t, ww: TF.cross_entropy(a, t, ww, **kw),
                      [x, target, w], wrt=(0,), rtol=1e-5, atol=1e-6)
    else:
        compare_torch(lambda a, t: F.cross_entropy(a, t, **kw), lambda a, t: TF.cross_entropy(a, t, **kw),
                      [x, target], wrt=(0,), rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_spatial_custom_ignore_and_probabilities_vs_torch(reduction):
    x, target = _loss_inputs((2, 3, 4, 5))
    target[0, 1, 2] = 1
    kw = dict(reduction=reduction, ignore_index=1, label_smoothing=0.1)
    compare_torch(lambda a, t: F.cross_entropy(a, t, **kw), lambda a, t: TF.cross_entropy(a, t, **kw),
                  [x, target], wrt=(0,), rtol=1e-5, atol=1e-6)
    probs = RNG.dirichlet(np.ones(4), size=3).astype(np.float32)
    x2 = randn(3, 4).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, 4).astype(np.float32)
    for smoothing in (0.0, 0.3):
        kw2 = dict(reduction=reduction, label_smoothing=smoothing)
        compare_torch(lambda a, t, ww: F.cross_entropy(a, t, ww, **kw2),
                      lambda a, t, ww: TF.cross_entropy(a, t, ww, **kw2), [x2, probs, w], wrt=(0, 1),
                      rtol=1e-5, atol=1e-6)
    # unbatched (C,) input with a 0-d target
    compare_torch(lambda a, t: F.cross_entropy(a, t, reduction=reduction, label_smoothing=0.1),
                  lambda a, t: TF.cross_entropy(a, t, reduction=reduction, label_smoothing=0.1),
                  [x2[0], np.array(2)], wrt=(0,), rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss_vs_torch(reduction):
    x, target = _loss_inputs((7, 4))
    target[2] = 3
    w = RNG.uniform(0.5, 2.0, 4).astype(np.float32)
    compare_torch(lambda a, t, ww: F.nll_loss(a, t, ww, ignore_index=3, reduction=reduction),
                  lambda a, t, ww: TF.nll_loss(a, t, ww, ignore_index=3, reduction=reduction),
                  [x, target, w], wrt=(0,), rtol=1e-5, atol=1e-6)
    compare_torch(lambda a, t: F.nll_loss(a, t, reduction=reduction),
                  lambda a, t: TF.nll_loss(a, t, reduction=reduction), [x, target], wrt=(0,), rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_bce_with_logits_vs_torch(reduction):
    x = (randn(4, 3) * 3).astype(np.float32)
    x[0, 0] = 0.0                 # zero logit: the composed |x| must still give sigmoid(0) - t
    x[1, 1] = 40.0
    x[2, 2] = -40.0
    t = RNG.uniform(0, 1, (4, 3)).astype(np.float32)
    pw = RNG.uniform(0.5, 3.0, 3).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, (4, 3)).astype(np.float32)
    compare_torch(lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=reduction),
                  lambda a, b: TF.binary_cross_entropy_with_logits(a, b, reduction=reduction),
                  [x, t], wrt=(0, 1), rtol=1e-5, atol=1e-6)
    compare_torch(lambda a, b, p, ww: F.binary_cross_entropy_with_logits(a, b, ww, reduction=reduction, pos_weight=p),
                  lambda a, b, p, ww: TF.binary_cross_entropy_with_logits(a, b, ww, reduction=reduction,
                                                                          pos_weight=p),
                  [x, t, pw, w], wrt=(0, 1), rtol=1e-5, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_regression_losses_vs_torch(reduction):
    x, y = randn(4, 5).astype(np.float32), randn(4, 5).astype(np.float32)
    y[0, 0] = x[0, 0]             # |d| == 0: L1's gradient is 0 there, as in PyTorch
    for fl, tl in ((F.mse_loss, TF.mse_loss), (F.l1_loss, TF.l1_loss), (F.smooth_l1_loss, TF.smooth_l1_loss),
                   (F.huber_loss, TF.huber_loss)):
        compare_torch(lambda a, b: fl(a, b, reduction=reduction), lambda a, b: tl(a, b, reduction=reduction),
                      [x, y], wrt=(0, 1), rtol=1e-5, atol=1e-6)
    p = RNG.uniform(0.05, 0.95, (4, 5)).astype(np.float32)
    t = RNG.uniform(0, 1, (4, 5)).astype(np.float32)
    compare_torch(lambda a, b: F.binary_cross_entropy(a, b, reduction=reduction),
                  lambda a, b: TF.binary_cross_entropy(a, b, reduction=reduction), [p, t], wrt=(0,),
                  rtol=1e-5, atol=1e-6)


# fuzz seed 901847: sigmoid saturates to exactly 1 (or 0), and the derivative of the clamped
# forward is inf * 0 = nan there (and 0.7 instead of torch's 0.065 near it); PyTorch's backward
# divides by max(x (1 - x), 1e-12)
SATURATED_LOGITS = np.array([[30.0, 40.0, 0.5, -40.0], [-800.0, 17.0, -17.0, 3.0]])


@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_binary_cross_entropy_of_saturated_sigmoid_like_torch(dtype):
    t = np.array([[0.3, 1.0, 0.0, 0.3], [1.0, 0.0, 0.3, 1.0]], dtype)
    w = np.array([0.5, 1.0, 2.0, 1.5], dtype)
    # near saturation 1 - x cancels: an ulp of difference between two sigmoids moves the result by ~1e-9
    tol = dict(rtol=1e-7, atol=1e-300) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-30)
    compare_torch(lambda a, b, c: F.binary_cross_entropy(flow.sigmoid(a), b, c),
                  lambda a, b, c: TF.binary_cross_entropy(torch.sigmoid(a), b, c),
                  [SATURATED_LOGITS.astype(dtype), t, w], wrt=(0, 1), **tol)


def test_binary_cross_entropy_op_gradients_finite_differences():
    x = RNG.uniform(0.05, 0.95, (3, 4))
    t = RNG.uniform(0, 1, (3, 4))
    check_grad(lambda a, b: apply("binary_cross_entropy", a, b), x, t)
    check_grad(lambda g, a, b: apply("binary_cross_entropy_grad", g, a, b), RNG.standard_normal((3, 4)), x, t)


@needs_torch
def test_binary_cross_entropy_of_saturated_sigmoid_in_a_graph_like_torch():
    """The graph's kernels (forward and PyTorch's backward) give torch's float32 gradient, not nan."""
    x = SATURATED_LOGITS.astype(np.float32)
    t = np.array([[0.3, 1.0, 0.0, 0.3], [1.0, 0.0, 0.3, 1.0]], np.float32)
    model = flow.nn.Module()
    model.scale = flow.nn.Parameter(flow.ones(4))

    class Step(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1.0))

        def build(self, a, b):
            loss = F.binary_cross_entropy(flow.sigmoid(a * self.model.scale), b, reduction="sum")
            loss.backward()
            return loss

    loss = Step()(ft(x), ft(t))
    grad = 1.0 - model.scale.numpy()
    theirs = torch.ones(4, requires_grad=True)
    their_loss = TF.binary_cross_entropy(torch.sigmoid(torch.tensor(x) * theirs), torch.tensor(t), reduction="sum")
    their_loss.backward()
    np.testing.assert_allclose(loss.numpy(), their_loss.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, theirs.grad.numpy(), rtol=1e-5, atol=1e-30)


def test_cross_entropy_grad_finite_differences():
    x, target = _loss_inputs((4, 3))
    target[0] = -100
    w = RNG.uniform(0.5, 2.0, 3)
    check_grad(lambda a, t, ww: F.cross_entropy(a, t, ww, label_smoothing=0.1), x.astype(np.float64), target, w,
               wrt=[0])


def test_fused_cross_entropy_rows_grad_and_double_grad_finite_differences():
    """(N, C) logits with class indices take the one-kernel path (cross_entropy_rows); its gradient
    op has a gradient of its own (double backward)."""
    from flowgen.ops.registry import apply

    x, target = _loss_inputs((5, 4))
    target[2] = -100
    for reduction in ("mean", "sum", "none"):
        check_grad(lambda a, t: F.cross_entropy(a, t, reduction=reduction), x.astype(np.float64), target, wrt=[0])
    g = RNG.standard_normal(5)
    check_grad(lambda gg, a, t: apply("cross_entropy_rows_grad", gg, a, t, ignore_index=-100),
               g, x.astype(np.float64), target, wrt=[0, 1])


def test_fused_cross_entropy_errors_name_the_op():
    x = ft(randn(3, 4))
    with pytest.raises(IndexError, match="cross_entropy: index 4 is out of bounds"):
        F.cross_entropy(x, flow.tensor(np.array([0, 4, 1])))
    with pytest.raises(ValueError, match=r"cross_entropy: expected target of shape \(3,\)"):
        F.cross_entropy(x, flow.tensor(np.array([0, 1])))
    with pytest.raises(RuntimeError, match="int64 class-index target"):
        F.cross_entropy(x, flow.tensor(np.array([True, False, True])))


def test_loss_rejects_bad_reduction():
    with pytest.raises(ValueError, match="reduction"):
        F.mse_loss(ft(randn(2)), ft(randn(2)), reduction="avg")


# --------------------------------------------------------------------------- normalisation

@needs_torch
@pytest.mark.parametrize("shape", [(6, 4), (4, 3, 5, 5), (3, 2, 7)])
def test_batch_norm_train_and_running_stats_vs_torch(shape):
    C = shape[1]
    x = (randn(*shape) * 2 + 1).astype(np.float32)
    w, b = RNG.uniform(0.5, 1.5, C).astype(np.float32), randn(C).astype(np.float32)
    rm_f, rv_f = ft(np.zeros(C, np.float32)), ft(np.ones(C, np.float32))
    rm_t, rv_t = torch.zeros(C), torch.ones(C)
    for _ in range(2):   # two steps: the second update starts from non-trivial running stats
        compare_torch(lambda a, ww, bb: F.batch_norm(a, rm_f, rv_f, ww, bb, True, 0.1, 1e-5),
                      lambda a, ww, bb: TF.batch_norm(a, rm_t, rv_t, ww, bb, True, 0.1, 1e-5),
                      [x, w, b], wrt=(0, 1, 2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rm_f.numpy(), rm_t.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv_f.numpy(), rv_t.numpy(), rtol=1e-5, atol=1e-6)
    # eval with the running statistics
    compare_torch(lambda a, ww, bb: F.batch_norm(a, rm_f, rv_f, ww, bb, False),
                  lambda a, ww, bb: TF.batch_norm(a, rm_t, rv_t, ww, bb, False), [x, w, b], wrt=(0, 1, 2),
                  rtol=1e-4, atol=1e-5)


def test_batch_norm_grad_finite_differences_and_in_place_update():
    x = randn(3, 2, 2, 2)
    check_grad(lambda a, ww, bb: F.batch_norm(a, None, None, ww, bb, True), x, randn(2), randn(2))
    rm = ft(np.zeros(2, np.float32))
    buffer = rm.numpy()
    F.batch_norm(ft(x.astype(np.float32)), rm, ft(np.ones(2, np.float32)), training=True, momentum=0.5)
    assert rm.numpy() is buffer                      # updated in place (graphs alias this array)
    np.testing.assert_allclose(buffer, 0.5 * x.mean(axis=(0, 2, 3)), rtol=1e-5)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(ft(randn(1, 3)), None, None, training=True)


@needs_torch
def test_layer_group_instance_norm_vs_torch():
    x = randn(2, 6, 4, 3).astype(np.float32)
    w6, b6 = RNG.uniform(0.5, 1.5, 6).astype(np.float32), randn(6).astype(np.float32)
    w43, b43 = RNG.uniform(0.5, 1.5, (4, 3)).astype(np.float32), randn(4, 3).astype(np.float32)
    tol = dict(rtol=1e-4, atol=1e-5)
    compare_torch(lambda a, ww, bb: F.layer_norm(a, (4, 3), ww, bb), lambda a, ww, bb: TF.layer_norm(a, (4, 3), ww, bb),
                  [x, w43, b43], wrt=(0, 1, 2), **tol)
    compare_torch(lambda a: F.layer_norm(a, 3), lambda a: TF.layer_norm(a, (3,)), [x], wrt=(0,), **tol)
    compare_torch(lambda a, ww, bb: F.group_norm(a, 3, ww, bb), lambda a, ww, bb: TF.group_norm(a, 3, ww, bb),
                  [x, w6, b6], wrt=(0, 1, 2), **tol)
    compare_torch(lambda a, ww, bb: F.instance_norm(a, weight=ww, bias=bb),
                  lambda a, ww, bb: TF.instance_norm(a, weight=ww, bias=bb), [x, w6, b6], wrt=(0, 1, 2), **tol)
    rm_f, rv_f = ft(np.zeros(6, np.float32)), ft(np.ones(6, np.float32))
    rm_t, rv_t = torch.zeros(6), torch.ones(6)
    compare_torch(lambda a: F.instance_norm(a, rm_f, rv_f, use_input_stats=True, momentum=0.2),
                  lambda a: TF.instance_norm(a, rm_t, rv_t, use_input_stats=True, momentum=0.2), [x], wrt=(0,), **tol)
    np.testing.assert_allclose(rm_f.numpy(), rm_t.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv_f.numpy(), rv_t.numpy(), rtol=1e-5, atol=1e-6)


def test_norm_grads_finite_differences():
    x = randn(2, 4, 3)
    check_grad(lambda a, ww, bb: F.layer_norm(a, (3,), ww, bb), x, randn(3), randn(3))
    check_grad(lambda a, ww, bb: F.group_norm(a, 2, ww, bb), x, randn(4), randn(4))


# --------------------------------------------------------------------------- activations, pad, one_hot, linear

@needs_torch
def test_activations_vs_torch():
    x = (randn(5, 7) * 4).astype(np.float32)
    x[0, :4] = [0.5, -0.5, 10.0, -10.0]
    cases = [
        (F.relu6, TF.relu6), (F.silu, TF.silu), (F.leaky_relu, TF.leaky_relu), (F.elu, TF.elu),
        (F.hardsigmoid, TF.hardsigmoid), (F.hardswish, TF.hardswish), (F.softplus, TF.softplus),
        (F.mish, TF.mish), (F.gelu, TF.gelu), (lambda a: F.gelu(a, approximate="tanh"),
                                              lambda a: TF.gelu(a, approximate="tanh")),
        (lambda a: F.hardtanh(a, -2.0, 3.0), lambda a: TF.hardtanh(a, -2.0, 3.0)),
        (lambda a: F.leaky_relu(a, 0.2), lambda a: TF.leaky_relu(a, 0.2)),
        (lambda a: F.softplus(a, 2.0, 5.0), lambda a: TF.softplus(a, 2.0, 5.0)),
    ]
    for fl, tl in cases:
        compare_torch(fl, tl, [x], wrt=(0,), rtol=1e-5, atol=1e-6)


class _EdgeValues(flow.nn.Graph):
    """softplus (two betas), mish, the shrink functions, threshold, sign and nan_to_num in one graph."""

    def build(self, x):
        return (F.softplus(x), F.softplus(x, 2.0, 5.0), F.mish(x), F.softshrink(x, 0.5), F.hardshrink(x, 0.5),
                F.threshold(x, 0.1, 20.0), flow.sign(x), flow.nan_to_num(x))


EDGE_VALUES = [-np.inf, -1e30, -100.0, -20.0, -3.0, -0.5, -0.0, 0.0, 0.5, 3.0, 20.0, 1e30, np.inf, np.nan]


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activations_at_edge_values_like_torch_in_eager_and_graphs(dtype):
    """softplus(-20) was 0 in float32 (log(1 + e^-20) rounds 1 + e^-20 to 1; now log1p), its float64
    result 3e-8 off; softshrink/hardshrink/threshold turned NaN into numbers; sign(NaN) was NaN in
    eager and 0 in kernels; nan_to_num left float64 infinities (its replacement became a float32 inf)."""
    x = np.array(EDGE_VALUES, dtype)
    t = torch.tensor(x)
    want = [TF.softplus(t), TF.softplus(t, 2.0, 5.0), TF.mish(t), TF.softshrink(t, 0.5), TF.hardshrink(t, 0.5),
            TF.threshold(t, 0.1, 20.0), torch.sign(t), torch.nan_to_num(t)]
    tiny = np.finfo(dtype).tiny     # below it (denormals) the libraries' exp/log1p round differently
    for name, results in (("eager", _EdgeValues.build(None, ft(x))), ("graph", _EdgeValues()(ft(x)))):
        for k, (got, exact) in enumerate(zip(results, want)):
            np.testing.assert_allclose(got.numpy(), exact.numpy(), rtol=4 * np.finfo(dtype).eps, atol=tiny,
                                       err_msg=f"{name} output {k}")


@needs_torch
@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_pad_vs_torch(mode):
    x = randn(2, 3, 4, 5).astype(np.float32)
    kw = dict(mode=mode, value=1.5) if mode == "constant" else dict(mode=mode)
    for pads in ([2, 1, 0, 3], [1, 0, 2, 2], [3, 3, 3, 3]):
        compare_torch(lambda a: F.pad(a, pads, **kw), lambda a: TF.pad(a, pads, **kw), [x], wrt=(0,),
                      rtol=1e-5, atol=1e-6)
    compare_torch(lambda a: F.pad(a, [1, 2], **kw), lambda a: TF.pad(a, [1, 2], **kw), [x[0]], wrt=(0,), rtol=1e-5,
                  atol=1e-6)
    if mode == "constant":
        compare_torch(lambda a: F.pad(a, [-1, 2, 1, -2]), lambda a: TF.pad(a, [-1, 2, 1, -2]), [x], wrt=(0,))
        compare_torch(lambda a: F.pad(a, [1, 1, 1, 1, 1, 1]), lambda a: TF.pad(a, [1, 1, 1, 1, 1, 1]), [x], wrt=(0,))


@needs_torch
def test_one_hot_and_linear_vs_torch():
    labels = RNG.integers(0, 5, size=(3, 4))
    out = F.one_hot(ft(labels), 6)
    assert out.dtype == dt.int64
    np.testing.assert_array_equal(out.numpy(), TF.one_hot(torch.tensor(labels), 6).numpy())
    np.testing.assert_array_equal(F.one_hot(ft(labels)).numpy(), TF.one_hot(torch.tensor(labels)).numpy())
    x, w, b = randn(3, 2, 5).astype(np.float32), randn(4, 5).astype(np.float32), randn(4).astype(np.float32)
    compare_torch(F.linear, TF.linear, [x, w, b], wrt=(0, 1, 2), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- speed

def _mobilenet_v2_params(rng, width=1.0):
    """Parameters of MobileNetV2 (CIFAR variant: stride-1 stem) as flowgen tensors."""
    def conv(o, c, k):
        return ft((rng.standard_normal((o, c, k, k)) * np.sqrt(2.0 / (c * k * k))).astype(np.float32), True)

    def bn(c):
        return (ft(np.ones(c, np.float32), True), ft(np.zeros(c, np.float32), True),
                ft(np.zeros(c, np.float32)), ft(np.ones(c, np.float32)))

    layers = [("conv", conv(32, 3, 3), 1, 1), ("bn", bn(32), True)]
    c_in = 32
    settings = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1)]
    blocks = []
    for t, c, n, s in settings:
        for i in range(n):
            hidden = c_in * t
            block = []
            if t != 1:
                block += [("conv", conv(hidden, c_in, 1), 1, 1), ("bn", bn(hidden), True)]
            block += [("conv", conv(hidden, 1, 3), s if i == 0 else 1, hidden), ("bn", bn(hidden), True),
                      ("conv", conv(c, hidden, 1), 1, 1), ("bn", bn(c), False)]
            stride = s if i == 0 else 1
            blocks.append((block, stride == 1 and c_in == c))
            c_in = c
    head = [("conv", conv(1280, c_in, 1), 1, 1), ("bn", bn(1280), True)]
    fc = (ft((rng.standard_normal((10, 1280)) * 0.01).astype(np.float32), True), ft(np.zeros(10, np.float32), True))
    return layers, blocks, head, fc


def _run_layers(x, layers):
    for kind, p, a, b in (layer if len(layer) == 4 else layer + (None,) for layer in layers):
        if kind == "conv":
            k = p.shape[2]
            x = F.conv2d(x, p, None, a, k // 2, 1, b)
        else:
            w, bias, rm, rv = p
            x = F.batch_norm(x, rm, rv, w, bias, training=True)
            if a:
                x = F.relu6(x)
    return x


def test_mobilenet_v2_eager_forward_backward_runs():
    """Eager MobileNetV2 trains end to end (speed belongs in benchmarks/, not in tests)."""
    rng = np.random.default_rng(0)
    stem, blocks, head, (fw, fb) = _mobilenet_v2_params(rng)
    x = ft(rng.standard_normal((8, 3, 32, 32)).astype(np.float32))
    y = ft(rng.integers(0, 10, size=8))

    def step():
        h = _run_layers(x, stem)
        for block, residual in blocks:
            out = _run_layers(h, block)
            h = h + out if residual else out
        h = _run_layers(h, head)
        logits = F.linear(F.adaptive_avg_pool2d(h, 1).reshape(8, 1280), fw, fb)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        return loss

    loss = step()
    assert np.isfinite(loss.item())
    assert stem[0][1].grad is not None and fw.grad is not None


# --------------------------------------------------------------------------- graph tracing

def test_gradients_trace_into_graphs_and_match_eager():
    """The same F.* code traced into IR + graph autodiff + the IR interpreter gives eager's grads."""
    trace = pytest.importorskip("flowgen.ir.trace")
    interpret = pytest.importorskip("flowgen.ir.interpret").interpret
    autodiff = pytest.importorskip("flowgen.passes.autodiff").autodiff

    rng = np.random.default_rng(0)
    arrays = dict(w1=rng.standard_normal((8, 3, 3, 3)) * 0.3, dw=rng.standard_normal((8, 1, 3, 3)) * 0.3,
                  g=np.ones(8), b=np.zeros(8), rm=np.zeros(8), rv=np.ones(8),
                  emb=rng.standard_normal((10, 4)), fw=rng.standard_normal((5, 12)) * 0.1)
    trainable = [k for k in arrays if k not in ("rm", "rv")]
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y, tok = rng.integers(0, 5, 4), rng.integers(0, 10, (4, 3))

    def params():
        return {k: ft(v.astype(np.float32), requires_grad=k in trainable) for k, v in arrays.items()}

    def build(p, x, y, tok):
        h = F.conv2d(x, p["w1"], None, 1, 1)
        h = F.relu6(F.batch_norm(h, p["rm"], p["rv"], p["g"], p["b"], training=True))
        h = F.conv2d(h, p["dw"], None, 2, 1, 1, 8)
        h = F.max_pool2d(h, 2, 2)
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        h = F.avg_pool2d(h, 3, 2, 1, count_include_pad=False)
        h = F.adaptive_avg_pool2d(h, 1).reshape(4, 8)
        e = F.layer_norm(F.embedding(tok, p["emb"], padding_idx=0).sum(1), 4)
        z = F.dropout(flow.cat([h, e], 1), 0.2)
        logits = F.linear(z, p["fw"])
        return (F.cross_entropy(logits, y, label_smoothing=0.1)
                + F.binary_cross_entropy_with_logits(logits, F.one_hot(y, 5).float()))

    flow.random.manual_seed(0)
    eager = params()
    loss = build(eager, ft(x), ft(y), ft(tok))
    loss.backward()

    flow.random.manual_seed(0)
    state = params()
    tracer = trace.Tracer("nn_ops", flow.device("cpu"))
    for k, v in state.items():
        tracer.add_state(k, v, "param")
    with tracer:
        out = build(state, tracer.add_input(ft(x), 0), tracer.add_input(ft(y), 1), tracer.add_input(ft(tok), 2))
    tracer.graph.outputs.append(out._value)
    graph, grads = autodiff(tracer.graph, out._value, trainable)
    graph.outputs.extend(grads[k] for k in trainable)
    outs, new_state = interpret(graph, [x, y, tok], {k: v.numpy() for k, v in state.items()})
    np.testing.assert_allclose(outs[0], loss.numpy(), rtol=1e-6)
    for k, g in zip(trainable, outs[1:]):
        np.testing.assert_allclose(g, eager[k].grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=k)
    for k in ("rm", "rv"):   # running statistics become state updates
        np.testing.assert_allclose(new_state[k], eager[k].numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
    ops = {n.op for n in graph.nodes}
    assert {"conv2d", "conv2d_grad_weight", "max_pool2d_grad", "avg_pool2d_grad", "upsample_bilinear2d_grad",
            "embedding_backward", "log_softmax", "gather", "scatter_add", "dropout"} <= ops
