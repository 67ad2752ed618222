"""Row gathers and scatters of the cpu target as native kernels, with the emulated kernels' index
checks. embedding and index_select (templates/cpu_gather.cpp.j2) copy a whole row (the `inner`
elements after the selected dim) per index, the (outer, index) pairs spread over the pool (an
index out of range is reported and its row is zeros); copies, so any dtype. embedding_backward
and index_add (templates/cpu_scatter.cpp.j2) add the source rows in entry order into double
accumulators, blocks of output columns spread over the pool (an index out of range is reported
and adds nothing), where the emulated kernels group the entries by destination first."""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernels.common import (make_index_check, node_args, node_comment, node_params, numel_of,
                                            shape_text, zero_literal)
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.templates import get_template


def render_gather(node, ctx: RenderContext):
    """An `embedding` or `index_select` node as one native kernel, or None (a `gather` keeps the
    emulated kernel)."""
    if node.op not in ("embedding", "index_select"):
        return None
    name, check_id = ctx.kernel_name(node, [node.op]), ctx.check_id
    x, index = node.inputs
    if node.op == "index_select":
        shape = tuple(x.shape) or (1,)
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = numel_of(shape[:dim]), shape[dim], numel_of(shape[dim + 1:])
        names, what = ("x", "index"), f"dim {dim} of {shape_text(x.shape)}, {index.numel} indices"
        check = make_index_check(node, check_id, "index", size, dim)
    else:   # embedding(weight, indices)
        outer, size, inner = 1, x.shape[0], x.shape[1]
        names, what = ("weight", "indices"), f"{index.numel} rows of {shape_text(x.shape)}"
        check = make_index_check(node, check_id, "index", size)
    what += " (a row per index)"
    comment = node_comment(node, what)
    source = get_template("cpu_gather.cpp.j2").render(
        name=name, comment=comment, what=node.op, params=node_params(node, names, ("out",)), outer=outer,
        n=index.numel, size=size, inner=inner, index_name=names[1], x_name=names[0],
        zero=zero_literal(node.output.dtype),
        x_t=x.dtype.ctype, out_t=node.output.dtype.ctype,
        check_id=check_id, wrap_negative=node.attrs.get("wrap_negative", False))
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op],
                   index_check=check)]


# The parameter names of the inputs of the scatters with a native kernel.
_SCATTER_NAMES = {"embedding_backward": ("src", "index"), "index_add": ("index", "src")}


def render_scatter(node, ctx: RenderContext):
    """An `embedding_backward` or `index_add` node (float32 or float64) as one native kernel: per
    block of output columns, one pass over the entries in ascending order adding each source row
    into a double accumulator per output element, then each element stored once: the emulated
    kernels' segments (np.bincount's order and precision), the same bits, without sorting. None
    for other dtypes and for `scatter_add` (the emulated kernels)."""
    out = node.output
    if node.op not in _SCATTER_NAMES or out.dtype not in (dt.float32, dt.float64):
        return None
    name, check_id = ctx.kernel_name(node, [node.op]), ctx.check_id
    if node.op == "embedding_backward":
        src, index = node.inputs
        outer, size, inner, dim = 1, out.shape[0], out.shape[1], None
        pad = node.attrs.get("padding_idx", -1)
        pad = -1 if pad is None or pad < 0 else pad
        what = f"{index.numel} rows into {shape_text(out.shape)}" + (f", padding_idx {pad}" if pad >= 0 else "")
    else:   # index_add(index, src, shape, dim): a zero tensor of `shape` with src's slices added along dim
        index, src = node.inputs
        if not out.shape:
            return None
        shape = tuple(out.shape)
        dim = node.attrs["dim"] % len(shape)
        outer, size, inner = numel_of(shape[:dim]), shape[dim], numel_of(shape[dim + 1:])
        pad, what = -1, f"dim {dim}: {index.numel} slices into {shape_text(out.shape)}"
    if src.dtype != out.dtype or index.numel == 0:
        return None
    what += " (a pass over the entries per block of columns)"
    comment = node_comment(node, what)
    source = get_template("cpu_scatter.cpp.j2").render(
        name=name, comment=comment, op=node.op, params=node_params(node, _SCATTER_NAMES[node.op], ("out",)),
        outer=outer, size=size, inner=inner, n=index.numel, padding_idx=pad, check_id=check_id, t=out.dtype.ctype,
        wrap_negative=node.attrs.get("wrap_negative", False), columns=min(inner, 16))
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op],
                   index_check=make_index_check(node, check_id, "index", size, dim))]

