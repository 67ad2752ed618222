"""Kernels that read a tensor as indices, each checking them (kernels/common.py, "Index checks").

* gather  — gather / index_select / embedding (templates/gather.cu.j2): one thread per output element.
* scatter — scatter_add / index_add / embedding_backward (scatter.cu.j2), deterministic: the entries
            (source elements, or rows along dim) are grouped by destination with integer work only
            into int32 scratch buffers (`<name>_rows`: one block counts them per destination and
            prefix-sums the counts, `<name>_fill`, `<name>_sort`: each segment in ascending entry
            order), then `<name>`, one thread per output element, adds its segment's sources in that
            order (double for floats, like the eager np.bincount) and stores once: the eager bits,
            every run. padding_idx is skipped. One thread sorts a segment (heapsort); on the GPU a
            segment of more than 256 entries (a token in many rows) is sorted by a block instead
            (`<name>_sort_long`: insertion-sorted runs, then merge passes through a second scratch
            buffer).
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, Kernel, RenderContext
from flowgen.codegen.kernels.common import (BLOCK, USER_OPS, contiguous_strides, coordinates, grid_1d, index_type,
                                            loader, make_index_check, node_comment, node_kernel, node_params,
                                            numel_of, offset_expr, render_template, shape_text, storer, zero_kernel,
                                            zero_literal)
from flowgen.codegen.target import serial_blocks, target_blocks
from flowgen.ir.graph import Value


def render_gather(node, ctx: RenderContext) -> list:
    return _gather(node, ctx.kernel_name(node, [node.op]), ctx.check_id)


def render_scatter(node, ctx: RenderContext) -> list:
    return _scatter(node, ctx.kernel_name(node, [node.op]), ctx.check_id)


def _select_layout(shape, dim):
    """(outer, size, inner) of `shape` around `dim`."""
    return numel_of(shape[:dim]), shape[dim], numel_of(shape[dim + 1:])


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
        lines, coords = coordinates(ishape, "i", "c")
        coords[dim] = "k"
        what = f"dim {dim}: {shape_text(x.shape)} at index {shape_text(index.shape)}"
        coord_lines = [ln for ln in lines if not ln.startswith(f"const long long c{dim} ")]
        source = render_template("gather.cu.j2", kind="gather", name=kernel_name, comment=node_comment(node, what),
                                 out_shape=shape_text(out.shape), x_shape=shape_text(x.shape), dim=dim,
                                 size=shape[dim], x_t=x.dtype.ctype, index_t=index.dtype.ctype, out_t=out.dtype.ctype,
                                 numel=out.numel, idx_t=index_type(out.numel), coord_lines=coord_lines,
                                 src_offset=offset_expr(coords, contiguous_strides(shape)),
                                 zero=zero_literal(out.dtype), check_id=check_id)
        check = make_index_check(node, check_id, "index", shape[dim], dim)
        return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what,
                            index_check=check)]
    if node.op == "index_select":
        x, index = node.inputs
        shape = tuple(x.shape) or (1,)
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = _select_layout(shape, dim)
        names, what = ("x", "index"), f"dim {dim} of {shape_text(x.shape)}, {index.numel} indices"
        check = make_index_check(node, check_id, "index", size, dim)
    else:                                                   # embedding(weight, indices)
        x, index = node.inputs
        outer, size, inner = 1, x.shape[0], x.shape[1]
        names, what = ("weight", "indices"), f"{index.numel} rows of {shape_text(x.shape)}"
        check = make_index_check(node, check_id, "index", size)
    n = index.numel
    j_expr, offset = _select_exprs(outer, n, inner, size)
    source = render_template("gather.cu.j2", kind="select", name=kernel_name, comment=node_comment(node, what),
                             what=node.op, params=node_params(node, names, ("out",)), outer=outer, n=n, size=size,
                             inner=inner, j_expr=j_expr, src_offset=offset, index_name=names[1], x_name=names[0],
                             numel=out.numel, idx_t=index_type(out.numel), zero=zero_literal(out.dtype),
                             check_id=check_id, wrap_negative=node.attrs.get("wrap_negative", False))
    return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what, index_check=check)]


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
        raise NotImplementedError(f"{USER_OPS.get(node.op, node.op)}: no scatter kernel for {out.dtype.name} "
                                  f"(float16, bfloat16, float32, float64, int32 or int64)")
    acc = _SCATTER_ACC[out.dtype]
    index, src = (node.inputs[1], node.inputs[0]) if node.op == "embedding_backward" else node.inputs
    seg = _scatter_segments(node, index, src)
    if seg["entries"] > 2 ** 30 or seg["keys"] >= 2 ** 31 - 1:
        raise NotImplementedError(f"{USER_OPS.get(node.op, node.op)}: {seg['entries']} entries into "
                                  f"{seg['keys']} destinations exceed the scatter kernels' int positions "
                                  f"(at most 2^30 entries)")
    if seg["entries"] == 0:
        return [zero_kernel(node, kernel_name, out, "the whole result: nothing is scattered into it")]
    counts = Value(f"{out.name}_counts", (seg["keys"],), dt.int32)
    offsets = Value(f"{out.name}_offsets", (seg["keys"] + 1,), dt.int32)
    positions = Value(f"{out.name}_positions", (seg["entries"],), dt.int32)
    serial = serial_blocks()
    # on the GPU a block sorts each segment longer than _LONG_SEGMENT: a thread would take O(L log L) steps
    long_segment = None if serial or seg["entries"] <= _LONG_SEGMENT else _LONG_SEGMENT
    ctx = dict(seg, index_t=index.dtype.ctype, check_id=check_id, serial=serial, long_segment=long_segment,
               threads=min(1024, -(-max(seg["entries"], seg["keys"]) // 32) * 32),   # the rows kernel's block
               idx_t=index_type(seg["entries"], seg["keys"], src.numel, out.numel))
    index_arg = BufferArg(index, f"const {index.dtype.ctype}*")
    rows = _scatter_helper(node, kernel_name, "rows", f"segments of {seg['entries']} entries over {seg['keys']} "
                           f"destinations", [index_arg, BufferArg(counts, "int*"), BufferArg(offsets, "int*")],
                           (1, 1, 1), (1 if serial else ctx["threads"], 1, 1), ctx,
                           index_check=make_index_check(node, check_id, "index", seg["size"], seg["dim"]))
    fill = _scatter_helper(node, kernel_name, "fill", "entries into their segments",
                           [index_arg, BufferArg(offsets, "const int*"), BufferArg(counts, "int*"),
                            BufferArg(positions, "int*")], grid_1d(seg["entries"]), (BLOCK, 1, 1), ctx)
    sorts = [_scatter_helper(node, kernel_name, "sort", "each segment in entry order",
                             [BufferArg(offsets, "const int*"), BufferArg(positions, "int*")],
                             grid_1d(seg["keys"]), (BLOCK, 1, 1), ctx)]
    if long_segment:
        merged = Value(f"{out.name}_merged", (seg["entries"],), dt.int32)
        sorts.append(_scatter_helper(
            node, kernel_name, "sort_long", f"segments of more than {long_segment} entries in entry order",
            [BufferArg(offsets, "const int*"), BufferArg(positions, "int*"), BufferArg(merged, "int*")],
            (min(seg["keys"], target_blocks()), 1, 1), (BLOCK, 1, 1), ctx))
    source = render_template("scatter.cu.j2", kind="sum", name=kernel_name, comment=node_comment(node, seg["what"]),
                             src_t=src.dtype.ctype, out_t=out.dtype.ctype, numel=out.numel, acc=acc,
                             load=loader(src.dtype, acc), store=storer(out.dtype, acc), **ctx)
    total = Kernel(name=kernel_name, source=source,
                   args=[BufferArg(src, f"const {src.dtype.ctype}*"), BufferArg(offsets, "const int*"),
                         BufferArg(positions, "const int*"), BufferArg(out, f"{out.dtype.ctype}*")],
                   grid=grid_1d(out.numel), block=(BLOCK, 1, 1), needs_fibers=False,
                   comment=node_comment(node, seg["what"]), ops=[node.op])
    return [rows, fill, *sorts, total]


def _scatter_helper(node, kernel_name, kind, what, args, grid, block, ctx, index_check=None) -> Kernel:
    """`<kernel_name>_<kind>`: one of a scatter's integer kernels (rows, fill, sort, sort_long);
    sort_long and the block-wide rows kernel synchronise."""
    name = f"{kernel_name}_{kind}"
    comment = node_comment(node, f"({what})")
    source = render_template("scatter.cu.j2", kind=kind, name=name, comment=comment, **ctx)
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
        lines, coords = coordinates(tuple(src.shape) or (1,), "m", "c")
        coords[dim] = "k"
        return dict(entries=src.numel, keys=out.numel, size=shape[dim], dim=dim, padding_idx=-1,
                    wrap_negative=False, key_lines=[ln for ln in lines if not ln.startswith(f"const long long c{dim} ")],
                    key_expr=offset_expr(coords, contiguous_strides(shape)), out_lines=[], out_key="i", src_offset="j",
                    what=f"dim {dim}: {shape_text(src.shape)} into {shape_text(out.shape)}",
                    formula="out[i] = the sum of src[j] over the source elements j whose destination is i")
    if node.op == "index_add":                              # an entry per source slice along dim
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = _select_layout(shape, dim)
        pad, what = -1, f"dim {dim}: {index.numel} slices into {shape_text(out.shape)}"
    else:                                                   # embedding_backward: an entry per row of grad
        dim, outer, size, inner = None, 1, out.shape[0], out.shape[1]
        pad = node.attrs.get("padding_idx", -1)
        pad = -1 if pad is None or pad < 0 else pad
        what = f"{index.numel} rows into {shape_text(out.shape)}" + (f", padding_idx {pad}" if pad >= 0 else "")
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
