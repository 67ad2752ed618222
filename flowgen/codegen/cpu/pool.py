"""Max-pool gradients of the cpu target as native kernels (templates/cpu_max_pool_grad.cpp.j2): a
plane per loop iteration, each window's maximum found once and its gradient added there. The
emulated kernel gives each input element a thread that recomputes the maximum of every window
covering it (KH*KW windows of KH*KW taps: ResNet-18's 3x3 max pool gradient took 18 ms of its
step); both add an element's gradients in the same order, so the numbers are the same."""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernels.common import node_args, node_comment, pair_of
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.templates import get_template


def render_pool2d(node, ctx: RenderContext):
    """A float32 `max_pool2d_grad` node as one native kernel, or None (the other pools of the
    family, and other dtypes, keep the emulated kernels)."""
    if node.op != "max_pool2d_grad" or any(v.dtype != dt.float32 for v in (*node.inputs, node.output)):
        return None
    name = ctx.kernel_name(node, [node.op])
    a = node.attrs
    N, C, H, W = node.output.shape
    OH, OW = node.inputs[0].shape[2:]
    (KH, KW), (SH, SW), (PH, PW) = pair_of(a["kernel_size"]), pair_of(a["stride"]), pair_of(a.get("padding", 0))
    DH, DW = pair_of(a.get("dilation", 1))
    what = f"{KH}x{KW} stride {SH}x{SW} pad {PH}x{PW} (a plane per iteration)"
    source = get_template("cpu_max_pool_grad.cpp.j2").render(
        name=name, comment=node_comment(node, what), N=N, C=C, H=H, W=W, OH=OH, OW=OW, KH=KH, KW=KW, SH=SH, SW=SW,
        PH=PH, PW=PW, DH=DH, DW=DW)
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=node_comment(node, what),
                   ops=[node.op])]
