"""Automatic mixed precision: which dtype each op runs in under autocast.

`graph.config.enable_amp(True, dtype=flow.bfloat16 | flow.float16)` (nn.Graph) and the eager
context manager `flow.autocast(device_type, dtype)` (= `flow.amp.autocast`) both read this module:
the tracer of build() (ir/trace.py) and the eager context push the autocast dtype, and
`registry.apply`, the one entry point of eager and traced ops alike, asks `plan()` for every op run
while one is active and casts the op's inputs as it says. Each op declares its class with its
defop (``autocast=``, flowgen/ops/registry.py PROPERTIES), following PyTorch's CUDA autocast lists
(aten/src/ATen/autocast_mode.cpp; a composite such as F.linear, F.mse_loss or F.group_norm follows
from its ops):

* "lower_precision" (matmul, the convolutions, attention): floating inputs (float32, and the other 16-bit type; never float64) are cast to
  the autocast dtype and the result stays in it: the GEMM / conv / attention kernels accumulate in
  float32 and store 16 bits. `F.linear` and the convolutions cast their bias too (PyTorch's linear
  and conv take all three operands in the autocast dtype), so the bias add stays 16-bit.
* "float32": 16-bit inputs are cast up to float32 and the result is float32 (softmax, log_softmax,
  cross entropy, layer_norm, exp/log/pow and friends, sum, cumsum/cumprod; and mean, which PyTorch
  computes in float32 inside its norm and loss kernels: BatchNorm's statistics and mse are means).
* None, every other op, runs in its inputs' dtypes (BatchNorm of a 16-bit input with float32 parameters
  computes in float32 and keeps the input's dtype, as PyTorch's batch_norm); a binary op of a
  16-bit and a float32 tensor promotes to float32 (add, mul, where, cat: PyTorch's type promotion,
  and its autocast "promote" list, which only names ops that do not promote by themselves).

Parameters stay float32: a 16-bit copy is a `cast` node whose gradient casts back, so every
parameter's gradient is float32; activation gradients flowing back through 16-bit activations are
16-bit, as in PyTorch.

How the casts land in a graph's kernels, gradient dtypes, memory and the AMP tests:
docs/mixed_precision.md.
"""
from __future__ import annotations

import contextlib
import functools

from flowgen import dtype as dt

LOW_DTYPES = (dt.float16, dt.bfloat16)

_active: list = [None]    # a stack: the autocast dtype now (None: off), innermost last


def active():
    """The autocast dtype in force (float16 or bfloat16), or None."""
    return _active[-1]


def push(dtype) -> None:
    """Enter an autocast region (`dtype` None: a region with autocast off, e.g. the gradient
    formulas traced while build() runs)."""
    if dtype is not None and dtype not in LOW_DTYPES:
        raise ValueError(f"autocast: dtype must be flow.float16 or flow.bfloat16, got {dtype}")
    _active.append(dtype)


def pop() -> None:
    _active.pop()


@contextlib.contextmanager
def disabled():
    """Autocast off inside (eager backward: gradient formulas run in the dtypes the forward chose)."""
    push(None)
    try:
        yield
    finally:
        pop()


def _is_castable(dtype) -> bool:
    return dtype in LOW_DTYPES or dtype == dt.float32


def plan(op, dtypes: list, low) -> tuple | None:
    """The dtype each input of `op` (an OpDef; inputs of `dtypes`) is cast to under autocast to `low`;
    None when it runs as given (no autocast class, or its inputs already have the dtypes its class asks for)."""
    autocast = op.extra["autocast"]
    if autocast == "lower_precision":
        inputs = tuple(low if _is_castable(d) else d for d in dtypes)
    elif autocast == "float32":
        inputs = tuple(dt.float32 if d in LOW_DTYPES else d for d in dtypes)
    else:
        return None
    return None if inputs == tuple(dtypes) else inputs


def run(dtypes: tuple, op_name: str, tensors, attrs: dict, apply):
    """Op `op_name` on `tensors` under autocast: the inputs cast to `dtypes` (what `plan()` gave;
    `cast` ops, which in a graph fuse into the loads of the kernel reading them), the op applied by
    `apply` (registry.apply: eager or traced)."""
    return apply(op_name, *(t if t.dtype == d else apply("cast", t, dtype=d) for t, d in zip(tensors, dtypes)),
                 **attrs)


class autocast:  # noqa: N801 - PyTorch's name
    """`with flow.autocast("cuda", dtype=flow.bfloat16):` (also `flow.amp.autocast`, and a
    decorator): eager ops in the block run in the dtypes their autocast classes give them, as under
    torch.autocast; `loss.backward()` runs its gradient formulas with autocast off, in the dtypes
    the forward chose. A graph traces build() with the config's autocast dtype (`enable_amp`, or
    none) whatever region the graph is called in; an autocast block inside build() applies to the
    ops in it, as in eager code. `device_type` is "cuda" or "cpu" (the classes are the same for both;
    the default dtype is float16 for "cuda" and bfloat16 for "cpu", as PyTorch's); `enabled=False`
    turns autocast off inside the block. `cache_enabled` is taken for PyTorch's signature: it caches
    weight casts there and changes no number."""

    def __init__(self, device_type: str, dtype=None, enabled: bool = True, cache_enabled=None):
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"autocast: device_type must be 'cuda' or 'cpu', got {device_type!r}")
        dtype = dtype if dtype is not None else (dt.float16 if device_type == "cuda" else dt.bfloat16)
        if dtype not in LOW_DTYPES:
            raise ValueError(f"autocast: dtype must be flow.float16 or flow.bfloat16, got {dtype}")
        self.dtype = dtype if enabled else None

    def __enter__(self):
        push(self.dtype)
        return self

    def __exit__(self, *exc):
        pop()
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapped
