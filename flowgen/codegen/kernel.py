"""`Kernel`: what codegen hands the runtimes — source text plus how to launch it.

Both executors (the Python runtime and the AOT program) launch kernels the same
way: a grid, a block, dynamic shared bytes and an argument list. Arguments are
either buffers (an IR value whose address the memory plan decides) or scalars
baked in at render time.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BufferArg:
    value: object        # flowgen.ir.graph.Value
    ctype: str           # "const float*" / "float*"


@dataclass(frozen=True)
class ScalarArg:
    ctype: str           # "int" / "long long" / "float"
    literal: object      # the Python number passed at launch


@dataclass(frozen=True)
class IndexCheck:
    """A kernel's bounds check of the indices it reads. The kernel reports an index outside
    [low, size) into the program's error record (runtime_cpp/flowgen_cuda_prelude.h) as `id`."""
    id: int              # 1, 2, ... within a program (0 in the record means "no error")
    op: str              # what the user called: cross_entropy, embedding, gather, ...
    scope: str           # module path of the node ("" at the top of build())
    what: str            # "label" or "index"
    size: int            # valid indices are [low, size)
    dim: int | None = None   # the dim the index selects along, where the op has one
    low: int = 0         # -size where negative indices count from the end (x[idx])

    def message_parts(self) -> tuple:
        """(text before the bad value, text after it): the standalone program joins them too."""
        where = self.scope or "the graph's build()"
        along = "" if self.dim is None else f" for dim {self.dim}"
        return f"{self.op} in {where}: {self.what} ", f" out of range [{self.low}, {self.size}){along}"

    def message(self, value: int) -> str:
        before, after = self.message_parts()
        return f"{before}{value}{after}"


class Blocks(int):
    """A launch grid's axis computed from a size: `times` * ceil(`extent` / `per_block`), clamped to
    [1, `cap`] before the product. An int that remembers its terms, so that a step with dynamic
    dimensions (codegen/dynamic.py) fits them and computes the grid for the sizes given at run
    time, as it fits the sizes in the kernel's code."""

    def __new__(cls, extent: int, per_block: int, cap: int | None = None, times: int = 1):
        blocks = max(1, -(-int(extent) // per_block))
        self = super().__new__(cls, int(times) * (blocks if cap is None else min(blocks, cap)))
        self.extent, self.per_block, self.cap, self.times = int(extent), per_block, cap, int(times)
        return self

    def __reduce__(self):
        return Blocks, (self.extent, self.per_block, self.cap, self.times)


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
    # (output, input) value pairs where the output may be written over the input's buffer: the
    # kernel reads every element of that input before the output's bytes over it are stored and
    # never afterwards (an elementwise body or epilogue reading the input at the element its thread
    # writes; a row kernel's pairs as its op declares them, `ops.lowering.Template.in_place`). The
    # memory planner shares only these (`memory.planner.Step.in_place`) and codegen/program.py's
    # declare_shared_memory refuses any other sharing.
    in_place: frozenset = frozenset()
    # Independent segments run side by side (a multi-tensor update): an output must not reuse
    # another segment's input, so the memory planner never places one in place.
    horizontal: bool = False
    # Set when the kernel reads a tensor as indices and checks them (see IndexCheck).
    index_check: IndexCheck | None = None
    # A collective (the op's attributes): no device code; the executor exchanges the input
    # buffers with the other ranks on the host and writes the outputs (ops/lowering.Collective).
    collective: dict | None = None
    # A native kernel of the cpu target (codegen/cpu/): plain C++ run once per launch (a 1x1x1
    # grid) that calls OpenBLAS and opens its own OpenMP loops; its program includes flowgen_cpu.h.
    native: bool = False
    # A step with dynamic dimensions (codegen/dynamic.py): the grid as the sizes given at run time
    # make it, per axis an int or a codegen.dynamic.GridSize; `grid` is the grid at the maximum.
    dynamic_grid: tuple | None = None


def every_output_over(outputs, inputs) -> frozenset:
    """`Kernel.in_place` of a kernel whose every output is written element by element, each element
    by a thread that has just read `inputs` at that element (elementwise bodies and epilogues)."""
    return frozenset((out, inp) for out in outputs for inp in inputs)


def kernel_name(index: int, node, ops) -> str:
    """k<index>_<scope>_<ops>: a kernel's C identifier, naming its place in the program, the
    module path of `node` and the ops it runs."""
    scope = "".join(c if c.isalnum() else "_" for c in (node.scope or "graph")).strip("_")
    tail = "_".join(dict.fromkeys(ops))[:48]
    return f"k{index}_{scope}_{tail}"


@dataclass(frozen=True)
class RenderContext:
    """What a kernel family's `render(node, ctx)` reads besides the node (codegen/kernels/)."""
    index: int = 0            # the position of the node's first kernel in the program
    name: str | None = None   # a name for the node's main kernel chosen by the caller (tests, autotune)
    check_id: int = 1         # numbers the node's index check (unique within a program), if it reads indices
    stream_values: Mapping = field(default_factory=dict)   # rng state name -> its Value (random ops)
    producers: Mapping = field(default_factory=dict)       # Value -> its node: fused epilogues inline constants

    def kernel_name(self, node, ops) -> str:
        """The name of `node`'s main kernel, which runs `ops` (helper kernels add a suffix to it)."""
        return self.name if self.name is not None else kernel_name(self.index, node, ops)

    def rng_state(self, node):
        """The rng state Value a random node reads (its ``stream``, passes/random_streams.py), or None."""
        return self.stream_values[node.attrs["stream"]] if "stream" in node.attrs else None
