"""Ordered walks along one dim, the numbers NumPy's (the eager reference) bit for bit.

* scan — cumsum / cumprod (forward or reversed) along any dim (templates/scan.cu.j2): one thread
         per row, sequential in the dtype; few long contiguous rows on a GPU: a block per row
         stages chunks in shared memory, coalesced, and its thread 0 scans them in the same order.
* sort — sort / topk along any dim (sort.cu.j2): one thread per element counts its rank in its
         row (the elements with a smaller key, or an equal one at a lower index: stable, NaN
         largest) and writes itself there. Rows longer than SORT_RUN: ranked in runs of SORT_RUN
         into a scratch row, then `<name>_merge<s>` kernels merge neighbouring runs (each element's
         position found by binary search in the other run), the last one into the outputs. topk of
         k <= SELECT_MAX_K from such rows: one kernel, a block per row (one thread on the cpu
         target) radix-selects the k-th order key, keeps the k first elements in shared memory and
         ranks them among themselves. The cpu target sorts the other long rows a thread per row by
         LSD radix sort of the same keys (scratch rows of keys and indices).
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, Kernel, RenderContext
from flowgen.codegen.kernels.common import (BLOCK, acc_type, convert_to, grid_1d, index_type, loader,
                                            node_comment, node_kernel, render_template, row_blocks, row_element,
                                            row_layout, shape_text, store_as)
from flowgen.codegen.target import serial_blocks, target_blocks
from flowgen.ir.graph import Value


def render_scan(node, ctx: RenderContext) -> list:
    return _scan(node, ctx.kernel_name(node, [node.op]))


def render_sort(node, ctx: RenderContext) -> list:
    return _sort(node, ctx.kernel_name(node, [node.op]))


# --------------------------------------------------------------------------
# scan: cumsum / cumprod

def _scan_step(op: str, dtype):
    """C++ of one scan step in `dtype`: the running value combined with the next element, then
    rounded to `dtype` (NumPy's accumulate in the dtype); integers wrap (two's complement, as NumPy)."""
    sign = "+" if op == "cumsum" else "*"
    if not dtype.is_floating:
        return lambda run, x: f"({dtype.ctype})((unsigned long long)({run}) {sign} (unsigned long long)({x}))"
    acc = acc_type(dtype)
    return lambda run, x: store_as(f"{convert_to(run, dtype, acc)} {sign} {convert_to(x, dtype, acc)}", dtype)


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
    outer, D, inner = row_layout(x.shape, dim)
    rows = outer * inner
    reverse = bool(node.attrs["reverse"])
    ctx = dict(name=kernel_name, op=node.op, dim=dim, shape=shape_text(x.shape), rows=rows, D=D, inner=inner,
               reverse=reverse, direction="from the last element to the first" if reverse else "from the first element",
               stride_text=f" (stride {inner})" if inner > 1 else "", t=x.dtype.ctype, dtype=x.dtype.name,
               first=D - 1 if reverse else 0, elem=row_element(inner), step=_scan_step(node.op, x.dtype),
               idx_t=index_type(rows))
    where = f"along dim {dim} of {shape_text(x.shape)}" + (" reversed" if reverse else "")
    if _use_block_scan(rows, D, inner):
        what = f"{where} (block per row)"
        source = render_template("scan.cu.j2", kind="block", comment=node_comment(node, what), block=BLOCK,
                                 chunk=SCAN_CHUNK,
                                 at=(lambda j: f"{D - 1} - ({j})") if reverse else (lambda j: j), **ctx)
        return [node_kernel(node, kernel_name, source, row_blocks(rows), (BLOCK, 1, 1), True, what)]
    what = f"{where} (thread per row)"
    source = render_template("scan.cu.j2", kind="thread", comment=node_comment(node, what), **ctx)
    return [node_kernel(node, kernel_name, source, grid_1d(rows), (BLOCK, 1, 1), False, what)]


# --------------------------------------------------------------------------
# sort: sort / topk

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
    outer, D, inner = row_layout(x.shape, dim)
    descending = bool(node.attrs["descending"] if node.op == "sort" else node.attrs["largest"])
    K = node.attrs["k"] if node.op == "topk" else D
    acc = "int" if x.dtype == dt.bool_ else acc_type(x.dtype)
    order = "descending" if descending else "ascending"
    passes = ((D - 1) // SORT_RUN).bit_length()
    ctx = dict(op=node.op, dim=dim, shape=shape_text(x.shape), rows=outer * inner, D=D, K=K, inner=inner,
               order=order, stride_text=f" (stride {inner})" if inner > 1 else "", t=x.dtype.ctype, acc=acc,
               load=loader(x.dtype, acc), elem=row_element(inner), cmp=">" if descending else "<",
               has_nan=x.dtype.is_floating, nan_first=descending, numel=x.numel, idx_t=index_type(x.numel),
               passes=passes, what=f"along dim {dim} of {shape_text(x.shape)}, {order}"
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
    key_bits = 32 if acc_type(dtype) == "float" else 64
    return dict(key_bits=key_bits, key_t="unsigned int" if key_bits == 32 else "unsigned long long",
                key_kind="float" if dtype.is_floating else "integer", descending=descending)


def _select_kernel(node, name, ctx, args, keys) -> Kernel:
    """topk by radix select (sort.cu.j2 kind "select"): one block per row; its threads share the
    row's histograms on a GPU, one thread walks it on the cpu target (no barriers, no fibers)."""
    per_warp = 32 * SELECT_PER_THREAD
    warps = 1 << ((ctx["D"] + per_warp - 1) // per_warp - 1).bit_length()   # a power of two
    threads = 1 if serial_blocks() else min(SELECT_THREADS, 32 * warps)
    step_what = f"radix select, block of {threads} per row" if threads > 1 else "radix select, thread per row"
    comment = node_comment(node, f"{ctx['what']} ({step_what})")
    # the cpu target's work per row (flowgen_emu::SerialBlocks): ~8 operations an element a read of the row
    row_work = 8 * ctx["D"] * (keys["key_bits"] // 8 + 2)
    source = render_template("sort.cu.j2", kind="select", name=name, comment=comment,
                             out_params=_sort_out_params(ctx["t"]), threads=threads, row_work=row_work, **keys, **ctx)
    return Kernel(name=name, source=source, args=args, grid=row_blocks(ctx["rows"]),
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
    comment = node_comment(node, f"{ctx['what']} (radix sort, thread per row)")
    row_work = 8 * ctx["D"] * (keys["key_bits"] // 4 + 2)   # ~8 operations an element a walk of the row
    source = render_template("sort.cu.j2", kind="radix", name=name, comment=comment,
                             out_params=_sort_out_params(ctx["t"]), row_work=row_work, **keys, **ctx)
    return Kernel(name=name, source=source, args=args + scratch, grid=row_blocks(ctx["rows"]),
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
    comment = node_comment(node, f"{ctx['what']} ({step_what})")
    out_params = _sort_out_params(ctx["t"], "" if step["to_outputs"] else "dst_")
    source = render_template("sort.cu.j2", name=name, comment=comment, out_params=out_params, **ctx, **step)
    return Kernel(name=name, source=source, args=args, grid=grid_1d(ctx["numel"]), block=(BLOCK, 1, 1),
                  needs_fibers=False, comment=comment, ops=[node.op])
