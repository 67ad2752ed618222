"""The ONNX -> flowgen table: one entry per standard ONNX operator (default domain) flowgen runs.

`onnx_import.py` reads a model with the onnx package and runs its nodes through this table. An
entry takes the node's inputs in order (flowgen tensors; None for an omitted optional input) and
its attributes as keywords, named and defaulted as the ONNX operator spec does (opset 13 and
later: axes, split and shape operands are inputs). It returns the node's output, or a tuple for
the operators in `MULTI_OUTPUT`. An operator missing here is refused at import, with every other
missing one; an attribute value flowgen does not support raises naming the operator.

Shape-like operands (Reshape's shape, Slice's starts, Expand's shape, ...) must be constant:
initializers, Constant nodes, or Shape of a tensor (flowgen's shapes are static) and what is
computed from them. Such values stay eager tensors, even inside nn.Graph, and `_static` reads them.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from flowgen import creation
from flowgen import dtype as dt
from flowgen import functional as ops
from flowgen.nn import functional as F

MULTI_OUTPUT = {"Split"}

# TensorProto.DataType -> flowgen dtype (the ones flowgen has)
ONNX_DTYPES = {1: dt.float32, 2: dt.uint8, 3: dt.int8, 5: dt.int16, 6: dt.int32, 7: dt.int64, 9: dt.bool_,
               10: dt.float16, 11: dt.float64, 16: dt.bfloat16}


def onnx_dtype(code: int, op: str) -> dt.DType:
    if code not in ONNX_DTYPES:
        raise NotImplementedError(f"ONNX {op}: element type {code} has no flowgen dtype")
    return ONNX_DTYPES[code]


def _static(t, op: str, what: str) -> np.ndarray:
    """The value of a shape-like operand, which must be known when the graph is built."""
    if t.is_lazy:
        raise NotImplementedError(f"ONNX {op}: its {what} operand is computed from the graph's inputs; flowgen "
                                  f"needs it constant (an initializer, a Constant, or Shape of a tensor)")
    return t.numpy()


def _ints(t, op: str, what: str) -> list:
    return [int(v) for v in np.atleast_1d(_static(t, op, what))]


def _axis(axis: int, ndim: int) -> int:
    return axis % ndim if ndim else 0


def _symmetric_pads(pads, spatial: int, op: str) -> tuple:
    pads = list(pads or [0] * 2 * spatial)
    begin, end = pads[:spatial], pads[spatial:]
    if begin != end:
        raise NotImplementedError(f"ONNX {op}: asymmetric pads {pads} are not supported by flowgen")
    return tuple(begin)


def _no_auto_pad(auto_pad, op: str):
    if auto_pad not in ("NOTSET", "VALID", b"NOTSET"):
        raise NotImplementedError(f"ONNX {op}: auto_pad={auto_pad!r} is not supported by flowgen (export with "
                                  f"explicit pads)")


# ------------------------------------------------------------------ constants and shapes
def _constant(value=None, value_float=None, value_floats=None, value_int=None, value_ints=None, **other):
    if other:
        raise NotImplementedError(f"ONNX Constant: attribute(s) {sorted(other)} are not supported by flowgen")
    if value is not None:
        return creation.tensor(value)
    if value_float is not None:
        return creation.tensor(np.float32(value_float))
    if value_floats is not None:
        return creation.tensor(np.asarray(value_floats, np.float32))
    if value_int is not None:
        return creation.tensor(np.int64(value_int))
    return creation.tensor(np.asarray(value_ints, np.int64))


def _shape(data, start=0, end=None):
    return creation.tensor(np.asarray(data.shape[start:end], np.int64))


def _constant_of_shape(shape, value=None):
    fill = np.zeros((1,), np.float32) if value is None else np.asarray(value).reshape(-1)
    return creation.tensor(np.full(tuple(_ints(shape, "ConstantOfShape", "shape")), fill[0], fill.dtype))


def _cast(x, to):
    return ops.cast(x, onnx_dtype(to, "Cast"))


def _range(start, limit, delta):
    values = [_static(v, "Range", name).item() for v, name in ((start, "start"), (limit, "limit"), (delta, "delta"))]
    return creation.arange(*values, dtype=start.dtype)


# ------------------------------------------------------------------ shapes
def _reshape(data, shape, allowzero=0):
    target = _ints(shape, "Reshape", "shape")
    if not allowzero:
        target = [data.shape[i] if s == 0 else s for i, s in enumerate(target)]
    return ops.reshape(data, tuple(target))


def _flatten(x, axis=1):
    axis = axis % x.ndim if x.ndim else 0
    return ops.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


def _transpose(x, perm=None):
    return ops.permute(x, *(perm if perm is not None else reversed(range(x.ndim))))


def _squeeze(x, axes=None):
    dims = range(x.ndim) if axes is None else [a % x.ndim for a in _ints(axes, "Squeeze", "axes")]
    shape = [s for i, s in enumerate(x.shape) if not (i in dims and s == 1)]
    return ops.reshape(x, tuple(shape))


def _unsqueeze(x, axes):
    out_ndim = x.ndim + len(_ints(axes, "Unsqueeze", "axes"))
    new = sorted(a % out_ndim for a in _ints(axes, "Unsqueeze", "axes"))
    shape, it = [], iter(x.shape)
    for i in range(out_ndim):
        shape.append(1 if i in new else next(it))
    return ops.reshape(x, tuple(shape))


def _concat(*inputs, axis):
    return ops.cat(list(inputs), axis)


def _split(x, split=None, axis=0, num_outputs=None):
    axis = _axis(axis, x.ndim)
    if split is not None:
        return tuple(ops.split(x, _ints(split, "Split", "split"), axis))
    size = x.shape[axis]
    chunk = -(-size // num_outputs)
    return tuple(ops.split(x, chunk, axis))


def _slice(data, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts, "Slice", "starts"), _ints(ends, "Slice", "ends")
    axes = list(range(len(starts))) if axes is None else _ints(axes, "Slice", "axes")
    steps = [1] * len(starts) if steps is None else _ints(steps, "Slice", "steps")
    key = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st < 0:
            raise NotImplementedError("ONNX Slice: negative steps are not supported by flowgen")
        key[a % data.ndim] = slice(s, e, st)
    return data[tuple(key)]


def _gather(data, indices, axis=0):
    axis = _axis(axis, data.ndim)
    n = data.shape[axis]
    if not indices.is_lazy:
        values = _static(indices, "Gather", "indices")
        indices = creation.tensor(np.where(values < 0, values + n, values).astype(np.int64))
    picked = ops.index_select(data, axis, ops.reshape(indices, (-1,)))
    return ops.reshape(picked, tuple(data.shape[:axis]) + tuple(indices.shape) + tuple(data.shape[axis + 1:]))


def _expand(x, shape):
    target = np.broadcast_shapes(tuple(x.shape), tuple(_ints(shape, "Expand", "shape")))
    return ops.broadcast_to(x, target)


def _trilu(x, k=None, upper=1):
    diagonal = 0 if k is None else int(_static(k, "Trilu", "k"))
    return ops.triu(x, diagonal) if upper else ops.tril(x, diagonal)


# ------------------------------------------------------------------ arithmetic
def _div(a, b):
    if not a.dtype.is_floating and not b.dtype.is_floating:
        return ops.div(a, b, rounding_mode="trunc")   # ONNX integer division truncates
    return ops.div(a, b)


def _variadic(fn):
    def reduce(*inputs):
        out = inputs[0]
        for x in inputs[1:]:
            out = fn(out, x)
        return out
    return reduce


def _clip(x, min=None, max=None):  # noqa: A002 - ONNX's names
    low = None if min is None else _static(min, "Clip", "min").item()
    high = None if max is None else _static(max, "Clip", "max").item()
    return ops.clamp(x, low, high)


def _hard_sigmoid(x, alpha=0.2, beta=0.5):
    return ops.clamp(x * alpha + beta, 0.0, 1.0)


def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _softmax(fn):
    def softmax(x, axis=-1):
        return fn(x, axis)
    return softmax


# ------------------------------------------------------------------ reductions
def _reduction(fn, op):
    """Reduce* with axes as an input (opset 18; ReduceSum from 13) or an attribute (before)."""
    def reduce(data, axes=None, keepdims=1, noop_with_empty_axes=0):
        dims = list(axes) if isinstance(axes, (list, tuple)) else [] if axes is None else _ints(axes, op, "axes")
        if not dims:
            if noop_with_empty_axes:
                return data
            dims = list(range(data.ndim))
        return fn(data, tuple(dims), keepdim=bool(keepdims))
    return reduce


# ------------------------------------------------------------------ neural-network operators
def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0):  # noqa: N803 - ONNX's names
    out = ops.matmul(ops.t(a) if transA else a, ops.t(b) if transB else b)
    if alpha != 1.0:
        out = out * alpha
    if c is not None:
        out = out + (c * beta if beta != 1.0 else c)
    return out


def _conv(x, w, b=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    _no_auto_pad(auto_pad, "Conv")
    spatial = x.ndim - 2
    by_dims = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
    if spatial not in by_dims:
        raise NotImplementedError(f"ONNX Conv: {spatial} spatial dims are not supported by flowgen (1, 2 or 3)")
    return by_dims[spatial](x, w, b, tuple(strides or [1] * spatial), _symmetric_pads(pads, spatial, "Conv"),
                            tuple(dilations or [1] * spatial), group)


def _pool_args(x, op, auto_pad, kernel_shape, pads, strides):
    _no_auto_pad(auto_pad, op)
    if x.ndim != 4:
        raise NotImplementedError(f"ONNX {op}: flowgen pools (N, C, H, W) inputs, got {tuple(x.shape)}")
    return tuple(kernel_shape), tuple(strides or [1, 1]), _symmetric_pads(pads, 2, op)


def _max_pool(x, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None, storage_order=0,
              strides=None):
    kernel, stride, padding = _pool_args(x, "MaxPool", auto_pad, kernel_shape, pads, strides)
    return F.max_pool2d(x, kernel, stride, padding, tuple(dilations or [1, 1]), bool(ceil_mode))


def _average_pool(x, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                  pads=None, strides=None):
    if dilations and any(d != 1 for d in dilations):
        raise NotImplementedError("ONNX AveragePool: dilations are not supported by flowgen")
    kernel, stride, padding = _pool_args(x, "AveragePool", auto_pad, kernel_shape, pads, strides)
    return F.avg_pool2d(x, kernel, stride, padding, bool(ceil_mode), bool(count_include_pad))


def _global_average_pool(x):
    return ops.mean(x, tuple(range(2, x.ndim)), keepdim=True)


def _batch_normalization(x, scale, b, mean, var, epsilon=1e-5, momentum=0.9, training_mode=0):
    if training_mode:
        raise NotImplementedError("ONNX BatchNormalization: training_mode=1 is not supported by flowgen (import "
                                  "an inference model)")
    return F.batch_norm(x, mean, var, scale, b, False, 0.0, epsilon)


def _layer_normalization(x, scale, b=None, axis=-1, epsilon=1e-5, stash_type=1):
    axis = _axis(axis, x.ndim)
    return F.layer_norm(x, tuple(x.shape[axis:]), scale, b, epsilon)


def _dropout(data, ratio=None, training_mode=None, seed=None):
    if training_mode is not None and bool(_static(training_mode, "Dropout", "training_mode")):
        raise NotImplementedError("ONNX Dropout: training_mode=True is not supported by flowgen (import an "
                                  "inference model)")
    return data


def _leaky_relu(x, alpha=0.01):
    return F.leaky_relu(x, alpha)


def _elu(x, alpha=1.0):
    return F.elu(x, alpha)


ONNX_OPS = {
    "getitem": operator.getitem,
    # --- constants, dtypes and shapes
    "Constant": _constant, "ConstantOfShape": _constant_of_shape, "Shape": _shape, "Cast": _cast,
    "Range": _range, "Identity": lambda x: x,
    "Reshape": _reshape, "Flatten": _flatten, "Transpose": _transpose, "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze, "Concat": _concat, "Split": _split, "Slice": _slice, "Gather": _gather,
    "Expand": _expand, "Trilu": _trilu,
    # --- elementwise
    "Add": ops.add, "Sub": ops.sub, "Mul": ops.mul, "Div": _div, "Pow": ops.pow,
    "Neg": ops.neg, "Abs": ops.abs, "Exp": ops.exp, "Log": ops.log, "Sqrt": ops.sqrt,
    "Reciprocal": ops.reciprocal, "Sin": ops.sin, "Cos": ops.cos, "Tanh": ops.tanh, "Erf": ops.erf,
    "Floor": ops.floor, "Ceil": ops.ceil, "Sigmoid": ops.sigmoid,
    "Max": _variadic(ops.maximum), "Min": _variadic(ops.minimum), "Sum": _variadic(ops.add),
    "Clip": _clip, "Where": ops.where,
    "Equal": ops.eq, "Less": ops.lt, "LessOrEqual": ops.le, "Greater": ops.gt, "GreaterOrEqual": ops.ge,
    "Not": ops.logical_not, "And": ops.logical_and, "Or": ops.logical_or, "Xor": ops.logical_xor,
    # --- activations
    "Relu": F.relu, "LeakyRelu": _leaky_relu, "Elu": _elu, "Gelu": _gelu, "Softplus": F.softplus,
    "HardSigmoid": _hard_sigmoid, "HardSwish": F.hardswish,
    "Softmax": _softmax(F.softmax), "LogSoftmax": _softmax(F.log_softmax),
    # --- reductions
    "ReduceMean": _reduction(ops.mean, "ReduceMean"), "ReduceSum": _reduction(ops.sum, "ReduceSum"),
    "ReduceMax": _reduction(ops.amax, "ReduceMax"), "ReduceMin": _reduction(ops.amin, "ReduceMin"),
    # --- neural-network operators
    "MatMul": ops.matmul, "Gemm": _gemm, "Conv": _conv, "MaxPool": _max_pool, "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool, "BatchNormalization": _batch_normalization,
    "LayerNormalization": _layer_normalization, "Dropout": _dropout,
}
