"""The kernel families: one module each, owning its templates (templates/<family>.cu.j2), its tile
choice and its renderers; `render_node` looks a node's renderer up in `RENDERERS`.

Every renderer is ``render(node, ctx) -> list[Kernel]``: the kernels that compute `node`, in
launch order (the first carries the node's kernel name, helper kernels a suffix of it), with the
`RenderContext` (codegen/kernel.py) saying what else it needs: the kernel's place in the program,
the index check's number, the rng state of a random op, the producers a fused epilogue reads
constants from. Each family bakes the node's static shapes and attributes into its template as
constants. Argument order, scratch buffers and index checks: kernels/common.py.

Families, by module:

* gemm.py      — matmul and the fused nodes anchored on one; the GEMM tiles (SIMT, mma.sync, wgmma)
* conv.py      — conv2d, conv2d_grad_input, conv2d_grad_weight (implicit GEMM, split-k grad_weight,
                 depthwise) and the fused nodes anchored on a forward conv
* attention.py — attention and attention_backward (and their dropout variants) without the scores
* rows.py      — softmax / log_softmax / cross-entropy rows, argmax / argmin, layer_norm
* scan_sort.py — cumsum / cumprod; sort / topk (ranking, merge passes, radix select and sort)
* indexing.py  — gather / index_select / embedding; scatter_add / index_add / embedding_backward
* pool.py      — pool2d (max, avg, adaptive avg) and upsample (nearest, bilinear), with gradients
* layout.py    — permute / slice / slice_backward / cat
* nonfinite.py — nonfinite_flag; randperm.py — randperm
* codegen/fused.py — the fused elementwise, multi-tensor and reduction bodies
"""
from __future__ import annotations

from flowgen.codegen import fused
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import (attention, conv, gemm, indexing, layout, nonfinite, pool, randperm, rows,
                                     scan_sort)
from flowgen.ops.registry import get_op

# A fused node's kind (passes/fusion.py), or a template op's family (ops.lowering.Template.family)
# -> its renderer. A fused node of kind "gemm" or "conv" is rendered by its anchor's family.
RENDERERS = {
    "elementwise": fused.render_elementwise,
    "multi": fused.render_segments,
    "reduction": fused.render_reduction,
    "gemm": gemm.render,
    "conv": conv.render,
    "conv2d": conv.render,
    "attention": attention.render,
    "softmax": rows.render_softmax,
    "argreduce": rows.render_argreduce,
    "layer_norm": rows.render_layer_norm,
    "scan": scan_sort.render_scan,
    "sort": scan_sort.render_sort,
    "gather": indexing.render_gather,
    "scatter": indexing.render_scatter,
    "pool2d": pool.render_pool2d,
    "upsample": pool.render_upsample,
    "copy": layout.render,
    "nonfinite": nonfinite.render,
    "randperm": randperm.render,
}


def family_of(node) -> str | None:
    """The template family of `node`'s op, or None (elementwise, views, collectives, ...)."""
    return getattr(get_op(node.op).lowering, "family", None)


def render_node(node, ctx: RenderContext) -> list:
    """The kernels (in launch order) that compute `node`: a fused node, or a template-family op
    (none when every output is empty)."""
    kind = node.attrs["kind"] if node.op == "fused" else family_of(node)
    try:
        render = RENDERERS[kind]
    except KeyError:
        raise NotImplementedError(f"codegen has no template family {kind!r} (op {node.op})") from None
    if all(v.numel == 0 for v in node.outputs):   # a fused one too (an empty batch's GEMM: a grid of 0 blocks)
        return []
    return render(node, ctx)
