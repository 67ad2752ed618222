"""nonfinite_flag (the AMP grad scaler's check): zero the flag, then one launch over every input
(a segment of blocks each, templates/nonfinite.cu.j2) that sets it on a NaN or infinity."""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.fused import unique_name, value_param_name
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels.common import (BLOCK, convert_to, node_comment, node_kernel, node_params,
                                            render_template, shape_text, zero_kernel)
from flowgen.codegen.target import block_segments


def render(node, ctx: RenderContext) -> list:
    kernel_name = ctx.kernel_name(node, [node.op])
    out = node.output
    taken = {"flag"}
    names = [unique_name(value_param_name(v, ctx.producers), taken) for v in node.inputs]
    segments = [{"numel": v.numel,
                 "load": convert_to(f"{name}[i]", v.dtype, "double" if v.dtype == dt.float64 else "float"),
                 "what": f"input {k}: {shape_text(v.shape)} {v.dtype.name}"}
                for k, (v, name) in enumerate(zip(node.inputs, names))]
    blocks = block_segments(segments, BLOCK)
    what = f"{len(node.inputs)} tensors"
    source = render_template("nonfinite.cu.j2", name=kernel_name, comment=node_comment(node, what),
                             segments=segments,
                             params=node_params(node, names, ["flag"]))
    return [zero_kernel(node, kernel_name, out, "the flag"),
            node_kernel(node, kernel_name, source, (blocks, 1, 1), (BLOCK, 1, 1), False, what)]
