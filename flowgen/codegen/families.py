"""Render one template-family IR node (matmul, conv2d, softmax, ...) into `Kernel`s.

`render_node(node, kernel_name)` looks up the op's `Template` lowering and calls the
function for that family; each family reads the node's static shapes and attributes,
bakes them into `templates/<family>.cu.j2` as constants and returns one or more
kernels in launch order.

Argument order (every kernel): the node's inputs in `node.inputs` order as
``const T*`` buffers, then its outputs as ``T*`` buffers; no scalar arguments.
Helper kernels that only zero-fill an output before an accumulating kernel
(``<name>_zero``) take that output alone.

Kernels by family (the main kernel carries `kernel_name`):

* gemm     — matmul(a, b): tiled SIMT GEMM, batch dims broadcast through strides.
* copy     — permute / slice / slice_backward / cat: one thread per output element
             with a baked index map (slice_backward writes zeros outside the slice).
* softmax  — softmax / log_softmax over any dim: one block per row (block reductions
             for max and sum) or, when the dim is not innermost, one thread per row
             walking the dim (coalesced across neighbouring rows).
* gather   — gather / index_select / embedding: one thread per output element.
             Indices outside [0, size) read as 0 (the NumPy reference raises instead).
* scatter  — scatter_add / index_add / embedding_backward: `<name>_zero` then one
             atomicAdd per source element; out-of-range indices (and padding_idx) are
             skipped. Accumulation order is not deterministic.
* conv2d   — conv2d, conv2d_grad_input, conv2d_grad_weight: implicit GEMM on the tile
             core (a plain GEMM indexing when the conv is 1x1/stride 1/no padding);
             one-input-channel-per-group convs (depthwise) use direct kernels.
             conv2d_grad_weight splits the reduction over batch x pixels across blocks
             when the weight alone gives too few blocks (`<name>_zero` + atomicAdd).
* pool2d   — max/avg pool forward and gradients, adaptive avg pool and its gradient:
             one thread per output (forward) or per input element (gradients, no atomics).
* upsample — nearest / bilinear forward and gradients: one thread per output (forward)
             or per input element (gradients gather their contributions, no atomics).
* argreduce — argmax / argmin: one block per row, first index wins ties, NaN wins.
"""
from __future__ import annotations

import math

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, Kernel
from flowgen.codegen.templates import get_template
from flowgen.ops.registry import get_op

# Threads per block for the one-thread-per-element kernels.
BLOCK = 256
# Cap on grid.x for grid-stride loops (they handle any size).
MAX_BLOCKS = 1 << 20
# Roughly "enough blocks to fill an H100" (132 SMs, two resident tiles each).
TARGET_BLOCKS = 264


# --------------------------------------------------------------------------
# dispatch

def render_node(node, kernel_name: str) -> list:
    """The kernels (in launch order) that compute `node`, a template-family op."""
    lowering = get_op(node.op).lowering
    family = getattr(lowering, "family", None)
    try:
        render = _FAMILIES[family]
    except KeyError:
        raise NotImplementedError(f"codegen has no template family {family!r} (op {node.op})") from None
    if all(v.numel == 0 for v in node.outputs):
        return []
    return render(node, kernel_name)


# --------------------------------------------------------------------------
# shared helpers

def _acc_type(*dtypes) -> str:
    """Accumulator/compute type: double for float64, long long for integers, else float."""
    if any(d == dt.float64 for d in dtypes):
        return "double"
    if all(not d.is_floating for d in dtypes):
        return "long long"
    return "float"


def _convert(expr: str, src, dst: str) -> str:
    """`expr` (stored as dtype `src`) converted to the C++ type `dst`."""
    if src == dt.float16:
        expr = f"__half2float({expr})"
        return expr if dst == "float" else f"({dst})({expr})"
    if src == dt.bfloat16:
        expr = f"__bfloat162float({expr})"
        return expr if dst == "float" else f"({dst})({expr})"
    return expr if src.ctype == dst else f"({dst})({expr})"


