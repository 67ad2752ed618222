"""The copy family (templates/copy.cu.j2): permute / slice / slice_backward / cat, one thread per
output element with a baked index map (slice_backward writes zeros outside the slice); a permute
that moves the innermost dim goes through 32 x 32 shared-memory tiles instead."""
from __future__ import annotations

from flowgen.codegen.fused import unique_name, value_param_name
from flowgen.codegen.kernel import Blocks, RenderContext
from flowgen.codegen.kernels.common import (BLOCK, contiguous_strides, converter, coordinates, grid_1d, index_type,
                                            node_comment, node_kernel, numel_of, offset_expr, render_template,
                                            shape_text, zero_literal)


def render(node, ctx: RenderContext) -> list:
    return {"permute": _permute, "slice": _slice, "slice_backward": _slice_backward, "cat": _cat}[node.op](
        node, ctx.kernel_name(node, [node.op]), ctx.producers)


def _names(node, producers) -> tuple:
    """The parameter names of the node's inputs and of its output (fused.value_param_name)."""
    taken = set()
    return ([unique_name(value_param_name(v, producers), taken) for v in node.inputs],
            unique_name(value_param_name(node.output, producers), taken))


def _copy_map(node, kernel_name, producers, src_offset, map_text, what) -> list:
    x, out = node.inputs[0], node.output
    (x_name,), out_name = _names(node, producers)
    lines, coords = coordinates(out.shape, "i", "c")
    source = render_template("copy.cu.j2", kind="map", name=kernel_name, comment=node_comment(node, what),
                             x_name=x_name, out_name=out_name,
                             out_shape=shape_text(out.shape), map_text=map_text, in_t=x.dtype.ctype,
                             out_t=out.dtype.ctype, numel=out.numel, idx_t=index_type(out.numel, x.numel),
                             coord_lines=lines, src_offset=src_offset(coords), convert=converter(x.dtype, out.dtype))
    return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


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


