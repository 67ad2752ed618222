"""Functional ops (`flow.add`, `flow.matmul`, ...): argument handling, then `apply`.

No math lives here: each function normalises its arguments and calls the op
definition in `flowgen/ops/` through `apply`. Tensor methods and nn modules
call these functions, so every path reaches the same definition. Composite
functions (mean, var, std, repeat, stack, split, masked_fill, getitem...) are
built from primitive ops, so their gradients and graph lowering come for free.

Attributes passed to `apply` are always explicit and normalised (non-negative
dims, full shapes with no -1), so graph passes never re-derive them.

Names shadow builtins here (sum, max, min, abs, pow, all, any); module code uses
the ``_b*`` aliases for the builtins.
"""
from __future__ import annotations

import builtins
import numbers
from collections import namedtuple

import numpy as np

from flowgen import dtype as dt
from flowgen.ops.registry import apply, normalize_dim, normalize_dims
from flowgen.tensor import Tensor, as_tensor_like
from flowgen.creation import (empty_like, full_like, keyword_sizes, ones_like, rand, rand_like,  # noqa: F401
                              randn_like, zeros, zeros_like)

_bmax, _bmin, _bsum, _babs, _ball, _bany = builtins.max, builtins.min, builtins.sum, builtins.abs, builtins.all, \
    builtins.any

_ValuesIndices = namedtuple("return_types", ["values", "indices"])


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def _dtype_of(x) -> dt.DType:
    if isinstance(x, Tensor):
        return x.dtype
    if isinstance(x, np.ndarray):
        return dt.from_numpy(x.dtype)
    return dt.default_for_scalar(x)


def _to_float(x):
    """Integer/bool tensors become float32 before float-only math (exp, log, div...)."""
    if isinstance(x, Tensor) and not x.dtype.is_floating:
        return apply("cast", x, dtype=dt.float32)
    return x


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _shape_args(args, name) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    try:
        return tuple(int(s) for s in args)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected ints or one sequence of ints, got {args!r}") from None


# =================================================================== arithmetic
def add(a, b, alpha=1):
    return apply("add", a, b if alpha == 1 else mul(b, alpha))


def sub(a, b, alpha=1):
    return apply("sub", a, b if alpha == 1 else mul(b, alpha))


subtract = sub


def mul(a, b):
    return apply("mul", a, b)


multiply = mul


def div(a, b, rounding_mode=None):
    """True division (integer inputs give float32); ``rounding_mode`` "floor" / "trunc" round the
    quotient ("floor": of the exact quotient, as PyTorch). Integers divided with a rounding mode
    give int64, computed in float64 (exact below 2**53; float32 rounds above 2**24)."""
    if rounding_mode not in (None, "floor", "trunc"):
        raise ValueError(f"div: rounding_mode must be None, 'floor' or 'trunc', got {rounding_mode!r}")
    int_result = not _dtype_of(a).is_floating and not _dtype_of(b).is_floating
    if int_result:
        to = dt.float32 if rounding_mode is None else dt.float64
        if _is_tensor(a):
            a = apply("cast", a, dtype=to)
        else:
            b = apply("cast", b, dtype=to)
    if rounding_mode == "floor":
        q = apply("floor_divide", *_floating_pair(a, b))
    else:
        q = apply("div", a, b)
        if rounding_mode == "trunc":
            q = sign(q) * floor(abs(q))
    return cast(q, dt.int64) if int_result and rounding_mode is not None else q


def _floating_pair(a, b):
    """a and b with a Python number or integer tensor operand cast to the other's floating dtype."""
    ta, tb = _dtype_of(a), _dtype_of(b)
    if not ta.is_floating:
        a = apply("cast", a, dtype=tb) if _is_tensor(a) else float(a)
    if not tb.is_floating:
        b = apply("cast", b, dtype=ta) if _is_tensor(b) else float(b)
    return a, b


true_divide = divide = div


def floor_divide(a, b):
    """floor(a / b). Not differentiable (PyTorch raises on a backward through it): the result does
    not require grad, so a loss built on it says so instead of training on zero gradients."""
    return detach(div(a, b, rounding_mode="floor"))


def pow(a, b):  # noqa: A001
    return apply("pow", a, b)


def square(x):
    return apply("mul", x, x)


def neg(x):
    return apply("neg", x)


negative = neg


def abs(x):  # noqa: A001
    return apply("abs", x)


def exp(x):
    return apply("exp", _to_float(x))


def log(x):
    return apply("log", _to_float(x))


def sqrt(x):
    return apply("sqrt", _to_float(x))


def rsqrt(x):
    return apply("rsqrt", _to_float(x))


def sin(x):
    return apply("sin", _to_float(x))


def cos(x):
    return apply("cos", _to_float(x))


def tanh(x):
    return apply("tanh", _to_float(x))


def sigmoid(x):
    return apply("sigmoid", _to_float(x))


def relu(x, inplace=False):
    return apply("relu", x)


def gelu(x, approximate="none"):
    return apply("gelu", _to_float(x), approximate=approximate)


def gelu_grad(g, x, approximate="none"):
    return apply("gelu_grad", g, x, approximate=approximate)


def silu(x):
    return apply("silu", _to_float(x))


def sign(x):
    return apply("sign", x)


def floor(x):
    if not x.dtype.is_floating:
        return x
    return apply("floor", x)


def reciprocal(x):
    return apply("reciprocal", _to_float(x))


def _bound(value, x, which):
    if value is None:
        if x.dtype.is_floating:
            return float("-inf") if which == "min" else float("inf")
        info = np.iinfo(x.dtype.np_dtype) if x.dtype != dt.bool_ else None
        return (int(info.min) if which == "min" else int(info.max)) if info else (which == "max")
    if isinstance(value, np.generic):
        value = value.item()
    if x.dtype.is_floating:
        return float(value)
    return int(value) if float(value) == int(value) else float(value)


def clamp(x, min=None, max=None):  # noqa: A002
    """Limit `x` to [min, max]; bounds may be numbers, None, or tensors (then maximum/minimum)."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    if _is_tensor(min) or _is_tensor(max):
        out = x if min is None else maximum(x, min)
        return out if max is None else minimum(out, max)
    return _clamp_op(x, min, max, exclusive=False)


def hardtanh(x, min_val=-1.0, max_val=1.0):
    """clamp(x, min_val, max_val) whose gradient passes strictly inside the bounds (0 at them, as
    torch's hardtanh and relu6; clamp's passes at them too). nn.functional.hardtanh's kernel."""
    return _clamp_op(x, min_val, max_val, exclusive=True)


def _clamp_op(x, min, max, exclusive: bool):   # noqa: A002
    if not x.dtype.is_floating and _bany(isinstance(v, float) and v != int(v) for v in (min, max) if v is not None):
        x = apply("cast", x, dtype=dt.float32)
    return apply("clamp", x, min=_bound(min, x, "min"), max=_bound(max, x, "max"), exclusive=exclusive)


clip = clamp


def clamp_min(x, min):  # noqa: A002
    return clamp(x, min=min)


def clamp_max(x, max):  # noqa: A002
    return clamp(x, max=max)


def maximum(a, b):
    return apply("maximum", a, b)


def minimum(a, b):
    return apply("minimum", a, b)


def eq(a, b):
    return apply("eq", a, b)


def ne(a, b):
    return apply("ne", a, b)


def lt(a, b):
    return apply("lt", a, b)


def le(a, b):
    return apply("le", a, b)


def gt(a, b):
    return apply("gt", a, b)


def ge(a, b):
    return apply("ge", a, b)


greater, greater_equal, less, less_equal, not_equal = gt, ge, lt, le, ne


def logical_and(a, b):
    return apply("logical_and", a, b)


def logical_or(a, b):
    return apply("logical_or", a, b)


def logical_not(x):
    return apply("logical_not", x)


def bitwise_and(a, b):
    return apply("bitwise_and", a, b)


def bitwise_or(a, b):
    return apply("bitwise_or", a, b)


