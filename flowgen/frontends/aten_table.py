"""The ATen -> flowgen table: one entry per ATen overload that flowgen runs, and nothing else.

Every importer reads this table: `flow.from_torch` (torch.export graphs), the `torch.compile`
backend (AOTAutograd graphs) and `flowgen build model.pt2`. An entry takes the overload's arguments
in its schema's order and names (tensors as flowgen tensors, `torch.dtype` as flowgen dtypes, a
`torch.device` as the device the graph runs on) and returns what the overload returns; a tuple
result is read by `getitem` nodes. An op missing here is refused before anything runs (the importer
lists every missing op with the user's source line), never approximated.

Keys are the overloads' names as `str(torch.ops.aten.<op>.<overload>)` spells them, so this module
does not import torch. `KEEP_COMPOSITE` names the composite ops flowgen runs as one op of its own
(one attention kernel, one GEMM with its bias epilogue, one layer_norm row kernel): the export keeps
them instead of decomposing them into the core ATen opset.
"""
from __future__ import annotations

import math
import operator

from flowgen import creation, mixed_precision
from flowgen import dtype as dt
from flowgen import functional as ops
from flowgen.autograd import no_grad
from flowgen.nn import functional as F
from flowgen.ops.registry import apply

# Composite ATen ops decomposed by default that flowgen has as ops of its own.
KEEP_COMPOSITE = (
    "aten.linear.default", "aten.matmul.default", "aten.scaled_dot_product_attention.default",
    "aten.layer_norm.default", "aten.group_norm.default", "aten.softmax.int", "aten.log_softmax.int", "aten.conv1d.default",
    "aten.conv2d.default", "aten.max_pool2d.default", "aten.adaptive_avg_pool2d.default",
    "aten.dropout.default", "aten.flatten.using_ints",
)

_UNBOUNDED = 2 ** 62   # ATen spells "to the end" of a slice as 2**63 - 1


# ------------------------------------------------------------------ helpers
def _tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _slice_key(x, dim, start, end, step):
    dim = dim % x.ndim
    start = None if start is None or start <= -_UNBOUNDED else start
    end = None if end is None or end >= _UNBOUNDED else end
    return (slice(None),) * dim + (slice(start, end, step),)


def _slice(x, dim=0, start=None, end=None, step=1):
    return x[_slice_key(x, dim, start, end, step)]


def _merged_index(op, x, indices, tensor_dims):
    """The indexed dims `tensor_dims` (adjacent) of `x` as one: (x reshaped with them merged, the
    merged dim's position, the linear index sum(i_j * stride_j) broadcast over the index tensors),
    each i_j checked and wrapped like a single index."""
    start, sizes = tensor_dims[0], [x.shape[d] for d in tensor_dims]
    linear, stride = None, 1
    for d, n in reversed(list(zip(tensor_dims, sizes))):
        index = indices[d] if indices[d].dtype == dt.int64 else ops.cast(indices[d], dt.int64)
        if not index.is_lazy:
            values = index.numpy()
            bad = (values < -n) | (values >= n)
            if bad.any():
                raise IndexError(f"{op}: index {int(values[bad].flat[0])} is out of bounds for dimension {d} with "
                                 f"size {n}")
        term = ops.where(index < 0, index + n, index) * stride
        linear = term if linear is None else linear + term
        stride *= n
    shape = tuple(x.shape)
    return ops.reshape(x, shape[:start] + (stride,) + shape[start + len(sizes):]), start, linear


def _index(x, indices):
    """`x[i0, i1, ...]` with ATen's list of optional index tensors (None: the whole dim). Several
    integer index tensors (NumPy's advanced indexing, as Hugging Face's causal masks index) are one
    index into the indexed dims merged (_merged_index); the broadcast dims stand where the indexed
    dims were if these are adjacent, else first (NumPy's and PyTorch's rule), which moving the
    indexed dims to the front gives."""
    tensor_dims = [d for d, i in enumerate(indices) if i is not None]
    if len(tensor_dims) <= 1:
        return x[tuple(slice(None) if i is None else i for i in indices)]
    if any(indices[d].dtype == dt.bool_ for d in tensor_dims):
        raise NotImplementedError("aten.index.Tensor with a boolean mask among several index tensors: flowgen "
                                  "takes several integer index tensors, or one mask")
    if tensor_dims != list(range(tensor_dims[0], tensor_dims[-1] + 1)):
        order = tensor_dims + [d for d in range(x.ndim) if d not in tensor_dims]
        x = ops.permute(x, *order)
        indices = [indices[d] if d in tensor_dims else None for d in order]
        tensor_dims = list(range(len(tensor_dims)))
    merged, start, linear = _merged_index("aten.index.Tensor", x, indices, tensor_dims)
    return merged[(slice(None),) * start + (linear,)]


