"""`flow.nn.functional` (``F``): PyTorch-style neural-network functions.

Everything here is either a thin call of a primitive op (conv2d, pooling,
softmax, gather, dropout...) or a composite built from flowgen ops, so it
traces into graphs, fuses, and gets its gradient from the op definitions.
No NumPy touches tensor data in this file; NumPy only builds small constant
index tensors (one_hot's class range, pad's source positions).
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen import creation as _creation
from flowgen import functional as _F
from flowgen import mixed_precision
from flowgen import random as _random
from flowgen.autograd import no_grad
from flowgen.ops.registry import apply, normalize_dim
from flowgen.tensor import Tensor

__all__ = [
    "linear", "conv2d", "relu", "relu6", "rrelu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu",
    "elu", "hardtanh", "hardsigmoid", "hardswish", "softplus", "mish", "softmax", "log_softmax", "dropout",
    "batch_norm", "layer_norm", "group_norm", "instance_norm", "max_pool2d", "avg_pool2d",
    "adaptive_avg_pool2d", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "embedding",
    "one_hot", "pad", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
    "sparse_softmax_cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "gather",
    "index_select",
]

_REDUCTIONS = ("none", "mean", "sum")


# --------------------------------------------------------------------------
# small helpers

def _pair(v, name="argument"):
    if isinstance(v, (tuple, list)):
        if len(v) == 1:
            return (int(v[0]), int(v[0]))
        if len(v) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
        return (int(v[0]), int(v[1]))
    return (int(v), int(v))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _const(array, like: Tensor) -> Tensor:
    """A small constant tensor (index ranges, masks) on `like`'s device."""
    array = np.asarray(array)
    return Tensor(array, dtype=dt.from_numpy(array.dtype), device=like.device)


def _scalar_like(value, like: Tensor) -> Tensor:
    return Tensor(np.array(value, dtype=like.dtype.np_dtype), dtype=like.dtype, device=like.device)


def _sum(x, dims, keepdim=False):
    return _F.sum(x, dims, keepdim=keepdim)


def _sum_all(x):
    return _F.sum(x)


def _reduce(loss, reduction, name):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return _sum_all(loss)
    if reduction == "mean":
        return _sum_all(loss) * (1.0 / loss.numel() if loss.numel() else float("nan"))
    raise ValueError(f"{name}: {reduction!r} is not a valid value for reduction (expected one of {_REDUCTIONS})")


def _check_reduction(reduction, name):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: {reduction!r} is not a valid value for reduction (expected one of {_REDUCTIONS})")


def _legacy_reduction(size_average, reduce, reduction, name):
    """The reduction a loss applies: PyTorch's deprecated `size_average` / `reduce` flags, when either
    is given, override `reduction` (reduce=False: 'none'; size_average=False: 'sum'; else 'mean')."""
    if size_average is not None or reduce is not None:
        if reduce is False:
            reduction = "none"
        else:
            reduction = "sum" if size_average is False else "mean"
    _check_reduction(reduction, name)
    return reduction


def _channel_shape(x, channel_dim=1):
    """(1, C, 1, ...) — the broadcast shape of a per-channel vector for `x`."""
    shape = [1] * x.ndim
    shape[channel_dim] = x.shape[channel_dim]
    return tuple(shape)


def _each(fn, out):
    """fn on a result, or on each of a tuple of results."""
    return tuple(fn(o) for o in out) if isinstance(out, tuple) else fn(out)


def _batched_2d(fn, x, *args, **kwargs):
    """Run a 4-D (N, C, H, W) function on an unbatched 3-D (C, H, W) input too."""
    if x.ndim == 3:
        return _each(lambda o: _F.squeeze(o, 0), fn(_F.unsqueeze(x, 0), *args, **kwargs))
    if x.ndim != 4:
        raise ValueError(f"expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape {tuple(x.shape)}")
    return fn(x, *args, **kwargs)


# --------------------------------------------------------------------------
# linear / convolution

def depend(input: Tensor, depend) -> Tensor:
    """`input`, with an order-only dependency on `depend` (a tensor or a list of them): in a graph,
    whatever reads the result runs after the kernels computing `depend`. Numerically the
    identity; in eager mode (everything already ran in program order) it returns `input` itself."""
    deps = list(depend) if isinstance(depend, (list, tuple)) else [depend]
    if not any(t.is_lazy for t in [input] + deps):
        return input
    return apply("depend", input, *deps)


def linear(input, weight, bias=None):
    """y = input @ weight.T + bias (weight is (out_features, in_features))."""
    out = _F.matmul(input, _F.transpose(weight, 0, 1))
    return _add_bias(out, bias) if bias is not None else out


