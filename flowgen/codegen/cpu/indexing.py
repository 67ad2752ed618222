"""Row gathers of the cpu target as native kernels (templates/cpu_gather.cpp.j2): embedding and
index_select copy a whole row (the `inner` elements after the selected dim) per index, the
(outer, index) pairs spread over the pool, with the emulated kernels' index check (an index out of
range is reported and its row is zeros). The emulated kernels run a thread per element. Copies,
so any dtype."""
from __future__ import annotations

from flowgen.codegen.kernels.common import (make_index_check, node_args, node_comment, node_params, numel_of,
                                            shape_text, zero_literal)
from flowgen.codegen.kernel import Kernel
from flowgen.codegen.templates import get_template


def render_select(node, name: str, check_id: int):
    """An `embedding` or `index_select` node as one native kernel."""
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
        n=index.numel, size=size, inner=inner, index_name=names[1], x_name=names[0], zero=zero_literal(node.output.dtype),
        check_id=check_id, wrap_negative=node.attrs.get("wrap_negative", False))
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op],
                   index_check=check)]