def _slice_scatter(input, src, dim=0, start=None, end=None, step=1):
    """`input` with `input[..., start:end:step]` (on `dim`) replaced by `src` (a functional setitem)."""
    return ops.setitem_value(input, _slice_key(input, dim, start, end, step), src)


def _select_scatter(input, src, dim, index):
    return ops.setitem_value(input, (slice(None),) * (dim % input.ndim) + (index,), src)


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    spatial = input.ndim - 2
    if transposed:
        by_dims = {1: F.conv_transpose1d, 2: F.conv_transpose2d}
        if spatial not in by_dims:
            raise NotImplementedError(f"aten.convolution: a transposed convolution over {spatial} spatial dims "
                                      f"is not supported by flowgen (1 or 2)")
        return by_dims[spatial](input, weight, bias, tuple(stride), tuple(padding), tuple(output_padding),
                                groups, tuple(dilation))
    by_dims = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
    if spatial not in by_dims:
        raise NotImplementedError(f"aten.convolution: a convolution over {spatial} spatial dims is not supported "
                                  f"by flowgen (1, 2 or 3)")
    return by_dims[spatial](input, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def _stat_dims(input):
    return (0,) + tuple(range(2, input.ndim))


def _batch_statistics(input, eps):
    """The batch mean and 1 / sqrt(biased var + eps) per channel, as ATen's save_mean / save_invstd."""
    dims = _stat_dims(input)
    mean = ops.mean(input, dims)
    diff = input - ops.mean(input, dims, keepdim=True)
    return mean, ops.rsqrt(ops.mean(diff * diff, dims) + eps)


def _batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """ATen's functional batch norm: (out, save_mean, save_invstd, new running_mean, new running_var).
    The running statistics are updated on copies (F.batch_norm's in-place update): the importer
    writes them back to the buffers, as the export's buffers_to_mutate says."""
    with no_grad():
        new_mean, new_var = ops.clone(running_mean), ops.clone(running_var)
    out = F.batch_norm(input, new_mean, new_var, weight, bias, training, momentum, eps)
    if training:
        mean, invstd = _batch_statistics(input, eps)
    else:
        mean, invstd = running_mean, ops.rsqrt(running_var + eps)
    return out, mean, invstd, new_mean, new_var


def _batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    out = F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    return out, running_mean, ops.rsqrt(running_var + eps)


def _batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    mean, invstd = _batch_statistics(input, eps)
    return F.batch_norm(input, None, None, weight, bias, True, momentum, eps), mean, invstd


def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    dims = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    mean = ops.mean(input, dims, keepdim=True)
    diff = input - mean
    rstd = ops.rsqrt(ops.mean(diff * diff, dims, keepdim=True) + eps)
    return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps), mean, rstd


def _native_group_norm(input, weight, bias, N, C, HxW, group, eps):  # noqa: N803 - ATen's names
    """(out, mean, rstd) with the statistics per (sample, group), as ATen's [N, group]."""
    grouped = ops.reshape(input, (N, group, -1))
    mean = ops.mean(grouped, 2)
    diff = grouped - ops.mean(grouped, 2, keepdim=True)
    rstd = ops.rsqrt(ops.mean(diff * diff, 2) + eps)
    return F.group_norm(input, group, weight, bias, eps), mean, rstd


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """ATen's elu: scale * x for x > 0, else scale * alpha * (exp(x * input_scale) - 1) (SELU's form)."""
    if scale == 1 and input_scale == 1:
        return F.elu(x, alpha)
    return ops.where(x > 0, x * scale, ops.expm1(x * input_scale) * (alpha * scale))