def _add_bias(out, bias):
    """The bias add of a linear layer or convolution (`bias` already shaped to broadcast). Under
    autocast the bias joins in the product's dtype: PyTorch's linear and convolutions take all
    three operands in the autocast dtype (flowgen/mixed_precision.py)."""
    if mixed_precision.active() is not None:
        bias = _F.cast(bias, out.dtype)
    return out + bias


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-d convolution, NCHW. ``padding`` may be an int, a pair, 'valid' or 'same'."""
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    kernel = tuple(weight.shape[2:])
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise ValueError("conv2d: padding='same' is not supported for strided convolutions")
            total = [dilation[i] * (kernel[i] - 1) for i in range(2)]
            left = [t // 2 for t in total]
            if any(t % 2 for t in total):   # odd total: the extra row/column goes bottom/right, as PyTorch
                extra = [t - 2 * lft for t, lft in zip(total, left)]
                input = pad(input, [0, extra[1], 0, extra[0]])
            padding = tuple(left)
        else:
            raise ValueError(f"conv2d: invalid padding string {padding!r}, should be 'valid' or 'same'")
    padding = _pair(padding, "padding")

    def run(x):
        out = apply("conv2d", x, weight, stride=stride, padding=padding, dilation=dilation, groups=int(groups))
        if bias is not None:
            out = _add_bias(out, _F.reshape(bias, (1, weight.shape[0], 1, 1)))
        return out

    return _batched_2d(run, input)


# --------------------------------------------------------------------------
# activations

def _result(input, out, inplace):
    """`out`, or with inplace=True `out` written into `input` and `input` returned (PyTorch's
    inplace= flags; autograd rebases input's history, Tensor._assign)."""
    return input._assign(out) if inplace else out


def relu(input, inplace=False):
    return _result(input, _F.relu(input), inplace)


def relu6(input, inplace=False):
    return hardtanh(input, 0.0, 6.0, inplace)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """Clamp to [min_val, max_val]; the gradient is 0 at the bounds, as torch's (clamp's is 1 there)."""
    return _result(input, _F.hardtanh(input, min_val, max_val), inplace)


def gelu(input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply("gelu", input, approximate=approximate)


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    """Randomized leaky ReLU: negative inputs scaled by a slope drawn uniformly from [lower, upper)
    per element while training (Philox stream, as dropout), by (lower + upper) / 2 otherwise."""
    if not 0.0 <= lower <= upper:
        raise ValueError(f"rrelu: need 0 <= lower <= upper, got lower={lower}, upper={upper}")
    if training:
        slope = _creation.uniform(tuple(input.shape), lower, upper, dtype=input.dtype)
    else:
        slope = (lower + upper) / 2.0
    return _result(input, _F.where(input >= 0, input, input * slope), inplace)


def silu(input, inplace=False):
    return _result(input, apply("silu", input), inplace)


def sigmoid(input):
    return _F.sigmoid(input)


def tanh(input):
    return _F.tanh(input)


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return _result(input, _F.where(input > 0, input, input * negative_slope), inplace)


def elu(input, alpha=1.0, inplace=False):
    # expm1 of the clamped value keeps the unused branch finite (and its gradient zero); expm1, as
    # PyTorch, keeps the relative precision near 0 (exp(x) - 1 is 0 for |x| < 3e-8 in float32) and
    # the sign of -0.0.
    return _result(input, _F.where(input > 0, input, _F.expm1(_F.clamp(input, None, 0.0)) * alpha), inplace)


def hardsigmoid(input, inplace=False):
    return _result(input, relu6(input + 3.0) * (1.0 / 6.0), inplace)


def hardswish(input, inplace=False):
    return _result(input, input * hardsigmoid(input), inplace)


def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + exp(s)) / beta with s = beta x, and x where s > threshold, as PyTorch. Computed as
    relu(s) + log1p(exp(-|s|)), which keeps the relative precision for s << 0 (1 + exp(s) rounds
    to 1 there: softplus(-20) came out 0 in float32); |s| as where(s > 0, s, -s), whose derivative
    at 0 (-1) with relu'(0) = 0 gives the gradient 1/2 there."""
    scaled = input * beta
    abs_scaled = _F.where(scaled > 0, scaled, -scaled)
    soft = (_F.relu(scaled) + _F.log1p(_F.exp(-abs_scaled))) * (1.0 / beta)
    return _F.where(scaled > threshold, input, soft)


def mish(input, inplace=False):
    return _result(input, input * _F.tanh(softplus(input)), inplace)


def logsigmoid(input):
    """log(sigmoid(x)) = -(relu(-x) + log1p(exp(-|x|))), finite for any x; |x| as where(x >= 0, x, -x)
    so that the gradient at 0 is exactly 1/2."""
    abs_x = _F.where(input >= 0, input, -input)
    return -(_F.relu(-input) + _F.log1p(_F.exp(-abs_x)))


def softsign(input):
    return input / (_F.abs(input) + 1.0)


def celu(input, alpha=1.0, inplace=False):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    if alpha == 0:
        raise ValueError("celu: alpha must not be 0 (ZeroDivisionError in the formula exp(x / alpha))")
    negative = _F.expm1(_F.clamp(input, None, 0.0) * (1.0 / alpha)) * alpha
    return _result(input, _F.where(input > 0, input, negative), inplace)


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(input, inplace=False):
    """scale * elu(x, alpha) with the self-normalising constants (Klambauer et al.; PyTorch's values)."""
    negative = _F.expm1(_F.clamp(input, None, 0.0)) * (_SELU_ALPHA * _SELU_SCALE)
    return _result(input, _F.where(input > 0, input * _SELU_SCALE, negative), inplace)


def tanhshrink(input):
    return input - _F.tanh(input)


def _check_lambd(lambd, name):
    if lambd < 0:
        raise RuntimeError(f"{name}: lambda must be greater or equal to 0, but found to be {lambd}.")


def softshrink(input, lambd=0.5):
    """x - lambd above lambd, x + lambd below -lambd, 0 between (gradient 0 at +-lambd, as torch);
    NaN stays NaN (x * 0 in the middle branch)."""
    _check_lambd(lambd, "softshrink")
    return _F.where(input > lambd, input - lambd, _F.where(input < -lambd, input + lambd, input * 0.0))


def hardshrink(input, lambd=0.5):
    """0 where -lambd <= x <= lambd, else x (so NaN stays NaN, as torch)."""
    return _F.where(_F.logical_and(input >= -lambd, input <= lambd), 0.0, input)


def threshold(input, threshold, value, inplace=False):
    """`value` where x <= threshold, else x (so NaN stays NaN, as torch)."""
    return _result(input, _F.where(input <= threshold, value, input), inplace)


def glu(input, dim=-1):
    """a * sigmoid(b), with a and b the two halves of `input` along `dim`."""
    if input.ndim == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    d = normalize_dim(dim, input.ndim, "glu")
    if input.shape[d] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {d} is size {input.shape[d]}")
    a, b = _F.chunk(input, 2, d)
    return a * _F.sigmoid(b)


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    """softmax(-x) over `dim` (None: PyTorch's legacy choice of dim)."""
    return softmax(-input if dtype is None else -_F.cast(input, dt.get(dtype)), dim)


def prelu(input, weight):
    """x where x > 0, else weight * x; weight has 1 element or one per channel (dim 1; no channel dim
    below 2-D input)."""
    count = weight.numel()
    if count == 1:
        slope = _F.reshape(weight, ())
    else:
        channels = input.shape[1] if input.ndim >= 2 else 1
        if weight.ndim != 1 or count != channels:
            raise RuntimeError(f"prelu: mismatch of parameter numbers and input channel size. Found parameter "
                               f"numbers = {count} and channel size = {channels}.")
        slope = _F.reshape(weight, _channel_shape(input))
    return _F.where(input > 0, input, input * slope)


def _legacy_softmax_dim(ndim):
    return 0 if ndim in (0, 1, 3) else 1


def softmax(input, dim=None, dtype=None):
    if dtype is not None:
        input = _F.cast(input, dt.get(dtype))
    if dim is None:
        dim = _legacy_softmax_dim(input.ndim)
    return apply("softmax", input, dim=normalize_dim(dim, max(input.ndim, 1), "softmax") if input.ndim else 0)


def log_softmax(input, dim=None, dtype=None):
    if dtype is not None:
        input = _F.cast(input, dt.get(dtype))
    if dim is None:
        dim = _legacy_softmax_dim(input.ndim)
    return apply("log_softmax", input, dim=normalize_dim(dim, max(input.ndim, 1), "log_softmax") if input.ndim else 0)


def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability p and scale the rest by 1/(1-p) (Philox stream, see flowgen.random)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return _result(input, input * 0.0, inplace)
    seed, offset = _random.next_dropout_seed()
    return _result(input, apply("dropout", input, p=float(p), seed=int(seed), offset=int(offset)), inplace)


# --------------------------------------------------------------------------
# normalisation

def _normalize(x, dims, eps):
    """(x - mean) / sqrt(biased var + eps) over `dims`; also returns mean and biased var (keepdim)."""
    mean = _F.mean(x, dims, keepdim=True)
    diff = x - mean
    var = _F.mean(diff * diff, dims, keepdim=True)
    return diff * _F.rsqrt(var + eps), mean, var


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Batch norm over (N, C, ...) inputs, per channel C.

    Training uses the batch statistics and, when running stats are given, updates them in place
    (``running = (1 - momentum) * running + momentum * stat``, unbiased variance, as PyTorch).
    """
    if input.ndim < 2:
        raise ValueError(f"batch_norm: expected an input with at least 2 dims (N, C, ...), got {tuple(input.shape)}")
    C = input.shape[1]
    bshape = _channel_shape(input)
    dims = (0,) + tuple(range(2, input.ndim))
    use_batch_stats = training or running_mean is None or running_var is None
    if use_batch_stats:
        n = _numel(input.shape[d] for d in dims)
        if training and n <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{list(input.shape)}")
        update = training and running_mean is not None and running_var is not None
        m = 0.0 if momentum is None else float(momentum)
        # Each running statistic is updated right after its batch statistic is computed, so a
        # compiled graph folds the update into the kernel that reduces the statistic.
        mean = _F.mean(input, dims, keepdim=True)
        if update:
            with no_grad():
                # (1 - m) * running + m * stat, written so that every op reads the statistic's chain
                running_mean.copy_(running_mean + (_F.reshape(mean, (C,)) - running_mean) * m)
        diff = input - mean
        var = _F.mean(diff * diff, dims, keepdim=True)
        if update:
            with no_grad():
                unbiased = _F.reshape(var, (C,)) * (n / max(n - 1, 1))
                running_var.copy_(running_var + (unbiased - running_var) * m)
        # One op with a closed-form gradient (flowgen/ops/norm_ops.py) instead of autodiff
        # through the statistics: two channel reductions and one kernel in the backward.
        return apply("batch_norm_affine", input, mean, _F.rsqrt(var + eps),
                     1.0 if weight is None else _F.reshape(weight, bshape),
                     0.0 if bias is None else _F.reshape(bias, bshape))
    else:
        mean = _F.reshape(running_mean, bshape)
        var = _F.reshape(running_var, bshape)
        out = (input - mean) * _F.rsqrt(var + eps)
    if weight is not None:
        out = out * _F.reshape(weight, bshape)
    if bias is not None:
        out = out + _F.reshape(bias, bshape)
    # a 16-bit input keeps its dtype (float32 statistics; batch_norm_affine does the same)
    return _F.cast(out, input.dtype) if input.dtype in (dt.float16, dt.bfloat16) else out


def normalized_shape_tuple(normalized_shape) -> tuple:
    """LayerNorm/RMSNorm's `normalized_shape` (an int or a sequence) as a tuple of ints."""
    return (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(int(s) for s in normalized_shape)


def _normalized_dims(input, normalized_shape, op: str) -> int:
    """How many trailing dims `normalized_shape` names; they must be the input's last dims
    (PyTorch's message)."""
    shape = normalized_shape_tuple(normalized_shape)
    k = len(shape)
    if k == 0 or tuple(input.shape[input.ndim - k:]) != shape:
        raise RuntimeError(f"{op}: given normalized_shape={list(shape)}, expected input with shape "
                           f"[*, {', '.join(map(str, shape))}], but got input of size {list(input.shape)}")
    return k


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    k = _normalized_dims(input, normalized_shape, "layer_norm")
    # one op (ops/norm_ops.py): a row kernel forward, the closed form backward
    affine = [t for t in (weight, bias) if t is not None]
    out, _, _ = apply("layer_norm", input, *affine, normalized_ndim=k, eps=float(eps),
                      has_weight=weight is not None, has_bias=bias is not None)
    return out


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """x / sqrt(mean(x^2 over the last len(normalized_shape) dims) + eps) * weight; eps None is the
    machine epsilon of the input's dtype (torch.finfo(dtype).eps), as PyTorch."""
    k = _normalized_dims(input, normalized_shape, "rms_norm")
    if eps is None:
        eps = float(np.finfo(input.dtype.np_dtype).eps)
    dims = tuple(range(input.ndim - k, input.ndim))
    out = input * _F.rsqrt(_F.mean(input * input, dims, keepdim=True) + eps)
    return out * weight if weight is not None else out


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    if input.ndim < 2:
        raise ValueError(f"group_norm: expected an input with at least 2 dims, got {tuple(input.shape)}")
    N, C = input.shape[:2]
    if C % num_groups:
        raise RuntimeError(f"group_norm: num_groups={num_groups} must divide the number of channels {C}")
    if N * (C // num_groups) * _numel(input.shape[2:]) == 1:   # as PyTorch's check, training or not
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{[N * C // num_groups, num_groups] + list(input.shape[2:])}")
    grouped = _F.reshape(input, (N, num_groups, _numel(input.shape[1:]) // num_groups))
    out, _, _ = _normalize(grouped, (2,), eps)
    out = _F.reshape(out, tuple(input.shape))
    bshape = _channel_shape(input)
    if weight is not None:
        out = out * _F.reshape(weight, bshape)
    if bias is not None:
        out = out + _F.reshape(bias, bshape)
    return out


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    if input.ndim < 3:
        raise ValueError(f"instance_norm: expected an input with spatial dims (N, C, ...), got {tuple(input.shape)}")
    C = input.shape[1]
    bshape = _channel_shape(input)
    dims = tuple(range(2, input.ndim))
    if use_input_stats or running_mean is None or running_var is None:
        out, mean, var = _normalize(input, dims, eps)
        if use_input_stats and running_mean is not None and running_var is not None:
            n = _numel(input.shape[d] for d in dims)
            m = float(momentum)
            with no_grad():
                batch_mean = _F.reshape(_F.mean(mean, (0,)), (C,))
                batch_var = _F.reshape(_F.mean(var, (0,)), (C,)) * (n / max(n - 1, 1))
                running_mean.copy_(running_mean * (1.0 - m) + batch_mean * m)
                running_var.copy_(running_var * (1.0 - m) + batch_var * m)
    else:
        out = (input - _F.reshape(running_mean, bshape)) * _F.rsqrt(_F.reshape(running_var, bshape) + eps)
    if weight is not None:
        out = out * _F.reshape(weight, bshape)
    if bias is not None:
        out = out + _F.reshape(bias, bshape)
    return out


# --------------------------------------------------------------------------
# pooling and resampling

def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """Max pooling; with return_indices=True also the int64 flat index (h * W + w) of each maximum
    in its (n, c) plane, as PyTorch."""
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == [] or stride == () else _pair(stride, "stride")
    attrs = dict(kernel_size=kernel, stride=stride, padding=_pair(padding, "padding"),
                 dilation=_pair(dilation, "dilation"), ceil_mode=bool(ceil_mode))
    if return_indices:
        return _batched_2d(lambda x: (apply("max_pool2d", x, **attrs), apply("max_pool2d_indices", x, **attrs)),
                           input)
    return _batched_2d(lambda x: apply("max_pool2d", x, **attrs), input)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == [] or stride == () else _pair(stride, "stride")
    attrs = dict(kernel_size=kernel, stride=stride, padding=_pair(padding, "padding"), ceil_mode=bool(ceil_mode),
                 count_include_pad=bool(count_include_pad))
    if divisor_override:
        if ceil_mode:
            raise NotImplementedError("avg_pool2d: divisor_override with ceil_mode=True is not supported")
        attrs["count_include_pad"] = True   # every window then divides by kh*kw exactly
        scale = kernel[0] * kernel[1] / float(divisor_override)
        return _batched_2d(lambda x: apply("avg_pool2d", x, **attrs) * scale, input)
    return _batched_2d(lambda x: apply("avg_pool2d", x, **attrs), input)


def adaptive_avg_pool2d(input, output_size):
    def run(x):
        H, W = x.shape[2:]
        if isinstance(output_size, (tuple, list)):
            oh, ow = output_size
        else:
            oh = ow = output_size
        oh = H if oh is None else int(oh)
        ow = W if ow is None else int(ow)
        if H % oh == 0 and W % ow == 0:
            k = (H // oh, W // ow)
            return apply("avg_pool2d", x, kernel_size=k, stride=k, padding=(0, 0), ceil_mode=False,
                         count_include_pad=True)
        return apply("adaptive_avg_pool2d", x, output_size=(oh, ow))

    return _batched_2d(run, input)


def _adaptive_windows(size, out):
    """PyTorch's adaptive pooling windows: [floor(i * size / out), ceil((i + 1) * size / out))."""
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


def adaptive_max_pool2d(input, output_size, return_indices=False):
    """Max over PyTorch's adaptive windows; with return_indices=True also the int64 flat index
    (h * W + w) of each maximum in its (n, c) plane (the first in row-major order among ties)."""
    def run(x):
        H, W = x.shape[2:]
        oh, ow = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
        oh, ow = H if oh is None else int(oh), W if ow is None else int(ow)
        if H % oh == 0 and W % ow == 0:     # equal windows: one max_pool2d
            return max_pool2d(x, (H // oh, W // ow), return_indices=return_indices)
        return _adaptive_max_windows(x, oh, ow, return_indices)

    return _batched_2d(run, input)


def _adaptive_max_windows(x, oh, ow, return_indices):
    """Uneven windows: the max over each column window of every row, then over each row window of
    those (the first maximum along w, then along h: row-major first, as PyTorch's kernel)."""
    H, W = x.shape[2:]
    col_max, col_arg = [], []
    for start, stop in _adaptive_windows(W, ow):
        values, indices = _F.max(x[:, :, :, start:stop], 3, keepdim=True)
        col_max.append(values)
        col_arg.append(indices + start)
    col_max, col_arg = _F.cat(col_max, 3), _F.cat(col_arg, 3)                     # (N, C, H, ow)
    out, flat = [], []
    for start, stop in _adaptive_windows(H, oh):
        values, rows = _F.max(col_max[:, :, start:stop], 2, keepdim=True)         # (N, C, 1, ow)
        out.append(values)
        if return_indices:
            cols = _F.gather(col_arg[:, :, start:stop], 2, rows)
            flat.append((rows + start) * W + cols)
    out = _F.cat(out, 2)
    return (out, _F.cat(flat, 2)) if return_indices else out


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    """Resize a 4-D (N, C, H, W) input: mode 'nearest' or 'bilinear' (PyTorch index rules)."""
    if input.ndim != 4:
        raise NotImplementedError(f"interpolate: flowgen supports 4-D (N, C, H, W) inputs, got {tuple(input.shape)}")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    if mode not in ("nearest", "bilinear"):
        raise NotImplementedError(f"interpolate: mode {mode!r} is not supported (use 'nearest' or 'bilinear')")
    if mode == "nearest" and align_corners is not None:
        raise ValueError("align_corners option can only be set with the interpolating modes: "
                         "linear | bilinear | bicubic | trilinear")
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: exactly one of size or scale_factor must be given")
    H, W = input.shape[2:]
    if size is not None:
        out = _pair(size, "size")
        scales = None
    else:
        sf = tuple(float(s) for s in scale_factor) if isinstance(scale_factor, (tuple, list)) \
            else (float(scale_factor),) * 2
        out = (int(math.floor(H * sf[0])), int(math.floor(W * sf[1])))
        scales = None if recompute_scale_factor else sf
    if mode == "nearest":
        return apply("upsample_nearest2d", input, size=out, scales=scales)
    return apply("upsample_bilinear2d", input, size=out, align_corners=bool(align_corners), scales=scales)


def upsample(input, size=None, scale_factor=None, mode="nearest", align_corners=None):
    return interpolate(input, size, scale_factor, mode, align_corners)


def upsample_nearest(input, size=None, scale_factor=None):
    return interpolate(input, size, scale_factor, mode="nearest")


def upsample_bilinear(input, size=None, scale_factor=None):
    return interpolate(input, size, scale_factor, mode="bilinear", align_corners=True)


# --------------------------------------------------------------------------
# indexing

def gather(input, dim, index):
    return apply("gather", input, index, dim=normalize_dim(dim, max(input.ndim, 1), "gather"))


def index_select(input, dim, index):
    return apply("index_select", input, index, dim=normalize_dim(dim, max(input.ndim, 1), "index_select"))


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """Rows `input` of `weight`. `padding_idx`: that row gets no gradient. `scale_grad_by_freq`: each
    index's gradient divided by how often it occurs in `input`. `max_norm`: first renormalise, in
    place in `weight`, the rows `input` touches whose `norm_type`-norm exceeds it (PyTorch)."""
    if max_norm is not None:
        _embedding_renorm_(weight, input, float(max_norm), float(norm_type))
    if sparse:
        raise NotImplementedError("embedding: sparse=True (sparse gradients) is not supported by flowgen; "
                                  "the weight gets a dense gradient with sparse=False")
    num = weight.shape[0]
    if padding_idx is None:
        pad_idx = -1
    else:
        if not -num <= padding_idx < num:
            raise ValueError(f"embedding: padding_idx {padding_idx} must be within num_embeddings ({num})")
        pad_idx = padding_idx % num
    return apply("embedding", weight, input, padding_idx=int(pad_idx), scale_grad_by_freq=bool(scale_grad_by_freq))


def _embedding_renorm_(weight, indices, max_norm, norm_type):
    """PyTorch's embedding_renorm_: each row `indices` touches whose norm exceeds `max_norm` is scaled
    in place by max_norm / (norm + 1e-7). The write is weight + (a detached change), so a graph's
    autodiff, like eager autograd, differentiates the lookup as if the renormalised weight were the
    parameter; in a graph it is an in-place update of the parameter, as BatchNorm's running stats."""
    if max_norm <= 0:
        raise ValueError(f"embedding: max_norm must be > 0, got {max_norm}")
    num = weight.shape[0]
    with no_grad():
        ones = _creation.ones_like(_F.unsqueeze(indices, -1), dtype=weight.dtype)
        touched = _F.gt(apply("embedding_backward", ones, indices, num_weights=int(num), padding_idx=-1), 0)
        norms = _F.norm(weight, norm_type, dim=1, keepdim=True)
        scale = _F.where(touched & _F.gt(norms, max_norm), max_norm / (norms + 1e-7), 1.0)
        weight.copy_(weight + _F.detach(weight * (scale - 1.0)))


def one_hot(tensor, num_classes=-1):
    """int64 one-hot encoding along a new last dimension: rows of the identity picked by `index_select`,
    so a class outside [0, num_classes) raises IndexError (eager, and graphs through the index check)."""
    if tensor.dtype not in (dt.int64, dt.int32):
        raise RuntimeError("one_hot is only applicable to index tensors (int64)")
    if num_classes == -1:
        if tensor.is_lazy:
            raise RuntimeError("one_hot inside nn.Graph.build() needs an explicit num_classes")
        num_classes = int(tensor.numpy().max()) + 1 if tensor.numel() else 0
    if not tensor.is_lazy and tensor.numel():
        values = tensor.numpy_view()
        bad = values[(values < 0) | (values >= num_classes)]
        if bad.size:
            raise IndexError(f"one_hot: class {int(bad.flat[0])} is out of range [0, {num_classes})")
    identity = _const(np.eye(num_classes, dtype=np.int64), tensor)
    rows = _F.index_select(identity, 0, _F.reshape(tensor, (-1,)))
    return _F.reshape(rows, tuple(tensor.shape) + (num_classes,))


def pad(input, pad, mode="constant", value=None):
    """Pad (or crop, with negative amounts) the last len(pad)//2 dims; pad = [left_last, right_last, ...].

    Every mode is one index_select per padded dim (with a `where` for the constant fill).
    """
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > input.ndim:
        raise ValueError(f"pad: padding length must be even and at most 2 * ndim, got {len(pad)} for "
                         f"{input.ndim}-D input")
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise NotImplementedError(f"pad: mode {mode!r} is not supported")
    if mode != "constant" and value:
        raise ValueError(f"pad: padding mode {mode!r} doesn't take in value argument")
    out = input
    for k in range(len(pad) // 2):
        dim = input.ndim - 1 - k
        left, right = pad[2 * k], pad[2 * k + 1]
        if left == 0 and right == 0:
            continue
        L = out.shape[dim]
        pos = np.arange(-left, L + right, dtype=np.int64)
        if mode == "constant":
            src = np.clip(pos, 0, max(L - 1, 0))
        elif mode == "replicate":
            src = np.clip(pos, 0, L - 1)
        elif mode == "circular":
            if left > L or right > L:
                raise ValueError("pad: circular padding may wrap around at most once")
            src = pos % L
        else:  # reflect (the edge is not repeated)
            if left >= L or right >= L:
                raise ValueError(f"pad: padding size should be less than the corresponding input dimension, "
                                 f"but got padding ({left}, {right}) at dimension {dim} of input "
                                 f"{list(input.shape)}")
            period = 2 * (L - 1) if L > 1 else 1
            src = np.abs(pos) % period
            src = np.where(src >= L, period - src, src)
        if len(pos) == 0:
            raise ValueError(f"pad: resulting size of dimension {dim} would be {len(pos)}")
        gathered = apply("index_select", out, _const(src, out), dim=dim)
        inside = (pos >= 0) & (pos < L)
        if mode == "constant" and not inside.all():
            shape = [1] * out.ndim
            shape[dim] = len(pos)
            fill = _scalar_like(0 if value is None else value, out)
            gathered = _F.where(_const(inside.reshape(shape), out), gathered, fill)
        out = gathered
    return out


# --------------------------------------------------------------------------
# losses

def mse_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    reduction = _legacy_reduction(size_average, reduce, reduction, "mse_loss")
    diff = input - target
    return _reduce(diff * diff, reduction, "mse_loss")


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    reduction = _legacy_reduction(size_average, reduce, reduction, "l1_loss")
    return _reduce(_F.abs(input - target), reduction, "l1_loss")


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    reduction = _legacy_reduction(size_average, reduce, reduction, "smooth_l1_loss")
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be >= 0 (PyTorch refuses negative values), got {beta}")
    diff = input - target
    if beta == 0.0:
        return _reduce(_F.abs(diff), reduction, "smooth_l1_loss")
    ad = _F.abs(diff)
    loss = _F.where(ad < beta, diff * diff * (0.5 / beta), ad - 0.5 * beta)
    return _reduce(loss, reduction, "smooth_l1_loss")


def huber_loss(input, target, reduction="mean", delta=1.0):
    _check_reduction(reduction, "huber_loss")
    if not delta > 0:
        raise ValueError(f"huber_loss: delta must be > 0 (PyTorch refuses non-positive values), got {delta}")
    diff = input - target
    ad = _F.abs(diff)
    loss = _F.where(ad < delta, diff * diff * 0.5, (ad - 0.5 * delta) * delta)
    return _reduce(loss, reduction, "huber_loss")


def _class_weight_shape(ndim, class_dim):
    shape = [1] * ndim
    shape[class_dim] = -1
    return shape


def _nll_parts(logp, target, weight, ignore_index, op="nll_loss"):
    """Per-element -w[t] * logp[t] (0 where ignored), the per-element weights, and the valid mask."""
    if target.dtype not in (dt.int64, dt.int32):
        raise RuntimeError(f"nll_loss: expected an int64 class-index target, got {target.dtype!r}")
    if logp.ndim < 2:
        raise ValueError(f"nll_loss: expected input of shape (N, C, ...), got {tuple(logp.shape)}")
    if tuple(target.shape) != (logp.shape[0],) + tuple(logp.shape[2:]):
        raise ValueError(f"nll_loss: expected target of shape {(logp.shape[0],) + tuple(logp.shape[2:])}, "
                         f"got {tuple(target.shape)}")
    C = logp.shape[1]
    if not target.is_lazy:   # in a graph, the gather kernel below checks (and names the module)
        t = target.numpy_view()
        bad = (t != ignore_index) & ((t < 0) | (t >= C))
        if bad.any():
            raise IndexError(f"{op}: target {int(t[bad].flat[0])} is out of bounds for {C} classes")
    valid = _F.ne(target, ignore_index)
    safe = target * _F.cast(valid, target.dtype)          # ignored entries read class 0, then get weight 0
    picked = _F.squeeze(apply("gather", logp, _F.unsqueeze(safe, 1), dim=1), 1)
    w = _F.cast(valid, logp.dtype)
    if weight is not None:
        if tuple(weight.shape) != (C,):
            raise RuntimeError(f"nll_loss: weight should have shape ({C},), got {tuple(weight.shape)}")
        w_t = _F.reshape(apply("index_select", weight, _F.reshape(safe, (safe.numel(),)), dim=0), tuple(safe.shape))
        w = w * w_t
    return -(picked * w), w, valid


def _unbatched(input, target):
    """(C,) input with a 0-d target → a batch of one."""
    if input.ndim == 1:
        return _F.unsqueeze(input, 0), _F.unsqueeze(target, 0) if target.ndim == 0 else target, True
    return input, target, False


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    reduction = _legacy_reduction(size_average, reduce, reduction, "nll_loss")
    input, target, unbatched = _unbatched(input, target)
    loss, w, _ = _nll_parts(input, target, weight, ignore_index)
    if reduction == "none":
        return _F.squeeze(loss, 0) if unbatched else loss
    if reduction == "sum":
        return _sum_all(loss)
    return _sum_all(loss) / _sum_all(w)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    """log_softmax over dim 1 (dim 0 for a (C,) input) then NLL; class-index or probability targets."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "cross_entropy")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if (input.ndim == 2 and not target.dtype.is_floating and weight is None and label_smoothing == 0
            and target.ndim == 1):
        # The common case in one row kernel each way (flowgen/ops/nn_ops.py: cross_entropy_rows).
        if not input.dtype.is_floating:
            raise TypeError(f"cross_entropy: expected floating point logits, got {input.dtype!r}")
        rows = apply("cross_entropy_rows", input, target, ignore_index=int(ignore_index))
        if reduction == "none":
            return rows
        if reduction == "sum":
            return _sum_all(rows)
        return _sum_all(rows) / _sum_all(_F.cast(_F.ne(target, ignore_index), input.dtype))
    class_dim = 1 if input.ndim >= 2 else 0
    C = input.shape[class_dim]
    logp = log_softmax(input, class_dim)
    cw = _F.reshape(weight, _class_weight_shape(input.ndim, class_dim)) if weight is not None else None

    if target.dtype.is_floating:   # class probabilities, same shape as input
        if tuple(target.shape) != tuple(input.shape):
            raise ValueError(f"cross_entropy: probability targets must match the input shape {tuple(input.shape)},"
                             f" got {tuple(target.shape)}")
        if label_smoothing > 0:
            target = target * (1.0 - label_smoothing) + label_smoothing / C
        prod = logp * target
        if cw is not None:
            prod = prod * cw
        loss = -_F.sum(prod, class_dim)
        if reduction == "none":
            return loss
        if reduction == "sum":
            return _sum_all(loss)
        return _sum_all(loss) * (C / max(input.numel(), 1))

    logp_b, target_b, unbatched = _unbatched(logp, target)
    nll, w, valid = _nll_parts(logp_b, target_b, weight, ignore_index, "cross_entropy")
    if reduction == "none":
        nll_red = nll
    elif reduction == "sum":
        nll_red = _sum_all(nll)
    else:
        nll_red = _sum_all(nll) / _sum_all(w)
    if label_smoothing <= 0:
        return _F.squeeze(nll_red, 0) if unbatched and reduction == "none" else nll_red

    cw_b = _F.reshape(weight, _class_weight_shape(logp_b.ndim, 1)) if weight is not None else None
    smooth = -_F.sum(logp_b * cw_b if cw_b is not None else logp_b, 1) * _F.cast(valid, logp_b.dtype)
    if reduction == "none":
        smooth_red = smooth
    elif reduction == "sum":
        smooth_red = _sum_all(smooth)
    elif weight is not None:
        smooth_red = _sum_all(smooth) / _sum_all(w)
    else:
        smooth_red = _sum_all(smooth) / _sum_all(_F.cast(valid, logp_b.dtype))
    out = nll_red * (1.0 - label_smoothing) + smooth_red * (label_smoothing / C)
    return _F.squeeze(out, 0) if unbatched and reduction == "none" else out


def sparse_softmax_cross_entropy(labels, logits):
    """OneFlow's (and TensorFlow's) per-element softmax cross-entropy, no reduction: logits
    [d0, ..., d_{r-1}, C] with the classes along the LAST dim, int32/int64 labels [d0, ..., d_{r-1}],
    each a class in [0, C) (none is ignored); the loss has the labels' shape and the logits' dtype.
    Note the argument order, labels first (`flow._C.sparse_softmax_cross_entropy(logits, labels)`
    takes them the other way round). One row kernel each way, as cross_entropy's common case."""
    op = "sparse_softmax_cross_entropy"
    if not logits.dtype.is_floating:
        raise TypeError(f"{op}: expected floating point logits, got {logits.dtype!r}")
    if labels.dtype not in (dt.int64, dt.int32):
        raise TypeError(f"{op}: expected int32 or int64 labels, got {labels.dtype!r}")
    if logits.ndim < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: expected logits [d0, ..., C] and labels of their shape without the last (class) "
                         f"dim, got logits {tuple(logits.shape)} and labels {tuple(labels.shape)}")
    C = logits.shape[-1]
    if not labels.is_lazy and labels.numel():   # in a graph, the row kernel checks (and names the module)
        values = labels.numpy_view()
        bad = values[(values < 0) | (values >= C)]
        if bad.size:
            raise IndexError(f"{op}: label {int(bad.flat[0])} is out of range [0, {C})")
    rows = apply("cross_entropy_rows", _F.reshape(logits, (-1, C)), _F.reshape(labels, (-1,)), ignore_index=None)
    return _F.reshape(rows, tuple(labels.shape))


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-(t log x + (1 - t) log(1 - x)), logs clamped at -100, and PyTorch's gradient (the
    `binary_cross_entropy` op)."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "binary_cross_entropy")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"binary_cross_entropy: target size ({list(target.shape)}) must be the same as input size "
                         f"({list(input.shape)})")
    loss = apply("binary_cross_entropy", input, _F.cast(target, input.dtype))
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy")


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                                     pos_weight=None):
    """(1 - t) x + lw * softplus(-x), lw = 1 + (pos_weight - 1) t; softplus(-x) = relu(-x) + log(1 + e^-|x|)."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "binary_cross_entropy_with_logits")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"Target size ({list(target.shape)}) must be the same as input size ({list(input.shape)})")
    # |x| as where(x >= 0, x, -x): at x == 0 its derivative (1) combines with relu'(0) = 0 to give
    # softplus(-x)' = -1/2 exactly, so zero logits get PyTorch's gradient sigmoid(0) - t.
    abs_x = _F.where(input >= 0, input, -input)
    softplus_neg = _F.relu(-input) + _F.log(_F.exp(-abs_x) + 1.0)
    if pos_weight is not None:
        log_weight = (pos_weight - 1.0) * target + 1.0
        loss = (1.0 - target) * input + log_weight * softplus_neg
    else:
        loss = (1.0 - target) * input + softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy_with_logits")


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """KL(target || exp(input)) pointwise: target * (log target - input), 0 where target == 0
    (`log_target`: target holds log-probabilities). "batchmean" divides the sum by the batch size."""
    if size_average is not None or reduce is not None:
        reduction = _legacy_reduction(size_average, reduce, reduction, "kl_div")
    if reduction not in _REDUCTIONS + ("batchmean",):
        raise ValueError(f"kl_div: {reduction!r} is not a valid value for reduction "
                         f"(expected one of {_REDUCTIONS + ('batchmean',)})")
    if log_target:
        loss = _F.exp(target) * (target - input)
    else:
        safe_log = _F.log(_F.where(target > 0, target, 1.0))
        loss = _F.where(target > 0, target * (safe_log - input), 0.0)
    if reduction == "batchmean":
        return _sum_all(loss) * (1.0 / (input.shape[0] if input.ndim else 1))
    return _reduce(loss, reduction, "kl_div")


def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    """max(0, -target * (input1 - input2) + margin)."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "margin_ranking_loss")
    return _reduce(_F.clamp_min(-target * (input1 - input2) + margin, 0.0), reduction, "margin_ranking_loss")


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """sum((x1 / max(|x1|, eps)) * (x2 / max(|x2|, eps))) along `dim`, PyTorch's formula: each norm is
    clamped on its own, and the clamp passes the norm's gradient through unchanged (PyTorch clamps
    without autograd)."""
    def unit(x):
        norm = _F.norm(x, 2, dim, keepdim=True)
        return x / (norm + _F.detach(_F.clamp_min(norm, eps) - norm))

    return _F.sum(unit(x1) * unit(x2), dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """|x1 - x2 + eps|_p over the last dim."""
    return _F.norm(x1 - x2 + eps, p, -1, keepdim)


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """input / max(|input|_p, eps) along `dim`."""
    if out is not None:
        raise ValueError("normalize: out= is not supported; use the returned tensor")
    return input / _F.clamp_min(_F.norm(input, p, dim, keepdim=True), eps)


def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    """1 - cos(x1, x2) where target == 1, max(0, cos(x1, x2) - margin) where target == -1."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "cosine_embedding_loss")
    # PyTorch's own eps placement: 1e-12 added to each squared norm before the product.
    dim = input1.ndim - 1
    dot = _F.sum(input1 * input2, dim)
    cos = dot / _F.sqrt((_F.sum(input1 * input1, dim) + 1e-12) * (_F.sum(input2 * input2, dim) + 1e-12))
    loss = _F.where(target == 1, 1.0 - cos, _F.where(target == -1, _F.clamp_min(cos - margin, 0.0), 0.0))
    return _reduce(loss, reduction, "cosine_embedding_loss")


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False, size_average=None,
                        reduce=None, reduction="mean"):
    """max(d(a, p) - d(a, n) + margin, 0) with d the pairwise p-distance (`swap`: d(a, n) becomes
    min(d(a, n), d(p, n)), the distance swap of Balntas et al.)."""
    reduction = _legacy_reduction(size_average, reduce, reduction, "triplet_margin_loss")
    d_pos = pairwise_distance(anchor, positive, p, eps)
    d_neg = pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_neg = _F.minimum(d_neg, pairwise_distance(positive, negative, p, eps))
    return _reduce(_F.clamp_min(d_pos - d_neg + margin, 0.0), reduction, "triplet_margin_loss")


def pixel_shuffle(input, upscale_factor):
    """(*, C r^2, H, W) -> (*, C, H r, W r): sub-pixel rearrangement (reshape + permute)."""
    r = int(upscale_factor)
    *lead, c, h, w = input.shape
    if c % (r * r):
        raise ValueError(f"pixel_shuffle: channels {c} not divisible by upscale_factor^2 = {r * r}")
    n = len(lead)
    x = _F.reshape(input, (*lead, c // (r * r), r, r, h, w))
    x = _F.permute(x, (*range(n), n, n + 3, n + 1, n + 4, n + 2))
    return _F.reshape(x, (*lead, c // (r * r), h * r, w * r))


def pixel_unshuffle(input, downscale_factor):
    """(*, C, H r, W r) -> (*, C r^2, H, W): the inverse of pixel_shuffle."""
    r = int(downscale_factor)
    *lead, c, h, w = input.shape
    if h % r or w % r:
        raise ValueError(f"pixel_unshuffle: spatial size ({h}, {w}) not divisible by downscale_factor {r}")
    n = len(lead)
    x = _F.reshape(input, (*lead, c, h // r, r, w // r, r))
    x = _F.permute(x, (*range(n), n, n + 2, n + 4, n + 1, n + 3))
    return _F.reshape(x, (*lead, c * r * r, h // r, w // r))


__all__ += ["kl_div", "margin_ranking_loss", "cosine_similarity", "pairwise_distance", "normalize",
            "cosine_embedding_loss", "triplet_margin_loss", "pixel_shuffle", "pixel_unshuffle"]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(q k^T * scale + mask) v over the last two dims (PyTorch's semantics).

    `attn_mask`: bool (True = may attend) or float (added to the scores), broadcast to (..., L, S);
    `is_causal`: query i attends keys j <= i (top-left aligned); `dropout_p` drops attention weights
    (always, as torch's functional form); `enable_gqa`: key/value heads are repeated to the query's.
    A row whose scores are all -inf (every key masked) gives 0, as PyTorch's SDPA.
    It is one `attention` op (`attention_dropout` with dropout; flowgen/ops/nn_ops.py) whose kernels
    run an online softmax per query row and rebuild the probabilities from the row's logsumexp in
    the backward, so neither direction materialises the [L, S] scores; the dropout mask is the one
    F.dropout on the weights would draw. Otherwise (dropout_p = 1, operands the op does not take,
    a float mask that requires grad) it is built from matmul/where/softmax/dropout ops. Both run
    (and differentiate) eagerly and inside nn.Graph.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    if query.ndim < 2 or key.ndim < 2 or value.ndim < 2:
        raise ValueError(f"scaled_dot_product_attention: query/key/value need at least 2 dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if enable_gqa and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = _F.repeat_interleave(key, groups, dim=key.ndim - 3)
        value = _F.repeat_interleave(value, groups, dim=value.ndim - 3)
    length, source = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if dropout_p < 1.0 and _one_attention_op(query, key, value, attn_mask):
        masks = () if attn_mask is None else (attn_mask,)
        if dropout_p == 0.0:
            return apply("attention", query, key, value, *masks, scale=scale, causal=bool(is_causal))[0]
        seed, offset = _random.next_dropout_seed()   # the one draw F.dropout on the weights makes
        return apply("attention_dropout", query, key, value, *masks, scale=scale, causal=bool(is_causal),
                     dropout_p=float(dropout_p), seed=int(seed), offset=int(offset))[0]
    scores = _F.matmul(query, _F.transpose(key, -2, -1)) * scale
    if is_causal:
        attn_mask = Tensor(np.tri(length, source, dtype=bool), device=query.device)
    if attn_mask is not None:
        if attn_mask.dtype == dt.bool_:
            scores = _F.where(attn_mask, scores, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = _safe_softmax(scores) if attn_mask is not None else _F.softmax(scores, -1)
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p, training=True)
    return _F.matmul(weights, value)


def _safe_softmax(scores):
    """softmax over the last dim, 0 (and no gradient) in rows whose scores are all -inf: PyTorch's
    SDPA. Such a row's scores are replaced by zeros first, so its softmax (then dropped) stays finite."""
    masked_row = _F.eq(_F.amax(scores, -1, keepdim=True), float("-inf"))
    weights = _F.softmax(_F.where(masked_row, 0.0, scores), -1)
    return _F.where(masked_row, 0.0, weights)


def _one_attention_op(query, key, value, attn_mask):
    """Whether the `attention` op takes these operands: one floating dtype, the same batch dims (no
    broadcasting), at least one key; a mask that is bool or of the query's dtype, broadcasting to
    (..., L, S), and no gradient wanted for it."""
    lead = tuple(query.shape[:-2])
    if not (query.dtype == key.dtype == value.dtype and query.dtype.is_floating and key.shape[-2] > 0
            and query.ndim == key.ndim == value.ndim and tuple(key.shape[:-2]) == lead
            and tuple(value.shape[:-2]) == lead):
        return False
    if attn_mask is None:
        return True
    full = (*lead, query.shape[-2], key.shape[-2])
    return (attn_mask.dtype in (dt.bool_, query.dtype) and not attn_mask.requires_grad
            and attn_mask.ndim <= len(full) and _broadcasts_to(tuple(attn_mask.shape), full))


def _broadcasts_to(shape, full) -> bool:
    return all(a in (1, b) for a, b in zip(shape[::-1], full[::-1]))


__all__ += ["scaled_dot_product_attention"]


# --------------------------------------------------------------------------
# 1-d and 3-d layers and transposed convolutions, built on the 2-d ops
# (so they train eagerly and run in nn.Graph through the conv/pool kernel families)

def _single(v, name):
    if isinstance(v, (tuple, list)):
        if len(v) != 1:
            raise ValueError(f"{name} must be an int or a 1-tuple, got {v!r}")
        return int(v[0])
    return int(v)


def _triple(v, name):
    if isinstance(v, (tuple, list)):
        if len(v) != 3:
            raise ValueError(f"{name} must be an int or a triple of ints, got {v!r}")
        return tuple(int(x) for x in v)
    return (int(v),) * 3


def _batched_1d(fn, x, name):
    """Run a (N, C, L) function on an unbatched (C, L) input too."""
    if x.ndim == 2:
        return _each(lambda o: _F.squeeze(o, 0), fn(_F.unsqueeze(x, 0)))
    if x.ndim != 3:
        raise ValueError(f"{name}: expected a 2-D (C, L) or 3-D (N, C, L) input, got shape {tuple(x.shape)}")
    return fn(x)


def _as_2d(x):      # (N, C, L) -> (N, C, 1, L)
    return _F.unsqueeze(x, 2)


def _from_2d(y):    # (N, C, 1, L) -> (N, C, L)
    return _F.squeeze(y, 2)


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """1-d convolution over (N, C, L): a conv2d over (N, C, 1, L). ``padding`` may be 'valid'/'same'."""
    pad_arg = padding if isinstance(padding, str) else (0, _single(padding, "padding"))
    w2 = _F.unsqueeze(weight, 2)
    return _batched_1d(lambda x: _from_2d(conv2d(_as_2d(x), w2, bias, stride=(1, _single(stride, "stride")),
                                                 padding=pad_arg, dilation=(1, _single(dilation, "dilation")),
                                                 groups=groups)), input, "conv1d")


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """3-d convolution over (N, C, D, H, W): for each depth tap, one conv2d over the (strided, dilated)
    depth slices batched together, summed over the taps."""
    if input.ndim == 4:
        return _F.squeeze(conv3d(_F.unsqueeze(input, 0), weight, bias, stride, padding, dilation, groups), 0)
    if input.ndim != 5:
        raise ValueError(f"conv3d: expected a 4-D or 5-D input, got shape {tuple(input.shape)}")
    (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = (_triple(stride, "stride"), _triple(padding, "padding"),
                                                _triple(dilation, "dilation"))
    n, c, depth = input.shape[:3]
    out_c, _, kd = weight.shape[:3]
    out_d = (depth + 2 * pd - dd * (kd - 1) - 1) // sd + 1
    if out_d <= 0:
        raise ValueError(f"conv3d: kernel depth {kd} (dilation {dd}) is larger than the padded input depth "
                         f"{depth + 2 * pd}")
    x = pad(input, [0, 0, 0, 0, pd, pd]) if pd else input
    total = None
    for tap in range(kd):
        start = tap * dd
        slices = x[:, :, start:start + sd * (out_d - 1) + 1:sd]                     # (N, C, out_d, H, W)
        flat = _F.reshape(_F.permute(slices, (0, 2, 1, 3, 4)), (n * out_d, c) + tuple(x.shape[3:]))
        y = apply("conv2d", flat, weight[:, :, tap], stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
                  groups=int(groups))
        total = y if total is None else total + y
    out = _F.permute(_F.reshape(total, (n, out_d) + tuple(total.shape[1:])), (0, 2, 1, 3, 4))
    if bias is not None:
        out = _add_bias(out, _F.reshape(bias, (1, out_c, 1, 1, 1)))
    return out


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """Transposed 2-d convolution: the adjoint of conv2d (its input gradient). weight (C_in, C_out/groups, kH, kW)."""
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    output_padding, dilation = _pair(output_padding, "output_padding"), _pair(dilation, "dilation")
    for op_, s_, d_ in zip(output_padding, stride, dilation):
        if op_ >= max(s_, d_):
            raise ValueError(f"conv_transpose2d: output_padding {output_padding} must be smaller than either "
                             f"stride {stride} or dilation {dilation}")

    def run(x):
        n, c, h, w = x.shape
        if c != weight.shape[0]:
            raise RuntimeError(f"conv_transpose2d: input has {c} channels but weight expects {weight.shape[0]}")
        k = weight.shape[2:]
        out_hw = tuple((size - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1) + output_padding[i] + 1
                       for i, size in enumerate((h, w)))
        out = apply("conv2d_grad_input", x, weight, input_shape=(n, weight.shape[1] * groups) + out_hw,
                    stride=stride, padding=padding, dilation=dilation, groups=int(groups))
        if bias is not None:
            out = _add_bias(out, _F.reshape(bias, (1, -1, 1, 1)))
        return out

    return _batched_2d(run, input)


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    w2 = _F.unsqueeze(weight, 2)
    return _batched_1d(lambda x: _from_2d(conv_transpose2d(
        _as_2d(x), w2, bias, stride=(1, _single(stride, "stride")), padding=(0, _single(padding, "padding")),
        output_padding=(0, _single(output_padding, "output_padding")), groups=groups,
        dilation=(1, _single(dilation, "dilation")))), input, "conv_transpose1d")


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    k = _single(kernel_size, "kernel_size")
    s = k if stride is None or stride == [] or stride == () else _single(stride, "stride")
    return _batched_1d(lambda x: _each(_from_2d, max_pool2d(_as_2d(x), (1, k), (1, s), (0, _single(padding, "padding")),
                                                           (1, _single(dilation, "dilation")), ceil_mode,
                                                           return_indices)), input, "max_pool1d")


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    k = _single(kernel_size, "kernel_size")
    s = k if stride is None or stride == [] or stride == () else _single(stride, "stride")
    return _batched_1d(lambda x: _from_2d(avg_pool2d(_as_2d(x), (1, k), (1, s), (0, _single(padding, "padding")),
                                                     ceil_mode, count_include_pad)), input, "avg_pool1d")


def adaptive_avg_pool1d(input, output_size):
    size = _single(output_size, "output_size")
    return _batched_1d(lambda x: _from_2d(adaptive_avg_pool2d(_as_2d(x), (1, size))), input, "adaptive_avg_pool1d")


__all__ += ["conv1d", "conv3d", "conv_transpose1d", "conv_transpose2d", "max_pool1d", "avg_pool1d",
            "adaptive_avg_pool1d"]


def _patch_kernel(kernel, like):
    """The identity filter bank (kh*kw, 1, kh, kw): output channel k copies kernel tap k."""
    kh, kw = kernel
    eye = np.eye(kh * kw, dtype=like.dtype.np_dtype).reshape(kh * kw, 1, kh, kw)
    return Tensor(eye, dtype=like.dtype, device=like.device)


def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """im2col: (N, C, H, W) -> (N, C*kh*kw, L) sliding blocks, as torch.nn.functional.unfold. A conv2d with
    an identity filter bank over each channel, so it runs (and differentiates) in graphs."""
    kernel, dilation = _pair(kernel_size, "kernel_size"), _pair(dilation, "dilation")
    padding, stride = _pair(padding, "padding"), _pair(stride, "stride")

    def run(x):
        n, c, h, w = x.shape
        cols = apply("conv2d", _F.reshape(x, (n * c, 1, h, w)), _patch_kernel(kernel, x), stride=stride,
                     padding=padding, dilation=dilation, groups=1)
        return _F.reshape(cols, (n, c * kernel[0] * kernel[1], cols.shape[2] * cols.shape[3]))

    return _batched_2d(run, input)


def fold(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """col2im: (N, C*kh*kw, L) -> (N, C, H, W), summing overlapping blocks (the adjoint of unfold)."""
    kernel, dilation = _pair(kernel_size, "kernel_size"), _pair(dilation, "dilation")
    padding, stride, (h, w) = _pair(padding, "padding"), _pair(stride, "stride"), _pair(output_size, "output_size")
    taps = kernel[0] * kernel[1]
    blocks = [(size + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
              for i, size in enumerate((h, w))]
    unbatched = input.ndim == 2
    x = _F.unsqueeze(input, 0) if unbatched else input
    if x.ndim != 3 or x.shape[1] % taps or x.shape[2] != blocks[0] * blocks[1]:
        raise RuntimeError(f"fold: expected input of shape (N, C*{taps}, {blocks[0] * blocks[1]}) for output_size "
                           f"{(h, w)} and kernel_size {kernel}, got {tuple(input.shape)}")
    n, c = x.shape[0], x.shape[1] // taps
    cols = _F.reshape(x, (n * c, taps, blocks[0], blocks[1]))
    out = apply("conv2d_grad_input", cols, _patch_kernel(kernel, x), input_shape=(n * c, 1, h, w), stride=stride,
                padding=padding, dilation=dilation, groups=1)
    out = _F.reshape(out, (n, c, h, w))
    return _F.squeeze(out, 0) if unbatched else out


__all__ += ["unfold", "fold"]


__all__ += ["logsigmoid", "softsign", "celu", "selu", "tanhshrink", "softshrink", "hardshrink", "threshold", "glu",
            "softmin", "prelu", "rms_norm", "adaptive_max_pool2d"]
