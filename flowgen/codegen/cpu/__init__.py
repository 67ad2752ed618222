"""The cpu target's native kernels: the nodes where plain C++ over OpenBLAS beats running the
CUDA kernel on the emulator (float32 GEMMs with their fused epilogues, convolutions, elementwise
chains, multi-tensor updates, fused reductions, copies (permute, slice, slice_backward, cat),
float32 attention and its backward, row gathers and scatters (embedding, index_select and their
gradients), cross-entropy rows and max-pool gradients as loops spread over a thread pool,
runtime_cpp/flowgen_cpu_pool.h). `render_native` returns a node's kernels, or None: the emulated
CUDA kernels stay, in the same program, so families move over one at a time.

The emulator remains the checker of the CUDA source: `FLOWGEN_CPU_KERNELS=emulator` (the test
suite's default) or `flowgen build --target emulator` renders every node as CUDA.
"""
from __future__ import annotations

from flowgen.codegen.cpu.attention import render_attention
from flowgen.codegen.cpu.conv import render_conv_node, render_fused_conv
from flowgen.codegen.cpu.copy import render_cat, render_permute, render_slice, render_slice_backward
from flowgen.codegen.cpu.elementwise import render_elementwise, render_segments
from flowgen.codegen.cpu.gemm import render_fused_gemm, render_matmul
from flowgen.codegen.cpu.indexing import render_row_scatter, render_select
from flowgen.codegen.cpu.pool import render_max_pool_grad
from flowgen.codegen.cpu.reduction import render_reduction
from flowgen.codegen.cpu.rows import render_cross_entropy
from flowgen.codegen.kernel import RenderContext

# The fused kinds and the template families with a native kernel; the others stay emulated.
_FUSED = {"gemm": render_fused_gemm, "conv": render_fused_conv, "elementwise": render_elementwise,
          "multi": render_segments, "reduction": render_reduction}
_NODES = {"matmul": render_matmul, "conv2d": render_conv_node, "conv2d_grad_input": render_conv_node,
          "conv2d_grad_weight": render_conv_node, "permute": render_permute, "slice": render_slice,
          "slice_backward": render_slice_backward, "max_pool2d_grad": render_max_pool_grad}
# Parameters named after the values they carry, whose producers say what they are.
_NAMED = {"cat": render_cat}
# Attention (its dropout variants read their rng state).
_RANDOM = {"attention": render_attention, "attention_backward": render_attention,
           "attention_dropout": render_attention, "attention_dropout_backward": render_attention}
_INDEXED = {"cross_entropy_rows": render_cross_entropy, "cross_entropy_rows_grad": render_cross_entropy,
            "embedding": render_select, "index_select": render_select,
            "embedding_backward": render_row_scatter, "index_add": render_row_scatter}


def render_native(node, ctx: RenderContext):
    """The native kernels computing `node`, or None (codegen/kernels/' calling convention)."""
    if any(v.numel == 0 for v in node.outputs):
        return None
    if node.op == "fused":
        render = _FUSED.get(node.attrs["kind"])
        return render(node, ctx.index, ctx.producers, ctx.stream_values) if render else None
    if node.op in _NODES:
        return _NODES[node.op](node, ctx.kernel_name(node, [node.op]))
    if node.op in _NAMED:
        return _NAMED[node.op](node, ctx.kernel_name(node, [node.op]), ctx.producers)
    if node.op in _RANDOM:
        return _RANDOM[node.op](node, ctx.kernel_name(node, [node.op]), ctx.rng_state(node))
    if node.op in _INDEXED:   # reads labels or indices: its index check is numbered ctx.check_id
        return _INDEXED[node.op](node, ctx.kernel_name(node, [node.op]), ctx.check_id)
    return None