def _max_pool2d_with_indices(input, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return F.max_pool2d(input, kernel_size, stride or None, padding, dilation, ceil_mode, return_indices=True)


def _index_put(self, indices, values, accumulate=False):
    """`self` with `values` written (accumulate=True: added, repeated positions adding up) at
    `self[indices]`. With accumulation (an embedding's gradient, a nearest upsampling's), the
    integer index tensors must index adjacent dims: they merge into one index (_merged_index) of
    an index_add; without, any index flowgen's setitem takes."""
    if not accumulate:
        return ops.setitem_value(self, tuple(slice(None) if i is None else i for i in indices), values)
    tensor_dims = [d for d, i in enumerate(indices) if i is not None]
    if (not tensor_dims or any(indices[d].dtype == dt.bool_ for d in tensor_dims)
            or tensor_dims != list(range(tensor_dims[0], tensor_dims[-1] + 1))):
        raise NotImplementedError("aten.index_put with accumulate=True: flowgen takes integer index tensors over "
                                  "adjacent dims (no boolean mask)")
    merged, start, linear = _merged_index("aten.index_put", self, indices, tensor_dims)
    shape = tuple(self.shape)
    trailing = shape[start + len(tensor_dims):]
    rows = shape[:start] + tuple(linear.shape) + trailing
    added = ops.index_add(merged, start, ops.reshape(linear, (-1,)),
                          ops.reshape(ops.broadcast_to(values, rows), shape[:start] + (-1,) + trailing))
    return ops.reshape(added, shape)


def _attention_scale(query, scale):
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                     attn_mask=None, scale=None):
    """ATen's CPU flash attention: (output, logsumexp of each query row's scores), flowgen's
    `attention` op, whose logsumexp has the same layout ([..., L], float32) and meaning."""
    if dropout_p:
        raise NotImplementedError("aten._scaled_dot_product_flash_attention_for_cpu with dropout: flowgen draws "
                                  "its own random stream, so the backward could not rebuild PyTorch's mask")
    masks = () if attn_mask is None else (attn_mask,)
    return apply("attention", query, key, value, *masks, scale=_attention_scale(query, scale), causal=bool(is_causal))


def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                              attn_mask=None, scale=None):
    """(dq, dk, dv) by flowgen's `attention_backward`. Its kernels rebuild the probabilities from
    each row's logsumexp in flowgen's layout, which PyTorch's saved `logsumexp` need not have (its
    decomposed forward saves another shape): the forward op runs again for its output and
    logsumexp, as FlashAttention's backward recomputes the scores anyway."""
    if dropout_p:
        raise NotImplementedError("aten._scaled_dot_product_flash_attention_for_cpu_backward with dropout: flowgen "
                                  "cannot rebuild PyTorch's dropout mask")
    masks = () if attn_mask is None else (attn_mask,)
    attrs = dict(scale=_attention_scale(query, scale), causal=bool(is_causal))
    recomputed, lse = apply("attention", query, key, value, *masks, **attrs)
    return apply("attention_backward", query, key, value, recomputed, grad_out, lse, *masks, **attrs)


def _native_dropout(input, p, train):
    if not train:
        return input, creation.ones(*input.shape, dtype=dt.bool_, device=input.device)
    keep = F.dropout(creation.ones(*input.shape, dtype=input.dtype, device=input.device), p, True) != 0
    return ops.where(keep, input * (0.0 if p == 1 else 1.0 / (1.0 - p)), 0.0), keep


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise NotImplementedError("aten.embedding: scale_grad_by_freq and sparse gradients are not supported by "
                                  "flowgen")
    return F.embedding(indices, weight, padding_idx=None if padding_idx == -1 else padding_idx)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """PyTorch's SDPA. Under autocast, its floating operands are cast to the autocast dtype first, as
    torch.autocast does (SDPA is on its lower-precision list): operands that autocast left in mixed
    dtypes (Llama's RoPE multiplies a bf16 query and key by float32 cos/sin, the value stays bf16)
    still reach flowgen's one attention op, which takes one dtype."""
    low = mixed_precision.active()
    if low is not None:
        query, key, value = (ops.cast(t, low) if t.dtype in (dt.float32,) + mixed_precision.LOW_DTYPES else t
                             for t in (query, key, value))
        if attn_mask is not None and attn_mask.dtype.is_floating and attn_mask.dtype != dt.float64:
            attn_mask = ops.cast(attn_mask, low)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return ops.clone(x) if dtype is None or dtype == x.dtype else ops.cast(x, dtype)


