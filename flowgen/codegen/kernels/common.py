"""What every kernel family shares: dtype conversions in generated C++, kernel parameters and
arguments, index arithmetic, launch shapes, the index-check record and the zero-fill helper kernel.

Argument order (every kernel): the node's inputs in `node.inputs` order as ``const T*`` buffers,
then its outputs as ``T*`` buffers; no scalar arguments. Helper kernels that only zero-fill an
output before an accumulating kernel (``<name>_zero``; a scatter of no entries is that kernel
alone) take that output alone. Kernels with scratch buffers (split-k conv grad_weight, scatter,
sort) take them as extra buffer arguments: Values of their own that the memory planner places in
the arena like any other.

Index checks: a kernel that reads a tensor as indices (gather, scatter, cross-entropy rows)
never uses one outside its range ([0, size), or [-size, size) for `wrap_negative`); it reports
the first such index into the program's error record as the context's `check_id`
(`Kernel.index_check` says what was checked) and treats it as missing: a gathered element or a
cross-entropy row (loss and gradient) is 0, a scattered one is dropped. An ignore_index label is
not checked.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.kernel import Blocks, BufferArg, IndexCheck, Kernel
from flowgen.codegen.target import target_blocks
from flowgen.codegen.templates import get_template
from flowgen.ops.registry import get_op

# Threads per block for the one-thread-per-element kernels.
BLOCK = 256
# Cap on grid.x for grid-stride loops (they handle any size).
MAX_BLOCKS = 1 << 20

def acc_type(*dtypes) -> str:
    """Accumulator/compute type: double for float64, long long for integers, else float."""
    if any(d == dt.float64 for d in dtypes):
        return "double"
    if all(not d.is_floating for d in dtypes):
        return "long long"
    return "float"


def convert_to(expr: str, src, dst: str) -> str:
    """`expr` (stored as dtype `src`) converted to the C++ type `dst`."""
    if src == dt.float16:
        expr = f"__half2float({expr})"
        return expr if dst == "float" else f"({dst})({expr})"
    if src == dt.bfloat16:
        expr = f"__bfloat162float({expr})"
        return expr if dst == "float" else f"({dst})({expr})"
    return expr if src.ctype == dst else f"({dst})({expr})"


def store_as(expr: str, dst) -> str:
    """A compute-type `expr` converted for storing into a buffer of dtype `dst`."""
    if dst == dt.float16:
        return f"__float2half({expr})"
    if dst == dt.bfloat16:
        return f"__float2bfloat16({expr})"
    return f"({dst.ctype})({expr})"


def cast_to(expr: str, src, dst) -> str:
    """A value of dtype `src` converted to dtype `dst` (copies between dtypes)."""
    if src == dst:
        return expr
    mid = "float" if dst in (dt.float16, dt.bfloat16, dt.float32) else dst.ctype
    value = convert_to(expr, src, mid)
    return value if dst.ctype == mid else store_as(value, dst)


def loader(dtype, acc: str):
    return lambda expr: convert_to(expr, dtype, acc)


def storer(dtype, acc: str):
    return lambda expr: expr if dtype.ctype == acc else store_as(expr, dtype)


def node_args(node) -> list:
    return ([BufferArg(v, f"const {v.dtype.ctype}*") for v in node.inputs]
            + [BufferArg(v, f"{v.dtype.ctype}*") for v in node.outputs])


def node_params(node, in_names, out_names) -> list:
    params = [f"const {v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.inputs, in_names)]
    params += [f"{v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.outputs, out_names)]
    return params


def declared_in_place(node, in_names, out_names, optional=()) -> frozenset:
    """`Kernel.in_place` of a row kernel: the (output, input) pairs its op declares by parameter name
    (`ops.lowering.Template.in_place`), as this node's values; `optional` names parameters the op
    may leave out (layer_norm_backward's residual)."""
    values = dict(zip(in_names, node.inputs)) | dict(zip(out_names, node.outputs))
    pairs = get_op(node.op).lowering.in_place
    unknown = {n for pair in pairs for n in pair} - set(values) - set(optional)
    if unknown:
        raise AssertionError(f"{node.op}: Template.in_place names {sorted(unknown)}, which are not parameters of "
                             f"its kernel ({', '.join(list(in_names) + list(out_names))})")
    return frozenset((values[out], values[inp]) for out, inp in pairs if out in values and inp in values)


def node_comment(node, what: str) -> str:
    return f"{node.scope or '<graph>'}: {node.op} {what}".rstrip()


def contiguous_strides(shape) -> list:
    out, acc = [], 1
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= d
    return list(reversed(out))


def numel_of(shape) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64))


def shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def index_type(*counts) -> str:
    """int when every linear index (plus one grid stride) fits, else long long."""
    return "int" if max(counts) + MAX_BLOCKS * BLOCK < 2 ** 31 else "long long"


