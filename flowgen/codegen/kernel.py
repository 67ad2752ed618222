"""`Kernel`: what codegen hands the runtimes — source text plus how to launch it.

Both executors (the Python runtime and the AOT program) launch kernels the same
way: a grid, a block, dynamic shared bytes and an argument list. Arguments are
either buffers (an IR value whose address the memory plan decides) or scalars
baked in at render time.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BufferArg:
    value: object        # flowgen.ir.graph.Value
    ctype: str           # "const float*" / "float*"


@dataclass(frozen=True)
class ScalarArg:
    ctype: str           # "int" / "long long" / "float"
    literal: object      # the Python number passed at launch


@dataclass
class Kernel:
    name: str            # C identifier; also names the module path, e.g. k3_model_0_fused_add_relu
    source: str          # CUDA C++: the __global__ function + its FLOWGEN_EMU_KERNEL line
    args: list           # BufferArg | ScalarArg, in parameter order
    grid: tuple          # (x, y, z)
    block: tuple         # (x, y, z)
    smem: int = 0        # dynamic shared memory bytes
    needs_fibers: bool = False
    comment: str = ""    # module path and the ops fused in
    ops: list = field(default_factory=list)   # op names fused into this kernel
    # Inputs read only at the element the thread writes, before writing it (same shape as the
    # output): an output may overwrite such an input's buffer in place (the contract is in
    # codegen/program.py's declare_shared_memory).
    pointwise_reads: frozenset = frozenset()
    # Independent segments run side by side (a multi-tensor update): an output must not reuse
    # another segment's input, so the memory planner never places one in place.
    horizontal: bool = False
