"""What a program is rendered for: the target's block count, the cpu target's one-thread blocks,
and the GPU architecture the CUDA program is for (which tensor-core instructions it may use); and
the launch shapes every kernel renderer derives from them (`block_segments`, `reduce_block`).

`rendering_for(target)` sets these while a program is built (codegen/program.py); the kernel
renderers (codegen/kernels/, codegen/fused.py) read them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

from flowgen.runtime.cpu_compiler import emulator_check

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
# The GPU architecture ("sm_90", ...) a 'cuda' program is rendered for, or None: any sm_80 or newer.
# On sm_90, tensor-core GEMMs and convs (bf16/fp16, tf32 under allow_tf32) use Hopper's warpgroup
# MMA (wgmma, _wgmma.j2; NVRTC compiles them for sm_90a); elsewhere mma.sync (_mma.j2). The
# emulator runs both.
_cuda_arch = contextvars.ContextVar("cuda_arch", default=None)
# Whether the cpu target renders the nodes codegen/cpu/ has native kernels for (GEMMs, convs
# through OpenBLAS) instead of running their CUDA kernels on the emulator (`native_cpu_kernels`).
_native_kernels = contextvars.ContextVar("native_kernels", default=False)
# Whether GEMMs, convs and attention may use tensor cores at all (off: their SIMT kernels, which the
# runtime's tensor-core check compares against and falls back to: runtime/tensor_core_check.py).
_tensor_cores = contextvars.ContextVar("tensor_cores", default=True)

# A step with dynamic dimensions renders each size with the kernel forms chosen for the maximum
# sizes (`forms_chosen_at`): {value name: its shape at the maximum}, or None.
_choice_shapes = contextvars.ContextVar("choice_shapes", default=None)

REDUCE_ELEMS_PER_THREAD = 8
SEGMENT_MAX_BLOCKS = 1024   # blocks per segment of a multi-tensor kernel (they stride beyond)

def target_blocks() -> int:
    return _target_blocks.get()


def allow_tf32() -> bool:
    return _allow_tf32.get()


def serial_blocks() -> bool:
    return _serial_blocks.get()


def tensor_cores() -> bool:
    return _tensor_cores.get()


def native_kernels() -> bool:
    return _native_kernels.get()


CPU_KERNELS = ("native", "emulator")


def native_cpu_kernels() -> bool:
    """Whether a 'cpu' program gets native kernels where codegen/cpu/ has them: `$FLOWGEN_CPU_KERNELS`
    is "native" (the default: speed) or "emulator" (every kernel the CUDA source on the emulator,
    to check that source). The checking emulator (`$FLOWGEN_EMULATOR_CHECK=1`) checks CUDA
    kernels only, so it gets every kernel as CUDA."""
    value = os.environ.get("FLOWGEN_CPU_KERNELS", "native").strip() or "native"
    if value not in CPU_KERNELS:
        raise ValueError(f"FLOWGEN_CPU_KERNELS={value!r}: must be one of {', '.join(CPU_KERNELS)}")
    return value == "native" and not emulator_check()


def warpgroup_mma() -> bool:
    """Whether GEMMs and convs may use Hopper's warpgroup MMA (the program is rendered for sm_90)."""
    return _cuda_arch.get() in ("sm_90", "sm_90a")