def bitwise_xor(a, b):
    return apply("bitwise_xor", a, b)


def bitwise_not(x):
    return apply("bitwise_not", x)


def logical_xor(a, b):
    return apply("ne", apply("cast", a, dtype=dt.bool_) if _is_tensor(a) else bool(a),
                 apply("cast", b, dtype=dt.bool_) if _is_tensor(b) else bool(b))


def where(cond, a, b):
    """``a`` where `cond` is true, else ``b``; scalars take the dtype of the tensor beside them."""
    if not _is_tensor(cond):
        cond = Tensor(np.asarray(cond, dtype=bool))
    like = a if _is_tensor(a) else (b if _is_tensor(b) else None)
    if like is None:
        a = Tensor(np.array(a), dtype=dt.default_for_scalar(a), device=cond.device)
        like = a
    if not _is_tensor(a):
        a = as_tensor_like(a, like)
    if not _is_tensor(b):
        b = as_tensor_like(b, like)
    return apply("where", cond, a, b)


def masked_fill(x, mask, value):
    """`x` with `value` where `mask` is true (keeps x's dtype)."""
    if _is_tensor(value):
        value = value if value.dtype == x.dtype else apply("cast", value, dtype=x.dtype)
    else:
        value = Tensor(np.array(value, dtype=x.dtype.np_dtype), dtype=x.dtype, device=x.device)
    return apply("where", mask, value, x)


def cast(x, dtype):
    """`x` converted to `dtype` (returns `x` itself when it already has that dtype)."""
    dtype = dt.get(dtype)
    if x.dtype == dtype:
        return x
    return apply("cast", x, dtype=dtype)


def clone(x):
    return apply("cast", x, dtype=x.dtype)


def detach(x):
    if x.is_lazy:
        return apply("detach", x)
    return x.detach()


def with_value(x, value):
    """`value`'s data with `x`'s autograd history (Tensor._write_through of a detach()ed view)."""
    return apply("with_value", x, value)


def sum_to(t, shape):
    """Sum `t` down to `shape` (undoing broadcasting); used by gradients."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    return apply("sum_to", t, shape=shape)


# =================================================================== reductions
def _dims(x, dim, name):
    if dim is None:
        return tuple(range(x.ndim))
    if isinstance(dim, (list, tuple)) and len(dim) == 0:
        return tuple(range(x.ndim))
    return normalize_dims(dim, x.ndim, op=name)


def sum(x, dim=None, keepdim=False, dtype=None):  # noqa: A001
    if dtype is not None:
        x = cast(x, dtype)
    return apply("sum", x, dims=_dims(x, dim, "sum"), keepdim=bool(keepdim))


def mean(x, dim=None, keepdim=False, dtype=None):
    x = cast(x, dtype) if dtype is not None else _to_float(x)
    return apply("mean", x, dims=_dims(x, dim, "mean"), keepdim=bool(keepdim))


def var(x, dim=None, unbiased=True, keepdim=False, correction=None):
    """Variance over `dim`; ``unbiased`` (or ``correction``) subtracts that many degrees of freedom."""
    x = _to_float(x)
    dims = _dims(x, dim, "var")
    count = _prod(x.shape[d] for d in dims)
    ddof = (1 if unbiased else 0) if correction is None else correction
    centered = x - mean(x, dims, keepdim=True)
    total = apply("sum", centered * centered, dims=dims, keepdim=bool(keepdim))
    return apply("div", total, float(_bmax(count - ddof, 0)))


def std(x, dim=None, unbiased=True, keepdim=False, correction=None):
    return sqrt(var(x, dim, unbiased=unbiased, keepdim=keepdim, correction=correction))


def prod(x, dim=None, keepdim=False, dtype=None):
    """The product over `dim` (all elements when None). Integer and bool inputs give int64, as
    PyTorch. It is the last element of a cumulative product, so the gradient is cumprod's, exact with
    zeros in the input (the product of the other elements, not prod / x)."""
    if dtype is not None:
        x = cast(x, dtype)
    elif not x.dtype.is_floating:
        x = cast(x, dt.int64)
    if dim is None:
        return prod(reshape(x, -1), 0)
    if x.ndim == 0:
        normalize_dim(dim, 0, op="prod")
        return x
    d = normalize_dim(dim, x.ndim, op="prod")
    if x.shape[d] == 0:     # the empty product: ones of the reduced shape
        return add(mul(sum(x, d, keepdim=keepdim), 0), 1)
    last = narrow(apply("cumprod", x, dim=d, reverse=False), d, x.shape[d] - 1, 1)
    return last if keepdim else squeeze(last, d)


def _extremum(x, dim, keepdim, op, arg_op, binary):
    if _is_tensor(dim):
        return binary(x, dim)
    if dim is None:
        return apply(op, x, dims=tuple(range(x.ndim)), keepdim=False)
    if x.ndim == 0:
        normalize_dim(dim, 0, op=op)
        return _ValuesIndices(x, Tensor(np.zeros((), np.int64), device=x.device))
    d = normalize_dim(dim, x.ndim, op=op)
    values = apply(op, x, dims=(d,), keepdim=bool(keepdim))
    indices = apply(arg_op, x, dim=d, keepdim=bool(keepdim))
    return _ValuesIndices(values, indices)


def max(x, dim=None, keepdim=False):  # noqa: A001
    """``max(x)`` -> value; ``max(x, dim)`` -> (values, indices); ``max(x, other_tensor)`` -> maximum."""
    return _extremum(x, dim, keepdim, "max", "argmax", maximum)


def min(x, dim=None, keepdim=False):  # noqa: A001
    return _extremum(x, dim, keepdim, "min", "argmin", minimum)


def amax(x, dim=None, keepdim=False):
    """The maximum over `dim`; its gradient is split evenly among ties (as torch.amax; max(x, dim)
    gives it all to the index it returns)."""
    return apply("max", x, dims=_dims(x, dim, "amax"), keepdim=bool(keepdim), split_ties=True)


def amin(x, dim=None, keepdim=False):
    return apply("min", x, dims=_dims(x, dim, "amin"), keepdim=bool(keepdim), split_ties=True)


def _arg(x, dim, keepdim, op):
    if dim is None:
        return apply(op, reshape(x, -1), dim=0, keepdim=False)
    if x.ndim == 0:
        normalize_dim(dim, 0, op=op)
        return Tensor(np.zeros((), np.int64), device=x.device)
    return apply(op, x, dim=normalize_dim(dim, x.ndim, op=op), keepdim=bool(keepdim))


def argmax(x, dim=None, keepdim=False):
    return _arg(x, dim, keepdim, "argmax")


def argmin(x, dim=None, keepdim=False):
    return _arg(x, dim, keepdim, "argmin")


def any(x, dim=None, keepdim=False):  # noqa: A001
    nonzero = x if x.dtype == dt.bool_ else ne(x, 0)
    return gt(apply("sum", nonzero, dims=_dims(x, dim, "any"), keepdim=bool(keepdim)), 0)


def all(x, dim=None, keepdim=False):  # noqa: A001
    return eq(apply("sum", logical_not(x), dims=_dims(x, dim, "all"), keepdim=bool(keepdim)), 0)


# =================================================================== shapes
def reshape(x, *shape, **keyword):
    """Reshape; one size may be -1 (inferred). A reshape to the same shape returns `x`.
    The shape may also be given as ``shape=`` (OneFlow/PyTorch keyword) or ``size=`` (view)."""
    shape = _shape_args(keyword_sizes(shape, keyword, ("shape", "size"), "reshape"), "reshape")
    in_shape = tuple(x.shape)
    if shape == in_shape:
        return x
    n = _prod(in_shape)
    if -1 in shape:
        if shape.count(-1) > 1:
            raise ValueError(f"reshape: only one dimension can be -1, got shape {shape}")
        known = _prod(s for s in shape if s != -1)
        if known == 0 or n % known:
            raise ValueError(f"reshape: shape {shape} is invalid for input of shape {in_shape} ({n} elements)")
        shape = tuple(n // known if s == -1 else s for s in shape)
    if _prod(shape) != n or builtins.any(s < 0 for s in shape):
        raise ValueError(f"reshape: shape {shape} is invalid for input of shape {in_shape} ({n} elements)")
    if shape == in_shape:
        return x
    return apply("reshape", x, shape=shape)


view = reshape


def view_as(x, other):
    return reshape(x, tuple(other.shape))


reshape_as = view_as


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return reshape(x, (1,))
    s = normalize_dim(start_dim, x.ndim, op="flatten")
    e = normalize_dim(end_dim, x.ndim, op="flatten")
    if s > e:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    shape = tuple(x.shape)
    return reshape(x, shape[:s] + (_prod(shape[s:e + 1]),) + shape[e + 1:])


def unsqueeze(x, dim):
    d = normalize_dim(dim, x.ndim + 1, op="unsqueeze")
    shape = tuple(x.shape)
    return apply("reshape", x, shape=shape[:d] + (1,) + shape[d:])


def squeeze(x, dim=None):
    shape = tuple(x.shape)
    if dim is None:
        dims = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = {d for d in normalize_dims(dim, x.ndim, op="squeeze") if shape[d] == 1}
    if not dims:
        return x
    return apply("reshape", x, shape=tuple(s for i, s in enumerate(shape) if i not in dims))


def permute(x, *dims, **keyword):
    dims = _shape_args(keyword_sizes(dims, keyword, ("dims",), "permute"), "permute")
    if len(dims) != x.ndim:
        raise ValueError(f"permute: got {len(dims)} dims {dims} for a tensor of shape {tuple(x.shape)}")
    dims = tuple(normalize_dim(d, x.ndim, op="permute") for d in dims)
    if dims == tuple(range(x.ndim)):
        return x
    return apply("permute", x, dims=dims)   # (a view: its strides are OneFlow's, registry.record_view)


def transpose(x, dim0, dim1):
    if x.ndim == 0:
        return x
    d0, d1 = normalize_dim(dim0, x.ndim, op="transpose"), normalize_dim(dim1, x.ndim, op="transpose")
    order = list(range(x.ndim))
    order[d0], order[d1] = order[d1], order[d0]
    return permute(x, order)


swapaxes = swapdims = transpose


def t(x):
    if x.ndim > 2:
        raise ValueError(f"t(): expects a tensor with <= 2 dims, got shape {tuple(x.shape)}")
    return transpose(x, 0, 1) if x.ndim == 2 else x


def expand(x, *sizes, **keyword):
    """Broadcast `x` to `sizes`; -1 keeps a dim's size. New dims are added on the left."""
    sizes = _shape_args(keyword_sizes(sizes, keyword, ("size",), "expand"), "expand")
    shape = tuple(x.shape)
    if len(sizes) < len(shape):
        raise ValueError(f"expand: the number of sizes {sizes} must be >= the number of dims of shape {shape}")
    lead = len(sizes) - len(shape)
    target = []
    for i, s in enumerate(sizes):
        if s == -1:
            if i < lead:
                raise ValueError(f"expand: -1 is not allowed for a new leading dim (sizes {sizes}, shape {shape})")
            s = shape[i - lead]
        target.append(s)
    target = tuple(target)
    if target == shape:
        return x
    return apply("expand", x, shape=target)