def _permute(node, kernel_name, producers):
    x, out = node.inputs[0], node.output
    dims = tuple(d % max(len(x.shape), 1) for d in node.attrs["dims"])
    xs = contiguous_strides(x.shape)
    what = f"dims {tuple(dims)}: {shape_text(x.shape)} -> {shape_text(out.shape)}"
    plan = _transpose_plan(x.shape, dims)
    if plan is None:
        return _copy_map(node, kernel_name, producers, lambda c: offset_expr(c, [xs[d] for d in dims]),
                         f"permuted index, dims {tuple(dims)}", what)
    what += " (tiled)"
    a, b = plan
    os_ = contiguous_strides(out.shape)
    out_pos = {d: k for k, d in enumerate(dims)}           # input dim -> output position
    rest = [d for d in range(len(x.shape)) if d not in (a, b)]
    rest_shape = [x.shape[d] for d in rest]
    lines, coords = coordinates(rest_shape, "r", "r")
    tile, rows = 32, 8
    tiles_a, tiles_b = -(-x.shape[a] // tile), -(-x.shape[b] // tile)
    nrest = numel_of(rest_shape)
    (x_name,), out_name = _names(node, producers)
    source = render_template(
        "copy.cu.j2", kind="transpose", name=kernel_name, comment=node_comment(node, what), dim_a=a, last_in=b,
        x_name=x_name, out_name=out_name,
        tile=tile, rows=rows, tiles_a=tiles_a, tiles_b=tiles_b, rest=nrest, size_a=x.shape[a], size_b=x.shape[b],
        in_t=x.dtype.ctype, out_t=out.dtype.ctype, rest_lines=lines,
        in_base=offset_expr(coords, [xs[d] for d in rest]),
        out_base=offset_expr(coords, [os_[out_pos[d]] for d in rest]),
        in_stride_a=xs[a], out_stride_b=os_[out_pos[b]], convert=converter(x.dtype, out.dtype))
    if tiles_a * tiles_b * nrest >= 2 ** 31:
        raise NotImplementedError(f"{node.op}: tensor too large for one grid of tiles")
    grid = Blocks(x.shape[a], tile, times=tiles_b * nrest)   # tiles_a x the rest (a dynamic step fits them)
    return [node_kernel(node, kernel_name, source, (grid, 1, 1), (tile, rows, 1), True, what)]


def _slice(node, kernel_name, producers):
    x = node.inputs[0]
    starts, steps = node.attrs["starts"], node.attrs["steps"]
    xs = contiguous_strides(x.shape)
    base = sum(b * s for b, s in zip(starts, xs))

    def src(coords):
        off = offset_expr(coords, [st * s for st, s in zip(steps, xs)])
        return str(base) if off == "0" else (off if base == 0 else f"{base} + {off}")

    text = ", ".join(f"{b}:{e}:{st}" for b, e, st in zip(starts, node.attrs["stops"], steps))
    return _copy_map(node, kernel_name, producers, src, f"slice [{text}]", f"[{text}] of {shape_text(x.shape)}")


def slice_selection(g_shape, out_shape, starts, steps, coords) -> tuple:
    """Where the gradient g of out[starts:stops:steps] lands in out, over out's leading dims whose
    coordinates are `coords` (all of them, or all but the last): (lines declaring the coordinates
    relative to the starts, the conditions that they are selected, g's offset for them). Shared
    by this family's slice_backward and the cpu target's native one (codegen/cpu/copy.py)."""
    gs = contiguous_strides(g_shape)
    lines, conditions, terms = [], [], []
    for d, coord in enumerate(coords):
        n, b, st = g_shape[d], starts[d], steps[d]
        if n == 0:
            conditions.append("false")
            continue
        if b == 0 and st == 1 and n == out_shape[d]:   # the whole dim
            if coord != "0":
                terms.append(coord if gs[d] == 1 else f"{coord} * {gs[d]}")
            continue
        rel = coord if b == 0 else f"s{d}"
        if b != 0:
            lines.append(f"const long long s{d} = {coord} - {b};")
            conditions.append(f"s{d} >= 0")
        conditions.append(f"{rel} < {(n - 1) * st + 1}")
        if st != 1:
            conditions.append(f"{rel} % {st} == 0")
        q = rel if st == 1 else f"({rel} / {st})"
        terms.append(q if gs[d] == 1 else f"{q} * {gs[d]}")
    return lines, conditions, " + ".join(terms) or "0"


def _slice_backward(node, kernel_name, producers):
    g, out = node.inputs[0], node.output
    (g_name,), out_name = _names(node, producers)
    starts, stops, steps = node.attrs["starts"], node.attrs["stops"], node.attrs["steps"]
    lines, coords = coordinates(out.shape, "i", "c")
    relative, conditions, src_offset = slice_selection(g.shape, out.shape, starts, steps, coords)
    text = ", ".join(f"{b}:{e}:{st}" for b, e, st in zip(starts, stops, steps))
    what = f"[{text}] of {shape_text(out.shape)}"
    source = render_template("copy.cu.j2", kind="slice_backward", name=kernel_name, comment=node_comment(node, what),
                             g_name=g_name, out_name=out_name,
                             out_shape=shape_text(out.shape), slice_text=text, in_t=g.dtype.ctype,
                             out_t=out.dtype.ctype, numel=out.numel, idx_t=index_type(out.numel),
                             coord_lines=lines + relative, conditions=conditions, src_offset=src_offset,
                             zero=zero_literal(out.dtype), convert=converter(g.dtype, out.dtype))
    return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what)]


def _cat(node, kernel_name, producers):
    out = node.output
    names, out_name = _names(node, producers)
    dim = node.attrs["dim"] % len(out.shape)
    lines, coords = coordinates(out.shape, "i", "c")
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
        parts.append(dict(name=names[k], end=start + n, offset=offset_expr(cs, contiguous_strides(v.shape)),
                          convert=converter(v.dtype, out.dtype)))
        start += n
    params = [f"const {v.dtype.ctype}* __restrict__ {name}" for v, name in zip(node.inputs, names)]
    params.append(f"{out.dtype.ctype}* __restrict__ {out_name}")
    what = f"{len(node.inputs)} inputs along dim {dim} -> {shape_text(out.shape)}"
    source = render_template("copy.cu.j2", kind="cat", name=kernel_name, comment=node_comment(node, what),
                             out_shape=shape_text(out.shape), dim=dim, params=params, out_name=out_name, numel=out.numel,
                             idx_t=index_type(out.numel), coord_lines=lines, parts=parts)
    return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what)]
