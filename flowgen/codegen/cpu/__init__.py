"""The cpu target's native kernels: the nodes where plain C++ over OpenBLAS beats running the
CUDA kernel on the emulator (float32 GEMMs with their fused epilogues, convolutions, elementwise
chains, multi-tensor updates, fused reductions, copies (permute, slice, slice_backward, cat),
float32 attention and its backward, row gathers and scatters (embedding, index_select and their
gradients), cross-entropy rows, layer norms and max-pool gradients as loops spread over a thread pool,
runtime_cpp/flowgen_cpu_pool.h). `render_native` returns a node's kernels, or None: the emulated
CUDA kernels stay, in the same program, so families move over one at a time.

One module per kernel family, as codegen/kernels/; every native renderer is
``render(node, ctx) -> list[Kernel] | None`` (ctx: codegen/kernel.py's RenderContext), None for
the nodes it leaves to the emulated kernels (another dtype, layout or op of its family).

The emulator remains the checker of the CUDA source: `FLOWGEN_CPU_KERNELS=emulator` (the test
suite's default) or `flowgen build --target emulator` renders every node as CUDA.
"""
from __future__ import annotations

from flowgen.codegen.cpu import attention, conv, copy, elementwise, gemm, indexing, pool, reduction, rows
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import family_of

# A fused node's kind or a template op's family, keyed as codegen/kernels/' RENDERERS -> its native
# renderer; the other kinds and families stay emulated.
NATIVE_RENDERERS = {
    "elementwise": elementwise.render_elementwise,
    "multi": elementwise.render_segments,
    "reduction": reduction.render_reduction,
    "gemm": gemm.render,
    "conv": conv.render,
    "conv2d": conv.render,
    "attention": attention.render,
    "softmax": rows.render_softmax,
    "layer_norm": rows.render_layer_norm,
    "gather": indexing.render_gather,
    "scatter": indexing.render_scatter,
    "pool2d": pool.render_pool2d,
    "copy": copy.render,
}


def render_native(node, ctx: RenderContext):
    """The native kernels computing `node`, or None (codegen/kernels/' calling convention)."""
    if any(v.numel == 0 for v in node.outputs):
        return None
    render = NATIVE_RENDERERS.get(node.attrs["kind"] if node.op == "fused" else family_of(node))
    return render(node, ctx) if render else None
