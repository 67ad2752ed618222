"""Random state: the Philox4x32-10 stream of random ops and dropout, and the NumPy generator
of weight initialisers.

Two sources, both reset by `manual_seed(seed)`:

* `philox_uniform(seed, offset, n)` — a counter-based stream, defined below bit
  for bit, so a CUDA kernel can regenerate exactly the numbers eager mode used.
  `next_dropout_seed()` hands out ``(seed, offset)`` pairs: the seed is the one
  given to `manual_seed`, the offset counts random calls since then (dropout and
  the random ops of `flowgen/ops/random_ops.py`: `rand`, `randn`, `normal`,
  `randint`, `randperm`, `bernoulli`, ...). A compiled graph draws its offsets from
  the same counter on every call, so graph and eager numbers agree.
* `generator()` — a NumPy ``Generator`` (PCG64) used by weight initialisers
  (`flow.nn.init`), the data loader's shuffling and creation functions given an
  explicit NumPy ``generator=``.

`get_rng_state()` / `set_rng_state(state)` save and restore both (a graph's
`state_dict()` carries it, so a resumed run draws the numbers an uninterrupted
one would).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC'11), the standard constants::

    M0 = 0xD2511F53   M1 = 0xCD9E8D57      (round multipliers)
    W0 = 0x9E3779B9   W1 = 0xBB67AE85      (key schedule increments)

    round((c0, c1, c2, c3), (k0, k1)):
        hi0:lo0 = M0 * c0      (32x32 -> 64-bit product, hi/lo halves)
        hi1:lo1 = M1 * c2
        return (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

    philox(c, k): 10 rounds; before rounds 2..10 the key is bumped
        k0 += W0, k1 += W1 (mod 2^32). The result is four uint32 words.

The flowgen uniform stream ``philox_uniform(seed, offset, n)``; element ``i``
(0 <= i < n, n < 2^34) is::

    key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)      # seed as uint64
    counter = (i >> 2, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF, 0)
    r       = philox(counter, key)[i & 3]                         # word i % 4
    u[i]    = (float)(r >> 8) * 2^-24                             # in [0, 1), exact in float32

So one Philox call yields elements 4j..4j+3, and each ``offset`` (one per
dropout call) owns a disjoint counter range whatever n is.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.tensor import Tensor

_DEFAULT_SEED = 67280421310721  # PyTorch's default; any fixed value keeps runs reproducible
_MASK32 = np.uint64(0xFFFFFFFF)

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85

_seed = _DEFAULT_SEED
_offset = 0
_generator = np.random.default_rng(_DEFAULT_SEED)


def manual_seed(seed: int):
    """Reseed every flowgen random source (creation functions, init, dropout)."""
    global _seed, _offset, _generator
    seed = int(seed)
    _seed = seed & 0xFFFFFFFFFFFFFFFF
    _offset = 0
    _generator = np.random.default_rng(_seed)
    return _seed


def initial_seed() -> int:
    return _seed


def generator() -> np.random.Generator:
    """The global NumPy generator (changes identity on `manual_seed`; don't cache it)."""
    return _generator


def next_dropout_seed() -> tuple:
    """``(seed, offset)`` for the next random call (dropout or a random op); advances the offset by one."""
    global _offset
    pair = (_seed, _offset)
    _offset += 1
    return pair


def philox4x32_10(counter, key):
    """Philox4x32-10 on arrays: ``counter`` is 4 uint32 arrays (broadcastable), ``key`` 2 uint32s.

    Returns four uint32 arrays.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counter)
    k0, k1 = (int(k) & 0xFFFFFFFF for k in key)
    m0, m1 = np.uint64(M0), np.uint64(M1)
    shift = np.uint64(32)
    for r in range(10):
        if r:
            k0 = (k0 + W0) & 0xFFFFFFFF
            k1 = (k1 + W1) & 0xFFFFFFFF
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & _MASK32,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & _MASK32)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def philox_uint32(seed: int, offset: int, n: int) -> np.ndarray:
    """The raw uint32 words of the stream (see the module docstring)."""
    n = int(n)
    if n >= 1 << 34:
        raise ValueError(f"philox stream: n={n} is too large (limit 2^34 elements per call)")
    seed, offset = int(seed) & 0xFFFFFFFFFFFFFFFF, int(offset) & 0xFFFFFFFFFFFFFFFF
    blocks = (n + 3) // 4
    j = np.arange(blocks, dtype=np.uint64)
    words = philox4x32_10((j, offset & 0xFFFFFFFF, offset >> 32, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return np.stack(words, axis=1).reshape(-1)[:n]


def uniform_from_words(r: np.ndarray) -> np.ndarray:
    """Stream words -> float32 uniforms in [0, 1): ``(r >> 8) * 2^-24`` (exact)."""
    return ((r >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)).astype(np.float32)


def philox_uniform(seed: int, offset: int, n: int) -> np.ndarray:
    """``n`` float32 uniforms in [0, 1): element i as defined in the module docstring."""
    return uniform_from_words(philox_uint32(seed, offset, n))


# get_rng_state() layout: int64 words (uint64 bit patterns); 128-bit PCG64 values as lo, hi.
_STATE_WORDS = ("seed", "offset", "pcg_state_lo", "pcg_state_hi", "pcg_inc_lo", "pcg_inc_hi",
                "pcg_has_uint32", "pcg_uinteger")


def get_rng_state():
    """The whole random state as an int64 tensor of 8 words: the Philox seed and offset, then the
    NumPy generator's PCG64 state (see `_STATE_WORDS`). `set_rng_state` restores it."""
    pcg = _generator.bit_generator.state
    if pcg["bit_generator"] != "PCG64":
        raise RuntimeError(f"get_rng_state: the NumPy generator is {pcg['bit_generator']}, expected PCG64")
    mask64 = (1 << 64) - 1
    words = [_seed, _offset, pcg["state"]["state"] & mask64, pcg["state"]["state"] >> 64,
             pcg["state"]["inc"] & mask64, pcg["state"]["inc"] >> 64, int(pcg["has_uint32"]), pcg["uinteger"]]
    return Tensor(np.array(words, dtype=np.uint64).view(np.int64), dtype=dt.int64)


def set_rng_state(state):
    """Restore a state from `get_rng_state()` (a tensor or array of 8 int64 words)."""
    words = np.asarray(state.numpy_view() if isinstance(state, Tensor) else state)
    if words.shape != (len(_STATE_WORDS),) or words.dtype != np.int64:
        raise ValueError(f"set_rng_state: expected the int64[{len(_STATE_WORDS)}] tensor get_rng_state() returns, "
                         f"got {words.dtype}{list(words.shape)}")
    global _seed, _offset, _generator
    w = [int(x) for x in words.view(np.uint64)]
    _seed, _offset = w[0], w[1]
    generator = np.random.Generator(np.random.PCG64())
    generator.bit_generator.state = {"bit_generator": "PCG64",
                                     "state": {"state": w[2] | (w[3] << 64), "inc": w[4] | (w[5] << 64)},
                                     "has_uint32": w[6], "uinteger": w[7]}
    _generator = generator


class preserved_dropout_stream:
    """Context manager: restore the dropout offset afterwards (tracing must not consume the stream)."""

    def __enter__(self):
        self._saved = _offset

    def __exit__(self, *exc):
        global _offset
        _offset = self._saved
        return False