def expand_as(x, other):
    return expand(x, tuple(other.shape))


def broadcast_to(x, shape):
    return expand(x, tuple(shape))


def repeat(x, *sizes, **keyword):
    """Tile `x` (torch.Tensor.repeat): built from reshape + expand + reshape."""
    sizes = _shape_args(keyword_sizes(sizes, keyword, ("sizes", "repeats"), "repeat"), "repeat")
    if len(sizes) < x.ndim:
        raise ValueError(f"repeat: number of repeat dims {sizes} can not be smaller than the number of dims "
                         f"of shape {tuple(x.shape)}")
    shape = (1,) * (len(sizes) - x.ndim) + tuple(x.shape)
    if _ball(r == 1 for r in sizes):
        return reshape(x, shape)
    interleaved = []
    for s in shape:
        interleaved += [1, s]
    y = reshape(x, interleaved)
    target = []
    for r, s in zip(sizes, shape):
        target += [r, s]
    y = expand(y, target)
    return reshape(y, tuple(r * s for r, s in zip(sizes, shape)))


def contiguous(x):
    """`x` itself when row-major, else a row-major copy (flowgen's data already is; the copy
    drops the permuted-view layout, as OneFlow's contiguous() does)."""
    return x if x.is_contiguous() else clone(x)


def _slice(x, starts, stops, steps):
    shape = tuple(x.shape)
    if tuple(starts) == (0,) * len(shape) and tuple(stops) == shape and _ball(s == 1 for s in steps):
        return x
    return apply("slice", x, starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


def narrow(x, dim, start, length):
    d = normalize_dim(dim, x.ndim, op="narrow")
    n = x.shape[d]
    if start < 0:
        start += n
    if not (0 <= start and length >= 0 and start + length <= n):
        raise IndexError(f"narrow: start {start} + length {length} exceeds dim {dim} of shape {tuple(x.shape)}")
    starts = tuple(start if i == d else 0 for i in range(x.ndim))
    stops = tuple(start + length if i == d else s for i, s in enumerate(x.shape))
    return _slice(x, starts, stops, (1,) * x.ndim)


def select(x, dim, index):
    d = normalize_dim(dim, x.ndim, op="select")
    n = x.shape[d]
    i = index + n if index < 0 else index
    if not 0 <= i < n:
        raise IndexError(f"select: index {index} is out of bounds for dimension {d} with size {n}")
    y = narrow(x, d, i, 1)
    shape = tuple(x.shape)
    return apply("reshape", y, shape=shape[:d] + shape[d + 1:])


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    if not _ball(_is_tensor(t) for t in tensors):
        raise TypeError("cat: expected a sequence of tensors")
    return apply("cat", *tensors, dim=normalize_dim(dim, tensors[0].ndim, op="cat") if tensors[0].ndim else dim)


concat = concatenate = cat


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    shapes = [tuple(t.shape) for t in tensors]
    if _bany(s != shapes[0] for s in shapes):
        raise ValueError(f"stack: expects each tensor to be equal size, but got shapes "
                         f"{', '.join(map(str, shapes))}")
    d = normalize_dim(dim, len(shapes[0]) + 1, op="stack")
    return apply("cat", *(unsqueeze(t, d) for t in tensors), dim=d)


def split(x, split_size_or_sections, dim=0):
    d = normalize_dim(dim, x.ndim, op="split")
    n = x.shape[d]
    if isinstance(split_size_or_sections, numbers.Integral):
        size = int(split_size_or_sections)
        if size <= 0:
            raise ValueError(f"split: split_size must be positive, got {size}")
        sections = [_bmin(size, n - s) for s in range(0, n, size)] or [0]
    else:
        sections = [int(s) for s in split_size_or_sections]
        if _bsum(sections) != n:
            raise ValueError(f"split: sections {sections} do not sum to the size {n} of dim {dim} "
                             f"(shape {tuple(x.shape)})")
    out, start = [], 0
    for s in sections:
        out.append(narrow(x, d, start, s))
        start += s
    return tuple(out)


def chunk(x, chunks, dim=0):
    d = normalize_dim(dim, x.ndim, op="chunk")
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    n = x.shape[d]
    size = -(-n // chunks) if n else 1
    return split(x, _bmax(size, 1), d)


def unbind(x, dim=0):
    d = normalize_dim(dim, x.ndim, op="unbind")
    return tuple(select(x, d, i) for i in range(x.shape[d]))


# ------------------------------------------------------------------- indexing
def _index_tensor(k):
    arr = np.asarray(k)
    if arr.dtype == np.bool_:
        return Tensor(arr, dtype=dt.bool_)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"tensors used as indices must be long, int or bool; got {arr.dtype} ({k!r})")
    return Tensor(arr.astype(np.int64), dtype=dt.int64)


def getitem(x, key):
    """``x[key]``: ints, slices (positive steps), None, Ellipsis lower to slice + reshape;
    one integer tensor/list index lowers to ``index_select``; a boolean mask works eagerly."""
    if not isinstance(key, tuple):
        key = (key,)
    items = []
    for k in key:
        if isinstance(k, (list, np.ndarray)):
            k = _index_tensor(k)
        elif isinstance(k, (bool, np.bool_)):
            raise IndexError("indexing with a Python bool is not supported")
        elif isinstance(k, numbers.Integral):
            k = int(k)
        elif _is_tensor(k):
            if k.dtype.is_floating:
                raise IndexError(f"tensors used as indices must be long, int or bool; got {k.dtype!r}")
            if k.ndim == 0 and not k.is_lazy and k.dtype != dt.bool_:
                k = int(k.item())
        elif not (k is None or k is Ellipsis or isinstance(k, slice)):
            raise IndexError(f"unsupported index {k!r} of type {type(k).__name__}")
        items.append(k)
    ellipses = [i for i, k in enumerate(items) if k is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = _bsum((k.ndim if k.dtype == dt.bool_ else 1) if _is_tensor(k) else (0 if k is None or k is Ellipsis
                                                                                    else 1) for k in items)
    ndim = x.ndim
    if consumed > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim} (shape {tuple(x.shape)}, index {key!r})")
    if ellipses:
        i = ellipses[0]
        items[i:i + 1] = [slice(None)] * (ndim - consumed)
    else:
        items += [slice(None)] * (ndim - consumed)

    shape = tuple(x.shape)
    starts, stops, steps, out_shape = [], [], [], []
    advanced = None
    d = 0
    for k in items:
        if k is None:
            out_shape.append(1)
        elif isinstance(k, int):
            n = shape[d]
            i = k + n if k < 0 else k
            if not 0 <= i < n:
                raise IndexError(f"index {k} is out of bounds for dimension {d} with size {n}")
            starts.append(i), stops.append(i + 1), steps.append(1)
            d += 1
        elif isinstance(k, slice):
            n = shape[d]
            if k.step is not None and k.step <= 0:
                raise ValueError(f"step must be greater than zero (got slice {k} on dim {d})")
            b, e, s = k.indices(n)
            e = _bmax(e, b)
            starts.append(b), stops.append(e), steps.append(s)
            out_shape.append(len(range(b, e, s)))
            d += 1
        else:  # tensor index
            if advanced is not None:
                raise NotImplementedError("flowgen supports one tensor/list index per indexing expression; "
                                          f"got several in {key!r}")
            span = k.ndim if k.dtype == dt.bool_ else 1
            if k.dtype == dt.bool_ and tuple(k.shape) != shape[d:d + span]:
                raise IndexError(f"the shape of the mask {tuple(k.shape)} does not match the shape "
                                 f"{shape[d:d + span]} of the indexed dims {d}..{d + span - 1} "
                                 f"of a tensor of shape {shape}")
            advanced = (len(out_shape), k, d)
            for j in range(span):
                starts.append(0), stops.append(shape[d + j]), steps.append(1)
                out_shape.append(shape[d + j])
            d += span
    result = _slice(x, starts, stops, steps)
    out_shape = tuple(out_shape)
    if tuple(result.shape) != out_shape:
        result = apply("reshape", result, shape=out_shape)
    if advanced is None:
        return result
    pos, idx, in_dim = advanced
    if idx.dtype == dt.bool_:
        if idx.is_lazy:
            raise RuntimeError("boolean-mask indexing (x[mask]) is eager-only: the result's shape depends on "
                               "the data, which nn.Graph cannot compile; use flow.where / masked_fill instead")
        mask = idx.numpy_view()
        merged = out_shape[:pos] + (mask.size,) + out_shape[pos + mask.ndim:]
        if merged != out_shape:
            result = apply("reshape", result, shape=merged)
        flat = Tensor(np.flatnonzero(mask).astype(np.int64), device=x.device)
        return apply("index_select", result, flat, dim=pos)
    n = shape[in_dim]
    if not idx.is_lazy:
        arr = idx.numpy_view()
        bad = (arr < -n) | (arr >= n)
        if bad.any():
            raise IndexError(f"index {int(arr[bad].flat[0])} is out of bounds for dimension {in_dim} with size {n}")
    flat = idx if idx.ndim == 1 else apply("reshape", idx, shape=(_prod(idx.shape),))
    if idx.dtype != dt.int64:
        flat = apply("cast", flat, dtype=dt.int64)
    # Python semantics: a negative index counts from the end (index_select alone refuses it).
    result = apply("index_select", result, flat, dim=pos, wrap_negative=True)
    if idx.ndim != 1:
        result = apply("reshape", result, shape=out_shape[:pos] + tuple(idx.shape) + out_shape[pos + 1:])
    return result


def scatter_positions(x, positions, values):
    """`x` with the elements at `positions` (int64 indices into x.reshape(-1), an array shaped like
    `values`) replaced by `values`; of repeated positions the last wins (NumPy's assignment). What an
    in-place write to a view or ``x[key] = value`` does to the tensor written, as ops: an
    index_select of the values and a where, so gradients flow to both and graphs compile it."""
    pos = np.asarray(positions, np.int64).reshape(-1)
    if tuple(values.shape) != tuple(np.shape(positions)):
        values = expand(values, tuple(np.shape(positions)))
    if values.dtype != x.dtype:
        values = apply("cast", values, dtype=x.dtype)
    n = x.numel()
    if pos.size == 0:
        return x
    flat = reshape(values, (pos.size,))
    if pos.size == n and np.array_equal(pos, np.arange(n)):
        return reshape(flat, tuple(x.shape))
    inverse = np.zeros(n, np.int64)
    inverse[pos] = np.arange(pos.size)
    mask = np.zeros(n, bool)
    mask[pos] = True
    gathered = apply("index_select", flat, Tensor(inverse, dtype=dt.int64, device=x.device), dim=0)
    return where(Tensor(mask.reshape(tuple(x.shape)), device=x.device), reshape(gathered, tuple(x.shape)), x)


def setitem_value(x, key, value):
    """What ``x[key] = value`` makes of `x` (Tensor.__setitem__ writes it in place). Any index
    of constant (eager) tensors, lists, ints, slices, None and Ellipsis works, eagerly and in
    graphs; an index computed in a graph must be one boolean mask over x's leading dims."""
    if not _is_tensor(value):
        value = Tensor(np.array(value, dtype=x.dtype.np_dtype), dtype=x.dtype, device=x.device)
    items = key if isinstance(key, tuple) else (key,)
    lazy = [k for k in items if _is_tensor(k) and k.is_lazy]
    if not lazy:
        positions = getitem(Tensor(np.arange(x.numel(), dtype=np.int64).reshape(tuple(x.shape)), dtype=dt.int64,
                                   device=x.device), key)
        return scatter_positions(x, positions.numpy_view(), value)
    mask = lazy[0]
    if len(items) != 1 or mask.dtype != dt.bool_ or tuple(mask.shape) != tuple(x.shape)[:mask.ndim]:
        raise NotImplementedError(
            f"x[index] = value inside nn.Graph.build() with an index computed in the graph ({key!r}): only one "
            f"boolean mask over the leading dims of x (shape {tuple(x.shape)}) is supported; the positions of "
            f"any other must be known when the graph is traced (use index_add/scatter_add, or a mask)")
    cond = reshape(mask, tuple(mask.shape) + (1,) * (x.ndim - mask.ndim))
    if value.dtype != x.dtype:
        value = apply("cast", value, dtype=x.dtype)
    return where(cond, value, x)


# =================================================================== linear algebra
def matmul(a, b):
    """torch.matmul semantics: 1-D operands are promoted (and the added dim removed), batch dims broadcast."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    if not sa or not sb:
        raise ValueError(f"matmul: both arguments need at least 1 dim, got shapes {sa} and {sb}")
    ka = sa[-1]
    kb = sb[0] if len(sb) == 1 else sb[-2]
    if ka != kb:
        raise ValueError(f"matmul: shapes {sa} and {sb} cannot be multiplied (inner sizes {ka} != {kb})")
    if len(sa) >= 2 and len(sb) >= 2:
        if sa[:-2] != sb[:-2]:
            try:
                np.broadcast_shapes(sa[:-2], sb[:-2])
            except ValueError:
                raise ValueError(f"matmul: shapes {sa} and {sb} cannot be multiplied (batch dims {sa[:-2]} and "
                                 f"{sb[:-2]} do not broadcast)") from None
        return apply("matmul", a, b)
    a2 = apply("reshape", a, shape=(1, ka)) if len(sa) == 1 else a
    b2 = apply("reshape", b, shape=(kb, 1)) if len(sb) == 1 else b
    out = apply("matmul", a2, b2)
    shape = tuple(out.shape)
    if len(sa) == 1 and len(sb) == 1:
        final = ()
    elif len(sa) == 1:
        final = shape[:-2] + shape[-1:]
    else:
        final = shape[:-1]
    return apply("reshape", out, shape=final)


def mm(a, b):
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"mm: expects 2-D tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return matmul(a, b)


def bmm(a, b):
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm: expects 3-D tensors with the same batch size, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    return matmul(a, b)


def dot(a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"dot: expects 1-D tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return matmul(a, b)


def mv(input, vec):
    """Matrix (n, m) times vector (m,) -> (n,)."""
    if input.ndim != 2 or vec.ndim != 1:
        raise ValueError(f"mv: expects a 2-D matrix and a 1-D vector, got shapes {tuple(input.shape)} and "
                         f"{tuple(vec.shape)}")
    return matmul(input, vec)


def tensordot(a, b, dims=2):
    """Sum of products over `dims`: an int n (the last n dims of `a` with the first n of `b`) or a
    pair of dim lists, as torch.tensordot; a permute + reshape + one matmul."""
    if isinstance(dims, numbers.Integral):
        n = int(dims)
        if n < 0 or n > a.ndim or n > b.ndim:
            raise RuntimeError(f"tensordot: dims={n} must be non-negative and at most the dims of both "
                               f"operands ({a.ndim} and {b.ndim})")
        dims_a, dims_b = list(range(a.ndim - n, a.ndim)), list(range(n))
    elif _is_tensor(dims):
        return tensordot(a, b, dims.tolist())
    else:
        if len(dims) != 2:
            raise RuntimeError(f"tensordot: dims must be an int or a pair of dim lists, got {dims!r}")
        dims_a, dims_b = ([d] if isinstance(d, numbers.Integral) else list(d) for d in dims)
    dims_a = [normalize_dim(d, a.ndim, op="tensordot") for d in dims_a]
    dims_b = [normalize_dim(d, b.ndim, op="tensordot") for d in dims_b]
    if len(dims_a) != len(dims_b):
        raise RuntimeError(f"tensordot: both dim lists must have the same length, got {dims_a} and {dims_b}")
    for da, db in zip(dims_a, dims_b):
        if a.shape[da] != b.shape[db]:
            raise RuntimeError(f"tensordot: contracted dimensions need to match, but first has size "
                               f"{a.shape[da]} in dim {da} and second has size {b.shape[db]} in dim {db}")
    free_a = [d for d in range(a.ndim) if d not in dims_a]
    free_b = [d for d in range(b.ndim) if d not in dims_b]
    k = _prod(a.shape[d] for d in dims_a)
    a2 = reshape(permute(a, free_a + dims_a), (_prod(a.shape[d] for d in free_a), k))
    b2 = reshape(permute(b, dims_b + free_b), (k, _prod(b.shape[d] for d in free_b)))
    return reshape(matmul(a2, b2), tuple(a.shape[d] for d in free_a) + tuple(b.shape[d] for d in free_b))


# =================================================================== nn-op front ends
# These ops are defined in flowgen/ops/nn_ops.py; the functions are here so Tensor
# methods (x.softmax(-1), x.gather(1, idx), x.index_select(0, idx)) reach them.
def softmax(x, dim=-1):
    return apply("softmax", _to_float(x), dim=normalize_dim(dim, x.ndim, op="softmax"))


def log_softmax(x, dim=-1):
    return apply("log_softmax", _to_float(x), dim=normalize_dim(dim, x.ndim, op="log_softmax"))


def gather(x, dim, index):
    return apply("gather", x, index, dim=normalize_dim(dim, x.ndim, op="gather"))


def index_select(x, dim, index):
    if not _is_tensor(index):
        index = _index_tensor(index)
    return apply("index_select", x, index, dim=normalize_dim(dim, x.ndim, op="index_select"))


def index_add(input, dim, index, source, alpha=1):
    """`input` with `alpha * source` slices added at rows `index` along `dim` (repeated indices
    accumulate), as torch.index_add: the index_add op (zeros with the slices added) plus input."""
    d = normalize_dim(dim, _bmax(input.ndim, 1), op="index_add")
    added = apply("index_add", index, source, shape=tuple(input.shape), dim=d)
    return add(input, added if alpha == 1 else mul(added, alpha))


def scatter_add(input, dim, index, src):
    """`input` with src[i..] added at the position index[i..] names along `dim`, as
    torch.scatter_add; only the leading index.shape part of `src` is read."""
    d = normalize_dim(dim, _bmax(input.ndim, 1), op="scatter_add")
    if src.ndim != index.ndim or builtins.any(i > s for i, s in zip(index.shape, src.shape)):
        raise RuntimeError(f"scatter_add: index {tuple(index.shape)} must have the dims of src "
                           f"{tuple(src.shape)} and be no larger in any of them")
    for i, (si, sx) in enumerate(zip(index.shape, input.shape)):
        if i != d and si > sx:
            raise RuntimeError(f"scatter_add: size of dimension {i} of index ({si}) is larger than that of "
                               f"input ({sx})")
    if tuple(src.shape) != tuple(index.shape):
        src = _slice(src, [0] * src.ndim, list(index.shape), [1] * src.ndim)
    return add(input, apply("scatter_add", index, src, shape=tuple(input.shape), dim=d))


# =================================================================== more math
def erf(x):
    return apply("erf", _to_float(x))


def erfinv(x):
    return apply("erfinv", _to_float(x))


def log1p(x):
    return apply("log1p", _to_float(x))


def expm1(x):
    return apply("expm1", _to_float(x))


def tan(x):
    return apply("tan", _to_float(x))


def asin(x):
    return apply("asin", _to_float(x))


def acos(x):
    return apply("acos", _to_float(x))


def atan(x):
    return apply("atan", _to_float(x))


def sinh(x):
    return apply("sinh", _to_float(x))


def cosh(x):
    return apply("cosh", _to_float(x))


def asinh(x):
    return apply("asinh", _to_float(x))


def acosh(x):
    return apply("acosh", _to_float(x))


def atanh(x):
    return apply("atanh", _to_float(x))


arcsin, arccos, arctan, arcsinh, arccosh, arctanh = asin, acos, atan, asinh, acosh, atanh


def log2(x):
    return apply("log2", _to_float(x))


def log10(x):
    return apply("log10", _to_float(x))


def exp2(x):
    return apply("exp2", _to_float(x))


def sinc(x):
    """sin(pi x) / (pi x), 1 at 0 (torch.sinc)."""
    return apply("sinc", _to_float(x))


def logit(x, eps=None):
    """log(z / (1 - z)), z = x clamped to [eps, 1 - eps]; eps None (or negative, as PyTorch) clamps nothing."""
    return apply("logit", _to_float(x), eps=None if eps is None or eps < 0 else float(eps))


def logit_grad(g, x, eps=None):
    return apply("logit_grad", g, x, eps=eps)


def deg2rad(x):
    """x * (pi / 180), the constant rounded to x's dtype (as torch)."""
    return mul(_to_float(x), 0.017453292519943295)


def rad2deg(x):
    """x * (180 / pi), the constant rounded to x's dtype (as torch)."""
    return mul(_to_float(x), 57.29577951308232)


def xlogy(x, y):
    """x * log(y); 0 where x == 0 unless y is NaN (torch.xlogy)."""
    return apply("xlogy", _to_float(x), _to_float(y))


def hypot(a, b):
    return apply("hypot", _to_float(a), _to_float(b))


def logaddexp(a, b):
    """log(exp(a) + exp(b)), computed without overflow."""
    return apply("logaddexp", _to_float(a), _to_float(b))


def copysign(a, b):
    """|a| with the sign of b (the sign bit: -0.0 counts as negative)."""
    return apply("copysign", _to_float(a), _to_float(b))


def ceil(x):
    return apply("ceil", x) if x.dtype.is_floating else x


def trunc(x):
    return apply("trunc", x) if x.dtype.is_floating else x


fix = trunc


def round(x, decimals=0):  # noqa: A001
    """Round half to even (torch.round); `decimals` scales by 10**decimals first."""
    if not x.dtype.is_floating:
        return x
    if decimals == 0:
        return apply("round", x)
    scale = 10.0 ** decimals
    return apply("div", apply("round", apply("mul", x, scale)), scale)


def frac(x):
    return sub(x, trunc(x))


def isnan(x):
    return apply("isnan", x) if x.dtype.is_floating else zeros_like(x, dtype=dt.bool_)


def isinf(x):
    return apply("isinf", x) if x.dtype.is_floating else zeros_like(x, dtype=dt.bool_)


def isfinite(x):
    return apply("isfinite", x) if x.dtype.is_floating else ones_like(x, dtype=dt.bool_)


def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    """NaN -> `nan`, +inf -> `posinf`, -inf -> `neginf` (default: the dtype's largest/lowest finite value)."""
    if not x.dtype.is_floating:
        return x
    info = np.finfo(x.dtype.np_dtype)
    posinf = float(info.max) if posinf is None else posinf
    neginf = float(info.min) if neginf is None else neginf
    y = where(isnan(x), nan, x)
    # the replacements as tensors of x's dtype: float64's largest value as a bare Python float
    # would become a float32 scalar here, which is inf again
    return where(isinf(y), where(gt(y, 0), full_like(y, posinf), full_like(y, neginf)), y)


def atan2(a, b):
    return apply("atan2", _to_float(a), _to_float(b))


arctan2 = atan2


def fmod(a, b):
    return apply("fmod", a, b)


def remainder(a, b):
    return apply("remainder", a, b)


def lerp(start, end, weight):
    """start + weight * (end - start)."""
    return add(start, mul(weight, sub(end, start)))


def addcmul(x, t1, t2, value=1):
    return add(x, mul(mul(t1, t2), value))


def addcdiv(x, t1, t2, value=1):
    return add(x, mul(div(t1, t2), value))


def logsumexp(x, dim, keepdim=False):
    """log(sum(exp(x))) over `dim`, shifted by the (gradient-free) maximum so large inputs do not overflow."""
    dims = _dims(x, dim, "logsumexp")
    x = _to_float(x)
    shift = detach(amax(x, dims, keepdim=True))
    shift = where(isinf(shift), 0.0, shift)   # all -inf (or +inf) rows: no shift, the sum says it
    out = add(log(sum(exp(sub(x, shift)), dims, keepdim=True)), shift)
    return out if keepdim else squeeze(out, dims) if dims else out


def norm(x, p="fro", dim=None, keepdim=False, dtype=None):
    """Vector p-norm over `dim` (all elements by default): p = 2/"fro", 1, inf, -inf, 0 or any float."""
    x = cast(x, dtype) if dtype is not None else _to_float(x)
    dims = _dims(x, dim, "norm")
    if p in ("fro", 2, 2.0):
        return _root(sum(mul(x, x), dims, keepdim), sqrt)
    if p in (float("inf"), "inf"):
        return amax(abs(x), dims, keepdim)
    if p in (float("-inf"), "-inf"):
        return amin(abs(x), dims, keepdim)
    if p == 1:
        return sum(abs(x), dims, keepdim)
    if p == 0:
        return sum(cast(ne(x, 0), x.dtype), dims, keepdim)
    if isinstance(p, numbers.Real):
        return _root(sum(pow(abs(x), float(p)), dims, keepdim), lambda s: pow(s, 1.0 / float(p)))
    raise ValueError(f"norm: unsupported norm type p={p!r} (a number, 'fro', inf or -inf)")


def _root(powered_sum, root):
    """root(powered_sum) whose gradient is 0 where the sum is 0, as PyTorch's norm backward (the
    root's derivative is inf at 0, and inf * 0 would make a zero vector's gradient NaN). The
    inner where keeps the root off 0; NaN sums still propagate (NaN != 0)."""
    nonzero = ne(powered_sum, 0)
    return where(nonzero, root(where(nonzero, powered_sum, 1.0)), 0.0)


# =================================================================== more shape ops
def movedim(x, source, destination):
    src = [normalize_dim(d, x.ndim, op="movedim") for d in ([source] if isinstance(source, int) else source)]
    dst = [normalize_dim(d, x.ndim, op="movedim") for d in ([destination] if isinstance(destination, int)
                                                             else destination)]
    if len(src) != len(dst):
        raise ValueError(f"movedim: source {source} and destination {destination} differ in length")
    order = [None] * x.ndim
    for s_, d_ in zip(src, dst):
        order[d_] = s_
    rest = iter(d for d in range(x.ndim) if d not in src)
    return permute(x, [o if o is not None else next(rest) for o in order])


moveaxis = movedim


def unflatten(x, dim, sizes):
    d = normalize_dim(dim, x.ndim, op="unflatten")
    return reshape(x, tuple(x.shape[:d]) + tuple(sizes) + tuple(x.shape[d + 1:]))


def repeat_interleave(x, repeats, dim=None):
    """Repeat each element `repeats` times along `dim` (flattened when None); `repeats` is an int
    (a tensor of per-element counts gives a data-dependent shape: eager only)."""
    if dim is None:
        x, dim = flatten(x), 0
    d = normalize_dim(dim, x.ndim, op="repeat_interleave")
    if _is_tensor(repeats):
        if repeats.is_lazy:
            raise RuntimeError("repeat_interleave: per-element repeat counts give a data-dependent shape, which "
                               "nn.Graph cannot compile; pass an int")
        counts = repeats.numpy_view().astype(np.int64).reshape(-1)
        index = Tensor(np.repeat(np.arange(x.shape[d], dtype=np.int64), counts), device=x.device)
        return apply("index_select", x, index, dim=d)
    r = int(repeats)
    shape = tuple(x.shape)
    y = expand(unsqueeze(x, d + 1), shape[:d + 1] + (r,) + shape[d + 1:])
    return reshape(y, shape[:d] + (shape[d] * r,) + shape[d + 1:])


def _triangle_mask(x, diagonal, lower, name):
    if x.ndim < 2:
        raise ValueError(f"{name}: expects a tensor with at least 2 dims, got shape {tuple(x.shape)}")
    rows, cols = x.shape[-2], x.shape[-1]
    keep = np.tri(rows, cols, int(diagonal), dtype=bool) if lower else ~np.tri(rows, cols, int(diagonal) - 1,
                                                                               dtype=bool)
    return Tensor(keep, device=x.device)


def tril(x, diagonal=0):
    """Lower triangle of the last two dims (elements with col - row <= diagonal), zeros elsewhere."""
    return where(_triangle_mask(x, diagonal, True, "tril"), x, zeros_like(x) if x.ndim == 0 else 0)


def triu(x, diagonal=0):
    """Upper triangle of the last two dims (elements with col - row >= diagonal), zeros elsewhere."""
    return where(_triangle_mask(x, diagonal, False, "triu"), x, 0)


def flip(x, dims):
    """Reverse the order of elements along `dims` (index_select with a reversed constant index)."""
    for d in normalize_dims(dims, x.ndim, op="flip"):
        reverse = Tensor(np.arange(x.shape[d] - 1, -1, -1, dtype=np.int64), device=x.device)
        x = apply("index_select", x, reverse, dim=d)
    return x


def roll(x, shifts, dims=None):
    """Shift elements along `dims` with wrap-around (torch.roll); no dims: over the flattened tensor."""
    if dims is None:
        return reshape(roll(flatten(x), shifts, 0), tuple(x.shape))
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(shifts) != len(dims):
        raise ValueError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    for shift, dim in zip(shifts, dims):
        d = normalize_dim(dim, x.ndim, op="roll")
        n = x.shape[d]
        k = shift % n if n else 0
        if k:
            x = cat([narrow(x, d, n - k, k), narrow(x, d, 0, n - k)], d)
    return x


def diff(x, n=1, dim=-1):
    d = normalize_dim(dim, x.ndim, op="diff")
    for _ in range(n):
        length = x.shape[d] - 1
        x = sub(narrow(x, d, 1, length), narrow(x, d, 0, length))
    return x


def outer(a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"outer: expects 1-D tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return mul(reshape(a, (-1, 1)), reshape(b, (1, -1)))


ger = outer


def addmm(x, m1, m2, beta=1, alpha=1):
    """beta * x + alpha * (m1 @ m2)."""
    product = mm(m1, m2)
    return add(mul(x, beta) if beta != 1 else x, mul(product, alpha) if alpha != 1 else product)


def baddbmm(x, b1, b2, beta=1, alpha=1):
    product = bmm(b1, b2)
    return add(mul(x, beta) if beta != 1 else x, mul(product, alpha) if alpha != 1 else product)


def diagonal(x, offset=0, dim1=0, dim2=1):
    """The elements (i, i + offset) of dims `dim1`, `dim2` as a new last dim (torch.diagonal):
    both dims moved last and flattened, then an index_select of the diagonal's positions."""
    d1, d2 = normalize_dim(dim1, x.ndim, op="diagonal"), normalize_dim(dim2, x.ndim, op="diagonal")
    if d1 == d2:
        raise ValueError(f"diagonal: dim1 and dim2 are the same dim ({dim1}, {dim2}) of shape {tuple(x.shape)}")
    rows, cols = x.shape[d1], x.shape[d2]
    first_row, first_col = (0, offset) if offset >= 0 else (-offset, 0)
    length = _bmax(0, _bmin(rows - first_row, cols - first_col))
    positions = (first_row + np.arange(length, dtype=np.int64)) * cols + first_col + np.arange(length, dtype=np.int64)
    last_two = movedim(x, (d1, d2), (-2, -1))
    flat = reshape(last_two, tuple(last_two.shape[:-2]) + (rows * cols,))
    return apply("index_select", flat, Tensor(positions, device=x.device), dim=flat.ndim - 1)


_diagonal = diagonal   # diag's argument `diagonal` (PyTorch's name) hides the function there


def diag(x, diagonal=0):
    """A 1-D tensor: the square matrix with it on diagonal `diagonal`; a 2-D tensor: that diagonal."""
    if x.ndim == 2:
        return _diagonal(x, diagonal)
    if x.ndim != 1:
        raise ValueError(f"diag: expects a 1-D or 2-D tensor, got shape {tuple(x.shape)}")
    n, k = x.shape[0], _babs(int(diagonal))
    size = n + k
    on_diagonal = Tensor(np.eye(size, size, int(diagonal), dtype=bool), device=x.device)
    padded = cat([x, zeros(k, dtype=x.dtype, device=x.device)]) if k else x
    # Row i of the matrix holds x[i] above the main diagonal, column j holds x[j] below it.
    spread = reshape(padded, (size, 1) if diagonal >= 0 else (1, size))
    return where(on_diagonal, spread, 0)


def trace(x):
    if x.ndim != 2:
        raise ValueError(f"trace: expects a 2-D tensor, got shape {tuple(x.shape)}")
    return sum(diagonal(x))


def einsum(equation, *operands):
    """Einstein summation built from permute/reshape/mul/sum (any equation with explicit or implicit
    output; a label repeated within one operand takes that operand's diagonal). Runs in graphs too.

    An ellipsis ('...') stands for the dims no label names; those of all operands broadcast
    together, aligned from the right (PyTorch's rule). An implicit output puts the ellipsis dims
    first, then the labels used once, in alphabetical order; an explicit output without '...'
    sums the ellipsis dims away."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    eq = equation.replace(" ", "")
    inputs, arrow, output = eq.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum: equation {equation!r} names {len(terms)} operands, got {len(operands)}")
    terms, output = _einsum_expand_ellipsis(equation, terms, output if arrow else None, operands)
    for term, op_ in zip(terms, operands):
        if len(term) != op_.ndim:
            raise ValueError(f"einsum: term {term!r} has {len(term)} labels but its operand has shape "
                             f"{tuple(op_.shape)}")
    terms, operands = zip(*[_einsum_take_diagonals(equation, t, o) for t, o in zip(terms, operands)])
    labels = list(dict.fromkeys("".join(terms)))
    sizes = {}
    for term, op_ in zip(terms, operands):
        for c, s_ in zip(term, op_.shape):
            if sizes.setdefault(c, s_) != s_ and s_ != 1 and sizes[c] != 1:
                raise ValueError(f"einsum: label {c!r} has sizes {sizes[c]} and {s_}")
            sizes[c] = builtins.max(sizes[c], s_)
    # Each operand viewed over all labels (size-1 where absent), multiplied, then summed over the rest.
    product = None
    for term, op_ in zip(terms, operands):
        order = sorted(range(len(term)), key=lambda i: labels.index(term[i]))
        view = permute(op_, order) if order != list(range(len(term))) else op_
        own = {term[i]: op_.shape[i] for i in order}   # size 1 where it broadcasts against another operand
        view = reshape(view, tuple(own.get(c, 1) for c in labels)) if len(labels) else view
        product = view if product is None else mul(product, view)
    summed = [i for i, c in enumerate(labels) if c not in output]
    if summed:
        product = sum(product, summed)
    kept = [c for c in labels if c in output]
    return permute(product, [kept.index(c) for c in output]) if len(kept) > 1 else product


def _einsum_take_diagonals(equation, term, operand):
    """(term, operand) with each label repeated within the term reduced to one dim: the diagonal
    of its dims ("ii->i" reads x[i, i]), moved last as torch.diagonal does."""
    while len(set(term)) != len(term):
        label = next(c for c in term if term.count(c) > 1)
        first, second = term.index(label), term.index(label, term.index(label) + 1)
        if operand.shape[first] != operand.shape[second]:
            raise ValueError(f"einsum: label {label!r} is repeated in term {term!r} of {equation!r} over dims of "
                             f"different sizes {operand.shape[first]} and {operand.shape[second]}")
        operand = diagonal(operand, 0, first, second)
        term = "".join(c for i, c in enumerate(term) if i not in (first, second)) + label
    return term, operand


# Labels for the ellipsis dims: characters no equation can contain (equations use letters only).
_ELLIPSIS_LABELS = "".join(chr(0x2460 + i) for i in range(64))


def _einsum_expand_ellipsis(equation, terms, output, operands):
    """(terms, output) with each '...' replaced by one label per dim it covers. An implicit output
    (None) becomes the ellipsis labels, then the labels used once, in alphabetical order."""
    def split(term, where):
        if term.count("...") > 1 or term.replace("...", "").count("."):
            raise ValueError(f"einsum: {where} {term!r} of {equation!r} has a '.' that is not part of a "
                             f"single ellipsis ('...')")
        return term.partition("...")

    covered = []
    for term, op_ in zip(terms, operands):
        head, dots, tail = split(term, "term")
        rank = op_.ndim - len(head) - len(tail) if dots else 0
        if rank < 0:
            raise ValueError(f"einsum: term {term!r} has {len(head) + len(tail)} labels but its operand has "
                             f"shape {tuple(op_.shape)}")
        covered.append(rank)
    ellipsis_rank = builtins.max(covered, default=0)
    if ellipsis_rank > len(_ELLIPSIS_LABELS):
        raise ValueError(f"einsum: the ellipsis of {equation!r} covers {ellipsis_rank} dims; at most "
                         f"{len(_ELLIPSIS_LABELS)} are supported")
    fresh = _ELLIPSIS_LABELS[:ellipsis_rank]
    expanded = []
    for term, rank in zip(terms, covered):
        head, dots, tail = split(term, "term")
        expanded.append(head + (fresh[ellipsis_rank - rank:] if dots else "") + tail)
    if output is None:
        counts = {}
        for c in "".join(expanded):
            counts[c] = counts.get(c, 0) + 1
        return expanded, fresh + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in fresh))
    head, dots, tail = split(output, "output")
    return expanded, head + (fresh if dots else "") + tail


# =================================================================== order-dependent: sort, topk, scans
def sort(x, dim=-1, descending=False, stable=True):
    """(values, indices) sorted along `dim`; stable (equal elements keep their order)."""
    d = normalize_dim(dim, x.ndim, op="sort") if x.ndim else 0
    values, indices = apply("sort", x, dim=d, descending=bool(descending))
    return _ValuesIndices(values, indices)


def argsort(x, dim=-1, descending=False, stable=True):
    return sort(x, dim, descending).indices


def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    """(values, indices) of the `k` largest (or smallest) elements along `dim`, in order; stable."""
    d = normalize_dim(dim, x.ndim, op="topk") if x.ndim else 0
    values, indices = apply("topk", x, k=int(k), dim=d, largest=bool(largest))
    return _ValuesIndices(values, indices)


def cumsum(x, dim, dtype=None):
    x = cast(x, dtype) if dtype is not None else (cast(x, dt.int64) if x.dtype == dt.bool_ else x)
    return apply("cumsum", x, dim=normalize_dim(dim, x.ndim, op="cumsum") if x.ndim else 0, reverse=False)


def cumprod(x, dim, dtype=None):
    x = cast(x, dtype) if dtype is not None else (cast(x, dt.int64) if x.dtype == dt.bool_ else x)
    return apply("cumprod", x, dim=normalize_dim(dim, x.ndim, op="cumprod") if x.ndim else 0, reverse=False)


def multinomial(input, num_samples, replacement=False, generator=None):
    """Category indices drawn by the weights in each row of `input` (1-D or 2-D, non-negative).

    The uniforms come from the Philox stream (`flow.manual_seed` makes draws reproducible; the
    numbers differ from PyTorch's generator). With replacement: the inverse of each row's CDF.
    Without: the `num_samples` largest keys log(u) / p (weighted sampling without replacement,
    Efraimidis-Spirakis; ties to the lower index), so zero-weight categories are never drawn.
    Both are built from flowgen ops, so they also run inside nn.Graph.build().
    """
    if generator is not None:
        raise NotImplementedError("multinomial: generator= is not supported; seed with flow.manual_seed")
    if input.ndim not in (1, 2):
        raise RuntimeError(f"multinomial: prob_dist must be 1 or 2 dim, got shape {tuple(input.shape)}")
    n = int(num_samples)
    if n <= 0:
        raise RuntimeError(f"multinomial: cannot sample n_sample <= 0 samples (got {n})")
    if not input.is_lazy:
        _check_multinomial_weights(input.numpy_view(), n, replacement)
    weights = _to_float(input) if input.ndim == 2 else unsqueeze(_to_float(input), 0)
    rows, categories = tuple(weights.shape)
    if replacement:
        draws = _inverse_cdf_draws(weights, rand(rows, n, dtype=weights.dtype, device=input.device))
    else:
        u = rand(rows, categories, dtype=dt.float64, device=input.device)
        keys = div(log(clamp_min(u, float(np.finfo(np.float64).tiny))), cast(weights, dt.float64))  # -inf at p = 0
        draws = topk(keys, n, dim=1).indices
    return draws if input.ndim == 2 else squeeze(draws, 0)


def _check_multinomial_weights(weights, n, replacement):
    weights = np.atleast_2d(weights)
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise RuntimeError("multinomial: probability tensor contains either inf, nan or element < 0")
    nonzero = (weights > 0).sum(1)
    if (nonzero == 0).any():
        raise RuntimeError("multinomial: invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement and (n > weights.shape[1] or (nonzero < n).any()):
        raise RuntimeError(f"multinomial: cannot sample {n} samples without replacement from rows with fewer "
                           f"non-zero categories (smallest row has {int(nonzero.min())})")


def _inverse_cdf_draws(weights, u):
    """For each row r and uniform u[r, s]: the number of categories j with cdf[r, j] <= u * total,
    i.e. the first category whose cumulative weight passes the target (searchsorted right)."""
    categories = weights.shape[1]
    upto = np.arange(categories)[:, None] <= np.arange(categories)[None, :]         # [i, j]: i <= j
    upto = Tensor(upto.astype(weights.dtype.np_dtype), device=weights.device)
    cdf = sum(mul(unsqueeze(weights, 2), upto), 1)                                       # [rows, C]
    target = mul(u, narrow(cdf, 1, categories - 1, 1))                                   # [rows, n]
    passed = le(unsqueeze(cdf, 1), unsqueeze(target, 2))                                 # [rows, n, C]
    count = sum(passed.to(dt.int64), 2)
    return clamp_max(count, categories - 1)


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """A Python bool: reads the data, so it is eager only."""
    return builtins.bool(np.allclose(_eager_array(a, "allclose"), _eager_array(b, "allclose"), rtol=rtol,
                                     atol=atol, equal_nan=equal_nan))


def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """Elementwise a == b or |a - b| <= atol + rtol * |b| with a finite |a - b| (a bool tensor; NaN
    is close to NaN only with equal_nan), torch.isclose's formula. No gradient."""
    if rtol < 0 or atol < 0:
        raise RuntimeError(f"isclose: rtol ({rtol}) and atol ({atol}) must be non-negative")
    a = detach(input)
    b = detach(as_tensor_like(other, a))
    if a.dtype != b.dtype:
        raise RuntimeError(f"isclose: {a.dtype} did not match {b.dtype} (both operands need the same dtype)")
    close = eq(a, b)
    if equal_nan and a.dtype.is_floating:
        close = logical_or(close, logical_and(isnan(a), isnan(b)))
    if a.dtype == dt.bool_ or (rtol == 0 and atol == 0):
        return close
    a, b = _to_float(a), _to_float(b)
    finite = logical_and(isfinite(a), isfinite(b))          # inf - inf is never computed
    a, b = where(finite, a, 0.0), where(finite, b, 0.0)
    error = abs(sub(a, b))
    allowed = add(mul(abs(b), rtol), atol)
    return logical_or(close, logical_and(finite, le(error, allowed)))


def equal(a, b) -> bool:
    """True when both tensors have the same shape and elements (a Python bool; eager only)."""
    x, y = _eager_array(a, "equal"), _eager_array(b, "equal")
    return x.shape == y.shape and builtins.bool(np.array_equal(x, y))


def _eager_array(t, name):
    if _is_tensor(t):
        if t.is_lazy:
            raise RuntimeError(f"{name}() returns a Python bool, so it needs data: it cannot run on a lazy "
                               f"tensor inside nn.Graph.build()")
        return t.numpy_view()
    return np.asarray(t)


__all__ = [name for name, value in list(globals().items())
           if not name.startswith("_") and callable(value)
           and getattr(value, "__module__", None) in (__name__, "flowgen.creation")
           and name not in {"Tensor", "as_tensor_like", "apply", "normalize_dim", "normalize_dims", "namedtuple",
                            "gelu_grad", "logit_grad", "getitem", "view", "view_as", "reshape_as", "contiguous", "keyword_sizes",
                            "hardtanh"}]