@contextlib.contextmanager
def rendering_for(target: str, allow_tf32: bool = False, serial_blocks: bool = None, arch: str = None,
                  tensor_cores: bool = True, native: bool = False):
    """Tile shapes, reduction splits and row layouts are chosen for `target` ("cuda" or "cpu");
    `allow_tf32` lets float32 GEMMs run on tensor cores with TF32 inputs; `serial_blocks`
    (default: on for "cpu") renders SIMT GEMM tiles (_gemm_tile_cpu.j2) and reductions as one
    thread per block; `arch` ("sm_90", ...; "cuda" only) is the GPU the program is for (None:
    any sm_80 or newer); `tensor_cores=False` renders every GEMM, conv and attention as its SIMT
    kernel (16-bit attention as a thread per row); `native` ("cpu" only) renders GEMMs and convs as
    native kernels (codegen/cpu/) where they have one."""
    if native and target != "cpu":
        raise ValueError(f"rendering_for: native kernels are for the 'cpu' target, not {target!r}")
    if arch is not None and target != "cuda":
        raise ValueError(f"rendering_for: arch={arch!r} is for the 'cuda' target, not {target!r}")
    token = _target_blocks.set(TARGET_BLOCKS[target])
    arch_token = _cuda_arch.set(arch)
    tf32_token = _allow_tf32.set(bool(allow_tf32))
    serial_token = _serial_blocks.set(target == "cpu" if serial_blocks is None else serial_blocks)
    tensor_cores_token = _tensor_cores.set(bool(tensor_cores))
    native_token = _native_kernels.set(bool(native))
    try:
        yield
    finally:
        _native_kernels.reset(native_token)
        _tensor_cores.reset(tensor_cores_token)
        _cuda_arch.reset(arch_token)
        _serial_blocks.reset(serial_token)
        _allow_tf32.reset(tf32_token)
        _target_blocks.reset(token)


@contextlib.contextmanager
def forms_chosen_at(graph):
    """Render kernels with the forms (tile shapes, a direct or a tiled GEMM) chosen for the shapes
    of `graph`'s values of the same names, not their own: codegen/dynamic.py renders a step at
    other sizes than its maximum (`graph`, the base Program's IR), and fits the renderings only
    when they are one program but for sizes. Only choices that hold at any size read these shapes
    (a tile's bounds checks cover any extent); an alignment's does not."""
    shapes = None if graph is None else _value_shapes(graph)
    token = _choice_shapes.set(shapes)
    try:
        yield
    finally:
        _choice_shapes.reset(token)


def _value_shapes(graph) -> dict:
    """{name: shape} of every value `graph` holds, fused nodes' inner ones too."""
    shapes = {v.name: tuple(v.shape) for v in list(graph.inputs) + [s.value for s in graph.state]}

    def add(nodes):
        for n in nodes:
            shapes.update((v.name, tuple(v.shape)) for v in list(n.inputs) + list(n.outputs))
            add(n.body)
    add(graph.nodes)
    return shapes


def chosen_shape(value) -> tuple:
    """The shape a kernel's form is chosen for (`forms_chosen_at`): its namesake's where that has
    the same rank, else `value`'s own (a step traced at another size may name another value so:
    then its kernels differ anyway, and codegen/dynamic.py refuses them)."""
    own = tuple(value.shape)
    shapes = _choice_shapes.get()
    chosen = None if shapes is None else shapes.get(value.name)
    return chosen if chosen is not None and len(chosen) == len(own) else own


def choice_key():
    """What `forms_chosen_at` set, for the keys of caches of rendered programs."""
    shapes = _choice_shapes.get()
    return None if shapes is None else tuple(sorted(shapes.items()))


def block_segments(segments: list, block: int = 256) -> int:
    """Give each segment dict (with "numel") its own range of blocks, "first_block" up to
    "end_block" (one thread per element, at most SEGMENT_MAX_BLOCKS blocks); the grid size. With
    one-thread blocks (the cpu target) each segment is one block: its thread walks the segment's
    elements in order, a plain loop."""
    first = 0
    for seg in segments:
        blocks = 1 if block == 1 else max(1, min(-(-seg["numel"] // block), SEGMENT_MAX_BLOCKS))
        seg.update(first_block=first, end_block=first + blocks)
        first += blocks
    return first


def reduce_block(size: int) -> int:
    """Threads per block: a power of two in [32, 256] giving each thread at least
    REDUCE_ELEMS_PER_THREAD elements (fewer idle threads and barriers per block)."""
    block = 32
    while block < 256 and block * 2 * REDUCE_ELEMS_PER_THREAD <= size:
        block *= 2
    return block
