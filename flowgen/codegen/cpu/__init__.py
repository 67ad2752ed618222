"""The cpu target's native kernels: the nodes where plain C++ over OpenBLAS beats running the
CUDA kernel on the emulator (float32 GEMMs with their fused epilogues, convolutions but the
depthwise ones, elementwise chains, multi-tensor updates, permutes, cross-entropy rows and max-pool
gradients as loops spread over a thread pool, runtime_cpp/flowgen_cpu_pool.h). `render_native` returns a node's kernels, or None: the emulated CUDA kernels
stay, in the same program, so families move over one at a time.

The emulator remains the checker of the CUDA source: `FLOWGEN_CPU_KERNELS=emulator` (the test
suite's default) or `flowgen build --target emulator` renders every node as CUDA.
"""
from __future__ import annotations

from flowgen.codegen import fused
from flowgen.codegen.cpu.conv import render_conv_node, render_fused_conv
from flowgen.codegen.cpu.copy import render_permute
from flowgen.codegen.cpu.elementwise import render_elementwise, render_segments
from flowgen.codegen.cpu.gemm import render_fused_gemm, render_matmul
from flowgen.codegen.cpu.pool import render_max_pool_grad
from flowgen.codegen.cpu.rows import render_cross_entropy

_CONV_OPS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")


def render_native(node, index: int, producers, stream_values=None):
    """The native kernels computing `node` (kernel numbers from `index`), or None."""
    if any(v.numel == 0 for v in node.outputs):
        return None
    if node.op == "fused":
        render = {"gemm": render_fused_gemm, "conv": render_fused_conv, "elementwise": render_elementwise,
                  "multi": render_segments}.get(node.attrs["kind"])
        return render(node, index, producers, stream_values) if render else None
    if node.op == "matmul":
        return render_matmul(node, fused.kernel_name(index, node, [node.op]))
    if node.op in _CONV_OPS:
        return render_conv_node(node, fused.kernel_name(index, node, [node.op]))
    if node.op == "permute":
        return render_permute(node, fused.kernel_name(index, node, [node.op]))
    if node.op == "max_pool2d_grad":
        return render_max_pool_grad(node, fused.kernel_name(index, node, [node.op]))
    if node.op in ("cross_entropy_rows", "cross_entropy_rows_grad"):   # its label check is numbered index + 1
        return render_cross_entropy(node, fused.kernel_name(index, node, [node.op]), index + 1)
    return None
