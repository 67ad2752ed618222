"""Convolutions of the cpu target as native kernels (templates/cpu_conv.cpp.j2): per group one
OpenBLAS sgemm over the whole batch (im2col of every image side by side; the gradient copied
channel-major; grad_input through col2im), so a conv hands the pool a few loops, not a few per
image. Depthwise convs (one input channel per group), where a GEMM of one channel does not pay,
are direct loops with the emulated kernels' arithmetic in the same order. A forward conv's fused
epilogue (bias, folded BatchNorm, activation, residual add) runs in the pass that stores the
outputs, from the same emitter as the emulated kernel's (codegen/fused.py `render_conv`).

Dtypes other than float32 keep the emulated kernels.
"""
from __future__ import annotations

from flowgen.codegen import fused
from flowgen.codegen.cpu.elementwise import element_loop, grain, piece_lines
from flowgen.codegen.cpu.gemm import NATIVE_DTYPES
from flowgen.codegen.kernels.common import node_args, node_comment, node_params
from flowgen.codegen.kernels.conv import _conv_geometry, _conv_text
from flowgen.codegen.kernel import Kernel, RenderContext, every_output_over
from flowgen.codegen.templates import get_template

_OPS = {"conv2d": "fwd", "conv2d_grad_input": "dgrad", "conv2d_grad_weight": "wgrad"}
_NAMES = {"fwd": ("x", "w", "y"), "dgrad": ("grad", "w", "dx"), "wgrad": ("grad", "x", "dw")}


def _source(conv, name, params, epilogue_lines, what_extra="") -> tuple:
    geo = _conv_geometry(conv)
    op = _OPS[conv.op]
    epilogue_lines, costly = element_loop(epilogue_lines or [])
    loop = dict(grain=grain(costly), piece_lines=piece_lines(epilogue_lines))
    if geo["CG"] == 1:
        what = f"{_conv_text(geo)} (depthwise, direct loops){what_extra}"
        source = get_template("cpu_depthwise.cpp.j2").render(
            name=name, comment=node_comment(conv, what), op=op, params=params, epilogue_lines=epilogue_lines,
            numel=conv.output.numel, **geo, **loop)
        return source, node_comment(conv, what)
    what = f"{_conv_text(geo)} (im2col + OpenBLAS sgemm over the batch){what_extra}"
    source = get_template("cpu_conv.cpp.j2").render(name=name, comment=node_comment(conv, what), op=op, params=params,
                                                    epilogue_lines=epilogue_lines, **geo, **loop)
    return source, node_comment(conv, what)


def render(node, ctx: RenderContext):
    """A conv op, or a fused node anchored on a forward conv (passes/fusion.py), as one native
    kernel, or None where the emulated kernel stays."""
    return render_fused_conv(node, ctx) if node.op == "fused" else render_conv_node(node, ctx)


def render_fused_conv(node, ctx: RenderContext):
    """A fused forward conv node (codegen/fused.py render_conv's input) as one native kernel, or
    None where the emulated kernel stays."""
    conv, epilogue = node.body[0], node.body[1:]
    if not all(v.dtype in NATIVE_DTYPES for v in (*conv.inputs, conv.output)):
        return None
    x, w = conv.inputs
    em = fused.Emitter(node, ctx.producers, ctx.stream_values, names={x: "x", w: "w"})
    lines, pointwise = fused.anchor_epilogue(em, epilogue, conv.output, tuple(conv.output.shape), ctx.producers,
                                             None)
    ops = [b.op for b in node.body]
    extra = f"; epilogue: {', '.join(b.op for b in epilogue)}" if epilogue else ""
    name = ctx.kernel_name(node, ops)
    source, comment = _source(conv, name, em.params, lines, extra)
    return [Kernel(name, source, em.args, (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=ops,
                   in_place=every_output_over(node.outputs, pointwise - {x, w}))]


def render_conv_node(node, ctx: RenderContext):
    """An unfused conv2d / conv2d_grad_input / conv2d_grad_weight node as one native kernel, or
    None where the emulated kernel stays."""
    name = ctx.kernel_name(node, [node.op])
    if not all(v.dtype in NATIVE_DTYPES for v in (*node.inputs, node.output)):
        return None
    names = _NAMES[_OPS[node.op]]
    source, comment = _source(node, name, node_params(node, names[:2], names[2:]), None)
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op])]
