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
from flowgen import functional as _F
from flowgen.autograd import no_grad
from flowgen.ops.registry import apply, normalize_dim
from flowgen.tensor import Tensor

__all__ = [
    "linear", "conv2d", "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "leaky_relu",
    "elu", "hardtanh", "hardsigmoid", "hardswish", "softplus", "mish", "softmax", "log_softmax", "dropout",
    "batch_norm", "layer_norm", "group_norm", "instance_norm", "max_pool2d", "avg_pool2d",
    "adaptive_avg_pool2d", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "embedding",
    "one_hot", "pad", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "gather", "index_select",
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


def _mean(x, dims, keepdim=False):
    dims = tuple(dims)
    count = _numel(x.shape[d] for d in dims)
    return _sum(x, dims, keepdim) * (1.0 / count)


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


def _channel_shape(x, channel_dim=1):
    """(1, C, 1, ...) — the broadcast shape of a per-channel vector for `x`."""
    shape = [1] * x.ndim
    shape[channel_dim] = x.shape[channel_dim]
    return tuple(shape)


def _batched_2d(fn, x, *args, **kwargs):
    """Run a 4-D (N, C, H, W) function on an unbatched 3-D (C, H, W) input too."""
    if x.ndim == 3:
        return _F.squeeze(fn(_F.unsqueeze(x, 0), *args, **kwargs), 0)
    if x.ndim != 4:
        raise ValueError(f"expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape {tuple(x.shape)}")
    return fn(x, *args, **kwargs)


# --------------------------------------------------------------------------
# linear / convolution

def linear(input, weight, bias=None):
    """y = input @ weight.T + bias (weight is (out_features, in_features))."""
    out = _F.matmul(input, _F.transpose(weight, 0, 1))
    return out + bias if bias is not None else out


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
            out = out + _F.reshape(bias, (1, weight.shape[0], 1, 1))
        return out

    return _batched_2d(run, input)


# --------------------------------------------------------------------------
# activations

def relu(input, inplace=False):
    return _F.relu(input)


def relu6(input, inplace=False):
    return hardtanh(input, 0.0, 6.0)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    return _F.clamp(input, min_val, max_val)


def gelu(input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply("gelu", input, approximate=approximate)


def silu(input, inplace=False):
    return apply("silu", input)


def sigmoid(input):
    return _F.sigmoid(input)


def tanh(input):
    return _F.tanh(input)


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return _F.where(input > 0, input, input * negative_slope)


def elu(input, alpha=1.0, inplace=False):
    # exp of the clamped value keeps the unused branch finite (and its gradient zero).
    return _F.where(input > 0, input, (_F.exp(_F.clamp(input, None, 0.0)) - 1.0) * alpha)


def hardsigmoid(input, inplace=False):
    return relu6(input + 3.0) * (1.0 / 6.0)


def hardswish(input, inplace=False):
    return input * hardsigmoid(input)


def softplus(input, beta=1.0, threshold=20.0):
    scaled = input * beta
    safe = _F.clamp(scaled, None, float(threshold))
    soft = _F.log(_F.exp(safe) + 1.0) * (1.0 / beta)
    return _F.where(scaled > threshold, input, soft)


def mish(input, inplace=False):
    return input * _F.tanh(softplus(input))


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
        return input * 0.0
    from flowgen import random as _random

    seed, offset = _random.next_dropout_seed()
    return apply("dropout", input, p=float(p), seed=int(seed), offset=int(offset))


# --------------------------------------------------------------------------
# normalisation

def _normalize(x, dims, eps):
    """(x - mean) / sqrt(biased var + eps) over `dims`; also returns mean and biased var (keepdim)."""
    mean = _mean(x, dims, keepdim=True)
    diff = x - mean
    var = _mean(diff * diff, dims, keepdim=True)
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
        mean = _mean(input, dims, keepdim=True)
        if update:
            with no_grad():
                # (1 - m) * running + m * stat, written so that every op reads the statistic's chain
                running_mean.copy_(running_mean + (_F.reshape(mean, (C,)) - running_mean) * m)
        diff = input - mean
        var = _mean(diff * diff, dims, keepdim=True)
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
    return out


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(int(s) for s in normalized_shape)
    k = len(normalized_shape)
    if k == 0 or tuple(input.shape[input.ndim - k:]) != normalized_shape:
        raise RuntimeError(f"layer_norm: given normalized_shape={list(normalized_shape)}, expected input with "
                           f"shape [*, {', '.join(map(str, normalized_shape))}], but got input of size "
                           f"{list(input.shape)}")
    out, _, _ = _normalize(input, tuple(range(input.ndim - k, input.ndim)), eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    if input.ndim < 2:
        raise ValueError(f"group_norm: expected an input with at least 2 dims, got {tuple(input.shape)}")
    N, C = input.shape[:2]
    if C % num_groups:
        raise RuntimeError(f"group_norm: num_groups={num_groups} must divide the number of channels {C}")
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
                batch_mean = _F.reshape(_mean(mean, (0,)), (C,))
                batch_var = _F.reshape(_mean(var, (0,)), (C,)) * (n / max(n - 1, 1))
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
    if return_indices:
        raise NotImplementedError("max_pool2d(return_indices=True) is not supported by flowgen")
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == [] or stride == () else _pair(stride, "stride")
    attrs = dict(kernel_size=kernel, stride=stride, padding=_pair(padding, "padding"),
                 dilation=_pair(dilation, "dilation"), ceil_mode=bool(ceil_mode))
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
    if max_norm is not None or scale_grad_by_freq:
        raise NotImplementedError("embedding: max_norm and scale_grad_by_freq are not supported by flowgen")
    num = weight.shape[0]
    if padding_idx is None:
        pad_idx = -1
    else:
        if not -num <= padding_idx < num:
            raise ValueError(f"embedding: padding_idx {padding_idx} must be within num_embeddings ({num})")
        pad_idx = padding_idx % num
    return apply("embedding", weight, input, padding_idx=int(pad_idx))


def one_hot(tensor, num_classes=-1):
    """int64 one-hot encoding along a new last dimension."""
    if tensor.dtype not in (dt.int64, dt.int32):
        raise RuntimeError("one_hot is only applicable to index tensors (int64)")
    if num_classes == -1:
        if tensor.is_lazy:
            raise RuntimeError("one_hot inside nn.Graph.build() needs an explicit num_classes")
        num_classes = int(tensor.numpy().max()) + 1 if tensor.numel() else 0
    classes = _const(np.arange(num_classes, dtype=np.int64), tensor)
    return _F.cast(_F.eq(_F.unsqueeze(tensor, -1), classes), dt.int64)


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
    _check_reduction(reduction, "mse_loss")
    diff = input - target
    return _reduce(diff * diff, reduction, "mse_loss")


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    _check_reduction(reduction, "l1_loss")
    return _reduce(_F.abs(input - target), reduction, "l1_loss")


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    _check_reduction(reduction, "smooth_l1_loss")
    diff = input - target
    if beta == 0.0:
        return _reduce(_F.abs(diff), reduction, "smooth_l1_loss")
    ad = _F.abs(diff)
    loss = _F.where(ad < beta, diff * diff * (0.5 / beta), ad - 0.5 * beta)
    return _reduce(loss, reduction, "smooth_l1_loss")


def huber_loss(input, target, reduction="mean", delta=1.0):
    _check_reduction(reduction, "huber_loss")
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
    _check_reduction(reduction, "nll_loss")
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
    _check_reduction(reduction, "cross_entropy")
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


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-(t log x + (1 - t) log(1 - x)), logs clamped at -100 as PyTorch."""
    _check_reduction(reduction, "binary_cross_entropy")
    log_x = _F.clamp(_F.log(input), -100.0, None)
    log_1mx = _F.clamp(_F.log(1.0 - input), -100.0, None)
    loss = -(target * log_x + (1.0 - target) * log_1mx)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy")


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                                     pos_weight=None):
    """(1 - t) x + lw * softplus(-x), lw = 1 + (pos_weight - 1) t; softplus(-x) = relu(-x) + log(1 + e^-|x|)."""
    _check_reduction(reduction, "binary_cross_entropy_with_logits")
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
