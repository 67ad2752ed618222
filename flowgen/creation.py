"""Tensor creation: `flow.tensor`, `zeros`, `randn`, `arange`, ... and `manual_seed`.

Random creation functions run the random ops of `flowgen/ops/random_ops.py` on the
Philox stream of `flowgen.random` (one stream offset per call), so `flow.manual_seed(s)`
makes them reproducible and, called inside `nn.Graph.build()`, they become graph ops that
draw fresh numbers on every call, the numbers eager mode would draw. Every function takes
``dtype=``, ``device=`` and ``requires_grad=`` like OneFlow/PyTorch; sizes may be
given as separate ints or one sequence (``zeros(2, 3)`` == ``zeros((2, 3))``).

Non-random creation functions return eager tensors even while a graph is being traced
(shapes are static, so ``zeros_like(lazy)`` is a constant of that shape).
"""
from __future__ import annotations

import builtins
import numbers

import numpy as np

from flowgen import dtype as dt
from flowgen import random as _random
from flowgen.device import as_device
from flowgen.errors import TraceError
from flowgen.ops import registry
from flowgen.ops.registry import apply
from flowgen.random import get_rng_state, initial_seed, manual_seed, set_rng_state  # noqa: F401  (flow.*)
from flowgen.tensor import Tensor, c_array, global_tensors

__all__ = [
    "tensor", "as_tensor", "from_numpy", "from_dlpack", "zeros", "ones", "full", "empty", "arange", "linspace", "eye",
    "randn", "rand", "randint", "randperm", "normal", "bernoulli", "zeros_like", "ones_like", "full_like",
    "empty_like", "randn_like", "rand_like", "randint_like", "manual_seed", "initial_seed", "seed", "get_rng_state",
    "set_rng_state", "cuda",
]


def _size(args, name="size") -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    try:
        size = tuple(int(s) for s in args)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: sizes must be ints or one sequence of ints, got {args!r}") from None
    if any(s < 0 for s in size):
        raise ValueError(f"{name}: negative size in {size}")
    return size


