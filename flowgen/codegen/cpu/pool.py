"""Pooling of the cpu target as native kernels.

* Forward pools (max, its indices, average, adaptive average; templates/cpu_pool2d.cpp.j2): an
  (n, c) plane per loop iteration, every output computed by the emulated kernel's own code
  (templates/_pool2d_window.j2), so the same numbers; a loop over the planes also takes its
  count at run time, where the emulated kernel's launch grid follows the batch (a dynamic one).
* Max-pool gradients (templates/cpu_max_pool_grad.cpp.j2): a plane per loop iteration, each
  window's maximum found once and its gradient added there. The emulated kernel gives each input
  element a thread that recomputes the maximum of every window covering it (KH*KW windows of KH*KW
  taps: ResNet-18's 3x3 max pool gradient took 18 ms of its step); both add an element's
  gradients in the same order, so the numbers are the same."""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernels.common import node_args, node_comment, pair_of
from flowgen.codegen.kernels.pool import pool2d_context
from flowgen.codegen.kernel import Kernel, RenderContext
from flowgen.codegen.templates import get_template


_FORWARD = ("max_pool2d", "max_pool2d_indices", "avg_pool2d", "adaptive_avg_pool2d")


def render_pool2d(node, ctx: RenderContext):
    """A float32 forward pool or `max_pool2d_grad` node as one native kernel, or None (the other
    gradients, and other dtypes, keep the emulated kernels)."""
    if node.op not in (*_FORWARD, "max_pool2d_grad") or any(v.dtype != dt.float32 for v in node.inputs) or \
            node.output.dtype not in (dt.float32, dt.int64):
        return None
    if node.op in _FORWARD:
        return _forward(node, ctx)
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


def _forward(node, ctx: RenderContext) -> list:
    name = ctx.kernel_name(node, [node.op])
    kind, context, what = pool2d_context(node, name)
    taps = context.get("KH", 1) * context.get("KW", 1) if kind != "adaptive_fwd" else \
        -(-context["H"] // context["OH"]) * -(-context["W"] // context["OW"])
    what += " (a plane per iteration)"
    comment = node_comment(node, what)
    source = get_template("cpu_pool2d.cpp.j2").render(kind=kind, comment=comment, what=what, taps=max(taps, 1),
                                                      **context)
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment,
                   ops=[node.op])]
