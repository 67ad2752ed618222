"""Render one template-family IR node (matmul, conv2d, softmax, ...) into `Kernel`s.

`render_node(node, kernel_name, check_id)` looks up the op's `Template` lowering and calls
the function for that family; each family reads the node's static shapes and attributes,
bakes them into `templates/<family>.cu.j2` as constants and returns one or more
kernels in launch order.

Index checks: a kernel that reads a tensor as indices (gather, scatter, cross-entropy rows)
never uses one outside its range ([0, size), or [-size, size) for `wrap_negative`); it reports
the first such index into the program's error record as `check_id` (`Kernel.index_check` says
what was checked) and treats it as missing: a gathered element or a cross-entropy row (loss
and gradient) is 0, a scattered one is dropped. An ignore_index label is not checked.

Argument order (every kernel): the node's inputs in `node.inputs` order as
``const T*`` buffers, then its outputs as ``T*`` buffers; no scalar arguments.
Helper kernels that only zero-fill an output before an accumulating kernel
(``<name>_zero``; a scatter of no entries is that kernel alone) take that output alone. Kernels with scratch buffers (split-k conv
grad_weight, scatter) take them as extra buffer arguments: Values of their own that the
memory planner places in the arena like any other.

Kernels by family (the main kernel carries `kernel_name`):

* gemm     — matmul(a, b): tiled SIMT GEMM, batch dims broadcast through strides; bf16/fp16
             operands (and float32 ones when TF32 is allowed) run on tensor cores instead
             (gemm_mma.cu.j2: mma.sync, ldmatrix, a cp.async pipeline); rendered for sm_90,
             they use warpgroup MMA (gemm_wgmma.cu.j2 on _wgmma.j2: wgmma from 128B-swizzled
             shared-memory tiles through matrix descriptors, a cp.async pipeline; tf32 operands
             gathered into K-major tiles and rounded by cvt.rna on the way in).
* copy     — permute / slice / slice_backward / cat: one thread per output element
             with a baked index map (slice_backward writes zeros outside the slice).
* softmax  — softmax / log_softmax over any dim, and cross-entropy rows and their
             gradient over (N, C) logits: one block per row (block reductions for
             max and sum) or, when the dim is not innermost, one thread per row
             walking the dim (coalesced across neighbouring rows).
* gather   — gather / index_select / embedding: one thread per output element.
* scatter  — scatter_add / index_add / embedding_backward, deterministic: the entries
             (source elements, or rows along dim) are grouped by destination with integer
             work only into int32 scratch buffers (`<name>_rows`: one block counts them per
             destination and prefix-sums the counts, `<name>_fill`, `<name>_sort`: each
             segment in ascending entry order), then `<name>`, one thread per output element,
             adds its segment's sources in that order (double for floats, like the eager
             np.bincount) and stores once: the eager bits, every run. padding_idx is skipped.
             One thread sorts a segment (heapsort); on the GPU a segment of more than 256
             entries (a token in many rows) is sorted by a block instead (`<name>_sort_long`:
             insertion-sorted runs, then merge passes through a second scratch buffer).
* conv2d   — conv2d, conv2d_grad_input, conv2d_grad_weight: implicit GEMM on the tile
             core (a plain GEMM indexing when the conv is 1x1/stride 1/no padding), the
             tensor-core ones (16-bit, tf32) on _mma.j2, or on _wgmma.j2 when rendered for sm_90;
             one-input-channel-per-group convs (depthwise) use direct kernels.
             conv2d_grad_weight splits the reduction over batch x pixels across blocks
             when the weight alone gives too few blocks: each split writes its partial
             sums to a scratch buffer and `<name>_combine` adds them in split order
             (no atomics, so the same bits every run).
* pool2d   — max/avg pool forward and gradients, adaptive avg pool and its gradient:
             one thread per output (forward) or per input element (gradients, no atomics).
* upsample — nearest / bilinear forward and gradients: one thread per output (forward)
             or per input element (gradients gather their contributions, no atomics).
* argreduce — argmax / argmin: one block per row, first index wins ties, NaN wins.
* scan     — cumsum / cumprod (forward or reversed) along any dim: one thread per row, sequential
             in the dtype, so the numbers are NumPy's (the eager reference) bit for bit; few long
             contiguous rows on a GPU: a block per row stages chunks in shared memory, coalesced,
             and its thread 0 scans them in the same order.
* sort     — sort / topk along any dim: one thread per element counts its rank in its row (the
             elements with a smaller key, or an equal one at a lower index: stable, NaN largest)
             and writes itself there. Rows longer than SORT_RUN: ranked in runs of SORT_RUN into
             a scratch row, then `<name>_merge<s>` kernels merge neighbouring runs (each element's
             position found by binary search in the other run), the last one into the outputs.
             topk of k <= SELECT_MAX_K from such rows: one kernel, a block per row (one thread on
             the cpu target) radix-selects the k-th order key, keeps the k first elements in shared
             memory and ranks them among themselves. The cpu target sorts the other long rows a
             thread per row by LSD radix sort of the same keys (scratch rows of keys and indices).
* attention — attention(q, k, v[, mask]) (output and the rows' logsumexp) and attention_backward
             (the dQ kernel, which also writes D = rowsum(dO * O) to a scratch buffer, then the
             dK/dV kernel); the `_dropout` variants drop P_ij with F.dropout's Philox mask, reading
             the rng state like randperm. The [L, S] scores never reach memory; no atomics. On a GPU
             (attention_tiled.cu.j2): a block of 4 warps per (slice, 64 query rows), or 64 key rows
             for dK/dV, streaming 64-row K/V (Q/dO) tiles through shared memory, an online softmax
             across key tiles, causal tiles above the diagonal never loaded; float16/bfloat16 on
             tensor cores (mma.sync m16n8k16, fp32 accumulation and statistics, P and dS fed from
             the accumulators as A fragments), float32/float64 on scalar loops. On the cpu target
             (and head dims over 128, or float64 tiles over the shared memory) attention.cu.j2: a
             thread per query row (forward, dQ) or key row (dK/dV), no barriers.
* layer_norm — layer_norm / add_layer_norm (forward: y, the row's mean and rstd; add_layer_norm
             also writes the residual sum it normalizes) and layer_norm_backward (dx, plus a
             residual gradient): a block of L threads per row (L = layer_norm_lanes(D)), each
             thread a lane of the op's fixed order, its elements kept in registers up to
             LAYER_NORM_CACHED_STEPS; Welford states (forward) or two sums (backward) merged in
             the op's tree through shared memory and warp shuffles. On the cpu target one thread
             per row with the L lanes' accumulators in arrays, merged the same way.
* randperm — a Fisher-Yates shuffle on one thread, reading the graph's rng state (the
             seed and per-call offset, passes/random_streams.py) as an extra argument.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, IndexCheck, Kernel
from flowgen.codegen.target import (allow_tf32, block_segments, reduce_block, serial_blocks, target_blocks,
                                    tensor_cores, warpgroup_mma)
from flowgen.codegen.templates import get_template
from flowgen.ir.graph import Value
from flowgen.ops.lowering import cpp_literal
from flowgen.ops.norm_ops import layer_norm_lanes
from flowgen.ops.registry import get_op

# Threads per block for the one-thread-per-element kernels.
BLOCK = 256
# Cap on grid.x for grid-stride loops (they handle any size).
MAX_BLOCKS = 1 << 20


# --------------------------------------------------------------------------
# dispatch

def render_node(node, kernel_name: str, check_id: int = 1, stream_values=None) -> list:
    """The kernels (in launch order) that compute `node`, a template-family op. `check_id`
    (unique within a program) numbers the node's index check, if its op reads indices; a random
    op (one with a ``stream`` attribute) also gets the rng state Value, from `stream_values`."""
    lowering = get_op(node.op).lowering
    family = getattr(lowering, "family", None)
    try:
        render = _FAMILIES[family]
    except KeyError:
        raise NotImplementedError(f"codegen has no template family {family!r} (op {node.op})") from None
    if all(v.numel == 0 for v in node.outputs):
        return []
    if family in _INDEX_FAMILIES:
        return render(node, kernel_name, check_id)
    if "stream" in node.attrs:
        return render(node, kernel_name, stream_values[node.attrs["stream"]])
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
    mid = "float" if dst in (dt.float16, dt.bfloat16, dt.float32) else dst.ctype
    value = _convert(expr, src, mid)
    return value if dst.ctype == mid else _store(value, dst)


def _loader(dtype, acc: str):
    return lambda expr: _convert(expr, dtype, acc)


def _storer(dtype, acc: str):
    return lambda expr: expr if dtype.ctype == acc else _store(expr, dtype)


def _args(node) -> list:
    return ([BufferArg(v, f"const {v.dtype.ctype}*") for v in node.inputs]
            + [BufferArg(v, f"{v.dtype.ctype}*") for v in node.outputs])


def _params(node, in_names, out_names) -> list:
    params = [f"const {v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.inputs, in_names)]
    params += [f"{v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.outputs, out_names)]
    return params


def _declared_in_place(node, in_names, out_names, optional=()) -> frozenset:
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


def _serial_rows_launch(rows: int) -> tuple:
    """(grid, block) of a thread-per-row kernel on the cpu target: the emulator runs a block's
    threads one after another on one core, so few rows (a GPT's 128) are spread over the
    target's blocks instead of filling one block of BLOCK threads."""
    block = max(1, min(BLOCK, -(-rows // target_blocks())))
    return _grid_1d(rows, block), (block, 1, 1)


def _coords(shape, index: str, prefix: str) -> tuple:
    """(lines, coords): `const long long c0 = i / 12;` ... per dim of `shape`; size-1 dims get no
    line and the coordinate "0"."""
    lines, coords = [], []
    st = _strides(shape)
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


def _offset(coords, strides) -> str:
    """sum(coord * stride), dropping zero coordinates and strides."""
    terms = [c if s == 1 else f"{c} * {s}" for c, s in zip(coords, strides) if s != 0 and c != "0"]
    return " + ".join(terms) if terms else "0"


def _zero_literal(dtype) -> str:
    return {dt.float32: "0.0f", dt.float64: "0.0", dt.float16: "__float2half(0.0f)",
            dt.bfloat16: "__float2bfloat16(0.0f)", dt.bool_: "false"}.get(dtype, "0")


def _zero_kernel(node, kernel_name: str, out, what: str) -> Kernel:
    n = out.numel
    idx_t = _idx_type(n)
    source = get_template("_common.j2").module.zero_fill(
        f"{kernel_name}_zero", _comment(node, f"(zero-fill {what})"), out.dtype.ctype, n, idx_t,
        _zero_literal(out.dtype))
    return Kernel(name=f"{kernel_name}_zero", source=str(source), args=[BufferArg(out, f"{out.dtype.ctype}*")],
                  grid=_grid_1d(n), block=(BLOCK, 1, 1), needs_fibers=False,
                  comment=_comment(node, f"(zero-fill {what})"), ops=[node.op])


def _nonfinite(node, kernel_name):
    """nonfinite_flag: zero the flag, then one launch over every input (a segment of blocks each)."""
    out = node.output
    segments = [{"numel": v.numel, "load": _convert(f"in{k}[i]", v.dtype, "double" if v.dtype == dt.float64 else "float"),
                 "what": f"input {k}: {_shape_text(v.shape)} {v.dtype.name}"} for k, v in enumerate(node.inputs)]
    blocks = block_segments(segments, BLOCK)
    what = f"{len(node.inputs)} tensors"
    source = _render("nonfinite.cu.j2", name=kernel_name, comment=_comment(node, what), segments=segments,
                     params=_params(node, [f"in{k}" for k in range(len(node.inputs))], ["flag"]))
    return [_zero_kernel(node, kernel_name, out, "the flag"),
            _kernel(node, kernel_name, source, (blocks, 1, 1), (BLOCK, 1, 1), False, what)]


def _kernel(node, name, source, grid, block, needs_fibers, what, smem=0, index_check=None) -> Kernel:
    return Kernel(name=name, source=source, args=_args(node), grid=tuple(grid), block=tuple(block), smem=smem,
                  needs_fibers=needs_fibers, comment=_comment(node, what), ops=[node.op], index_check=index_check)


def _render(template: str, **context) -> str:
    return get_template(template).render(**context)


# --------------------------------------------------------------------------
# gemm

# (BM, BN, TM, TN): every configuration uses 256 threads; k steps are 16 wide (8 for the largest tiles).
_TILES = ((128, 128, 8, 8), (128, 64, 8, 4), (64, 128, 4, 8), (64, 64, 4, 4), (32, 64, 2, 4), (64, 32, 4, 2),
          (32, 32, 2, 2), (16, 64, 1, 4), (64, 16, 4, 1), (16, 16, 1, 1))


# The cpu target's extra shapes (serial tiles, _gemm_tile_cpu.j2: one thread computes the whole
# tile, so TM x TN only names a nominal 256-thread split): each element of A and B that a tile
# packs feeds BM * BN / (BM + BN) multiply-adds, so wider tiles spend less of their time packing.
_CPU_TILES = ((256, 256, 16, 16), (256, 128, 16, 8), (128, 256, 8, 16))


class _Tile(dict):
    """Tile configuration; a dict so Jinja reads `t.BM` etc."""

    __getattr__ = dict.__getitem__


def ranked_tiles(M: int, N: int, batch: int, acc: str, k_splits=None) -> list:
    """Tile shapes (BM, BN, TM, TN), best first by estimated time: padded work x per-multiply-add
    overhead (shared memory traffic falls with larger per-thread tiles), scaled up when there
    are too few blocks to fill the GPU. `k_splits(blocks)`, when given, says how many ways the
    k loop may be split across blocks (more blocks for the same tile)."""
    costed, best, best_cost = [], None, None
    serial = serial_blocks()
    for BM, BN, TM, TN in (_CPU_TILES + _TILES if serial else _TILES):
        if acc == "double" and TM * TN > 16:                 # keep double accumulators in registers
            continue
        blocks = -(-M // BM) * -(-N // BN) * batch
        if k_splits is not None:
            blocks *= k_splits(blocks)
        padded = -(-M // BM) * BM * -(-N // BN) * BN
        # per multiply-add: shared-memory traffic (GPU), or packing A and B (cpu)
        overhead = 16.0 / BM + 16.0 / BN if serial else 2.0 / TM + 2.0 / TN
        cost = padded * (1.0 + overhead) * max(1.0, target_blocks() / blocks)
        costed.append((cost, (BM, BN, TM, TN)))
        if best_cost is None or cost < best_cost * 0.999:   # near-ties keep the table's order
            best, best_cost = (BM, BN, TM, TN), cost
    return [best] + [dims for _, dims in sorted(costed, key=lambda c: c[0]) if dims != best]


def make_tile(dims, acc: str, a_order: str, b_order: str) -> _Tile:
    BM, BN, TM, TN = dims
    return _Tile(BM=BM, BN=BN, BK=16 if BM * BN <= 64 * 64 else 8, TM=TM, TN=TN, RX=BN // TN, RY=BM // TM,
                 NT=(BM // TM) * (BN // TN), acc=acc, a_order=a_order, b_order=b_order)


def _choose_tile(M: int, N: int, batch: int, acc: str, a_order: str, b_order: str, k_splits=None) -> _Tile:
    return make_tile(ranked_tiles(M, N, batch, acc, k_splits)[0], acc, a_order, b_order)


def _batch_offset_lines(out_batch, a_batch, b_batch, a_mat: int, b_mat: int) -> list:
    """Offsets of batch entry `z` into a and b (right-aligned broadcasting, stride 0 where size 1)."""
    if _numel(out_batch) == 1:
        return []
    lines, coords = _coords(out_batch, "z", "z")

    def strides_for(shape, mat):
        shape = (1,) * (len(out_batch) - len(shape)) + tuple(shape)
        return [0 if size == 1 else s * mat for size, s in zip(shape, _strides(shape))]

    lines.append(f"const long long a_base = {_offset(coords, strides_for(a_batch, a_mat))};")
    lines.append(f"const long long b_base = {_offset(coords, strides_for(b_batch, b_mat))};")
    return lines


def _gemm(node, kernel_name: str) -> list:
    a, b = node.inputs
    c = node.output
    store = _storer(c.dtype, _acc_type(a.dtype, b.dtype))
    return [gemm_kernel(node, kernel_name, a, b, c, params=None, args=_args(node), epilogue_lines=[
        f"c[c_base + (long long)m * GN + n] = {store('val')};"])]


def gemm_kernel(node, kernel_name, a, b, c, params, args, epilogue_lines, a_trans=False, b_trans=False,
                ops=None, what_extra="", a_ptr="a", b_ptr="b") -> Kernel:
    """One tiled GEMM kernel for c = op(a) @ op(b), where op transposes the last two dims when
    asked (the operand is then read in place: no transpose kernel). `params`/`args` default
    to (a, b, c); `epilogue_lines` run per output element with `val` (the accumulator), `m`,
    `n`, `c_base` in scope — the fusion pass puts bias adds and activations there."""
    if dt.bool_ in (a.dtype, b.dtype, c.dtype):
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): boolean matmul has no kernel")
    M, K = (a.shape[-1], a.shape[-2]) if a_trans else a.shape[-2:]
    N = b.shape[-2] if b_trans else b.shape[-1]
    out_batch = tuple(c.shape[:-2])
    batch = _numel(out_batch)
    acc = _acc_type(a.dtype, b.dtype)
    # Shallow (small K) or tiny problems: one thread per output, no shared memory or barriers.
    direct = K <= 16 or (M * N * batch <= 256 and K <= 8192)
    if params is None:
        params = [f"const {a.dtype.ctype}* __restrict__ a", f"const {b.dtype.ctype}* __restrict__ b",
                  f"{c.dtype.ctype}* __restrict__ c"]
    kind = None if direct else tensor_core_kind(a.dtype, b.dtype)
    if kind is not None and warpgroup_mma():
        return _wgmma_gemm_kernel(node, kernel_name, kind, (a, b, c), (M, N, K), params, args, epilogue_lines,
                                  a_trans, b_trans, ops, what_extra, a_ptr, b_ptr)
    if kind is not None:
        return _mma_gemm_kernel(node, kernel_name, kind, (a, b, c), (M, N, K), params, args, epilogue_lines,
                                a_trans, b_trans, ops, what_extra, a_ptr, b_ptr)
    t = _choose_tile(M, N, batch, acc, "m" if a_trans else "k", "k" if b_trans else "n")
    n_tiles, m_tiles = _grid_tiles(node, M, N, batch, t.BM, t.BN)
    serial = not direct and serial_blocks()
    what = (f"{_shape_text(a.shape)}{'^T' if a_trans else ''} @ {_shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" ({'direct GEMM' if direct else f'tiled GEMM {t.BM}x{t.BN}'}{', one thread per tile' if serial else ''})"
            f"{what_extra}")
    source = _render(
        "gemm.cu.j2", name=kernel_name, comment=_comment(node, what), params=params,
        a_ptr=a_ptr, b_ptr=b_ptr,
        a_desc=_operand_text("A", a_trans), b_desc=_operand_text("B", b_trans), acc=acc,
        a_index="(long long)k * GM + m" if a_trans else "(long long)m * GK + k",
        b_index="(long long)n * GK + k" if b_trans else "(long long)k * GN + n",
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles, t=t,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        load_a=_loader(a.dtype, acc), load_b=_loader(b.dtype, acc), epilogue_lines=epilogue_lines, direct=direct,
        serial=serial)
    if direct:
        grid, block = _grid_1d(batch * M * N), (BLOCK, 1, 1)
    else:
        grid, block = (n_tiles * batch, m_tiles, 1), (1 if serial else t.NT, 1, 1)
    return Kernel(name=kernel_name, source=source, args=args, grid=grid, block=block, smem=0,
                  needs_fibers=not (direct or serial), comment=_comment(node, what), ops=ops or [node.op])


def _batch_text(shape) -> str:
    return "".join(f"{s}, " for s in shape)


def _operand_text(name: str, trans: bool) -> str:
    return f"{name}^T" if trans else name


def _grid_tiles(node, M: int, N: int, batch: int, BM: int, BN: int) -> tuple:
    """(column tiles, row tiles) of a GEMM grid: x = column tiles x batch entries, y = row tiles."""
    n_tiles, m_tiles = -(-N // BN), -(-M // BM)
    if m_tiles > 65535:
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): M = {M} needs more than 65535 row tiles")
    if n_tiles * batch >= 2 ** 31:
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): too many column tiles x batch entries")
    return n_tiles, m_tiles


# --------------------------------------------------------------------------
# gemm on tensor cores (templates/gemm_mma.cu.j2)

# Block tiles (BM, BN, WM, WN), four warps each; in table order when costs tie.
_MMA_TILES = ((128, 128, 64, 64), (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32))
# Per input precision: the mma.sync device function, its k, the block's k step, pipeline stages.
_MMA_KINDS = {"bf16": ("mma_m16n8k16_bf16", 16, 32, 3), "f16": ("mma_m16n8k16_f16", 16, 32, 3),
              "tf32": ("mma_m16n8k8_tf32", 8, 16, 3)}


def tensor_core_kind(a_dtype, b_dtype):
    """The tensor-core precision of a GEMM with these operand dtypes: "bf16" / "f16" (16-bit
    operands, fp32 accumulation), "tf32" for float32 operands when the graph allows TF32
    (`rendering_for(..., allow_tf32=True)`), or None: the SIMT kernel (always with
    `rendering_for(..., tensor_cores=False)`)."""
    if a_dtype != b_dtype or not tensor_cores():
        return None
    if a_dtype == dt.bfloat16:
        return "bf16"
    if a_dtype == dt.float16:
        return "f16"
    if a_dtype == dt.float32 and allow_tf32():
        return "tf32"
    return None


def _mma_tile(M: int, N: int, batch: int, tiles=_MMA_TILES, k_splits=None) -> tuple:
    """The entry of `tiles` ((BM, BN, ...) each) with the least padded work, scaled up when too
    few blocks fill the target; the first of near-ties. `k_splits(blocks)`, when given, says how
    many ways the k loop may be split across blocks (as in `ranked_tiles`)."""
    def cost(dims):
        BM, BN = dims[:2]
        blocks = -(-M // BM) * -(-N // BN) * batch
        if k_splits is not None:
            blocks *= k_splits(blocks)
        return -(-M // BM) * BM * -(-N // BN) * BN * max(1.0, target_blocks() / blocks)
    best = tiles[0]
    for dims in tiles[1:]:
        if cost(dims) < cost(best) * 0.999:
            best = dims
    return best


def _mma_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, kind, what):
    """How one operand's k tile is staged: rows over its non-contiguous dim, `vec` elements per
    copy (16-byte cp.async.cg where the contiguous length allows aligned vectors, else 8- or
    4-byte cp.async.ca, else plain loads for 16-bit rows of odd length); rows padded (`LD`)."""
    x = _staged_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, what)
    pad = 4 if kind == "tf32" and k_contiguous else 8
    x.update(LD=x.C + pad, elems=x.R * (x.C + pad))
    return x


def _staged_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, what):
    """The copy of one operand's k tile into shared memory (see `_mma_operand`), without a row layout."""
    contiguous_len = K if k_contiguous else mn_size
    item = dtype.itemsize
    vec = next(v for v in (16 // item, 8 // item, 4 // item, 1) if v >= 1 and contiguous_len % v == 0)
    copy_kind = "cg" if vec * item == 16 else "ca" if vec * item >= 4 else "plain"
    if k_contiguous:
        R, C, o0, O, i0, I, ld = tile_mn, BK, mn_origin, mn_extent, "k0", "GK", "GK"
    else:
        R, C, o0, O, i0, I, ld = BK, tile_mn, "k0", "GK", mn_origin, mn_extent, mn_extent
    return _Tile(name=name, ptr=ptr, major="k" if k_contiguous else "mn", R=R, C=C, vec=vec, copy_kind=copy_kind,
                 o0=o0, O=O, i0=i0, I=I, ld=ld, what=what)


def _mma_gemm_kernel(node, kernel_name, kind, operands, sizes, params, args, epilogue_lines, a_trans, b_trans, ops,
                     what_extra, a_ptr, b_ptr) -> Kernel:
    """c = op(a) @ op(b) on tensor cores; same arguments and epilogue contract as `gemm_kernel`."""
    a, b, c = operands
    M, N, K = sizes
    out_batch = tuple(c.shape[:-2])
    batch = _numel(out_batch)
    BM, BN, WM, WN = _mma_tile(M, N, batch)
    BK = _MMA_KINDS[kind][2]
    n_tiles, m_tiles = _grid_tiles(node, M, N, batch, BM, BN)
    a_op = _mma_operand("a", a_ptr, not a_trans, BM, BK, "m0", "GM", M, K, a.dtype, kind,
                        f"A(m, k), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})")
    b_op = _mma_operand("b", b_ptr, b_trans, BN, BK, "n0", "GN", N, K, b.dtype, kind,
                        f"B(k, n), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})")
    a_op["desc"], b_op["desc"] = _operand_text("A", a_trans), _operand_text("B", b_trans)
    t = _mma_tile_config(kind, (BM, BN, WM, WN), a.dtype, a_op, b_op)
    what = (f"{_shape_text(a.shape)}{'^T' if a_trans else ''} @ {_shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" (tensor-core GEMM {BM}x{BN}, {kind} mma.sync){what_extra}")
    source = _render(
        "gemm_mma.cu.j2", name=kernel_name, comment=_comment(node, what), params=params, t=t,
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        epilogue_lines=epilogue_lines)
    return Kernel(name=kernel_name, source=source, args=args, grid=(n_tiles * batch, m_tiles, 1), block=(t.NT, 1, 1),
                  smem=t.smem, needs_fibers=True, comment=_comment(node, what), ops=ops or [node.op])


def _mma_implicit_gemm_tile(kind, GM: int, GN: int, groups: int, dtype, op: str, k_splits=None) -> _Tile:
    """The `t` of an implicit-GEMM conv on tensor cores: both operands gathered by the conv
    template's load statements, A (GM x GK) staged k-major and B (GK x GN) n-major. `k_splits(blocks,
    BK)`: as in `_mma_tile`, for split-k grad_weight."""
    BK = _MMA_KINDS[kind][2]
    BM, BN, WM, WN = _mma_tile(GM, GN, groups, k_splits=k_splits and (lambda blocks: k_splits(blocks, BK)))
    names = {"fwd": ("weights", "input windows"), "dgrad": ("weights", "output-gradient taps"),
             "wgrad": ("output gradients", "input windows")}[op]
    a_op = _Tile(name="a", major="k", R=BM, C=BK, LD=BK + (4 if kind == "tf32" else 8), copy_kind="gather",
                 what=f"A(m, k) ({names[0]}), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})")
    b_op = _Tile(name="b", major="mn", R=BK, C=BN, LD=BN + 8, copy_kind="gather",
                 what=f"B(k, n) ({names[1]}), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})")
    a_op["elems"], b_op["elems"] = a_op.R * a_op.LD, b_op.R * b_op.LD
    return _mma_tile_config(kind, (BM, BN, WM, WN), dtype, a_op, b_op)


def _mma_tile_config(kind, dims, dtype, a_op, b_op) -> _Tile:
    """The `t` of _mma.j2: block and warp tiles, the mma, pipeline depth, operand staging, and
    `smem`, the dynamic shared memory of all stages in bytes."""
    BM, BN, WM, WN = dims
    mma, KSTEP, BK, STAGES = _MMA_KINDS[kind]
    stage_elems = a_op.elems + b_op.elems
    return _Tile(BM=BM, BN=BN, BK=BK, WM=WM, WN=WN, WARPS_M=BM // WM, NT=32 * (BM // WM) * (BN // WN), STAGES=STAGES,
                 MI=WM // 16, NI=WN // 8, KSTEP=KSTEP, kind=kind, mma=mma, elem=dtype.ctype, elem_bytes=dtype.itemsize,
                 zero=_zero_literal(dtype), to_elem=_storer(dtype, "float"), a=a_op, b=b_op, stage_elems=stage_elems,
                 smem=STAGES * stage_elems * dtype.itemsize)


# --------------------------------------------------------------------------
# gemm on Hopper tensor cores (templates/gemm_wgmma.cu.j2), for programs rendered for sm_90

# The warpgroup MMA per input precision and tile width BN (fp32 accumulation), and its k.
_WGMMA_KINDS = {"bf16": ("wgmma_m64n{}k16_bf16", 16), "f16": ("wgmma_m64n{}k16_f16", 16),
                "tf32": ("wgmma_m64n{}k8_tf32", 8)}
# Block tiles (BM, BN): BM / 64 warpgroups of 64 x BN; in table order when costs tie.
_WGMMA_TILES = ((128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
# The k step is one 128-byte swizzled row (64 16-bit or 32 tf32 elements). Pipeline stages: as
# many as fit in an sm_90 block's shared memory (227 KiB, less the 1 KiB alignment), at most 5.
# Copies run stages - 2 k tiles ahead of the MMAs; one more stage is read by the MMAs still in
# flight. Tiles with a gathered operand (conv, tf32) take 3: their loads are synchronous, so
# deeper prefetch gains nothing.
_WGMMA_ROW_BYTES, _WGMMA_MAX_STAGES, _WGMMA_GATHER_STAGES, _SM90_SHARED_BYTES = 128, 5, 3, 227 * 1024


def _wgmma_gemm_kernel(node, kernel_name, kind, operands, sizes, params, args, epilogue_lines, a_trans, b_trans,
                       ops, what_extra, a_ptr, b_ptr) -> Kernel:
    """c = op(a) @ op(b) with warpgroup MMA; same arguments and epilogue contract as `gemm_kernel`.
    Block tiles: `_WGMMA_TILES`. 16-bit operands are copied by cp.async in their own order;
    tf32 ones are gathered (K-major tiles only, rounded by cvt.rna as the mma.sync path does)."""
    a, b, c = operands
    M, N, K = sizes
    out_batch = tuple(c.shape[:-2])
    batch = _numel(out_batch)
    BM, BN = _mma_tile(M, N, batch, _WGMMA_TILES)
    BK = _WGMMA_ROW_BYTES // a.dtype.itemsize
    n_tiles, m_tiles = _grid_tiles(node, M, N, batch, BM, BN)
    a_what = f"A(m, k), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})"
    b_what = f"B(k, n), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})"
    loads = {}
    if kind == "tf32":
        a_op = _Tile(name="a", major="k", order="mn" if a_trans else "k", copy_kind="gather", what=a_what)
        b_op = _Tile(name="b", major="k", order="k" if b_trans else "mn", copy_kind="gather", what=b_what)
        loads = dict(a_load=f"v = {a_ptr}[a_base + {'(long long)k * GM + m' if a_trans else '(long long)m * GK + k'}];",
                     b_load=f"v = {b_ptr}[b_base + {'(long long)n * GK + k' if b_trans else '(long long)k * GN + n'}];")
    else:
        a_op = _staged_operand("a", a_ptr, not a_trans, BM, BK, "m0", "GM", M, K, a.dtype, a_what)
        b_op = _staged_operand("b", b_ptr, b_trans, BN, BK, "n0", "GN", N, K, b.dtype, b_what)
        for x in (a_op, b_op):
            x["address"] = f"{x.name}_base + (long long)go * {x.ld} + gi"
    a_op["desc"], b_op["desc"] = _operand_text("A", a_trans), _operand_text("B", b_trans)
    t = _wgmma_tile_config(kind, BM, BN, a.dtype, a_op, b_op)
    what = (f"{_shape_text(a.shape)}{'^T' if a_trans else ''} @ {_shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" (tensor-core GEMM {BM}x{BN}, {kind} wgmma){what_extra}")
    source = _render(
        "gemm_wgmma.cu.j2", name=kernel_name, comment=_comment(node, what), params=params, t=t,
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        epilogue_lines=epilogue_lines, **loads)
    return Kernel(name=kernel_name, source=source, args=args, grid=(n_tiles * batch, m_tiles, 1), block=(t.NT, 1, 1),
                  smem=t.smem, needs_fibers=True, comment=_comment(node, what), ops=ops or [node.op])


def _wgmma_implicit_gemm_tile(kind, geo: dict, sizes, op: str, pointwise: bool, dtype, k_splits=None) -> _Tile:
    """The `t` of an implicit-GEMM conv on warpgroup MMA. An operand that is contiguous in memory
    along its tile's rows (16-bit only: tf32 inputs are rounded on the way in) is copied by
    cp.async (`_wgmma_conv_copies`); the others are gathered by the conv template's load
    statements: A (weights or output gradients) K-major; B M/N-major for 16-bit forward /
    grad_input (consecutive threads on consecutive pixels), K-major for grad_weight (consecutive k
    = pixels) and for tf32 (the only layout wgmma reads it in). `k_splits(blocks, BK)`: as in
    `_mma_tile`, for split-k grad_weight."""
    GM, GN, groups = sizes
    BK = _WGMMA_ROW_BYTES // dtype.itemsize
    BM, BN = _mma_tile(GM, GN, groups, _WGMMA_TILES, k_splits and (lambda blocks: k_splits(blocks, BK)))
    names = {"fwd": ("weights", "input windows"), "dgrad": ("weights", "output-gradient taps"),
             "wgrad": ("output gradients", "input windows")}[op]
    a_what = f"A(m, k) ({names[0]}), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})"
    b_what = f"B(k, n) ({names[1]}), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})"
    b_order = "k" if op == "wgrad" else "mn"
    a_op = _Tile(name="a", major="k", order="k", copy_kind="gather", what=a_what)
    b_op = _Tile(name="b", major="k" if kind == "tf32" else b_order, order=b_order, copy_kind="gather", what=b_what)
    if kind != "tf32":
        copies = _wgmma_conv_copies(geo, op, pointwise, (BM, BN, BK), dtype, (a_what, b_what))
        a_op, b_op = copies.get("a", a_op), copies.get("b", b_op)
    return _wgmma_tile_config(kind, BM, BN, dtype, a_op, b_op)


def _wgmma_conv_copies(geo: dict, op: str, pointwise: bool, tile, dtype, whats) -> dict:
    """The conv operands that cp.async can copy, by name ("a", "b"): those whose tile rows are runs
    of memory that aligned vectors of 2 to 8 elements tile (the run length a multiple of the
    vector's, so no vector crosses from one run to the next, e.g. one image to the next). Each gives `address`,
    the element offset of (row go, column gi) in its buffer. Forward weights are rows of GK; output
    gradients (grad_weight's A) runs of OH x OW pixels; a 1x1 conv's input / output-gradient
    pixels runs of H x W, and grad_input's 1x1 weights runs of CG channels."""
    BM, BN, BK = tile
    C, O, CG, OG = (geo[k] for k in ("C", "O", "CG", "OG"))
    HW, OHW, GK = geo["H"] * geo["W"], geo["OH"] * geo["OW"], geo["CG"] * geo["KH"] * geo["KW"]
    a_what, b_what = whats
    # (name, buffer, k-major?, run length, address of (go, gi))
    found = []
    if op == "fwd":
        found.append(("a", "w", True, GK, f"(long long)(grp * {OG} + go) * GK + gi"))
    if op == "wgrad":
        found.append(("a", "grad", True, OHW,
                      f"((long long)(gi / {OHW}) * {O} + grp * {OG} + go) * {OHW} + gi % {OHW}"))
    if pointwise and op == "fwd":
        found.append(("b", "x", False, HW, f"((long long)(gi / {HW}) * {C} + grp * {CG} + go) * {HW} + gi % {HW}"))
    if pointwise and op == "dgrad":
        found.append(("a", "w", False, CG, f"(long long)(grp * {OG} + go) * {CG} + gi"))
        found.append(("b", "grad", False, HW, f"((long long)(gi / {HW}) * {O} + grp * {OG} + go) * {HW} + gi % {HW}"))
    if pointwise and op == "wgrad":
        found.append(("b", "x", True, HW, f"((long long)(gi / {HW}) * {C} + grp * {CG} + go) * {HW} + gi % {HW}"))
    copies = {}
    for name, ptr, k_major, run, address in found:
        mn = (BM, "m0", "GM") if name == "a" else (BN, "n0", "GN")
        x = _staged_operand(name, ptr, k_major, mn[0], BK, mn[1], mn[2], run, run, dtype,
                            a_what if name == "a" else b_what)
        if x.copy_kind != "plain":
            # k runs to this block's k_end (split-k), not GK
            x.update(address=address, **({"I": "k_end"} if k_major else {"O": "k_end"}))
            copies[name] = x
    return copies


def _wgmma_tile_config(kind, BM: int, BN: int, dtype, a_op, b_op) -> _Tile:
    """The `t` of _wgmma.j2: block tile, the wgmma, pipeline depth, operand staging (tf32 tiles
    hold cvt.rna-rounded bit patterns), and `smem`: the stages, or the epilogue's fp32 tile of
    padded rows, whichever is larger (_WGMMA_TILES all take the stages), + 1024: the tiles start
    at the first 1024-byte boundary of the shared window."""
    function, KSTEP = _WGMMA_KINDS[kind]
    elem_bytes = dtype.itemsize
    BK = _WGMMA_ROW_BYTES // elem_bytes
    stage_bytes = (BM + BN) * _WGMMA_ROW_BYTES
    if "gather" in (a_op.copy_kind, b_op.copy_kind):
        STAGES = _WGMMA_GATHER_STAGES
    else:
        STAGES = min(_WGMMA_MAX_STAGES, (_SM90_SHARED_BYTES - 1024) // stage_bytes)
    tf32 = kind == "tf32"
    return _Tile(BM=BM, BN=BN, BK=BK, KSTEP=KSTEP, V=16 // elem_bytes, WGS=BM // 64, NT=2 * BM, STAGES=STAGES,
                 wgmma=function.format(BN), elem="unsigned" if tf32 else dtype.ctype, elem_bytes=elem_bytes,
                 zero="0u" if tf32 else _zero_literal(dtype),
                 to_elem=(lambda v: f"float_to_tf32({v})") if tf32 else _storer(dtype, "float"),
                 a=a_op, b=b_op, a_elems=BM * BK, stage_elems=(BM + BN) * BK,
                 smem=max(STAGES * stage_bytes, BM * (BN + 8) * 4) + 1024)


# --------------------------------------------------------------------------
# copy: permute, slice, slice_backward, cat

def _converter(src, dst):
    return lambda expr: _cast(expr, src, dst)


def _copy_map(node, kernel_name, src_offset, map_text, what) -> list:
    x, out = node.inputs[0], node.output
    lines, coords = _coords(out.shape, "i", "c")
    source = _render("copy.cu.j2", kind="map", name=kernel_name, comment=_comment(node, what),
                     out_shape=_shape_text(out.shape), map_text=map_text, in_t=x.dtype.ctype,
                     out_t=out.dtype.ctype, numel=out.numel, idx_t=_idx_type(out.numel, x.numel),
                     coord_lines=lines, src_offset=src_offset(coords), convert=_converter(x.dtype, out.dtype))
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


def _transpose_plan(in_shape, dims):
    """(a, b) input dims for the tiled permute, or None when a plain index map is as good:
    the output's innermost dim comes from input dim `a`, the input's innermost dim `b` moves."""
    n = len(in_shape)
    if n < 2 or dims[-1] == n - 1:
        return None
    a, b = dims[-1], n - 1
    if in_shape[a] < 8 or in_shape[b] < 8:
        return None
    return a, b


def _permute(node, kernel_name):
    x, out = node.inputs[0], node.output
    dims = tuple(d % max(len(x.shape), 1) for d in node.attrs["dims"])
    xs = _strides(x.shape)
    what = f"dims {tuple(dims)}: {_shape_text(x.shape)} -> {_shape_text(out.shape)}"
    plan = _transpose_plan(x.shape, dims)
    if plan is None:
        return _copy_map(node, kernel_name, lambda c: _offset(c, [xs[d] for d in dims]),
                         f"permuted index, dims {tuple(dims)}", what)
    what += " (tiled)"
    a, b = plan
    os_ = _strides(out.shape)
    out_pos = {d: k for k, d in enumerate(dims)}           # input dim -> output position
    rest = [d for d in range(len(x.shape)) if d not in (a, b)]
    rest_shape = [x.shape[d] for d in rest]
    lines, coords = _coords(rest_shape, "r", "r")
    tile, rows = 32, 8
    tiles_a, tiles_b = -(-x.shape[a] // tile), -(-x.shape[b] // tile)
    nrest = _numel(rest_shape)
    source = _render(
        "copy.cu.j2", kind="transpose", name=kernel_name, comment=_comment(node, what), dim_a=a, last_in=b,
        tile=tile, rows=rows, tiles_a=tiles_a, tiles_b=tiles_b, rest=nrest, size_a=x.shape[a], size_b=x.shape[b],
        in_t=x.dtype.ctype, out_t=out.dtype.ctype, rest_lines=lines,
        in_base=_offset(coords, [xs[d] for d in rest]), out_base=_offset(coords, [os_[out_pos[d]] for d in rest]),
        in_stride_a=xs[a], out_stride_b=os_[out_pos[b]], convert=_converter(x.dtype, out.dtype))
    grid = tiles_a * tiles_b * nrest
    if grid >= 2 ** 31:
        raise NotImplementedError(f"{node.op}: tensor too large for one grid of tiles")
    return [_kernel(node, kernel_name, source, (grid, 1, 1), (tile, rows, 1), True, what)]


def _slice(node, kernel_name):
    x = node.inputs[0]
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    xs = _strides(x.shape)
    base = sum(b * s for b, s in zip(starts, xs))

    def src(coords):
        off = _offset(coords, [st * s for st, s in zip(steps, xs)])
        return str(base) if off == "0" else (off if base == 0 else f"{base} + {off}")

    text = ", ".join(f"{b}:{e}:{st}" for b, e, st in zip(starts, node.attrs["stops"], steps))
    return _copy_map(node, kernel_name, src, f"slice [{text}]", f"[{text}] of {_shape_text(x.shape)}")


def _slice_backward(node, kernel_name):
    g, out = node.inputs[0], node.output
    starts, stops, steps = node.attrs["starts"], node.attrs["stops"], node.attrs["steps"]
    lines, coords = _coords(out.shape, "i", "c")
    gs = _strides(g.shape)
    conditions, terms = [], []
    for d, (size, b, e, st) in enumerate(zip(out.shape, starts, stops, steps)):
        n = g.shape[d]
        if n == 0:
            conditions.append("false")
            continue
        if b == 0 and st == 1 and e == size:
            if coords[d] != "0":
                terms.append(coords[d] if gs[d] == 1 else f"{coords[d]} * {gs[d]}")
            continue
        rel = coords[d] if b == 0 else f"s{d}"
        if b != 0:
            lines.append(f"const long long s{d} = {coords[d]} - {b};")
            conditions.append(f"s{d} >= 0")
        conditions.append(f"{rel} < {(n - 1) * st + 1}")
        if st != 1:
            conditions.append(f"{rel} % {st} == 0")
        q = rel if st == 1 else f"({rel} / {st})"
        terms.append(q if gs[d] == 1 else f"{q} * {gs[d]}")
    text = ", ".join(f"{b}:{e}:{st}" for b, e, st in zip(starts, stops, steps))
    what = f"[{text}] of {_shape_text(out.shape)}"
    source = _render("copy.cu.j2", kind="slice_backward", name=kernel_name, comment=_comment(node, what),
                     out_shape=_shape_text(out.shape), slice_text=text, in_t=g.dtype.ctype, out_t=out.dtype.ctype,
                     numel=out.numel, idx_t=_idx_type(out.numel), coord_lines=lines, conditions=conditions,
                     src_offset=" + ".join(terms) if terms else "0", zero=_zero_literal(out.dtype),
                     convert=_converter(g.dtype, out.dtype))
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


def _cat(node, kernel_name):
    out = node.output
    dim = node.attrs["dim"] % len(out.shape)
    lines, coords = _coords(out.shape, "i", "c")
    if coords[dim] == "0":                     # size-1 cat dim: a single non-empty input
        lines.append(f"const long long c{dim} = 0;")
        coords[dim] = f"c{dim}"
    parts, start = [], 0
    for k, v in enumerate(node.inputs):
        n = v.shape[dim]
        if n == 0:                  # an empty input keeps its parameter but gets no branch
            continue
        cs = list(coords)
        cs[dim] = coords[dim] if start == 0 else f"(c{dim} - {start})"
        parts.append(dict(name=f"in{k}", end=start + n, offset=_offset(cs, _strides(v.shape)),
                          convert=_converter(v.dtype, out.dtype)))
        start += n
    params = [f"const {v.dtype.ctype}* __restrict__ in{k}" for k, v in enumerate(node.inputs)]
    params.append(f"{out.dtype.ctype}* __restrict__ out")
    what = f"{len(node.inputs)} inputs along dim {dim} -> {_shape_text(out.shape)}"
    source = _render("copy.cu.j2", kind="cat", name=kernel_name, comment=_comment(node, what),
                     out_shape=_shape_text(out.shape), dim=dim, params=params, numel=out.numel,
                     idx_t=_idx_type(out.numel), coord_lines=lines, parts=parts)
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


def _copy(node, kernel_name):
    return {"permute": _permute, "slice": _slice, "slice_backward": _slice_backward,
            "cat": _cat}[node.op](node, kernel_name)


# --------------------------------------------------------------------------
# softmax / log_softmax and argmax / argmin: rows along one dim

def _rows(shape, dim):
    """(outer, D, inner) of `shape` viewed around `dim` (a 0-d tensor is one row of one)."""
    if not shape:
        return 1, 1, 1
    dim %= len(shape)
    return _numel(shape[:dim]), shape[dim], _numel(shape[dim + 1:])


def _use_columns(D: int, inner: int, rows: int) -> bool:
    """One thread per row when the dim is strided and there are rows enough to fill the GPU."""
    return inner > 1 and rows >= 32 * target_blocks() // 4


def _elem(inner: int):
    return lambda j: j if inner == 1 else f"(long long){j} * {inner}"


def _row_kernels(node, kernel_name, template, ctx, index_check=None) -> list:
    """One kernel that reduces along a dim: a thread per row when the dim is strided and rows
    are many (coalesced), else a block per row with block reductions."""
    D, inner, rows = ctx["D"], ctx["inner"], ctx["rows"]
    where = f"over dim {ctx['dim']} of {ctx['shape']}"
    # the cpu target (serial_blocks) runs softmax rows a thread each: no barriers, no fibers
    serial_rows = serial_blocks() and template == "softmax.cu.j2" and ctx["mode"] in ("softmax", "log_softmax")
    if _use_columns(D, inner, rows) or serial_rows:
        what = f"{where} (thread per row)"
        source = _render(template, kind="column", comment=_comment(node, what), **ctx)
        grid, block = _serial_rows_launch(rows) if serial_blocks() else (_grid_1d(rows), (BLOCK, 1, 1))
        return [_kernel(node, kernel_name, source, grid, block, False, what, index_check=index_check)]
    block = reduce_block(D)
    what = f"{where} (block per row)"
    source = _render(template, kind="block", comment=_comment(node, what), block=block, **ctx)
    return [_kernel(node, kernel_name, source, (min(rows, MAX_BLOCKS), 1, 1), (block, 1, 1), True, what,
                    index_check=index_check)]


# per op: (kernel parameter names, what the last pass over the row computes)
_ROW_SOFTMAX_MODES = {
    "softmax": (("x",), ("y",)),
    "log_softmax": (("x",), ("y",)),
    "cross_entropy_rows": (("x", "target"), ("loss",)),
    "cross_entropy_rows_grad": (("g", "x", "target"), ("dx",)),
}


def _softmax(node, kernel_name, check_id):
    """softmax / log_softmax along any dim, and the cross-entropy rows (forward: the row's loss
    from its max and sum of exp; backward: g * (softmax - onehot)) on (N, C) logits."""
    in_names, out_names = _ROW_SOFTMAX_MODES[node.op]
    x, y = node.inputs[in_names.index("x")], node.output
    dim = node.attrs["dim"] % max(len(x.shape), 1) if "dim" in node.attrs else 1
    outer, D, inner = _rows(x.shape, dim)
    rows = outer * inner
    acc = _acc_type(x.dtype, y.dtype)
    f = "" if acc == "double" else "f"
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=_shape_text(x.shape), rows=rows, D=D, inner=inner,
               stride_text=f" (stride {inner})" if inner > 1 else "", in_t=x.dtype.ctype, out_t=y.dtype.ctype,
               acc=acc, mode=node.op, load=_loader(x.dtype, acc), store=_storer(y.dtype, acc), elem=_elem(inner),
               fmax=f"fmax{f}", exp=f"exp{f}", logf=f"log{f}", one="1.0" if acc == "double" else "1.0f",
               idx_t=_idx_type(rows), params=_params(node, in_names, out_names),
               # C++ telling an ignored row by its label t (ignore_index None: no row is ignored)
               ignored="false" if node.attrs.get("ignore_index") is None else
               f"t == {cpp_literal(int(node.attrs['ignore_index']))}")
    if node.op.startswith("cross_entropy"):
        ctx.update(load_g=_loader(node.inputs[0].dtype, acc), check_id=check_id)
        kernels = _row_kernels(node, kernel_name, "softmax.cu.j2", ctx,
                               index_check=_index_check(node, check_id, "label", D))
    else:
        kernels = _row_kernels(node, kernel_name, "softmax.cu.j2", ctx)
    for k in kernels:
        k.in_place = _declared_in_place(node, in_names, out_names)
    return kernels


# --------------------------------------------------------------------------
# layer_norm / add_layer_norm / layer_norm_backward: rows over the trailing dims

# per op: (kernel parameter names of the inputs that are always there, of the outputs)
_LAYER_NORM_OPERANDS = {
    "layer_norm": (("x",), ("y", "mean_out", "rstd_out")),
    "add_layer_norm": (("a", "b"), ("sum", "y", "mean_out", "rstd_out")),
    "layer_norm_backward": (("g", "x", "mean", "rstd"), ("dx",)),
}

# Elements per thread a block kernel keeps in registers: longer rows are read (or recomputed) again.
LAYER_NORM_CACHED_STEPS = 32


def _layer_norm_names(node) -> tuple:
    """(input names, output names) of a layer_norm-family node's kernel parameters."""
    fixed, out_names = _LAYER_NORM_OPERANDS[node.op]
    attrs = node.attrs
    optional = ("weight", "residual") if node.op == "layer_norm_backward" else ("weight", "bias")
    flags = (attrs["has_weight"], attrs.get("has_residual", False) or attrs.get("has_bias", False))
    return list(fixed) + [n for n, on in zip(optional, flags) if on], out_names


def _layer_norm(node, kernel_name):
    """One row kernel: the forward (statistics by Welford per lane, merged in the op's fixed tree;
    add_layer_norm also writes the residual sum) or the backward's dx (two row sums, same tree).
    A block of L threads per row, or on the cpu target one thread per row with L accumulators:
    the same arithmetic in the same order either way (ops/norm_ops.py)."""
    attrs = node.attrs
    backward = node.op == "layer_norm_backward"
    in_names, out_names = _layer_norm_names(node)
    operand = dict(zip(in_names, node.inputs))
    x = operand["x"] if "x" in operand else operand["a"]
    k = attrs["normalized_ndim"]
    D = _numel(x.shape[len(x.shape) - k:])
    rows = _numel(x.shape[:len(x.shape) - k])
    stat = node.inputs[2] if backward else node.outputs[-1]
    ct = stat.dtype.ctype
    L = layer_norm_lanes(D)
    S = -(-D // L)
    ctx = dict(name=kernel_name, op=node.op, shape=_shape_text(x.shape), normalized_ndim=k, rows=rows, D=D, L=L,
               S=S, ct=ct, idx_t=_idx_type(rows), params=_params(node, in_names, out_names),
               mode="backward" if backward else "forward", residual=node.op == "add_layer_norm",
               has_weight=attrs["has_weight"], has_bias=attrs.get("has_bias", False),
               has_residual=attrs.get("has_residual", False), cache=S <= LAYER_NORM_CACHED_STEPS,
               eps=None if backward else cpp_literal(attrs["eps"], double=True), store_x=_storer(x.dtype, ct),
               store_y=None if backward else _storer(node.outputs[-3].dtype, ct),
               store_dx=_storer(node.outputs[0].dtype, ct))
    # load_x, load_weight, ...: an operand's element in the compute type (add_layer_norm's sum reads as x)
    ctx.update({f"load_{n}": _loader(v.dtype, ct) for n, v in operand.items()}, load_x=_loader(x.dtype, ct))
    serial = serial_blocks()
    what = f"over the last {k} dims of {_shape_text(x.shape)} ({'thread' if serial else 'block'} per row)"
    source = _render("layer_norm.cu.j2", kind="serial" if serial else "block", comment=_comment(node, what), **ctx)
    if serial:
        kernel = _kernel(node, kernel_name, source, *_serial_rows_launch(rows), False, what)
    else:
        kernel = _kernel(node, kernel_name, source, (min(rows, MAX_BLOCKS), 1, 1), (L, 1, 1), True, what)
    kernel.in_place = _declared_in_place(node, in_names, out_names, optional=("residual",))
    return [kernel]


def _argreduce(node, kernel_name):
    x = node.inputs[0]
    if x.dtype == dt.bool_:
        raise NotImplementedError(f"{node.op}: boolean input has no kernel")
    dim = node.attrs["dim"] % max(len(x.shape), 1)
    outer, D, inner = _rows(x.shape, dim)
    rows = outer * inner
    acc = _acc_type(x.dtype)
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=_shape_text(x.shape), rows=rows, D=D, inner=inner,
               stride_text=f" (stride {inner})" if inner > 1 else "", in_t=x.dtype.ctype, acc=acc,
               load=_loader(x.dtype, acc), elem=_elem(inner), cmp=">" if node.op == "argmax" else "<",
               idx_t=_idx_type(rows))
    return _row_kernels(node, kernel_name, "argreduce.cu.j2", ctx)


# --------------------------------------------------------------------------
# scan: cumsum / cumprod; sort: sort / topk (templates/scan.cu.j2, sort.cu.j2)

def _scan_step(op: str, dtype):
    """C++ of one scan step in `dtype`: the running value combined with the next element, then
    rounded to `dtype` (NumPy's accumulate in the dtype); integers wrap (two's complement, as NumPy)."""
    sign = "+" if op == "cumsum" else "*"
    if not dtype.is_floating:
        return lambda run, x: f"({dtype.ctype})((unsigned long long)({run}) {sign} (unsigned long long)({x}))"
    acc = _acc_type(dtype)
    return lambda run, x: _store(f"{_convert(run, dtype, acc)} {sign} {_convert(x, dtype, acc)}", dtype)


# Elements a block-per-row scan stages in shared memory at a time.
SCAN_CHUNK = 2048


def _use_block_scan(rows: int, D: int, inner: int) -> bool:
    """A block per row for few long contiguous rows on a GPU (thread-per-row would leave it idle
    and read each row with one thread's dependent loads); the cpu target keeps a thread per row."""
    return not serial_blocks() and inner == 1 and D > 2 * BLOCK and rows <= 4 * target_blocks()


def _scan(node, kernel_name):
    """cumsum / cumprod along any dim, sequential per row (see scan.cu.j2): a thread per row, or
    a block per row staging chunks in shared memory when rows are few and long."""
    x = node.inputs[0]
    if x.dtype == dt.bool_:
        raise NotImplementedError(f"{node.op}: boolean input has no kernel (cast it to an integer type)")
    dim = node.attrs["dim"] % max(len(x.shape), 1)
    outer, D, inner = _rows(x.shape, dim)
    rows = outer * inner
    reverse = bool(node.attrs["reverse"])
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=_shape_text(x.shape), rows=rows, D=D, inner=inner,
               reverse=reverse, direction="from the last element to the first" if reverse else "from the first element",
               stride_text=f" (stride {inner})" if inner > 1 else "", t=x.dtype.ctype, dtype=x.dtype.name,
               first=D - 1 if reverse else 0, elem=_elem(inner), step=_scan_step(node.op, x.dtype),
               idx_t=_idx_type(rows))
    where = f"along dim {dim} of {_shape_text(x.shape)}" + (" reversed" if reverse else "")
    if _use_block_scan(rows, D, inner):
        what = f"{where} (block per row)"
        source = _render("scan.cu.j2", kind="block", comment=_comment(node, what), block=BLOCK, chunk=SCAN_CHUNK,
                         at=(lambda j: f"{D - 1} - ({j})") if reverse else (lambda j: j), **ctx)
        return [_kernel(node, kernel_name, source, (min(rows, MAX_BLOCKS), 1, 1), (BLOCK, 1, 1), True, what)]
    what = f"{where} (thread per row)"
    source = _render("scan.cu.j2", kind="thread", comment=_comment(node, what), **ctx)
    return [_kernel(node, kernel_name, source, _grid_1d(rows), (BLOCK, 1, 1), False, what)]


# Longest row the sort family ranks whole (D comparisons per element); longer rows are ranked in
# runs of this length, then the runs are merged pairwise (a scratch row of values and indices).
SORT_RUN = 256


# topk of at most this many from a row longer than SORT_RUN selects instead of sorting the row: a block
# per row (on a GPU up to SELECT_THREADS threads, each with SELECT_PER_THREAD elements or more; one
# thread on the cpu target) keeps the k in shared memory.
SELECT_MAX_K = 1024
SELECT_THREADS = 512
SELECT_PER_THREAD = 16


def _sort(node, kernel_name):
    """sort / topk along any dim (see sort.cu.j2): each element's rank counted in its row; rows
    longer than SORT_RUN ranked in runs, then merged in ceil(log2(D / SORT_RUN)) passes, through
    two scratch pairs (values, indices) used in turn; topk of few from long rows by radix select,
    other long rows on the cpu target by radix sort."""
    x, values, indices = node.inputs[0], *node.outputs
    dim = node.attrs["dim"] % max(len(x.shape), 1)
    outer, D, inner = _rows(x.shape, dim)
    descending = bool(node.attrs["descending"] if node.op == "sort" else node.attrs["largest"])
    K = node.attrs["k"] if node.op == "topk" else D
    acc = "int" if x.dtype == dt.bool_ else _acc_type(x.dtype)
    order = "descending" if descending else "ascending"
    passes = ((D - 1) // SORT_RUN).bit_length()
    ctx = dict(op=node.op, dim=dim, shape=_shape_text(x.shape), rows=outer * inner, D=D, K=K, inner=inner,
               order=order, stride_text=f" (stride {inner})" if inner > 1 else "", t=x.dtype.ctype, acc=acc,
               load=_loader(x.dtype, acc), elem=_elem(inner), cmp=">" if descending else "<",
               has_nan=x.dtype.is_floating, nan_first=descending, numel=x.numel, idx_t=_idx_type(x.numel),
               passes=passes, what=f"along dim {dim} of {_shape_text(x.shape)}, {order}"
               + (f", k={K}" if node.op == "topk" else ""))
    source_arg = [BufferArg(x, f"const {x.dtype.ctype}*")]
    outputs = _sort_pair_args(values, indices, writable=True)
    if D > SORT_RUN:
        keys = _order_keys(x.dtype, descending)
        if node.op == "topk" and K <= SELECT_MAX_K:
            return [_select_kernel(node, kernel_name, ctx, source_arg + outputs, keys)]
        if serial_blocks():
            return [_radix_sort_kernel(node, kernel_name, ctx, source_arg + outputs, keys)]
    if passes == 0:
        return [_sort_kernel(node, kernel_name, ctx, "thread per element", source_arg + outputs, kind="rank", run=D,
                             to_outputs=True)]
    scratch = [(Value(f"{values.name}_runs{k}", (x.numel,), x.dtype), Value(f"{indices.name}_runs{k}", (x.numel,),
                                                                              dt.int64)) for k in range(min(passes, 2))]
    kernels = [_sort_kernel(node, kernel_name, ctx, f"runs of {SORT_RUN}, thread per element",
                            source_arg + _sort_pair_args(*scratch[0], writable=True), kind="rank", run=SORT_RUN,
                            to_outputs=False)]
    for step in range(1, passes + 1):
        last = step == passes
        dst = outputs if last else _sort_pair_args(*scratch[step % 2], writable=True)
        width = SORT_RUN << (step - 1)
        kernels.append(_sort_kernel(node, f"{kernel_name}_merge{step}", ctx, f"merge runs of {width}",
                                    _sort_pair_args(*scratch[(step - 1) % 2], writable=False) + dst, kind="merge",
                                    step=step + 1, width=width, to_outputs=last))
    return kernels


def _order_keys(dtype, descending: bool) -> dict:
    """The select and radix kernels' order keys (sort.cu.j2 `order_key`): unsigned integers of the
    compute type's width whose order is the output's."""
    key_bits = 32 if _acc_type(dtype) == "float" else 64
    return dict(key_bits=key_bits, key_t="unsigned int" if key_bits == 32 else "unsigned long long",
                key_kind="float" if dtype.is_floating else "integer", descending=descending)


def _select_kernel(node, name, ctx, args, keys) -> Kernel:
    """topk by radix select (sort.cu.j2 kind "select"): one block per row; its threads share the
    row's histograms on a GPU, one thread walks it on the cpu target (no barriers, no fibers)."""
    per_warp = 32 * SELECT_PER_THREAD
    warps = 1 << ((ctx["D"] + per_warp - 1) // per_warp - 1).bit_length()   # a power of two
    threads = 1 if serial_blocks() else min(SELECT_THREADS, 32 * warps)
    step_what = f"radix select, block of {threads} per row" if threads > 1 else "radix select, thread per row"
    comment = _comment(node, f"{ctx['what']} ({step_what})")
    # the cpu target's work per row (flowgen_emu::SerialBlocks): ~8 operations an element a read of the row
    row_work = 8 * ctx["D"] * (keys["key_bits"] // 8 + 2)
    source = _render("sort.cu.j2", kind="select", name=name, comment=comment, out_params=_sort_out_params(ctx["t"]),
                     threads=threads, row_work=row_work, **keys, **ctx)
    return Kernel(name=name, source=source, args=args, grid=(min(ctx["rows"], MAX_BLOCKS), 1, 1),
                  block=(threads, 1, 1), needs_fibers=threads > 1, comment=comment, ops=[node.op])


def _radix_sort_kernel(node, name, ctx, args, keys) -> Kernel:
    """sort / topk of long rows on the cpu target (sort.cu.j2 kind "radix"): a thread per row sorts
    its order keys by LSD radix sort through two scratch rows of keys and indices."""
    x = node.inputs[0]
    key_dtype = dt.int32 if keys["key_bits"] == 32 else dt.int64
    scratch = []
    for k in "ab":
        scratch += [BufferArg(Value(f"{node.outputs[0].name}_keys_{k}", (x.numel,), key_dtype), f"{keys['key_t']}*"),
                    BufferArg(Value(f"{node.outputs[1].name}_order_{k}", (x.numel,), dt.int64), "long long*")]
    comment = _comment(node, f"{ctx['what']} (radix sort, thread per row)")
    row_work = 8 * ctx["D"] * (keys["key_bits"] // 4 + 2)   # ~8 operations an element a walk of the row
    source = _render("sort.cu.j2", kind="radix", name=name, comment=comment, out_params=_sort_out_params(ctx["t"]),
                     row_work=row_work, **keys, **ctx)
    return Kernel(name=name, source=source, args=args + scratch, grid=(min(ctx["rows"], MAX_BLOCKS), 1, 1),
                  block=(1, 1, 1), needs_fibers=False, comment=comment, ops=[node.op])


def _sort_out_params(t: str, prefix: str = "") -> str:
    """The kernel parameters a sort-family kernel writes: the outputs, or (prefix "dst_") scratch."""
    return f"{t}* __restrict__ {prefix}values, long long* __restrict__ {prefix}indices"


def _sort_pair_args(values, indices, writable: bool) -> list:
    const = "" if writable else "const "
    return [BufferArg(values, f"{const}{values.dtype.ctype}*"), BufferArg(indices, f"{const}long long*")]


def _sort_kernel(node, name, ctx, step_what, args, **step) -> Kernel:
    """One sort-family kernel (sort.cu.j2 `kind` "rank" or "merge"), writing the op's outputs or
    the next scratch pair."""
    comment = _comment(node, f"{ctx['what']} ({step_what})")
    out_params = _sort_out_params(ctx["t"], "" if step["to_outputs"] else "dst_")
    source = _render("sort.cu.j2", name=name, comment=comment, out_params=out_params, **ctx, **step)
    return Kernel(name=name, source=source, args=args, grid=_grid_1d(ctx["numel"]), block=(BLOCK, 1, 1),
                  needs_fibers=False, comment=comment, ops=[node.op])


# --------------------------------------------------------------------------
# gather: gather, index_select, embedding; scatter: scatter_add, index_add, embedding_backward

# The op a user wrote, for error messages, where the IR op is a helper of it.
_USER_OPS = {"cross_entropy_rows": "cross_entropy", "cross_entropy_rows_grad": "cross_entropy (backward)",
             "embedding_backward": "embedding (backward)"}


def _index_check(node, check_id: int, what: str, size: int, dim=None) -> IndexCheck:
    low = -int(size) if node.attrs.get("wrap_negative", False) else 0
    return IndexCheck(id=check_id, op=_USER_OPS.get(node.op, node.op), scope=node.scope or "", what=what,
                      size=int(size), dim=dim, low=low)


def _select_layout(shape, dim):
    """(outer, size, inner) of `shape` around `dim`."""
    return _numel(shape[:dim]), shape[dim], _numel(shape[dim + 1:])


def _select_exprs(outer, n, inner, size):
    """C++ for j (the selected row) from i and the source offset of row k."""
    j_expr = "i" if inner == 1 else f"i / {inner}"
    if outer > 1:
        j_expr = f"({j_expr}) % {n}" if " " in j_expr else f"{j_expr} % {n}"
    row = "k" if outer == 1 else f"o * {size} + k"
    offset = row if inner == 1 else (f"k * {inner} + r" if outer == 1 else f"({row}) * {inner} + r")
    return j_expr, offset


def _gather(node, kernel_name, check_id):
    out = node.output
    if node.op == "gather":
        x, index = node.inputs
        shape = tuple(x.shape) or (1,)
        dim = node.attrs["dim"] % len(shape)
        ishape = tuple(index.shape) or (1,)
        lines, coords = _coords(ishape, "i", "c")
        coords[dim] = "k"
        what = f"dim {dim}: {_shape_text(x.shape)} at index {_shape_text(index.shape)}"
        source = _render("gather.cu.j2", kind="gather", name=kernel_name, comment=_comment(node, what),
                         out_shape=_shape_text(out.shape), x_shape=_shape_text(x.shape), dim=dim, size=shape[dim],
                         x_t=x.dtype.ctype, index_t=index.dtype.ctype, out_t=out.dtype.ctype, numel=out.numel,
                         idx_t=_idx_type(out.numel), coord_lines=[ln for ln in lines if not ln.startswith(
                             f"const long long c{dim} ")], src_offset=_offset(coords, _strides(shape)),
                         zero=_zero_literal(out.dtype), check_id=check_id)
        check = _index_check(node, check_id, "index", shape[dim], dim)
        return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what,
                        index_check=check)]
    if node.op == "index_select":
        x, index = node.inputs
        shape = tuple(x.shape) or (1,)
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = _select_layout(shape, dim)
        names, what = ("x", "index"), f"dim {dim} of {_shape_text(x.shape)}, {index.numel} indices"
        check = _index_check(node, check_id, "index", size, dim)
    else:                                                   # embedding(weight, indices)
        x, index = node.inputs
        outer, size, inner = 1, x.shape[0], x.shape[1]
        names, what = ("weight", "indices"), f"{index.numel} rows of {_shape_text(x.shape)}"
        check = _index_check(node, check_id, "index", size)
    n = index.numel
    j_expr, offset = _select_exprs(outer, n, inner, size)
    source = _render("gather.cu.j2", kind="select", name=kernel_name, comment=_comment(node, what), what=node.op,
                     params=_params(node, names, ("out",)), outer=outer, n=n, size=size, inner=inner,
                     j_expr=j_expr, src_offset=offset, index_name=names[1], x_name=names[0], numel=out.numel,
                     idx_t=_idx_type(out.numel), zero=_zero_literal(out.dtype), check_id=check_id,
                     wrap_negative=node.attrs.get("wrap_negative", False))
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what, index_check=check)]


# Scatter segments longer than this are sorted by a block (merge passes) on the GPU, not a thread.
_LONG_SEGMENT = 256

# The dtypes a scatter kernel sums: floats in double (the eager np.bincount's accumulator; 16-bit
# results round double -> float -> 16 bits, as the eager cast does), integers in long long
# (wrapping like np.add.at on the stored type).
_SCATTER_ACC = {dt.float32: "double", dt.float64: "double", dt.float16: "double", dt.bfloat16: "double",
                dt.int32: "long long", dt.int64: "long long"}


def _scatter(node, kernel_name, check_id):
    """scatter_add / index_add / embedding_backward as a segmented sum, deterministic and equal to
    the eager reference bit for bit: the entries (source elements or rows) are grouped by
    destination with integer work only (`_rows`: counts and their prefix sum, `_fill`, `_sort`:
    each segment in ascending entry order), then one thread per output element adds its
    segment's sources in that order, in double for floats like np.bincount, and stores once."""
    out = node.output
    if out.dtype not in _SCATTER_ACC:
        raise NotImplementedError(f"{_USER_OPS.get(node.op, node.op)}: no scatter kernel for {out.dtype.name} "
                                  f"(float16, bfloat16, float32, float64, int32 or int64)")
    acc = _SCATTER_ACC[out.dtype]
    index, src = (node.inputs[1], node.inputs[0]) if node.op == "embedding_backward" else node.inputs
    seg = _scatter_segments(node, index, src)
    if seg["entries"] > 2 ** 30 or seg["keys"] >= 2 ** 31 - 1:
        raise NotImplementedError(f"{_USER_OPS.get(node.op, node.op)}: {seg['entries']} entries into "
                                  f"{seg['keys']} destinations exceed the scatter kernels' int positions "
                                  f"(at most 2^30 entries)")
    if seg["entries"] == 0:
        return [_zero_kernel(node, kernel_name, out, "the whole result: nothing is scattered into it")]
    counts = Value(f"{out.name}_counts", (seg["keys"],), dt.int32)
    offsets = Value(f"{out.name}_offsets", (seg["keys"] + 1,), dt.int32)
    positions = Value(f"{out.name}_positions", (seg["entries"],), dt.int32)
    serial = serial_blocks()
    # on the GPU a block sorts each segment longer than _LONG_SEGMENT: a thread would take O(L log L) steps
    long_segment = None if serial or seg["entries"] <= _LONG_SEGMENT else _LONG_SEGMENT
    ctx = dict(seg, index_t=index.dtype.ctype, check_id=check_id, serial=serial, long_segment=long_segment,
               threads=min(1024, -(-max(seg["entries"], seg["keys"]) // 32) * 32),   # the rows kernel's block
               idx_t=_idx_type(seg["entries"], seg["keys"], src.numel, out.numel))
    index_arg = BufferArg(index, f"const {index.dtype.ctype}*")
    rows = _scatter_helper(node, kernel_name, "rows", f"segments of {seg['entries']} entries over {seg['keys']} "
                           f"destinations", [index_arg, BufferArg(counts, "int*"), BufferArg(offsets, "int*")],
                           (1, 1, 1), (1 if serial else ctx["threads"], 1, 1), ctx,
                           index_check=_index_check(node, check_id, "index", seg["size"], seg["dim"]))
    fill = _scatter_helper(node, kernel_name, "fill", "entries into their segments",
                           [index_arg, BufferArg(offsets, "const int*"), BufferArg(counts, "int*"),
                            BufferArg(positions, "int*")], _grid_1d(seg["entries"]), (BLOCK, 1, 1), ctx)
    sorts = [_scatter_helper(node, kernel_name, "sort", "each segment in entry order",
                             [BufferArg(offsets, "const int*"), BufferArg(positions, "int*")],
                             _grid_1d(seg["keys"]), (BLOCK, 1, 1), ctx)]
    if long_segment:
        merged = Value(f"{out.name}_merged", (seg["entries"],), dt.int32)
        sorts.append(_scatter_helper(
            node, kernel_name, "sort_long", f"segments of more than {long_segment} entries in entry order",
            [BufferArg(offsets, "const int*"), BufferArg(positions, "int*"), BufferArg(merged, "int*")],
            (min(seg["keys"], target_blocks()), 1, 1), (BLOCK, 1, 1), ctx))
    source = _render("scatter.cu.j2", kind="sum", name=kernel_name, comment=_comment(node, seg["what"]),
                     src_t=src.dtype.ctype, out_t=out.dtype.ctype, numel=out.numel, acc=acc,
                     load=_loader(src.dtype, acc), store=_storer(out.dtype, acc), **ctx)
    total = Kernel(name=kernel_name, source=source,
                   args=[BufferArg(src, f"const {src.dtype.ctype}*"), BufferArg(offsets, "const int*"),
                         BufferArg(positions, "const int*"), BufferArg(out, f"{out.dtype.ctype}*")],
                   grid=_grid_1d(out.numel), block=(BLOCK, 1, 1), needs_fibers=False,
                   comment=_comment(node, seg["what"]), ops=[node.op])
    return [rows, fill, *sorts, total]


def _scatter_helper(node, kernel_name, kind, what, args, grid, block, ctx, index_check=None) -> Kernel:
    """`<kernel_name>_<kind>`: one of a scatter's integer kernels (rows, fill, sort, sort_long);
    sort_long and the block-wide rows kernel synchronise."""
    name = f"{kernel_name}_{kind}"
    comment = _comment(node, f"({what})")
    source = _render("scatter.cu.j2", kind=kind, name=name, comment=comment, **ctx)
    return Kernel(name=name, source=source, args=args, grid=grid, block=block,
                  needs_fibers=kind == "sort_long" or kind == "rows" and not ctx["serial"], comment=comment,
                  ops=[node.op],
                  index_check=index_check)


def _scatter_segments(node, index, src) -> dict:
    """How `node` scatters: its entries (what one index moves) and destination keys, C++ for an
    entry's key (key_lines, key_expr over m and its checked index k), for an output element's key
    (out_lines, out_key over i) and for the source offset of entry j there (src_offset)."""
    out = node.output
    shape = tuple(out.shape) or (1,)
    if node.op == "scatter_add":                            # an entry per source element
        dim = node.attrs["dim"] % len(shape)
        lines, coords = _coords(tuple(src.shape) or (1,), "m", "c")
        coords[dim] = "k"
        return dict(entries=src.numel, keys=out.numel, size=shape[dim], dim=dim, padding_idx=-1,
                    wrap_negative=False, key_lines=[ln for ln in lines if not ln.startswith(f"const long long c{dim} ")],
                    key_expr=_offset(coords, _strides(shape)), out_lines=[], out_key="i", src_offset="j",
                    what=f"dim {dim}: {_shape_text(src.shape)} into {_shape_text(out.shape)}",
                    formula="out[i] = the sum of src[j] over the source elements j whose destination is i")
    if node.op == "index_add":                              # an entry per source slice along dim
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = _select_layout(shape, dim)
        pad, what = -1, f"dim {dim}: {index.numel} slices into {_shape_text(out.shape)}"
    else:                                                   # embedding_backward: an entry per row of grad
        dim, outer, size, inner = None, 1, out.shape[0], out.shape[1]
        pad = node.attrs.get("padding_idx", -1)
        pad = -1 if pad is None or pad < 0 else pad
        what = f"{index.numel} rows into {_shape_text(out.shape)}" + (f", padding_idx {pad}" if pad >= 0 else "")
    out_lines, src_offset = _segment_rows(outer, size, inner, index.numel)
    return dict(entries=index.numel, keys=size, size=size, dim=dim, padding_idx=pad,
                wrap_negative=node.attrs.get("wrap_negative", False), key_lines=[], key_expr="k",
                out_lines=out_lines, out_key="row", src_offset=src_offset, what=what,
                formula=f"out[o, row, r] = the sum of src[o, j, r] over the entries j with index[j] == row "
                        f"(out [{outer}, {size}, {inner}], src [{outer}, {index.numel}, {inner}])")


def _segment_rows(outer, size, inner, n) -> tuple:
    """For an output [outer, size, inner] summing rows of a source [outer, n, inner]: C++ lines for
    `row` (the output's coordinate along dim; also `o`, `r` where needed) from i, and the source
    offset of row j."""
    lines = [f"const long long r = i % {inner};"] if inner > 1 else []
    row = "i" if inner == 1 else f"i / {inner}"
    if outer > 1:
        row = f"({row}) % {size}" if " " in row else f"{row} % {size}"
        lines.append(f"const long long o = i / {size * inner};")
    lines.append(f"const long long row = {row};")
    src_row = "j" if outer == 1 else f"o * {n} + j"
    offset = src_row if inner == 1 else (f"j * {inner} + r" if outer == 1 else f"({src_row}) * {inner} + r")
    return lines, offset


# --------------------------------------------------------------------------
# pool2d: max / avg / adaptive avg pooling and their gradients

def _pair(v) -> tuple:
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[-1]))
    return (int(v), int(v))


def _neg_inf(acc: str) -> str:
    # INFINITY is not defined under NVRTC; this spelling works on both backends.
    inf = "-__int_as_float(0x7f800000)"
    return inf if acc == "float" else f"({acc})({inf})"


def _pool2d(node, kernel_name):
    op, a = node.op, node.attrs
    out = node.output
    grad = op.endswith("_grad")
    big, small = (out, node.inputs[0]) if grad else (node.inputs[0], out)
    N, C, H, W = big.shape
    OH, OW = small.shape[2:]
    indices = op == "max_pool2d_indices"
    acc = _acc_type(*(v.dtype for v in node.inputs), *(() if indices else (out.dtype,)))
    ctx = dict(name=kernel_name, N=N, C=C, H=H, W=W, OH=OH, OW=OW, numel=out.numel,
               idx_t=_idx_type(out.numel, node.inputs[0].numel), acc=acc, store=_storer(out.dtype, acc),
               y_t=out.dtype.ctype, out_t=out.dtype.ctype, neg_inf=_neg_inf(acc))
    if op.startswith("adaptive"):
        kind = "adaptive"
        what = f"{_shape_text(big.shape)} -> {OH}x{OW} bins"
    else:
        (KH, KW), (SH, SW), (PH, PW) = _pair(a["kernel_size"]), _pair(a["stride"]), _pair(a.get("padding", 0))
        DH, DW = _pair(a.get("dilation", 1)) if op.startswith("max") else (1, 1)
        ctx.update(KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW,
                   include_pad=bool(a.get("count_include_pad", True)))
        kind = "max" if op.startswith("max") else "avg"
        what = f"{KH}x{KW} stride {SH}x{SW} pad {PH}x{PW}" + (f" dilation {DH}x{DW}" if (DH, DW) != (1, 1) else "")
        if a.get("ceil_mode"):
            what += " ceil_mode"
    g = node.inputs[0]
    if grad:
        ctx.update(g_t=g.dtype.ctype, load_g=_loader(g.dtype, acc))
        if kind == "max":
            x = node.inputs[1]
            ctx.update(x_t=x.dtype.ctype, load=_loader(x.dtype, acc))
    else:
        ctx.update(x_t=g.dtype.ctype, load=_loader(g.dtype, acc))
    kind += "_indices" if indices else "_bwd" if grad else "_fwd"
    source = _render("pool2d.cu.j2", kind=kind, comment=_comment(node, what), **ctx)
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


# --------------------------------------------------------------------------
# upsample: nearest / bilinear and their gradients

def _f32_literal(value) -> str:
    """A float32 value as a C++ float literal that parses back to exactly that value."""
    return f"{float(np.float32(value))!r}f"


def _coord_literal(value, coord: str) -> str:
    """`value` in the coordinate type (`float` or `double`) as a C++ literal that parses back to
    exactly that value."""
    return _f32_literal(value) if coord == "float" else repr(float(value))


def _upsample_dim(in_size: int, out_size: int, scale, linear: bool, align_corners: bool, dst: str, src: str,
                  coord: str) -> dict:
    """How output coordinate `dst` maps to the input along one dim, and (for the gradients) the
    inclusive window [lo, hi] of outputs that can read input coordinate `src`. Nearest source
    indices are computed in float32 for every dtype, linear ones in `coord` (the accumulation
    type), as PyTorch does."""
    last_out = out_size - 1
    if not linear:
        if out_size == in_size:
            return dict(mode="identity", dst=dst, size=in_size, factor="", lo=src, hi=src)
        if out_size == 2 * in_size:
            return dict(mode="half", dst=dst, size=in_size, factor="", lo=f"2 * {src}", hi=f"2 * {src} + 1")
        factor = np.float32(1.0 / scale) if scale is not None and scale > 0 else \
            np.float32(in_size) / np.float32(out_size)
        inv = 1.0 / float(factor)
        lo = f"max(0, (int)((float){src} * {inv!r}f) - 2)"
        hi = f"({src} == {in_size - 1} ? {last_out} : min({last_out}, (int)((float)({src} + 1) * {inv!r}f) + 2))"
        return dict(mode="float", dst=dst, size=in_size, factor=_f32_literal(factor), lo=lo, hi=hi)
    t = np.float32 if coord == "float" else np.float64
    if align_corners:
        factor = t(in_size - 1) / t(out_size - 1) if out_size > 1 else t(0)
    else:
        factor = t(1.0 / scale) if scale is not None and scale > 0 else t(in_size) / t(out_size)
    if float(factor) == 0.0:
        lo, hi = "0", str(last_out)
    else:
        inv = 1.0 / float(factor)
        # outputs whose source coordinate lies in (src - 1, src + 1), with a margin for rounding
        shift = "" if align_corners else " + 0.5f"
        lo = f"max(0, (int)floorf(((float){src} - 1.0f{shift}) * {inv!r}f) - 2)"
        hi = f"min({last_out}, (int)ceilf(((float){src} + 1.0f{shift}) * {inv!r}f) + 2)"
    return dict(mode="linear", dst=dst, size=in_size, factor=_coord_literal(factor, coord),
                align_corners=bool(align_corners), lo=lo, hi=hi, t=coord, f="f" if coord == "float" else "",
                mul="FLOWGEN_MUL_RN" if coord == "float" else "FLOWGEN_DMUL_RN", max="fmaxf" if coord == "float" else "fmax")


def _upsample(node, kernel_name):
    op, a = node.op, node.attrs
    out = node.output
    grad = op.endswith("_grad")
    big, small = (node.inputs[0], out) if grad else (out, node.inputs[0])
    N, C, H, W = small.shape
    OH, OW = big.shape[2:]
    linear = "bilinear" in op
    align = bool(a.get("align_corners") or False)
    scales = a.get("scales") or (None, None)
    src = node.inputs[0]
    acc = _acc_type(src.dtype, out.dtype)
    rows = _upsample_dim(H, OH, scales[0], linear, align, "oh", "h", acc)
    cols = _upsample_dim(W, OW, scales[1], linear, align, "ow", "w", acc)
    ctx = dict(name=kernel_name, N=N, C=C, H=H, W=W, OH=OH, OW=OW, rows=rows, cols=cols, numel=out.numel,
               idx_t=_idx_type(out.numel, src.numel), acc=acc, out_t=out.dtype.ctype, store=_storer(out.dtype, acc))
    if grad:
        ctx.update(g_t=src.dtype.ctype, load_g=_loader(src.dtype, acc))
    else:
        ctx.update(x_t=src.dtype.ctype, load=_loader(src.dtype, acc), copy=_converter(src.dtype, out.dtype))
    kind = ("bilinear" if linear else "nearest") + ("_bwd" if grad else "_fwd")
    what = f"{_shape_text(small.shape)} -> {OH}x{OW}" + (" align_corners" if linear and align else "")
    source = _render("upsample.cu.j2", kind=kind, comment=_comment(node, what), **ctx)
    return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


# --------------------------------------------------------------------------
# conv2d: forward, grad_input, grad_weight

def _conv_geometry(node) -> dict:
    a = node.attrs
    if node.op == "conv2d":
        x, w = node.inputs
        x_shape, w_shape, y_shape = x.shape, w.shape, node.output.shape
    elif node.op == "conv2d_grad_input":
        g, w = node.inputs
        x_shape, w_shape, y_shape = tuple(a["input_shape"]), w.shape, g.shape
    else:
        g, x = node.inputs
        x_shape, w_shape, y_shape = x.shape, tuple(a["weight_shape"]), g.shape
    (SH, SW), (PH, PW), (DH, DW) = _pair(a.get("stride", 1)), _pair(a.get("padding", 0)), _pair(a.get("dilation", 1))
    G = int(a.get("groups", 1))
    N, C, H, W = x_shape
    O, CG, KH, KW = w_shape
    OH, OW = y_shape[2:]
    return dict(N=N, C=C, H=H, W=W, O=O, CG=CG, KH=KH, KW=KW, OH=OH, OW=OW, G=G, OG=O // G,
                SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW)


def _conv_text(geo) -> str:
    text = f"{geo['KH']}x{geo['KW']}"
    if (geo["SH"], geo["SW"]) != (1, 1):
        text += f" stride {geo['SH']}" if geo["SH"] == geo["SW"] else f" stride {geo['SH']}x{geo['SW']}"
    if (geo["PH"], geo["PW"]) != (0, 0):
        text += f" pad {geo['PH']}" if geo["PH"] == geo["PW"] else f" pad {geo['PH']}x{geo['PW']}"
    if (geo["DH"], geo["DW"]) != (1, 1):
        text += f" dilation {geo['DH']}" if geo["DH"] == geo["DW"] else f" dilation {geo['DH']}x{geo['DW']}"
    if geo["G"] > 1:
        text += f" groups {geo['G']}"
    return text


def conv_key(node) -> str:
    """What a conv kernel's speed depends on: the op, its geometry and dtype."""
    geo = _conv_geometry(node)
    return f"{node.op}:{node.inputs[0].dtype.name}:" + ",".join(f"{k}={geo[k]}" for k in sorted(geo))


def conv_tile_candidates(node, count: int = 4) -> list:
    """The cost model's `count` best tiles for an implicit-GEMM conv; [] for depthwise convs."""
    geo = _conv_geometry(node)
    if geo["CG"] == 1:
        return []
    acc = _acc_type(*(v.dtype for v in node.inputs), node.output.dtype)
    GM, GN = {"conv2d": (geo["OG"], geo["N"] * geo["OH"] * geo["OW"]),
              "conv2d_grad_input": (geo["CG"], geo["N"] * geo["H"] * geo["W"]),
              "conv2d_grad_weight": (geo["OG"], geo["CG"] * geo["KH"] * geo["KW"])}[node.op]
    return ranked_tiles(GM, GN, geo["G"], acc)[:count]


def conv2d_kernels(node, kernel_name, fusion=None):
    """Conv kernels. `fusion` (forward only) gives the fused node's params/args, the epilogue
    statements (run per output with `val` and its flat index `i`) and the fused op names."""
    kernels = _conv2d_kernels(node, kernel_name, fusion)
    if fusion is not None:
        kernels[-1].args, kernels[-1].ops = fusion["args"], fusion["ops"]
    return kernels


def _conv2d_kernels(node, kernel_name, fusion):
    geo = _conv_geometry(node)
    out = node.output
    first, second = node.inputs
    acc = _acc_type(first.dtype, second.dtype, out.dtype)
    op = {"conv2d": "fwd", "conv2d_grad_input": "dgrad", "conv2d_grad_weight": "wgrad"}[node.op]
    names = {"fwd": ("x", "w", "y"), "dgrad": ("grad", "w", "dx"), "wgrad": ("grad", "x", "dw")}[op]
    loads = {"fwd": dict(load_x=_loader(first.dtype, acc), load_w=_loader(second.dtype, acc), x_t=first.dtype.ctype,
                         w_t=second.dtype.ctype),
             "dgrad": dict(load_g=_loader(first.dtype, acc), load_w=_loader(second.dtype, acc), g_t=first.dtype.ctype,
                           w_t=second.dtype.ctype),
             "wgrad": dict(load_g=_loader(first.dtype, acc), load_x=_loader(second.dtype, acc), g_t=first.dtype.ctype,
                           x_t=second.dtype.ctype)}[op]
    ctx = dict(geo, name=kernel_name, acc=acc, store=_storer(out.dtype, acc), out_t=out.dtype.ctype, op=op,
               params=fusion["params"] if fusion else _params(node, names[:2], names[2:]),
               epilogue_lines=fusion["epilogue_lines"] if fusion else None, **loads)
    text = _conv_text(geo)
    N, C, H, W, O, CG, OG, G = (geo[k] for k in ("N", "C", "H", "W", "O", "CG", "OG", "G"))
    KH, KW, OH, OW = geo["KH"], geo["KW"], geo["OH"], geo["OW"]

    if CG == 1:                                             # depthwise (one input channel per group)
        kind = "dw_" + op
        if op == "wgrad":
            block = 1 if serial_blocks() else reduce_block(N * OH * OW)   # cpu: a thread sums in order
            what = f"{text} (depthwise, block per weight)"  # grad_weight: never fused
            source = _render("conv2d.cu.j2", kind=kind, comment=_comment(node, what), block=block, **ctx)
            return [_kernel(node, kernel_name, source, (min(O * KH * KW, MAX_BLOCKS), 1, 1), (block, 1, 1),
                            block > 1, what)]
        what = f"{text} (depthwise, direct)" + (fusion["what_extra"] if fusion else "")
        source = _render("conv2d.cu.j2", kind=kind, comment=_comment(node, what), numel=out.numel,
                         idx_t=_idx_type(out.numel), **ctx)
        return [_kernel(node, kernel_name, source, _grid_1d(out.numel), (BLOCK, 1, 1), False, what)]

    pointwise = (KH, KW) == (1, 1) and (geo["SH"], geo["SW"], geo["PH"], geo["PW"]) == (1, 1, 0, 0)
    if op == "fwd":
        GM, GN, GK, a_order, b_order = OG, N * OH * OW, CG * KH * KW, "k", "n"
    elif op == "dgrad":
        GM, GN, GK, a_order, b_order = CG, N * H * W, OG * KH * KW, "k", "n"
    else:
        GM, GN, GK, a_order, b_order = OG, CG * KH * KW, N * OH * OW, "k", "k"
    if max(GM, GN, GK) >= 2 ** 31 - 2 ** 16:
        raise NotImplementedError(f"{node.op}: implicit GEMM of {GM}x{GN}x{GK} overflows int indexing")
    # grad_weight's reduction (batch x pixels) splits across blocks when its tiles alone leave the
    # GPU idle; 16-bit outputs too: the partials stay float32 and are rounded once (`_split_k_wgrad_kernels`)
    can_split = op == "wgrad" and out.dtype in (dt.float16, dt.bfloat16, dt.float32, dt.float64)

    def k_splits(blocks, bk):
        return _wgrad_k_splits(GK, G, blocks, bk, out.numel * (8 if acc == "double" else 4),
                              first.numel * first.dtype.itemsize + second.numel * second.dtype.itemsize)

    kind = tensor_core_kind(first.dtype, second.dtype)
    warpgroup = kind is not None and warpgroup_mma()   # rendered for sm_90: wgmma instead of mma.sync
    chosen = node.attrs.get("tile")   # (BM, BN, TM, TN) measured by runtime/autotune.py; else the cost model
    split_rule = k_splits if can_split else None
    if warpgroup:
        t = _wgmma_implicit_gemm_tile(kind, geo, (GM, GN, G), op, pointwise, first.dtype, split_rule)
    elif kind is not None:
        t = _mma_implicit_gemm_tile(kind, GM, GN, G, first.dtype, op, split_rule)
    elif chosen:
        t = make_tile(chosen, acc, a_order, b_order)
    else:
        t = _choose_tile(GM, GN, G, acc, a_order, b_order, split_rule and (lambda blocks: k_splits(blocks, 16)))
    m_tiles, n_tiles = -(-GM // t.BM), -(-GN // t.BN)
    splits, kchunk = 1, GK
    if can_split:
        want = k_splits(m_tiles * n_tiles * G, t.BK)
        if want > 1:   # chunks of whole k tiles (the mainloops step k_begin by BK)
            kchunk = -(-(-(-GK // want)) // t.BK) * t.BK
            splits = -(-GK // kchunk)
    if G * splits > 65535 or m_tiles > 65535:
        raise NotImplementedError(f"{node.op}: grid too large ({G} groups x {splits} splits, {m_tiles} row tiles)")
    serial = kind is None and serial_blocks()
    what = f"{text} ({'1x1 as GEMM' if pointwise else 'implicit GEMM'} {t.BM}x{t.BN}" + \
        (f" on tensor cores, {kind} {'wgmma' if warpgroup else 'mma.sync'}" if kind else "") + \
        (f", split-k {splits}" if splits > 1 else "") + (", one thread per tile" if serial else "") + ")" + \
        (fusion["what_extra"] if fusion else "")
    if splits == 1:
        source = _render("conv2d.cu.j2", kind="igemm", comment=_comment(node, what), GM=GM, GN=GN, GK=GK, t=t,
                         splits=splits, kchunk=kchunk, pointwise=pointwise, tensor_cores=kind, warpgroup=warpgroup,
                         serial=serial, **ctx)
        return [_kernel(node, kernel_name, source, (n_tiles, m_tiles, G), (1 if serial else t.NT, 1, 1),
                        not serial, what, smem=t.smem if kind else 0)]
    return _split_k_wgrad_kernels(node, kernel_name, ctx, what, splits, dict(
        GM=GM, GN=GN, GK=GK, t=t, kchunk=kchunk, pointwise=pointwise, tensor_cores=kind, warpgroup=warpgroup,
        serial=serial),
        grid=(n_tiles, m_tiles, G * splits), block=(1 if serial else t.NT, 1, 1), smem=t.smem if kind else 0)


# Split-k grad_weight: at least this many k tiles per split (each block's pipeline fills and drains
# once), and at most this much scratch for the partials. The scratch is arena memory at the
# backward's peak, written once by the implicit GEMM and read once by the combine: 2 x its size in
# memory traffic, a traffic the unsplit kernel does not have. So splits stop where that traffic
# would pass the conv's own (reading its two operands once; below it the extra traffic costs less
# than the idle SMs it fills), and at 64 MiB whatever the operands' size (a few tens of
# microseconds of an H100's HBM; an arena slot well below a ResNet-50 batch's activations).
_SPLIT_K_MIN_K_TILES, _SPLIT_K_SCRATCH_BYTES = 16, 64 << 20


def _wgrad_k_splits(GK: int, G: int, blocks: int, bk: int, split_bytes: int, operand_bytes: int) -> int:
    """Ways to split grad_weight's reduction of GK (batch x pixels) terms across blocks, for a
    grid of `blocks` tiles (all G groups) with k tiles of `bk`: enough blocks to fill the target
    (`target_blocks`), at least _SPLIT_K_MIN_K_TILES k tiles per split, G x splits within the
    grid's z limit, and the scratch (`split_bytes` of partial sums per split) within the cap above
    (`operand_bytes`: the conv's two inputs)."""
    scratch_cap = min(_SPLIT_K_SCRATCH_BYTES, operand_bytes // 2)
    return max(1, min(-(-target_blocks() // blocks), -(-GK // (bk * _SPLIT_K_MIN_K_TILES)), 65535 // G,
                      scratch_cap // split_bytes))


def _split_k_wgrad_kernels(node, kernel_name, ctx, what, splits, igemm, grid, block, smem) -> list:
    """A split-k grad_weight as two kernels, deterministic (the same bits every run): the
    implicit GEMM writes each split's partial dw, unrounded (float32; float64 for float64
    convs), to its own slice of a scratch buffer (placed in the arena by the memory planner,
    like fused.py's split reductions), then `<name>_combine` adds the slices in split order, one
    thread per weight (no barrier, no atomics), and rounds once to dw's dtype (bf16/fp16 under
    AMP: one rounding, as the unsplit kernel's). Against the unsplit kernel only the grouping of
    the sum changes (each split's chunk of batch x pixels, then the chunks' sums): both are
    within the accumulator's summation error of the exact (float64) sum, and equal where every
    partial sum is exact (small integer inputs)."""
    out, acc = node.output, ctx["acc"]
    scratch = Value(f"{out.name}_partials", (splits * out.numel,), dt.float64 if acc == "double" else dt.float32)
    params = _params(node, ["grad", "x"], [])[:2] + [f"{acc}* __restrict__ partials"]
    args = _args(node)[:2] + [BufferArg(scratch, f"{acc}*")]
    what = f"{what} -> partial sums per split"
    source = _render("conv2d.cu.j2", kind="igemm", comment=_comment(node, what), splits=splits,
                     **dict(ctx, params=params), **igemm)
    partial = Kernel(name=kernel_name, source=source, args=args, grid=tuple(grid), block=tuple(block), smem=smem,
                     needs_fibers=not igemm["serial"], comment=_comment(node, what), ops=[node.op])
    combine_what = f"(combine {splits} split-k partials in order)"
    source = _render("conv2d.cu.j2", kind="splitk_combine", comment=_comment(node, combine_what), splits=splits,
                     numel=out.numel, idx_t=_idx_type(out.numel), **dict(ctx, name=f"{kernel_name}_combine"))
    combine = Kernel(name=f"{kernel_name}_combine", source=source,
                     args=[BufferArg(scratch, f"const {acc}*"), BufferArg(out, f"{out.dtype.ctype}*")],
                     grid=_grid_1d(out.numel), block=(BLOCK, 1, 1), needs_fibers=False,
                     comment=_comment(node, combine_what), ops=[node.op])
    return [partial, combine]


# Families whose ops read a tensor as indices: their renderers take the node's check id.
_INDEX_FAMILIES = {"softmax", "gather", "scatter"}


# --------------------------------------------------------------------------
# attention: softmax(q k^T * scale + mask) v and its gradients without the [L, S] scores

def _attention(node, kernel_name, rng=None):
    """`attention`: one forward kernel (output + logsumexp); `attention_backward`: the dQ kernel
    (which also saves D = rowsum(dO * O) in a scratch buffer) then the dK/dV kernel. The
    `_dropout` variants also read the graph's rng state `rng` (seed, base offset) when their
    stream is bound (passes/random_streams.py), else their own seed/offset attributes. On a GPU
    the kernels are tiled (attention_tiled.cu.j2, `_attention_tiling`); on the cpu target, a
    thread per row (attention.cu.j2)."""
    q, k, v = node.inputs[:3]
    L, E, S, Ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if S == 0:
        raise NotImplementedError(f"{node.op}: no keys (S = 0) in {_shape_text(k.shape)}")
    plain = 6 if node.op.endswith("_backward") else 3   # inputs before the optional mask
    mask = node.inputs[plain] if len(node.inputs) > plain else None
    acc = _acc_type(q.dtype)
    causal = bool(node.attrs["causal"])
    ctx = dict(slices=_numel(q.shape[:-2]), L=L, S=S, E=E, Ev=Ev, causal=causal,
               causal_text=", causal (keys j <= i)" if causal else "", q_t=q.dtype.ctype, acc=acc,
               load=_loader(q.dtype, acc), store=_storer(q.dtype, acc),
               exp="exp" if acc == "double" else "expf", log="log" if acc == "double" else "logf",
               one="1.0" if acc == "double" else "1.0f", neg_inf=_neg_inf(acc), out_t=q.dtype.ctype,
               scale=repr(float(node.attrs["scale"])) if acc == "double" else _f32_literal(node.attrs["scale"]),
               keys_of_row=f"(i + 1 < {S} ? i + 1 : {S})" if causal else str(S), first_query="j" if causal else "0",
               dropout=_attention_dropout(node.attrs, rng is not None),
               **_attention_mask_context(mask, q.shape[:-2], L, S, acc))
    tiling = _attention_tiling(q.dtype, E, Ev, acc)
    shapes = f"{_shape_text(q.shape)} x {_shape_text(k.shape)}" + (" causal" if causal else "") + \
        (f" mask {_shape_text(mask.shape)}" if mask is not None else "") + \
        (f" dropout {node.attrs['dropout_p']}" if ctx["dropout"] else "")
    extra = [(mask, "mask")] if mask is not None else []
    extra += [(rng, "rng")] if rng is not None else []
    if node.op.endswith("_backward"):
        return _attention_backward(node, kernel_name, ctx, tiling, shapes, extra)
    y, lse = node.outputs
    what = f"{shapes} -> {_shape_text(y.shape)} + logsumexp ({_attention_layout(tiling, 'query')}, online softmax)"
    return [_attention_kernel(node, ctx, tiling, kernel_name, "forward", what, L,
                              [(q, "q"), (k, "k"), (v, "v"), *extra], [(y, "y"), (lse, "lse")])]


def _attention_dropout(attrs, streamed: bool):
    """The dropout's p (a float32 literal) and its seed/offset as C++: read from the rng state
    when the stream is bound, else the attributes; None without dropout."""
    if "dropout_p" not in attrs:
        return None
    seed, offset = ("(unsigned long long)rng[0]", f"(unsigned long long)(rng[1] + {attrs['offset']}LL)") \
        if streamed else (f"{attrs['seed'] & (2 ** 64 - 1)}ULL", f"{attrs['offset']}ULL")
    return dict(p=_f32_literal(attrs["dropout_p"]), text=attrs["dropout_p"], seed=seed, offset=offset)


def _attention_mask_context(mask, lead, L, S, acc) -> dict:
    """How the kernels index a mask broadcast to [*lead, L, S]: `mask_slice` (the offset of the
    (batch x head) slice, a term "(slice / 3LL % 2LL) * 12LL" per non-broadcast lead dim) and the
    strides of i and j (0 where the mask's dim is 1)."""
    if mask is None:
        return dict(mask=None, mask_text="")
    full = (*lead, L, S)
    shape = (1,) * (len(full) - len(mask.shape)) + tuple(mask.shape)
    strides = [0 if n == 1 else st for n, st in zip(shape, _strides(shape))]
    inner = _strides(lead)
    slice_terms = [f"(slice / {inner[d]}LL % {lead[d]}LL) * {strides[d]}LL" for d in range(len(lead)) if strides[d]]
    kind = "bool" if mask.dtype == dt.bool_ else "float"
    return dict(mask=kind, mask_slice=slice_terms, mask_stride_i=strides[-2], mask_stride_j=strides[-1],
                load_mask=_loader(mask.dtype, acc),
                mask_text=f", {kind} mask {_shape_text(mask.shape)} broadcast to {_shape_text(full)}")


# Tiled attention (attention_tiled.cu.j2): blocks of ATTENTION_THREADS threads (4 warps), each over
# a tile of ATTENTION_TILE rows (queries, or keys for dK/dV) against streamed tiles of as many rows.
ATTENTION_THREADS, ATTENTION_TILE = 128, 64
# Head dims up to this run tiled (the accumulators of a [64, 128] tile per block fill the registers).
ATTENTION_MAX_HEAD_DIM = 128
# Shared memory a tiled attention kernel may take (of an H100's 227 KiB per block).
ATTENTION_SMEM_LIMIT = 200 * 1024


def _attention_tiling(dtype, E: int, Ev: int, acc: str):
    """The tiled kernels' constants, or None for a thread per row: on the cpu target (one thread
    per block there: the tiles' barriers and shuffles would run as fibers, while a thread per row
    streams K and V from cache), and for head dims over ATTENTION_MAX_HEAD_DIM or tiles over
    ATTENTION_SMEM_LIMIT (float64 with head dims over 64). 16-bit inputs run on tensor cores
    ("mma" engine; a thread per row when rendered without tensor cores), float32/float64 on scalar
    loops ("simt")."""
    mma = dtype in (dt.bfloat16, dt.float16)
    if serial_blocks() or max(E, Ev) > ATTENTION_MAX_HEAD_DIM or (mma and not tensor_cores()):
        return None
    EP, EvP = -(-E // 16) * 16, -(-Ev // 16) * 16        # head dims zero-padded to the k step
    pad = 8 if mma else 1                                # 16 bytes (ldmatrix rows); 1 (odd: no bank conflicts)
    elem, acc_bytes = (2 if mma else 4 if acc == "float" else 8), 4 if acc == "float" else 8
    T = ATTENTION_TILE
    tile_e, tile_v = T * (EP + pad) * elem, T * (EvP + pad) * elem
    smem = 2 * tile_e + 2 * tile_v + 2 * T * acc_bytes + (0 if mma else T * (T + 1) * acc_bytes)
    if smem > ATTENTION_SMEM_LIMIT:
        return None
    smem_t = dtype.ctype if mma else acc
    return dict(engine="mma" if mma else "simt", NT=ATTENTION_THREADS, BM=T, BN=T,
                RA=2 if mma else T // (ATTENTION_THREADS // 16), EP=EP, EvP=EvP, LDE=EP + pad, LDV=EvP + pad,
                LDP=T + 1, smem_t=smem_t, tile_bytes_e=tile_e, tile_bytes_v=tile_v, acc_bytes=acc_bytes,
                smem=smem, mma=f"mma_m16n8k16_{'bf16' if dtype == dt.bfloat16 else 'f16'}" if mma else None,
                to_smem=(lambda expr: expr) if mma else _loader(dtype, acc),
                smem_zero=_store("0.0f", dtype) if mma else "0")


def _attention_layout(tiling, rows: str) -> str:
    """How a kernel's work is split, for its comment."""
    if tiling is None:
        return f"thread per {rows} row"
    where = f"tensor cores, {tiling['mma'].rsplit('_', 1)[1]} mma.sync" if tiling["engine"] == "mma" else "SIMT"
    return f"block per {tiling['BM']} {rows} rows, {where}"


def _attention_backward(node, kernel_name, ctx, tiling, shapes, extra) -> list:
    """Two kernels: over query rows (D -> scratch, dQ), then over key rows (dK, dV). `extra`: the
    (mask, rng) arguments the node has."""
    q, k, v, o, dout, lse = node.inputs[:6]
    dq, dk, dv = node.outputs
    rowdot = Value(f"{dq.name}_rowdot", tuple(lse.shape), dt.float64 if ctx["acc"] == "double" else dt.float32)
    dq_what = f"{shapes} -> dQ {_shape_text(dq.shape)} ({_attention_layout(tiling, 'query')}; " \
              f"D = rowsum(dO * O) to scratch)"
    dkdv_what = f"{shapes} -> dK {_shape_text(dk.shape)}, dV {_shape_text(dv.shape)} ({_attention_layout(tiling, 'key')})"
    return [
        _attention_kernel(node, ctx, tiling, f"{kernel_name}_dq", "backward_dq", dq_what, ctx["L"],
                          [(q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout"), (lse, "lse"), *extra],
                          [(dq, "dq_out"), (rowdot, "rowdot")]),
        _attention_kernel(node, ctx, tiling, f"{kernel_name}_dkdv", "backward_dkdv", dkdv_what, ctx["S"],
                          [(q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (lse, "lse"), (rowdot, "rowdot"), *extra],
                          [(dk, "dk_out"), (dv, "dv_out")]),
    ]


def _attention_kernel(node, ctx, tiling, name, kind, what, rows_per_slice, reads, writes) -> Kernel:
    """One kernel over the `rows_per_slice` rows of every slice: a thread per row, or with `tiling` a
    block per tile of rows; `reads`/`writes`: (Value, parameter name) in argument order."""
    args = [BufferArg(x, f"const {x.dtype.ctype}*") for x, _ in reads] + \
        [BufferArg(x, f"{x.dtype.ctype}*") for x, _ in writes]
    params = [f"const {x.dtype.ctype}* __restrict__ {n}" for x, n in reads] + \
        [f"{x.dtype.ctype}* __restrict__ {n}" for x, n in writes]
    comment = _comment(node, what)
    if tiling is None:
        rows = ctx["slices"] * rows_per_slice
        source = _render("attention.cu.j2", kind=kind, name=name, comment=comment, rows=rows,
                         idx_t=_idx_type(rows), params=params, **ctx)
        return Kernel(name=name, source=source, args=args, grid=_grid_1d(rows), block=(BLOCK, 1, 1),
                      needs_fibers=False, comment=comment, ops=[node.op])
    if kind == "backward_dkdv" and max(tiling["EP"], tiling["EvP"]) > 64:
        tiling = dict(tiling, BN=tiling["BN"] // 2)   # dK and dV fill the registers: half the score tile
    tiles = -(-rows_per_slice // tiling["BM"])
    source = _render("attention_tiled.cu.j2", kind=kind, name=name, comment=comment, params=params,
                     tiles_per_slice=tiles, **ctx, **tiling)
    return Kernel(name=name, source=source, args=args, grid=(ctx["slices"] * tiles, 1, 1),
                  block=(tiling["NT"], 1, 1), smem=tiling["smem"], needs_fibers=True, comment=comment,
                  ops=[node.op])


# --------------------------------------------------------------------------
# randperm

def _randperm(node, kernel_name, rng):
    n = node.output.numel
    comment = _comment(node, f"of {n}")
    source = _render("randperm.cu.j2", name=kernel_name, comment=comment, n=n, offset=node.attrs["offset"])
    args = [BufferArg(node.output, "long long*"), BufferArg(rng, "const long long*")]
    return [Kernel(name=kernel_name, source=source, args=args, grid=(1, 1, 1), block=(1, 1, 1),
                   needs_fibers=False, comment=comment, ops=[node.op])]


_FAMILIES = {
    "gemm": _gemm,
    "copy": _copy,
    "softmax": _softmax,
    "argreduce": _argreduce,
    "scan": _scan,
    "sort": _sort,
    "gather": _gather,
    "scatter": _scatter,
    "nonfinite": _nonfinite,
    "pool2d": _pool2d,
    "upsample": _upsample,
    "conv2d": conv2d_kernels,
    "randperm": _randperm,
    "attention": _attention,
    "layer_norm": _layer_norm,
}
