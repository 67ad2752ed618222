"""Cross-entropy rows of the cpu target as native kernels (templates/cpu_cross_entropy.cpp.j2):
the loss and its gradient on (N, C) logits, one row per loop iteration in order, with the
emulated kernel's formulas and label check. The emulated kernels reduce each row across a
block's threads with barriers, which the emulator runs as fibers."""
from __future__ import annotations

from flowgen.codegen.families import (_ROW_SOFTMAX_MODES, _acc_type, _args, _comment, _declared_in_place,
                                      _index_check, _loader, _params, _shape_text, _storer)
from flowgen.codegen.kernel import Kernel
from flowgen.codegen.templates import get_template
from flowgen.ops.lowering import cpp_literal


def render_cross_entropy(node, name: str, check_id: int):
    """A cross_entropy_rows / cross_entropy_rows_grad node on (N, C) logits as one native kernel,
    or None (other layouts keep the emulated kernel)."""
    in_names, out_names = _ROW_SOFTMAX_MODES[node.op]
    x, y = node.inputs[in_names.index("x")], node.output
    if len(x.shape) != 2 or node.attrs.get("dim", 1) % 2 != 1:   # (N, C), classes along dim 1
        return None
    rows, D = x.shape
    acc = _acc_type(x.dtype, y.dtype)
    f = "" if acc == "double" else "f"
    ignore = node.attrs.get("ignore_index")
    what = f"over dim 1 of {_shape_text(x.shape)} (row per iteration)"
    source = get_template("cpu_cross_entropy.cpp.j2").render(
        name=name, comment=_comment(node, what), op=node.op, shape=_shape_text(x.shape), rows=rows, D=D, acc=acc,
        params=_params(node, in_names, out_names), load=_loader(x.dtype, acc), store=_storer(y.dtype, acc),
        load_g=_loader(node.inputs[0].dtype, acc), fmax=f"fmax{f}", exp=f"exp{f}", logf=f"log{f}",
        one="1.0" if acc == "double" else "1.0f", check_id=check_id,
        ignored="false" if ignore is None else f"t == {cpp_literal(int(ignore))}")
    return [Kernel(name, source, _args(node), (1, 1, 1), (1, 1, 1), native=True, comment=_comment(node, what),
                   ops=[node.op], in_place=_declared_in_place(node, in_names, out_names),
                   index_check=_index_check(node, check_id, "label", D))]
