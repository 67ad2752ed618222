"""Row kernels of the cpu target as native kernels: cross-entropy rows (templates/cpu_cross_entropy.cpp.j2),
the loss and its gradient on (N, C) logits, one row per loop iteration in order, with the
emulated kernel's formulas and label check (the emulated kernels reduce each row across a
block's threads with barriers, which the emulator runs as fibers); layer_norm and its backward,
the emulated one-thread-per-row code (templates/layer_norm.cu.j2, kind "serial") with its rows in a
loop over the pool."""
from __future__ import annotations

from flowgen import dtype as dt

from flowgen.codegen.kernels.common import (acc_type, declared_in_place, loader, make_index_check, node_args,
                                            node_comment, node_params, shape_text, storer)
from flowgen.codegen.kernels.rows import _ROW_SOFTMAX_MODES, _layer_norm
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.templates import get_template
from flowgen.ops.lowering import cpp_literal


def render_softmax(node, ctx: RenderContext):
    """A cross_entropy_rows / cross_entropy_rows_grad node on (N, C) logits as one native kernel,
    or None (other layouts, and softmax / log_softmax, keep the emulated kernels)."""
    if node.op not in ("cross_entropy_rows", "cross_entropy_rows_grad"):
        return None
    name, check_id = ctx.kernel_name(node, [node.op]), ctx.check_id
    in_names, out_names = _ROW_SOFTMAX_MODES[node.op]
    x, y = node.inputs[in_names.index("x")], node.output
    if len(x.shape) != 2 or node.attrs.get("dim", 1) % 2 != 1:   # (N, C), classes along dim 1
        return None
    rows, D = x.shape
    acc = acc_type(x.dtype, y.dtype)
    f = "" if acc == "double" else "f"
    ignore = node.attrs.get("ignore_index")
    what = f"over dim 1 of {shape_text(x.shape)} (row per iteration)"
    source = get_template("cpu_cross_entropy.cpp.j2").render(
        name=name, comment=node_comment(node, what), op=node.op, shape=shape_text(x.shape), rows=rows, D=D, acc=acc,
        params=node_params(node, in_names, out_names), load=loader(x.dtype, acc), store=storer(y.dtype, acc),
        load_g=loader(node.inputs[0].dtype, acc), fmax=f"fmax{f}", exp=f"exp{f}", logf=f"log{f}",
        one="1.0" if acc == "double" else "1.0f", check_id=check_id,
        ignored="false" if ignore is None else f"t == {cpp_literal(int(ignore))}")
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=node_comment(node, what),
                   ops=[node.op], in_place=declared_in_place(node, in_names, out_names),
                   index_check=make_index_check(node, check_id, "label", D))]


def render_layer_norm(node, ctx: RenderContext):
    """A layer_norm / add_layer_norm / layer_norm_backward node on float32 as one native kernel, or
    None (other dtypes keep the emulated kernel)."""
    if not all(v.dtype == dt.float32 for v in (*node.inputs, *node.outputs)):
        return None
    return _layer_norm(node, ctx.kernel_name(node, [node.op]), native=True)
