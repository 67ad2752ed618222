"""Random ops: numbers drawn from the counter-based Philox stream of `flowgen/random.py`.

Each op reads the stream ``(seed, offset)`` its caller drew with `random.next_dropout_seed()`
(one offset per call, shared with dropout), and element ``i`` depends only on ``i``: a kernel
computes any element on its own, so a compiled graph draws exactly the numbers eager mode
draws for the same seed and call sequence. In a graph, `passes/random_streams.py` rewrites
``offset`` relative to the per-call rng state named by the ``stream`` attribute.

* ``random_uniform(shape, dtype, low, high)``: ``low + (high - low) * u[i]`` with ``u[i]``
  the float32 uniform of word ``i``; exactly ``u[i]`` for [0, 1).
* ``random_normal(shape, dtype, mean, std)``: Box-Muller over words ``2i`` and ``2i + 1``
  in double, ``mean + std * sqrt(-2 log(1 - u[2i])) * cos(2 pi u[2i+1])``, then rounded
  to ``dtype``. (The uniforms have 24 bits, so ``|z| <= 5.77``.)
* ``random_int(shape, dtype, low, high)``: ``low + ((w[2i] << 32) | w[2i+1]) mod (high - low)``.
* ``randperm(n)``: Fisher-Yates from the top, ``p[i] <-> p[j]`` with
  ``j = ((w[2i] << 32) | w[2i+1]) mod (i + 1)`` for ``i = n-1 .. 1``. A shuffle is
  sequential: its kernel (template family ``randperm``) runs on one GPU thread, fine for
  the index permutations graphs draw (batch shuffles), slow for millions of elements.

Bit-for-bit agreement: uniforms and integers are exact. Normal samples and uniforms over
other bounds go through double math (log, cos, a multiply-add) rounded to the output dtype:
in float32 the graph equals eager unless the double results of NumPy and the device
libraries straddle a float32 rounding boundary (their last double bits can differ, about one
element in 2^29); float64 outputs may differ in the last bit.

Bernoulli draws (`flow.bernoulli`, `Tensor.bernoulli_`, the drop-path mask) are
``random_uniform(...) < p`` built from these ops in `flowgen/creation.py`.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen.ops.lowering import Elementwise, Template, cpp_literal
from flowgen.ops.registry import TensorMeta, defop
from flowgen.random import philox_uint32, uniform_from_words


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _word_pairs(seed, offset, n) -> np.ndarray:
    """uint64 ``(w[2i] << 32) | w[2i+1]`` for i < n."""
    words = philox_uint32(seed, offset, 2 * n).astype(np.uint64).reshape(n, 2)
    return (words[:, 0] << np.uint64(32)) | words[:, 1]


def _sample_infer(op, floating):
    def infer(shape, dtype, seed, offset, stream=None, **bounds):
        if floating and not dtype.is_floating:
            raise TypeError(f"{op}: dtype must be a floating point type, got {dtype!r}")
        if any(int(s) < 0 for s in shape):
            raise ValueError(f"{op}: negative size in {tuple(shape)}")
        return TensorMeta(tuple(shape), dtype)
    return infer


def _stream_call(function: str, extra: str = "") -> str:
    return f"{function}({{seed}}, {{offset}}, {{idx}}{extra})"


# `stream` (a graph's rng state name, passes/random_streams.py) only matters to kernels: the
# references use the seed and offset attributes as given.

def _uniform_ref(shape, dtype, low, high, seed, offset, stream=None):
    u = uniform_from_words(philox_uint32(seed, offset, _numel(shape))).reshape(shape)
    if (low, high) == (0.0, 1.0):
        return u.astype(dtype.np_dtype)
    return (np.float64(low) + np.float64(high - low) * u.astype(np.float64)).astype(dtype.np_dtype)


def _uniform_expr(attrs) -> str:
    u = _stream_call("flowgen_philox_uniform")
    low, high = float(attrs["low"]), float(attrs["high"])
    if (low, high) == (0.0, 1.0):
        return u
    return f"({cpp_literal(low, True)} + {cpp_literal(high - low, True)} * (double){u})"


defop("random_uniform", infer=_sample_infer("random_uniform", True), ref=_uniform_ref,
      lowering=Elementwise(_uniform_expr), random=True,
      doc="random_uniform(shape, dtype, low, high, seed, offset): low + (high - low) * philox_uniform[idx]")


def _normal_ref(shape, dtype, mean, std, seed, offset, stream=None):
    n = _numel(shape)
    u = uniform_from_words(philox_uint32(seed, offset, 2 * n)).astype(np.float64).reshape(n, 2)
    z = np.sqrt(-2.0 * np.log(1.0 - u[:, 0])) * np.cos(2 * math.pi * u[:, 1])
    return (np.float64(mean) + np.float64(std) * z).astype(dtype.np_dtype).reshape(shape)


defop("random_normal", infer=_sample_infer("random_normal", True), ref=_normal_ref,
      lowering=Elementwise(lambda attrs: f"({cpp_literal(float(attrs['mean']), True)} + "
                                         f"{cpp_literal(float(attrs['std']), True)} * "
                                         f"{_stream_call('flowgen_philox_normal')})"),
      random=True, doc="random_normal(shape, dtype, mean, std, seed, offset): Box-Muller in double")


def _int_infer(shape, dtype, low, high, seed, offset, stream=None):
    if int(high) <= int(low):
        raise ValueError(f"random_int: empty range [{low}, {high})")
    return _sample_infer("random_int", False)(shape, dtype, seed, offset)


def _int_ref(shape, dtype, low, high, seed, offset, stream=None):
    r = _word_pairs(seed, offset, _numel(shape)) % np.uint64(int(high) - int(low))
    return (np.int64(low) + r.astype(np.int64)).astype(dtype.np_dtype).reshape(shape)


def _int_expr(attrs) -> str:
    span = int(attrs["high"]) - int(attrs["low"])
    return f"({cpp_literal(int(attrs['low']))} + (long long){_stream_call('flowgen_philox_below', f', {span}ULL')})"


defop("random_int", infer=_int_infer, ref=_int_ref, lowering=Elementwise(_int_expr),
      random=True, doc="random_int(shape, dtype, low, high, seed, offset): low + philox pair mod (high - low)")


def _randperm_infer(n, seed, offset, stream=None):
    if int(n) < 0:
        raise ValueError(f"randperm: n must be non-negative, got {n}")
    return TensorMeta((int(n),), dt.int64)


def _randperm_ref(n, seed, offset, stream=None):
    n = int(n)
    perm = np.arange(n, dtype=np.int64)
    pairs = _word_pairs(seed, offset, n)
    for i in range(n - 1, 0, -1):
        j = int(pairs[i] % np.uint64(i + 1))
        perm[i], perm[j] = perm[j], perm[i]
    return perm


defop("randperm", infer=_randperm_infer, ref=_randperm_ref, lowering=Template("randperm"), random=True,
      doc="randperm(n, seed, offset): Fisher-Yates over philox pairs, one thread")