def _assert_tensor_metadata(a, size=None, stride=None, dtype=None, device=None, layout=None):
    """The export's check of a tensor's dtype and shape (emitted around `.to()`): checked here too."""
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"aten._assert_tensor_metadata: expected dtype {dtype}, got {a.dtype}")
    if size is not None and tuple(a.shape) != tuple(size):
        raise ValueError(f"aten._assert_tensor_metadata: expected shape {tuple(size)}, got {tuple(a.shape)}")


def _full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:
        dtype = dt.bool_ if isinstance(fill_value, bool) else dt.int64 if isinstance(fill_value, int) else dt.float32
    return creation.full(tuple(size), fill_value, dtype=dtype, device=device)


def _full_like(x, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return creation.full(tuple(x.shape), fill_value, dtype=dtype or x.dtype, device=device or x.device)


def _pair(value):
    return (value, value) if isinstance(value, int) else tuple(value) * (2 if len(value) == 1 else 1)


def _convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    """(grad_input, grad_weight, grad_bias) of a 2-d convolution, by flowgen's conv2d gradient ops.
    A transposed convolution is the adjoint of conv2d(., weight) (from its output space to its
    input space): its input's gradient is that conv2d of grad_output, its weight's gradient the
    conv2d weight gradient with input and grad_output in swapped roles (output_padding only adds
    rows that conv2d's floor drops)."""
    if input.ndim != 4:
        raise NotImplementedError(f"aten.convolution_backward: flowgen has the gradients of 2-d convolutions; this "
                                  f"one is {input.ndim - 2}-d{' and transposed' if transposed else ''}")
    attrs = dict(stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=int(groups))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = F.conv2d(grad_output, weight, None, attrs["stride"], attrs["padding"], attrs["dilation"],
                                  attrs["groups"])
        else:
            grad_input = apply("conv2d_grad_input", grad_output, weight, input_shape=tuple(input.shape), **attrs)
    if output_mask[1]:
        grad, source = (input, grad_output) if transposed else (grad_output, input)
        grad_weight = apply("conv2d_grad_weight", grad, source, weight_shape=tuple(weight.shape), **attrs)
    if output_mask[2]:
        grad_bias = ops.sum(grad_output, (0, 2, 3))
    return grad_input, grad_weight, grad_bias


def _max_pool2d_with_indices_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode,
                                      indices):
    """Each output's gradient added at the input position `indices` names (h * W + w in its plane),
    as ATen defines it: a scatter_add over each (n, c) plane."""
    plane = input.shape[-2] * input.shape[-1]
    lead = tuple(input.shape[:-2])
    added = ops.scatter_add(creation.zeros(*lead, plane, dtype=grad_output.dtype, device=grad_output.device),
                            len(lead), ops.reshape(indices, lead + (-1,)), ops.reshape(grad_output, lead + (-1,)))
    return ops.reshape(added, tuple(input.shape))


def _adaptive_avg_pool2d_backward(grad_output, input):
    if input.ndim != 4:
        raise NotImplementedError(f"aten._adaptive_avg_pool2d_backward: flowgen takes (N, C, H, W) inputs, got "
                                  f"{tuple(input.shape)}")
    return apply("adaptive_avg_pool2d_grad", grad_output, input_shape=tuple(input.shape),
                 output_size=tuple(grad_output.shape[2:]))


def _upsample_scales(scales_h, scales_w):
    return None if scales_h is None and scales_w is None else (scales_h, scales_w)


def _upsample_vec_size(input, output_size, scale_factors):
    """(output size, scales) of an upsample `.vec` overload: the size given, or floor(in * scale)
    with the scales kept (PyTorch then maps indices by 1 / scale, not in / out)."""
    if output_size is not None:
        return tuple(output_size), None
    return tuple(int(math.floor(n * s)) for n, s in zip(input.shape[2:], scale_factors)), tuple(scale_factors)


