"""What a program is rendered for: the target's block count, and the cpu target's one-thread blocks.

`rendering_for(target)` sets these while a program is built (codegen/program.py); the kernel
renderers (codegen/families.py, codegen/fused.py) read them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

# Blocks that fill the device a program is rendered for: an H100 (132 SMs, two resident tiles
# each), or the CPU emulator, which runs blocks on its cores and pays per thread switch, so few
# large tiles are best there. `rendering_for(target)` sets it while a program is built.
TARGET_BLOCKS = {"cuda": 264, "cpu": 2 * (os.cpu_count() or 1)}
_target_blocks = contextvars.ContextVar("target_blocks", default=TARGET_BLOCKS["cuda"])
# Whether float32 GEMMs may run on tensor cores in TF32 (`graph.config.allow_tf32`).
_allow_tf32 = contextvars.ContextVar("allow_tf32", default=False)
# Whether SIMT GEMM tiles (gemm, implicit-GEMM conv; _gemm_tile_cpu.j2) and reductions run one
# thread per block with no shared memory or barriers: on the emulator a block of synchronising
# threads runs as fibers, its slowest path. The GPU's kernels still run on the emulator when a
# program is rendered for "cuda" (tests, FLOWGEN_EMULATE_CUDA).
_serial_blocks = contextvars.ContextVar("serial_blocks", default=False)


def target_blocks() -> int:
    return _target_blocks.get()


def allow_tf32() -> bool:
    return _allow_tf32.get()


def serial_blocks() -> bool:
    return _serial_blocks.get()


@contextlib.contextmanager
def rendering_for(target: str, allow_tf32: bool = False, serial_blocks: bool = None):
    """Tile shapes, reduction splits and row layouts are chosen for `target` ("cuda" or "cpu");
    `allow_tf32` lets float32 GEMMs run on tensor cores with TF32 inputs; `serial_blocks`
    (default: on for "cpu") renders SIMT GEMM tiles (_gemm_tile_cpu.j2) and reductions as one
    thread per block."""
    token = _target_blocks.set(TARGET_BLOCKS[target])
    tf32_token = _allow_tf32.set(bool(allow_tf32))
    serial_token = _serial_blocks.set(target == "cpu" if serial_blocks is None else serial_blocks)
    try:
        yield
    finally:
        _serial_blocks.reset(serial_token)
        _allow_tf32.reset(tf32_token)
        _target_blocks.reset(token)
