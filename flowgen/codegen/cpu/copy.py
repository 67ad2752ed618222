"""Copies of the cpu target as native kernels (templates/cpu_copy.cpp.j2): permute, slice,
slice_backward and cat, each a loop spread over the pool. A permute reads each output element at
its permuted index (the emulated kernel of a transposing permute moves 32x32 tiles through shared
memory with barriers, so its threads run as fibers on the emulator, its slowest path: a Linear's
weight transpose took tens of milliseconds). A slice or slice_backward walks the output a row (its
last dim) at a time, the row's source found once; a cat copies each input's contiguous blocks.
Copies move values unchanged (or converted as the emulated kernels convert), so any dtype."""
from __future__ import annotations

from flowgen.codegen.fused import unique_name, value_param_name
from flowgen.codegen.kernels.common import (contiguous_strides, converter, coordinates, node_args, node_comment,
                                            numel_of, offset_expr, shape_text, zero_literal)
from flowgen.codegen.kernels.layout import slice_selection
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.templates import get_template


def render(node, ctx: RenderContext):
    """A permute, slice, slice_backward or cat node as one native kernel, or None (a 0-d slice)."""
    return {"permute": _permute, "slice": _slice, "slice_backward": _slice_backward, "cat": _cat}[node.op](node, ctx)


def _kernel(node, ctx, what, **context) -> list:
    name = ctx.kernel_name(node, [node.op])
    comment = node_comment(node, what)
    source = get_template("cpu_copy.cpp.j2").render(name=name, comment=comment, **context)
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op])]


def _permute(node, ctx):
    """A `permute` node as one native kernel: rows copied whole where the last dim stays last, 32 x 32
    tiles where only the last two dims swap, else a loop over the output elements."""
    x, out = node.inputs[0], node.output
    n = len(x.shape)
    dims = tuple(d % max(n, 1) for d in node.attrs["dims"])
    strides = contiguous_strides(x.shape)
    text = f"dims {dims}: {shape_text(x.shape)} -> {shape_text(out.shape)}"
    context = dict(in_t=x.dtype.ctype, out_t=out.dtype.ctype, convert=converter(x.dtype, out.dtype),
                   out_shape=shape_text(out.shape), in_shape=shape_text(x.shape))
    if n >= 2 and dims[-1] == n - 1:
        rows, width, lines, coords = _rows(out.shape)
        return _kernel(node, ctx, f"{text} (a row per iteration)", kind="slice",
                       source_text=f"in {shape_text(x.shape)} with its dims permuted {dims}",
                       rows=rows, width=width, row_lines=lines, step=1,
                       src_offset=offset_expr(coords, [strides[d] for d in dims[:-1]]), **context)
    if n >= 2 and dims == (*range(n - 2), n - 1, n - 2):
        R, C = x.shape[-2:]
        return _kernel(node, ctx, f"{text} (32 x 32 tiles)", kind="transpose", batch=numel_of(x.shape[:-2]), R=R, C=C,
                       tiles_r=-(-R // 32), tiles_c=-(-C // 32), **context)
    lines, coords = coordinates(out.shape, "i", "c")
    return _kernel(node, ctx, f"{text} (a loop over the output)", kind="map", map_text=f"permuted index, dims {dims}",
                   numel=out.numel, coord_lines=lines, src_offset=offset_expr(coords, [strides[d] for d in dims]),
                   **context)


def _slice_text(attrs) -> str:
    return ", ".join(f"{b}:{e}:{st}" for b, e, st in zip(attrs["starts"], attrs["stops"], attrs["steps"]))


def _rows(shape) -> tuple:
    """(rows, row length, coordinate lines of row `r`, the rows' coordinates): `shape` walked a
    last-dim row at a time."""
    lines, coords = coordinates(shape[:-1], "r", "c")
    return numel_of(shape[:-1]), shape[-1], lines, coords


def _slice(node, ctx):
    """A `slice` node as one native kernel: per output row, the source row's start once, then its
    elements `step` apart."""
    x, out = node.inputs[0], node.output
    if not out.shape:
        return None
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    xs = contiguous_strides(x.shape)
    base = sum(b * s for b, s in zip(starts, xs))
    rows, width, lines, coords = _rows(out.shape)
    offset = offset_expr(coords, [st * s for st, s in zip(steps[:-1], xs[:-1])])
    src = str(base) if offset == "0" else (offset if base == 0 else f"{base} + {offset}")
    text = _slice_text(node.attrs)
    return _kernel(node, ctx, f"[{text}] of {shape_text(x.shape)} (a row per iteration)", kind="slice",
                   source_text=f"in[{text}] of {shape_text(x.shape)}", in_shape=shape_text(x.shape),
                   out_shape=shape_text(out.shape), rows=rows, width=width, row_lines=lines, src_offset=src,
                   step=steps[-1] * xs[-1], in_t=x.dtype.ctype, out_t=out.dtype.ctype,
                   convert=converter(x.dtype, out.dtype))


def _slice_backward(node, ctx):
    """A `slice_backward` node as one native kernel: per row of the full gradient, zeros, then the
    slice's gradient at its selected elements when the row is selected."""
    g, out = node.inputs[0], node.output
    if not out.shape:
        return None
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    rows, width, lines, coords = _rows(out.shape)
    relative, conditions, g_offset = slice_selection(g.shape, out.shape, starts, steps, coords)
    text = _slice_text(node.attrs)
    return _kernel(node, ctx, f"[{text}] of {shape_text(out.shape)} (a row per iteration)", kind="slice_backward",
                   slice_text=text, out_shape=shape_text(out.shape), rows=rows, width=width, row_lines=lines + relative,
                   conditions=conditions, g_offset=g_offset, g_width=g.shape[-1],
                   first=starts[-1], step=steps[-1], in_t=g.dtype.ctype, out_t=out.dtype.ctype,
                   zero=zero_literal(out.dtype), convert=converter(g.dtype, out.dtype))


def _cat(node, ctx):
    """A `cat` node as one native kernel: the output as [outer, length along dim, inner], each
    input's [outer, its length, inner] block copied to its place, (outer, input) pairs spread
    over the pool. Parameters are named after the values they carry (fused.value_param_name)."""
    out = node.output
    dim = node.attrs["dim"] % len(out.shape)
    outer, inner = numel_of(out.shape[:dim]), numel_of(out.shape[dim + 1:])
    taken = {"out"}
    names = [unique_name(value_param_name(v, ctx.producers), taken) for v in node.inputs]
    parts, start = [], 0
    for k, v in enumerate(node.inputs):
        parts.append(dict(k=k, name=names[k], run=v.shape[dim] * inner, at=start * inner,
                          convert=converter(v.dtype, out.dtype)))
        start += v.shape[dim]
    params = [f"const {v.dtype.ctype}* __restrict__ {n}" for v, n in zip(node.inputs, names)]
    params.append(f"{out.dtype.ctype}* __restrict__ out")
    return _kernel(node, ctx, f"{len(node.inputs)} inputs along dim {dim} -> {shape_text(out.shape)} (block copies)",
                   kind="cat", out_shape=shape_text(out.shape), dim=dim, params=params, parts=parts, outer=outer,
                   out_run=out.shape[dim] * inner, count=len(node.inputs), out_t=out.dtype.ctype,
                   numel=out.numel)