def _check_upsample_2d(name, input):
    if input.ndim != 4:
        raise NotImplementedError(f"aten.{name}: flowgen upsamples (N, C, H, W) inputs, got {tuple(input.shape)}")


def _upsample_nearest2d_vec(input, output_size, scale_factors):
    _check_upsample_2d("upsample_nearest2d", input)
    size, scales = _upsample_vec_size(input, output_size, scale_factors)
    return apply("upsample_nearest2d", input, size=size, scales=scales)


def _upsample_nearest2d(input, output_size, scales_h=None, scales_w=None):
    _check_upsample_2d("upsample_nearest2d", input)
    return apply("upsample_nearest2d", input, size=tuple(output_size), scales=_upsample_scales(scales_h, scales_w))


def _upsample_bilinear2d_vec(input, output_size, align_corners, scale_factors):
    _check_upsample_2d("upsample_bilinear2d", input)
    size, scales = _upsample_vec_size(input, output_size, scale_factors)
    return apply("upsample_bilinear2d", input, size=size, align_corners=bool(align_corners), scales=scales)


def _upsample_bilinear2d(input, output_size, align_corners, scales_h=None, scales_w=None):
    _check_upsample_2d("upsample_bilinear2d", input)
    return apply("upsample_bilinear2d", input, size=tuple(output_size), align_corners=bool(align_corners),
                 scales=_upsample_scales(scales_h, scales_w))


def _upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    return apply("upsample_nearest2d_grad", grad_output, input_shape=tuple(input_size), size=tuple(output_size),
                 scales=_upsample_scales(scales_h, scales_w))


def _upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None,
                                  scales_w=None):
    return apply("upsample_bilinear2d_grad", grad_output, input_shape=tuple(input_size), size=tuple(output_size),
                 align_corners=bool(align_corners), scales=_upsample_scales(scales_h, scales_w))


def _filled(value):
    def make(size, dtype=None, layout=None, device=None, pin_memory=None):
        return creation.full(tuple(size), value, dtype=dtype or dt.float32, device=device)
    return make


