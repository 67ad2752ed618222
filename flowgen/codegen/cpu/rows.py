"""Row kernels of the cpu target as native kernels. Cross-entropy rows
(templates/cpu_cross_entropy.cpp.j2): the loss and its gradient on (N, C) logits, one row per
loop iteration in order, with the emulated kernel's formulas and label check (the emulated kernels
reduce each row across a block's threads with barriers, which the emulator runs as fibers).
layer_norm and its backward (templates/cpu_layer_norm.cpp.j2): the emulated serial kernel's rows
(its lanes and merge tree, from layer_norm.cu.j2's macros) spread over the pool."""
from __future__ import annotations

from flowgen.codegen.kernels.common import (acc_type, declared_in_place, index_type, loader, make_index_check,
                                            node_args, node_comment, node_params, numel_of, shape_text, storer)
from flowgen.codegen.kernels.rows import _ROW_SOFTMAX_MODES, _layer_norm_names
from flowgen.codegen.kernel import Kernel
from flowgen.codegen.templates import get_template
from flowgen.ops.lowering import cpp_literal
from flowgen.ops.norm_ops import layer_norm_lanes


def render_cross_entropy(node, name: str, check_id: int):
    """A cross_entropy_rows / cross_entropy_rows_grad node on (N, C) logits as one native kernel,
    or None (other layouts keep the emulated kernel)."""
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


def render_layer_norm(node, name: str):
    """A layer_norm / add_layer_norm / layer_norm_backward node as one native kernel: the
    emulated serial kernel's rows (layer_norm.cu.j2's lanes, Welford steps and merge tree, its
    macros), a row per iteration of a loop spread over the pool; the same numbers."""
    attrs = node.attrs
    backward = node.op == "layer_norm_backward"
    in_names, out_names = _layer_norm_names(node)
    operand = dict(zip(in_names, node.inputs))
    x = operand["x"] if "x" in operand else operand["a"]
    k = attrs["normalized_ndim"]
    D = numel_of(x.shape[len(x.shape) - k:])
    rows = numel_of(x.shape[:len(x.shape) - k])
    stat = node.inputs[2] if backward else node.outputs[-1]
    ct = stat.dtype.ctype
    L = layer_norm_lanes(D)
    what = f"over the last {k} dims of {shape_text(x.shape)} (a row per iteration)"
    context = dict(name=name, op=node.op, shape=shape_text(x.shape), normalized_ndim=k, rows=rows, D=D, L=L,
                   S=-(-D // L), ct=ct, idx_t=index_type(rows), params=node_params(node, in_names, out_names),
                   mode="backward" if backward else "forward", residual=node.op == "add_layer_norm",
                   has_weight=attrs["has_weight"], has_bias=attrs.get("has_bias", False),
                   has_residual=attrs.get("has_residual", False), cache=False, kind="serial",
                   eps=None if backward else cpp_literal(attrs["eps"], double=True), store_x=storer(x.dtype, ct),
                   store_y=None if backward else storer(node.outputs[-3].dtype, ct),
                   store_dx=storer(node.outputs[0].dtype, ct), comment=node_comment(node, what))
    context.update({f"load_{n}": loader(v.dtype, ct) for n, v in operand.items()}, load_x=loader(x.dtype, ct))
    source = get_template("cpu_layer_norm.cpp.j2").render(**context)
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=context["comment"],
                   ops=[node.op], in_place=declared_in_place(node, in_names, out_names, optional=("residual",)))]