def grid_1d(n: int, block: int = BLOCK) -> tuple:
    return (Blocks(n, block, MAX_BLOCKS), 1, 1)


def row_blocks(rows: int) -> tuple:
    """The grid of a kernel with a block per row (at most MAX_BLOCKS blocks, which stride beyond)."""
    return (Blocks(rows, 1, MAX_BLOCKS), 1, 1)


def serial_rows_launch(rows: int, chosen_rows: int = None) -> tuple:
    """(grid, block) of a thread-per-row kernel on the cpu target: the emulator runs a block's
    threads one after another on one core, so few rows (a GPT's 128) are spread over the
    target's blocks instead of filling one block of BLOCK threads. The block is chosen for
    `chosen_rows` (codegen/target.py chosen_shape; default `rows`)."""
    block = max(1, min(BLOCK, -(-(rows if chosen_rows is None else chosen_rows) // target_blocks())))
    return grid_1d(rows, block), (block, 1, 1)


def coordinates(shape, index: str, prefix: str) -> tuple:
    """(lines, coords): `const long long c0 = i / 12;` ... per dim of `shape`; size-1 dims get no
    line and the coordinate "0"."""
    lines, coords = [], []
    st = contiguous_strides(shape)
    first = next((d for d, s in enumerate(shape) if s != 1), None)
    for d, size in enumerate(shape):
        if size == 1:
            coords.append("0")
            continue
        expr = index if st[d] == 1 else f"{index} / {st[d]}"
        if d != first:
            expr = f"({expr}) % {size}" if " " in expr else f"{expr} % {size}"
        lines.append(f"const long long {prefix}{d} = {expr};")
        coords.append(f"{prefix}{d}")
    return lines, coords


def offset_expr(coords, strides) -> str:
    """sum(coord * stride), dropping zero coordinates and strides."""
    terms = [c if s == 1 else f"{c} * {s}" for c, s in zip(coords, strides) if s != 0 and c != "0"]
    return " + ".join(terms) if terms else "0"


def zero_literal(dtype) -> str:
    return {dt.float32: "0.0f", dt.float64: "0.0", dt.float16: "__float2half(0.0f)",
            dt.bfloat16: "__float2bfloat16(0.0f)", dt.bool_: "false"}.get(dtype, "0")


def zero_kernel(node, kernel_name: str, out, what: str) -> Kernel:
    n = out.numel
    idx_t = index_type(n)
    source = get_template("_common.j2").module.zero_fill(
        f"{kernel_name}_zero", node_comment(node, f"(zero-fill {what})"), out.dtype.ctype, n, idx_t,
        zero_literal(out.dtype))
    return Kernel(name=f"{kernel_name}_zero", source=str(source), args=[BufferArg(out, f"{out.dtype.ctype}*")],
                  grid=grid_1d(n), block=(BLOCK, 1, 1), needs_fibers=False,
                  comment=node_comment(node, f"(zero-fill {what})"), ops=[node.op])


def node_kernel(node, name, source, grid, block, needs_fibers, what, smem=0, index_check=None) -> Kernel:
    return Kernel(name=name, source=source, args=node_args(node), grid=tuple(grid), block=tuple(block), smem=smem,
                  needs_fibers=needs_fibers, comment=node_comment(node, what), ops=[node.op], index_check=index_check)


def render_template(template: str, **context) -> str:
    return get_template(template).render(**context)


def converter(src, dst):
    return lambda expr: cast_to(expr, src, dst)


def row_layout(shape, dim):
    """(outer, D, inner) of `shape` viewed around `dim` (a 0-d tensor is one row of one)."""
    if not shape:
        return 1, 1, 1
    dim %= len(shape)
    return numel_of(shape[:dim]), shape[dim], numel_of(shape[dim + 1:])


def row_element(inner: int):
    return lambda j: j if inner == 1 else f"(long long){j} * {inner}"


# The op a user wrote, for error messages, where the IR op is a helper of it.
USER_OPS = {"cross_entropy_rows": "cross_entropy", "cross_entropy_rows_grad": "cross_entropy (backward)",
            "embedding_backward": "embedding (backward)"}


def make_index_check(node, check_id: int, what: str, size: int, dim=None) -> IndexCheck:
    low = -int(size) if node.attrs.get("wrap_negative", False) else 0
    return IndexCheck(id=check_id, op=USER_OPS.get(node.op, node.op), scope=node.scope or "", what=what,
                      size=int(size), dim=dim, low=low)


def pair_of(v) -> tuple:
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[-1]))
    return (int(v), int(v))


def neg_inf(acc: str) -> str:
    # INFINITY is not defined under NVRTC; this spelling works on both backends.
    inf = "-__int_as_float(0x7f800000)"
    return inf if acc == "float" else f"({acc})({inf})"


def f32_literal(value) -> str:
    """A float32 value as a C++ float literal that parses back to exactly that value."""
    return f"{float(np.float32(value))!r}f"