def _arange(start, end=None, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return creation.arange(start, end, step, dtype=dtype, device=device)


def _scalar_tensor(value, dtype=None, layout=None, device=None, pin_memory=None):
    return creation.tensor(value, dtype=dtype or dt.float32, device=device)


def _var(x, dim=None, correction=None, keepdim=False):
    return ops.var(x, dim, keepdim=keepdim, correction=1 if correction is None else correction)


def _reduce(fn):
    def reduce(x, dim=None, keepdim=False, dtype=None):
        return fn(x, dim if dim else None, keepdim=keepdim, dtype=dtype)
    return reduce


def _max_dim(x, dim, keepdim=False):
    return ops.amax(x, dim, keepdim=keepdim), ops.argmax(x, dim, keepdim=keepdim)


def _min_dim(x, dim, keepdim=False):
    return ops.amin(x, dim, keepdim=keepdim), ops.argmin(x, dim, keepdim=keepdim)


def _softmax(fn):
    def softmax(x, dim, half_to_float_or_dtype=None):
        if isinstance(half_to_float_or_dtype, bool):   # _softmax(x, dim, half_to_float)
            dtype = dt.float32 if half_to_float_or_dtype else None
        else:
            dtype = half_to_float_or_dtype
        return fn(x if dtype is None else ops.cast(x, dtype), dim)
    return softmax


def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _where(condition, a, b):
    return ops.where(condition, a, b)


def _rsub(a, b, alpha=1):
    return ops.sub(b, a, alpha)


def _copy(dst, src, non_blocking=False):
    """The functional copy: `src` broadcast to `dst`'s shape in `dst`'s dtype."""
    return ops.cast(ops.broadcast_to(src, tuple(dst.shape)), dst.dtype)


def _fill(x, value):
    return creation.full(tuple(x.shape), value, dtype=x.dtype, device=x.device)


def _split(x, split_size, dim=0):
    return tuple(ops.split(x, split_size, dim))


def _squeeze(x, dim=None):
    if isinstance(dim, (list, tuple)):
        for d in sorted((d % x.ndim for d in dim), reverse=True):
            x = ops.squeeze(x, d) if x.shape[d] == 1 else x
        return x
    return ops.squeeze(x, dim)


def _avg_pool2d(input, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return F.avg_pool2d(input, kernel_size, stride or None, padding, ceil_mode, count_include_pad, divisor_override)


def _max_pool2d(input, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return F.max_pool2d(input, kernel_size, stride or None, padding, dilation, ceil_mode)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


def _conv(fn):
    def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        return fn(input, weight, bias, _tuple(stride), _tuple(padding), _tuple(dilation), groups)
    return conv


def _clamp(x, min=None, max=None):  # noqa: A002 - ATen's names
    return ops.clamp(x, min, max)


def _integer_division_rest(rounding_mode, float_op):
    """fmod (rounding_mode "trunc": the sign of the dividend) or remainder ("floor": the sign of the
    divisor): flowgen's op for floating point, a - b * div(a, b) for integers (a Swin Transformer's
    shifted-window indices are integer fmods)."""
    def rest(a, b):
        integral = [not t.dtype.is_floating if hasattr(t, "dtype") else isinstance(t, int) for t in (a, b)]
        if all(integral):
            return ops.sub(a, ops.mul(ops.div(a, b, rounding_mode=rounding_mode), b))
        # an integer tensor with a floating-point operand: PyTorch promotes it to float32
        a, b = (ops.cast(t, dt.float32) if whole and hasattr(t, "dtype") else t for t, whole in zip((a, b), integral))
        return float_op(a, b)
    return rest


def _pow(a, b):
    return ops.pow(a, b)


ATEN_OPS = {
    # --- tuple results and no-op bookkeeping
    "<built-in function getitem>": operator.getitem,
    "aten._assert_tensor_metadata.default": _assert_tensor_metadata,
    # --- elementwise arithmetic
    "aten.add.Tensor": ops.add, "aten.add.Scalar": ops.add,
    "aten.sub.Tensor": ops.sub, "aten.sub.Scalar": ops.sub,
    "aten.rsub.Scalar": _rsub, "aten.rsub.Tensor": _rsub,
    "aten.mul.Tensor": ops.mul, "aten.mul.Scalar": ops.mul,
    "aten.div.Tensor": ops.div, "aten.div.Scalar": ops.div, "aten.div.Tensor_mode": ops.div,
    "aten.pow.Tensor_Scalar": _pow, "aten.pow.Tensor_Tensor": _pow, "aten.pow.Scalar": _pow,
    "aten.neg.default": ops.neg, "aten.abs.default": ops.abs, "aten.reciprocal.default": ops.reciprocal,
    "aten.exp.default": ops.exp, "aten.log.default": ops.log, "aten.sqrt.default": ops.sqrt,
    "aten.rsqrt.default": ops.rsqrt, "aten.sin.default": ops.sin, "aten.cos.default": ops.cos,
    "aten.tanh.default": ops.tanh, "aten.sigmoid.default": ops.sigmoid, "aten.erf.default": ops.erf,
    "aten.log1p.default": ops.log1p, "aten.expm1.default": ops.expm1, "aten.sign.default": ops.sign,
    "aten.floor.default": ops.floor, "aten.ceil.default": ops.ceil, "aten.round.default": ops.round,
    "aten.trunc.default": ops.trunc,
    "aten.fmod.Scalar": _integer_division_rest("trunc", ops.fmod),
    "aten.fmod.Tensor": _integer_division_rest("trunc", ops.fmod),
    "aten.remainder.Scalar": _integer_division_rest("floor", ops.remainder),
    "aten.remainder.Tensor": _integer_division_rest("floor", ops.remainder),
    "aten.maximum.default": ops.maximum, "aten.minimum.default": ops.minimum,
    "aten.clamp.default": _clamp, "aten.clamp.Tensor": _clamp,
    "aten.clamp_min.default": ops.clamp_min, "aten.clamp_max.default": ops.clamp_max,
    "aten.where.self": _where, "aten.where.ScalarSelf": _where, "aten.where.ScalarOther": _where,
    "aten.where.Scalar": _where,
    "aten.masked_fill.Scalar": ops.masked_fill, "aten.masked_fill.Tensor": ops.masked_fill,
    # --- activations
    "aten.relu.default": F.relu, "aten.gelu.default": _gelu, "aten.silu.default": F.silu,
    "aten.hardtanh.default": F.hardtanh, "aten.leaky_relu.default": F.leaky_relu,
    "aten.elu.default": _elu, "aten.prelu.default": F.prelu, "aten._prelu_kernel.default": F.prelu, "aten.softplus.default": F.softplus, "aten.hardswish.default": F.hardswish,
    "aten.hardsigmoid.default": F.hardsigmoid,
    # --- comparisons and logic
    "aten.eq.Tensor": ops.eq, "aten.eq.Scalar": ops.eq, "aten.ne.Tensor": ops.ne, "aten.ne.Scalar": ops.ne,
    "aten.lt.Tensor": ops.lt, "aten.lt.Scalar": ops.lt, "aten.le.Tensor": ops.le, "aten.le.Scalar": ops.le,
    "aten.gt.Tensor": ops.gt, "aten.gt.Scalar": ops.gt, "aten.ge.Tensor": ops.ge, "aten.ge.Scalar": ops.ge,
    "aten.logical_and.default": ops.logical_and, "aten.logical_or.default": ops.logical_or,
    "aten.logical_not.default": ops.logical_not, "aten.logical_xor.default": ops.logical_xor,
    "aten.bitwise_not.default": ops.bitwise_not, "aten.bitwise_and.Tensor": ops.bitwise_and,
    "aten.bitwise_or.Tensor": ops.bitwise_or, "aten.isnan.default": ops.isnan,
    # --- reductions
    "aten.sum.dim_IntList": _reduce(ops.sum), "aten.sum.default": lambda x, dtype=None: ops.sum(x, dtype=dtype),
    "aten.mean.dim": _reduce(ops.mean), "aten.mean.default": lambda x, dtype=None: ops.mean(x, dtype=dtype),
    "aten.amax.default": lambda x, dim=(), keepdim=False: ops.amax(x, tuple(dim) or None, keepdim),
    "aten.amin.default": lambda x, dim=(), keepdim=False: ops.amin(x, tuple(dim) or None, keepdim),
    "aten.max.dim": _max_dim, "aten.min.dim": _min_dim,
    "aten.argmax.default": ops.argmax, "aten.argmin.default": ops.argmin,
    "aten.var.correction": _var,
    "aten.any.dim": ops.any, "aten.any.default": ops.any, "aten.all.dim": ops.all,
    "aten.all.default": ops.all,
    "aten.cumsum.default": lambda x, dim, dtype=None: ops.cumsum(x, dim, dtype=dtype),
    # --- matrix products
    "aten.linear.default": F.linear, "aten.matmul.default": ops.matmul, "aten.mm.default": ops.mm,
    "aten.bmm.default": ops.bmm, "aten.addmm.default": ops.addmm, "aten.baddbmm.default": ops.baddbmm,
    # --- shapes and copies (flowgen is row-major: a memory_format changes no number)
    "aten.view.default": ops.reshape, "aten.reshape.default": ops.reshape,
    "aten._unsafe_view.default": ops.reshape, "aten.flatten.using_ints": ops.flatten,
    "aten.permute.default": lambda x, dims: ops.permute(x, *dims), "aten.t.default": ops.t,
    "aten.transpose.int": ops.transpose, "aten.unsqueeze.default": ops.unsqueeze,
    "aten.squeeze.dim": _squeeze, "aten.squeeze.dims": _squeeze, "aten.squeeze.default": _squeeze,
    "aten.expand.default": lambda x, size, implicit=False: ops.expand(x, *size),
    "aten.cat.default": lambda tensors, dim=0: ops.cat(list(tensors), dim),
    "aten.stack.default": lambda tensors, dim=0: ops.stack(list(tensors), dim),
    "aten.split.Tensor": _split, "aten.split_with_sizes.default": _split,
    "aten.slice.Tensor": _slice, "aten.select.int": ops.select, "aten.narrow.default": ops.narrow,
    "aten.index.Tensor": _index, "aten.index_select.default": ops.index_select,
    "aten.index_put.default": _index_put,
    "aten.slice_scatter.default": _slice_scatter, "aten.select_scatter.default": _select_scatter,
    "aten.constant_pad_nd.default": lambda input, pad, value=0: F.pad(input, tuple(pad), "constant", value),
    "aten.gather.default": lambda x, dim, index, sparse_grad=False: ops.gather(x, dim, index),
    "aten.tril.default": ops.tril, "aten.triu.default": ops.triu,
    "aten.repeat.default": lambda x, repeats: ops.repeat(x, *repeats),
    "aten.clone.default": lambda x, memory_format=None: ops.clone(x),
    "aten.contiguous.default": lambda x, memory_format=None: x,
    "aten.alias.default": lambda x: x, "aten.detach.default": ops.detach,
    "aten.lift_fresh_copy.default": ops.clone,
    "aten._to_copy.default": _to_copy,
    "aten.to.dtype": lambda x, dtype, non_blocking=False, copy=False, memory_format=None: _to_copy(x, dtype),
    "aten.copy.default": _copy, "aten.fill.Scalar": _fill,
    # --- creation
    "aten.arange.default": _arange, "aten.arange.start": _arange, "aten.arange.start_step": _arange,
    "aten.full.default": _full, "aten.full_like.default": _full_like,
    "aten.zeros_like.default": lambda x, **kw: _full_like(x, 0, **kw),
    "aten.ones_like.default": lambda x, **kw: _full_like(x, 1, **kw),
    "aten.zeros.default": _filled(0), "aten.ones.default": _filled(1),
    "aten.scalar_tensor.default": _scalar_tensor,
    # --- neural-network ops
    "aten.convolution.default": _convolution, "aten.conv1d.default": _conv(F.conv1d),
    "aten.conv2d.default": _conv(F.conv2d), "aten.conv2d.padding": _conv(F.conv2d),
    "aten.conv1d.padding": _conv(F.conv1d),
    "aten._native_batch_norm_legit_functional.default": _batch_norm_functional,
    "aten._native_batch_norm_legit_no_training.default": _batch_norm_no_training,
    "aten._native_batch_norm_legit.no_stats": _batch_norm_no_stats,
    "aten.layer_norm.default": _layer_norm, "aten.native_layer_norm.default": _native_layer_norm,
    "aten.group_norm.default": lambda input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True:
        F.group_norm(input, num_groups, weight, bias, eps),
    "aten.native_group_norm.default": _native_group_norm,
    "aten.max_pool2d.default": _max_pool2d, "aten.max_pool2d_with_indices.default": _max_pool2d_with_indices,
    "aten.avg_pool2d.default": _avg_pool2d,
    "aten.upsample_nearest2d.vec": _upsample_nearest2d_vec, "aten.upsample_nearest2d.default": _upsample_nearest2d,
    "aten.upsample_bilinear2d.vec": _upsample_bilinear2d_vec, "aten.upsample_bilinear2d.default": _upsample_bilinear2d,
    "aten.adaptive_avg_pool2d.default": F.adaptive_avg_pool2d,
    "aten._adaptive_avg_pool2d.default": F.adaptive_avg_pool2d,
    "aten.softmax.int": _softmax(F.softmax), "aten._softmax.default": _softmax(F.softmax),
    "aten.log_softmax.int": _softmax(F.log_softmax), "aten._log_softmax.default": _softmax(F.log_softmax),
    "aten.embedding.default": _embedding,
    "aten.scaled_dot_product_attention.default": _sdpa,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _flash_attention,
    "aten.dropout.default": lambda input, p, train: F.dropout(input, p, train),
    "aten.native_dropout.default": _native_dropout,
    # --- backward ops that the core decompositions keep in AOTAutograd's backward graphs
    # (torch.compile training): flowgen's gradient ops of the forward op
    "aten.convolution_backward.default": _convolution_backward,
    "aten.max_pool2d_with_indices_backward.default": _max_pool2d_with_indices_backward,
    "aten._adaptive_avg_pool2d_backward.default": _adaptive_avg_pool2d_backward,
    "aten.upsample_nearest2d_backward.default": _upsample_nearest2d_backward,
    "aten.upsample_bilinear2d_backward.default": _upsample_bilinear2d_backward,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _flash_attention_backward,
}