def _store(expr: str, dst) -> str:
    """A compute-type `expr` converted for storing into a buffer of dtype `dst`."""
    if dst == dt.float16:
        return f"__float2half({expr})"
    if dst == dt.bfloat16:
        return f"__float2bfloat16({expr})"
    return f"({dst.ctype})({expr})"


def _cast(expr: str, src, dst) -> str:
    """A value of dtype `src` converted to dtype `dst` (copies between dtypes)."""
    if src == dst:
        return expr
    return _store(_convert(expr, src, "float" if dst.is_floating and dst != dt.float64 else dst.ctype), dst)


def _loader(dtype, acc: str):
    return lambda expr: _convert(expr, dtype, acc)


def _storer(dtype):
    return lambda expr: _store(expr, dtype)


def _args(node) -> list:
    return ([BufferArg(v, f"const {v.dtype.ctype}*") for v in node.inputs]
            + [BufferArg(v, f"{v.dtype.ctype}*") for v in node.outputs])


def _params(node, in_names, out_names) -> list:
    params = [f"const {v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.inputs, in_names)]
    params += [f"{v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.outputs, out_names)]
    return params


def _comment(node, what: str) -> str:
    return f"{node.scope or '<graph>'}: {node.op} {what}".rstrip()


def _strides(shape) -> list:
    out, acc = [], 1
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= d
    return list(reversed(out))


def _numel(shape) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64))


def _shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _idx_type(*counts) -> str:
    """int when every linear index (plus one grid stride) fits, else long long."""
    return "int" if max(counts) + MAX_BLOCKS * BLOCK < 2 ** 31 else "long long"


