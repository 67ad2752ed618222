"""Permutes of the cpu target as native kernels (templates/cpu_copy.cpp.j2): a loop over the
output reading each element at its permuted index. The emulated kernel of a transposing permute
moves 32x32 tiles through shared memory with barriers, so its threads run as fibers on the
emulator, its slowest path (a Linear's weight transpose took tens of milliseconds)."""
from __future__ import annotations

from flowgen.codegen.kernels.common import (contiguous_strides, converter, coordinates, node_args, node_comment,
                                            offset_expr, shape_text)
from flowgen.codegen.kernel import Kernel
from flowgen.codegen.templates import get_template


def render_permute(node, name: str):
    """A `permute` node as one native kernel."""
    x, out = node.inputs[0], node.output
    dims = tuple(d % max(len(x.shape), 1) for d in node.attrs["dims"])
    strides = contiguous_strides(x.shape)
    lines, coords = coordinates(out.shape, "i", "c")
    what = f"dims {dims}: {shape_text(x.shape)} -> {shape_text(out.shape)} (a loop over the output)"
    source = get_template("cpu_copy.cpp.j2").render(
        name=name, comment=node_comment(node, what), out_shape=shape_text(out.shape), map_text=f"permuted index, dims {dims}",
        in_t=x.dtype.ctype, out_t=out.dtype.ctype, numel=out.numel, coord_lines=lines,
        src_offset=offset_expr(coords, [strides[d] for d in dims]), convert=converter(x.dtype, out.dtype))
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=node_comment(node, what),
                   ops=[node.op])]