def keyword_sizes(positional, keyword, names, fn):
    """Sizes given positionally or by one of the keyword `names` (``flow.zeros(size=(2, 3))``,
    ``x.reshape(shape=(2, 3))``), as the positional tuple they stand for."""
    unknown = set(keyword) - set(names)
    if unknown:
        raise TypeError(f"{fn}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    if keyword:
        if positional or len(keyword) > 1:
            raise TypeError(f"{fn}() got the sizes twice: positionally and as {'/'.join(keyword)}=")
        return (next(iter(keyword.values())),)
    return positional


def _make(arr, dtype, device, requires_grad) -> Tensor:
    target = dt.get(dtype) if dtype is not None else None
    t = Tensor.__new__(Tensor)
    Tensor.__init__(t, None, device=device, requires_grad=False)
    if target is None:
        target = dt.from_numpy(arr.dtype)
    t._data = c_array(arr, target.np_dtype)
    t._dtype = target
    if requires_grad:
        if not target.is_floating:
            raise RuntimeError(f"only floating point tensors can require gradients, got {target!r}")
        t.requires_grad = True
    return t


def _plain(data):
    """Nested lists/tuples that may hold tensors -> nested lists of Python/NumPy values."""
    if isinstance(data, Tensor):
        return data.numpy_view()
    if isinstance(data, (list, tuple)):
        return [_plain(d) for d in data]
    return data


# ------------------------------------------------------------------ from data
def tensor(data, dtype=None, device=None, requires_grad=False) -> Tensor:
    """A new tensor holding a copy of `data` (list, scalar, ndarray or tensor).

    Python floats become float32 (flowgen's default float), Python ints int64, bools
    bool; NumPy arrays and NumPy scalars keep their dtype (float64 stays float64, as in
    PyTorch and OneFlow); pass ``dtype=`` to choose.
    """
    if isinstance(data, Tensor):
        if data.is_lazy:
            raise RuntimeError("flow.tensor() got a lazy tensor inside nn.Graph.build(); use the tensor "
                               "itself (or .clone()) instead of copying it")
        arr = data.numpy_view().copy()
        if dtype is None:
            dtype = data.dtype
    else:
        arr = np.array(_plain(data))
        if arr.dtype == object:
            raise TypeError(f"flow.tensor: cannot build a tensor from {type(data).__name__} data {data!r}")
        keeps_dtype = isinstance(data, (np.ndarray, np.generic))
        if dtype is None and arr.dtype == np.float64 and not keeps_dtype:
            dtype = dt.float32
    return _make(arr, dtype, device, requires_grad)


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """Like `tensor`, but returns `data` itself when it is already a tensor of that dtype."""
    if isinstance(data, Tensor) and (dtype is None or dt.get(dtype) == data.dtype):
        return data
    if isinstance(data, Tensor):
        return data.to(dt.get(dtype))
    return tensor(data, dtype=dtype, device=device)


def from_numpy(array: np.ndarray) -> Tensor:
    """A tensor sharing `array`'s memory when it is contiguous (dtype kept, float64 included)."""
    array = np.asarray(array)
    return _make(array, dt.from_numpy(array.dtype), None, False)


def from_dlpack(ext) -> Tensor:
    """A tensor sharing the memory of any DLPack producer on the CPU (``torch`` tensors, NumPy arrays)."""
    return from_numpy(np.from_dlpack(ext))


# ------------------------------------------------------------------ constant fills
def _fill(size_args, value, dtype, device, requires_grad, default=dt.float32, name="full"):
    size = _size(size_args, name)
    target = dt.get(dtype) if dtype is not None else default
    arr = np.full(size, value, dtype=target.np_dtype) if value != 0 else np.zeros(size, target.np_dtype)
    return _make(arr, target, device, requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad=False, **keyword) -> Tensor:
    return _fill(keyword_sizes(size, keyword, ("size",), "zeros"), 0, dtype, device, requires_grad, name="zeros")


def ones(*size, dtype=None, device=None, requires_grad=False, **keyword) -> Tensor:
    return _fill(keyword_sizes(size, keyword, ("size",), "ones"), 1, dtype, device, requires_grad, name="ones")


def empty(*size, dtype=None, device=None, requires_grad=False, **keyword) -> Tensor:
    """Uninitialised in PyTorch; zeros here (NumPy gives no cheaper safe choice)."""
    return _fill(keyword_sizes(size, keyword, ("size",), "empty"), 0, dtype, device, requires_grad, name="empty")


def _scalar_dtype(value):
    if isinstance(value, Tensor):
        return value.dtype
    return dt.default_for_scalar(value.item() if isinstance(value, np.generic) else value)


def full(size, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    if isinstance(fill_value, Tensor):
        fill_value = fill_value.item()
    default = _scalar_dtype(fill_value)
    return _fill((size,) if isinstance(size, numbers.Integral) else (tuple(size),), fill_value, dtype, device,
                 requires_grad, default=default, name="full")


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad=False) -> Tensor:
    if end is None:
        start, end = 0, start
    values = [v.item() if isinstance(v, (Tensor, np.generic)) else v for v in (start, end, step)]
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    is_int = builtins.all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
    default = dt.int64 if is_int else dt.float32
    target = dt.get(dtype) if dtype is not None else default
    arr = np.arange(*values, dtype=np.float64 if not is_int else np.int64)
    return _make(arr, target, device, requires_grad)


def linspace(start, end, steps, dtype=None, device=None, requires_grad=False) -> Tensor:
    arr = np.linspace(float(start), float(end), int(steps))
    return _make(arr, dtype if dtype is not None else dt.float32, device, requires_grad)


def eye(n, m=None, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _make(np.eye(int(n), int(m) if m is not None else None), dtype if dtype is not None else dt.float32,
                 device, requires_grad)


# ------------------------------------------------------------------ random
def _refuse_generator_in_build(name: str, generator):
    """An explicit NumPy generator has no kernel: inside build() it would freeze one draw."""
    if generator is not None and registry._tracer_hook is not None:
        raise TraceError(f"flow.{name}(generator=...) inside nn.Graph.build(): a NumPy generator cannot run in a "
                         f"compiled graph; drop generator= (the graph then draws from flowgen's Philox stream, "
                         f"as eager mode does) or draw the tensor outside build() and pass it in")


def _draw(op: str, device, requires_grad: bool, **attrs) -> Tensor:
    """Run random op `op` on the next Philox offset (a graph node inside build(), see ops/random_ops.py)."""
    seed, offset = _random.next_dropout_seed()
    out = apply(op, seed=seed, offset=offset, **attrs)
    if not out.is_lazy and device is not None:
        out.device = as_device(device)
    if requires_grad and not out.dtype.is_floating:
        raise RuntimeError(f"only floating point tensors can require gradients, got {out.dtype!r}")
    return out.requires_grad_() if requires_grad else out


def _random_dtype(dtype, default=dt.float32):
    return dt.get(dtype) if dtype is not None else default


def randn(*size, dtype=None, device=None, requires_grad=False, generator=None, **keyword) -> Tensor:
    """Standard normal samples (ops/random_ops.py: Box-Muller over the Philox stream); the sizes
    positionally or as ``size=``."""
    return normal(0.0, 1.0, _size(keyword_sizes(size, keyword, ("size",), "randn"), "randn"), dtype=dtype, device=device, requires_grad=requires_grad,
                  generator=generator)


def rand(*size, dtype=None, device=None, requires_grad=False, generator=None, **keyword) -> Tensor:
    """Uniform samples in [0, 1); the sizes positionally or as ``size=``."""
    shape = _size(keyword_sizes(size, keyword, ("size",), "rand"), "rand")
    _refuse_generator_in_build("rand", generator)
    if generator is not None:
        return _make(generator.random(shape, dtype=np.float32), _random_dtype(dtype), device, requires_grad)
    return _draw("random_uniform", device, requires_grad, shape=shape, dtype=_random_dtype(dtype), low=0.0, high=1.0)


def uniform(size, low=0.0, high=1.0, dtype=None, device=None) -> Tensor:
    """Uniform samples in [low, high) (`Tensor.uniform_`), computed in double then rounded to `dtype`."""
    return _draw("random_uniform", device, False, shape=_size((tuple(size),), "uniform"),
                 dtype=_random_dtype(dtype), low=float(low), high=float(high))


def normal(mean=0.0, std=1.0, size=(), dtype=None, device=None, requires_grad=False, generator=None,
           out=None) -> Tensor:
    """Normal(mean, std) samples of `size`; with ``out=`` they are written into `out` (as OneFlow)."""
    shape = _size((size,) if isinstance(size, int) else (tuple(size),), "normal")
    _refuse_generator_in_build("normal", generator)
    if generator is not None:
        result = _make(generator.normal(float(mean), float(std), shape), _random_dtype(dtype), device, requires_grad)
    else:
        result = _draw("random_normal", device, requires_grad, shape=shape,
                       dtype=_random_dtype(dtype if dtype is not None or out is None else out.dtype),
                       mean=float(mean), std=float(std))
    return result if out is None else out.copy_(result)


def randint(*args, low=None, high=None, size=None, dtype=None, device=None, requires_grad=False,
            generator=None) -> Tensor:
    """``randint(high, size)`` or ``randint(low, high, size)`` (any of them by keyword): ints in
    [low, high), int64 by default."""
    args = list(args)
    if high is not None:              # randint(low=0, high=10, size=...), randint(0, high=10, size=...)
        low = low if low is not None else (args.pop(0) if args else 0)
        args = [low, high] + args
    elif low is not None:
        raise TypeError("randint: low= given without high=")
    if size is None:
        if not args:
            raise TypeError("randint: missing size")
        size = args.pop()
    if len(args) == 1:
        low, high = 0, args[0]
    elif len(args) == 2:
        low, high = args
    else:
        raise TypeError("randint(high, size) or randint(low, high, size)")
    if int(high) <= int(low):
        raise ValueError(f"randint: empty range [{low}, {high})")
    shape = _size((size,) if isinstance(size, int) else (tuple(size),), "randint")
    _refuse_generator_in_build("randint", generator)
    if generator is not None:
        arr = generator.integers(int(low), int(high), size=shape, dtype=np.int64)
        return _make(arr, _random_dtype(dtype, dt.int64), device, requires_grad)
    return _draw("random_int", device, requires_grad, shape=shape, dtype=_random_dtype(dtype, dt.int64),
                 low=int(low), high=int(high))


def randperm(n, dtype=None, device=None, generator=None) -> Tensor:
    """A random permutation of 0..n-1 (Fisher-Yates over the Philox stream, ops/random_ops.py)."""
    _refuse_generator_in_build("randperm", generator)
    if generator is not None:
        return _make(generator.permutation(int(n)).astype(np.int64), _random_dtype(dtype, dt.int64), device, False)
    out = _draw("randperm", device, False, n=int(n))
    return out if dtype is None else out.to(dt.get(dtype))


def bernoulli(input, p=None, generator=None) -> Tensor:
    """1 with probability `p` (default: the values of `input`), else 0, in `input`'s dtype:
    ``rand_like(input) < p``, so graphs draw the same mask as eager mode."""
    _refuse_generator_in_build("bernoulli", generator)
    if generator is not None:
        probs = np.broadcast_to(input.numpy_view() if p is None else p, tuple(input.shape))
        return _make(generator.random(probs.shape) < probs, input.dtype, input.device, False)
    u = rand(tuple(input.shape), dtype=dt.float32, device=input.device)
    return (u < (input if p is None else p)).to(input.dtype)


def seed() -> int:
    """Reseed from fresh entropy; returns the new seed."""
    s = int(np.random.SeedSequence().entropy) & 0xFFFFFFFFFFFFFFFF
    return manual_seed(s)


# ------------------------------------------------------------------ *_like
def _refuse_global(name, t):
    if isinstance(t, Tensor) and t.is_global:
        raise NotImplementedError(f"flowgen has no {name} of a global tensor (each rank would draw different "
                                  f"random values); draw a local tensor with the same seed on every rank and "
                                  f"make it global with to_global(placement, flow.sbp.broadcast)")


def _like(t, dtype, device):
    return (dt.get(dtype) if dtype is not None else t.dtype,
            device if device is not None else t.device)


def _filled_like(t, value, dtype, device, requires_grad) -> Tensor:
    """full_like's work: a global `t` gives a global constant with its placement (and sbp,
    global_tensor.filled_like), as OneFlow does."""
    d, dev = _like(t, dtype, device)
    if isinstance(t, Tensor) and t.is_global:
        if device is not None:
            raise ValueError(f"a *_like of a global tensor takes its placement; got device={device!r}")
        def fill(shape):
            return full(shape, value, dtype=d, device=t._global.local.device, requires_grad=requires_grad)

        return global_tensors().filled_like(t, fill)
    return full(tuple(t.shape), value, dtype=d, device=dev, requires_grad=requires_grad)


def zeros_like(t, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled_like(t, 0, dtype, device, requires_grad)


def ones_like(t, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled_like(t, 1, dtype, device, requires_grad)


def empty_like(t, dtype=None, device=None, requires_grad=False) -> Tensor:
    return zeros_like(t, dtype=dtype, device=device, requires_grad=requires_grad)


def full_like(t, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    if isinstance(fill_value, Tensor):
        fill_value = fill_value.item()
    return _filled_like(t, fill_value, dtype, device, requires_grad)


def randn_like(t, dtype=None, device=None, requires_grad=False) -> Tensor:
    _refuse_global("randn_like", t)
    d, dev = _like(t, dtype, device)
    return randn(tuple(t.shape), dtype=d, device=dev, requires_grad=requires_grad)


def rand_like(t, dtype=None, device=None, requires_grad=False) -> Tensor:
    _refuse_global("rand_like", t)
    d, dev = _like(t, dtype, device)
    return rand(tuple(t.shape), dtype=d, device=dev, requires_grad=requires_grad)


def randint_like(t, low, high=None, dtype=None, device=None) -> Tensor:
    _refuse_global("randint_like", t)
    d, dev = _like(t, dtype, device)
    if high is None:
        low, high = 0, low
    return randint(low, high, tuple(t.shape), dtype=d, device=dev)


# ------------------------------------------------------------------ flow.cuda
class cuda:  # noqa: N801 - `flow.cuda.is_available()`
    """`flow.cuda`: whether compiled graphs can run on a GPU here."""

    @staticmethod
    def is_available() -> bool:
        try:  # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load
            from flowgen.runtime import cuda_driver
        except ImportError:
            return False
        try:
            return bool(cuda_driver.available())
        except Exception:  # noqa: BLE001 - a broken driver means "not available"
            return False

    @staticmethod
    def device_count() -> int:
        if not cuda.is_available():
            return 0
        # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load.
        from flowgen.runtime import cuda_driver

        count = getattr(cuda_driver, "device_count", None)
        return int(count()) if callable(count) else 1

    @staticmethod
    def manual_seed(seed: int):
        return manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def synchronize(device=None):
        """Eager work is synchronous; compiled graphs synchronise when their results are read."""
        return None