def _grid_1d(n: int, block: int = BLOCK) -> tuple:
    return (max(1, min(-(-n // block), MAX_BLOCKS)), 1, 1)


def _unravel(shape, index: str, prefix: str) -> list:
    """`const long long c0 = i / 12;` ... per dim of `shape` (size-1 dims give 0)."""
    lines = []
    st = _strides(shape)
    for d, size in enumerate(shape):
        if size == 1:
            lines.append(f"const long long {prefix}{d} = 0;")
            continue
        expr = index if st[d] == 1 else f"{index} / {st[d]}"
        if d > 0:
            expr = f"({expr}) % {size}"
        lines.append(f"const long long {prefix}{d} = {expr};")
    return lines


def _offset(coords, strides) -> str:
    terms = [c if s == 1 else f"{c} * {s}" for c, s in zip(coords, strides) if s != 0]
    return " + ".join(terms) if terms else "0"


def _zero_literal(dtype) -> str:
    return _store("0", dtype) if dtype.is_floating else "0"


def _zero_kernel(node, kernel_name: str, out, what: str) -> Kernel:
    n = out.numel
    idx_t = _idx_type(n)
    source = get_template("_common.j2").module.zero_fill(
        f"{kernel_name}_zero", _comment(node, f"(zero-fill {what})"), out.dtype.ctype, n, idx_t,
        _zero_literal(out.dtype))
    return Kernel(name=f"{kernel_name}_zero", source=str(source), args=[BufferArg(out, f"{out.dtype.ctype}*")],
                  grid=_grid_1d(n), block=(BLOCK, 1, 1), needs_fibers=False,
                  comment=_comment(node, f"(zero-fill {what})"), ops=[node.op])


def _kernel(node, name, source, grid, block, needs_fibers, what, smem=0) -> Kernel:
    return Kernel(name=name, source=source, args=_args(node), grid=tuple(grid), block=tuple(block), smem=smem,
                  needs_fibers=needs_fibers, comment=_comment(node, what), ops=[node.op])


def _render(template: str, **context) -> str:
    return get_template(template).render(**context)


# --------------------------------------------------------------------------
# gemm

# (BM, BN, TM, TN): every configuration uses 256 threads and a k step of 16.
_TILES = ((64, 64, 4, 4), (32, 64, 2, 4), (64, 32, 4, 2), (32, 32, 2, 2), (16, 64, 1, 4), (64, 16, 4, 1),
          (16, 16, 1, 1))


class _Tile(dict):
    """Tile configuration; a dict so Jinja reads `t.BM` etc."""

    __getattr__ = dict.__getitem__


def _choose_tile(M: int, N: int, batch: int, acc: str, a_order: str, b_order: str) -> _Tile:
    """The tile with the least estimated time: waves of blocks x work per block, where small
    per-thread tiles pay more shared-memory traffic per multiply-add."""
    best, best_cost = None, None
    for BM, BN, TM, TN in _TILES:
        blocks = -(-M // BM) * -(-N // BN) * batch
        waves = -(-blocks // TARGET_BLOCKS)
        cost = waves * BM * BN * (1.0 + 1.0 / TM + 1.0 / TN)
        if best_cost is None or cost < best_cost:
            best, best_cost = (BM, BN, TM, TN), cost
    BM, BN, TM, TN = best
    return _Tile(BM=BM, BN=BN, BK=16, TM=TM, TN=TN, RX=BN // TN, RY=BM // TM, NT=(BM // TM) * (BN // TN),
                 acc=acc, a_order=a_order, b_order=b_order)


def _batch_offset_lines(out_batch, a_batch, b_batch, a_mat: int, b_mat: int) -> list:
    """Offsets of batch entry `z` into a and b (right-aligned broadcasting, stride 0 where size 1)."""
    if _numel(out_batch) == 1:
        return []
    lines = _unravel(out_batch, "z", "z")
    coords = [f"z{d}" for d in range(len(out_batch))]

    def strides_for(shape, mat):
        shape = (1,) * (len(out_batch) - len(shape)) + tuple(shape)
        st = [s * mat for s in _strides(shape)]
        return [0 if size == 1 else s for size, s in zip(shape, st)]

    lines = [ln for ln, size in zip(lines, out_batch) if size != 1]
    coords_used = [c for c, size in zip(coords, out_batch) if size != 1]
    sa = [s for s, size in zip(strides_for(a_batch, a_mat), out_batch) if size != 1]
    sb = [s for s, size in zip(strides_for(b_batch, b_mat), out_batch) if size != 1]
    lines.append(f"const long long a_base = {_offset(coords_used, sa)};")
    lines.append(f"const long long b_base = {_offset(coords_used, sb)};")
    return lines


def _gemm(node, kernel_name: str) -> list:
    a, b = node.inputs
    c = node.output
    if dt.bool_ in (a.dtype, b.dtype, c.dtype):
        raise NotImplementedError(f"{node.op}: boolean matmul has no kernel")
    M, K = a.shape[-2:]
    N = b.shape[-1]
    out_batch = tuple(c.shape[:-2])
    batch = _numel(out_batch)
    acc = _acc_type(a.dtype, b.dtype)
    t = _choose_tile(M, N, batch, acc, "k", "n")
    n_tiles, m_tiles = -(-N // t.BN), -(-M // t.BM)
    if m_tiles > 65535:
        raise NotImplementedError(f"{node.op}: M = {M} needs more than 65535 row tiles")

    def batch_text(shape):
        return "".join(f"{s}, " for s in shape)

    source = _render(
        "gemm.cu.j2", name=kernel_name, comment=_comment(node, f"{_shape_text(a.shape)} @ {_shape_text(b.shape)}"),
        a_t=a.dtype.ctype, b_t=b.dtype.ctype, c_t=c.dtype.ctype, M=M, N=N, K=K, batch=batch,
        batch_text=batch_text(out_batch), a_batch_text=batch_text(a.shape[:-2]),
        b_batch_text=batch_text(b.shape[:-2]), n_tiles=n_tiles, m_tiles=m_tiles, t=t,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        load_a=_loader(a.dtype, acc), load_b=_loader(b.dtype, acc), store_c=_storer(c.dtype))
    if n_tiles * batch >= 2 ** 31:
        raise NotImplementedError(f"{node.op}: too many column tiles x batch entries for one grid")
    return [_kernel(node, kernel_name, source, (n_tiles * batch, m_tiles, 1), (t.NT, 1, 1), True,
                    f"{_shape_text(a.shape)} @ {_shape_text(b.shape)} (tiled GEMM {t.BM}x{t.BN})")]


_FAMILIES = {
    "gemm": _gemm,
}
