"""Image resampling over NCHW tensors, no atomics.

* pool2d   — max / avg pool forward and gradients, adaptive avg pool and its gradient
             (templates/pool2d.cu.j2): one thread per output (forward) or per input element
             (gradients gather their contributions).
* upsample — nearest / bilinear forward and gradients (upsample.cu.j2): one thread per output
             (forward) or per input element (gradients gather their contributions).
"""
from __future__ import annotations

import numpy as np

from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels.common import (BLOCK, acc_type, converter, f32_literal, grid_1d, index_type, loader,
                                            neg_inf, node_comment, node_kernel, pair_of, render_template, shape_text,
                                            storer)


def render_pool2d(node, ctx: RenderContext) -> list:
    return _pool2d(node, ctx.kernel_name(node, [node.op]))


def render_upsample(node, ctx: RenderContext) -> list:
    return _upsample(node, ctx.kernel_name(node, [node.op]))


# --------------------------------------------------------------------------
# pool2d: max / avg / adaptive avg pooling and their gradients

def _pool2d(node, kernel_name):
    kind, ctx, what = pool2d_context(node, kernel_name)
    source = render_template("pool2d.cu.j2", kind=kind, comment=node_comment(node, what), **ctx)
    return [node_kernel(node, kernel_name, source, grid_1d(node.output.numel), (BLOCK, 1, 1), False, what)]


def pool2d_context(node, kernel_name) -> tuple:
    """(kind, template context, what it computes) of a pool2d node: what pool2d.cu.j2, and for the
    forward kinds the cpu target's cpu_pool2d.cpp.j2, render (one window per output,
    _pool2d_window.j2)."""
    op, a = node.op, node.attrs
    out = node.output
    grad = op.endswith("_grad")
    big, small = (out, node.inputs[0]) if grad else (node.inputs[0], out)
    N, C, H, W = big.shape
    OH, OW = small.shape[2:]
    indices = op == "max_pool2d_indices"
    acc = acc_type(*(v.dtype for v in node.inputs), *(() if indices else (out.dtype,)))
    ctx = dict(name=kernel_name, N=N, C=C, H=H, W=W, OH=OH, OW=OW, numel=out.numel,
               idx_t=index_type(out.numel, node.inputs[0].numel), acc=acc, store=storer(out.dtype, acc),
               y_t=out.dtype.ctype, out_t=out.dtype.ctype, neg_inf=neg_inf(acc))
    if op.startswith("adaptive"):
        kind = "adaptive"
        what = f"{shape_text(big.shape)} -> {OH}x{OW} bins"
    else:
        (KH, KW), (SH, SW), (PH, PW) = pair_of(a["kernel_size"]), pair_of(a["stride"]), pair_of(a.get("padding", 0))
        DH, DW = pair_of(a.get("dilation", 1)) if op.startswith("max") else (1, 1)
        ctx.update(KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW,
                   include_pad=bool(a.get("count_include_pad", True)))
        kind = "max" if op.startswith("max") else "avg"
        what = f"{KH}x{KW} stride {SH}x{SW} pad {PH}x{PW}" + (f" dilation {DH}x{DW}" if (DH, DW) != (1, 1) else "")
        if a.get("ceil_mode"):
            what += " ceil_mode"
    g = node.inputs[0]
    if grad:
        ctx.update(g_t=g.dtype.ctype, load_g=loader(g.dtype, acc))
        if kind == "max":
            x = node.inputs[1]
            ctx.update(x_t=x.dtype.ctype, load=loader(x.dtype, acc))
    else:
        ctx.update(x_t=g.dtype.ctype, load=loader(g.dtype, acc))
    kind += "_indices" if indices else "_bwd" if grad else "_fwd"
    return kind, ctx, what


# --------------------------------------------------------------------------
# upsample: nearest / bilinear and their gradients


def _coord_literal(value, coord: str) -> str:
    """`value` in the coordinate type (`float` or `double`) as a C++ literal that parses back to
    exactly that value."""
    return f32_literal(value) if coord == "float" else repr(float(value))


def _upsample_dim(in_size: int, out_size: int, scale, linear: bool, align_corners: bool, dst: str, src: str,
                  coord: str) -> dict:
    """How output coordinate `dst` maps to the input along one dim, and (for the gradients) the
    inclusive window [lo, hi] of outputs that can read input coordinate `src`. Nearest source
    indices are computed in float32 for every dtype, linear ones in `coord` (the accumulation
    type), as PyTorch does."""
    last_out = out_size - 1
    if not linear:
        if out_size == in_size:
            return dict(mode="identity", dst=dst, size=in_size, factor="", lo=src, hi=src)
        if out_size == 2 * in_size:
            return dict(mode="half", dst=dst, size=in_size, factor="", lo=f"2 * {src}", hi=f"2 * {src} + 1")
        factor = np.float32(1.0 / scale) if scale is not None and scale > 0 else \
            np.float32(in_size) / np.float32(out_size)
        inv = 1.0 / float(factor)
        lo = f"max(0, (int)((float){src} * {inv!r}f) - 2)"
        hi = f"({src} == {in_size - 1} ? {last_out} : min({last_out}, (int)((float)({src} + 1) * {inv!r}f) + 2))"
        return dict(mode="float", dst=dst, size=in_size, factor=f32_literal(factor), lo=lo, hi=hi)
    t = np.float32 if coord == "float" else np.float64
    if align_corners:
        factor = t(in_size - 1) / t(out_size - 1) if out_size > 1 else t(0)
    else:
        factor = t(1.0 / scale) if scale is not None and scale > 0 else t(in_size) / t(out_size)
    if float(factor) == 0.0:
        lo, hi = "0", str(last_out)
    else:
        inv = 1.0 / float(factor)
        # outputs whose source coordinate lies in (src - 1, src + 1), with a margin for rounding
        shift = "" if align_corners else " + 0.5f"
        lo = f"max(0, (int)floorf(((float){src} - 1.0f{shift}) * {inv!r}f) - 2)"
        hi = f"min({last_out}, (int)ceilf(((float){src} + 1.0f{shift}) * {inv!r}f) + 2)"
    return dict(mode="linear", dst=dst, size=in_size, factor=_coord_literal(factor, coord),
                align_corners=bool(align_corners), lo=lo, hi=hi, t=coord, f="f" if coord == "float" else "",
                mul="FLOWGEN_MUL_RN" if coord == "float" else "FLOWGEN_DMUL_RN", max="fmaxf" if coord == "float" else "fmax")


def _upsample(node, kernel_name):
    op, a = node.op, node.attrs
    out = node.output
    grad = op.endswith("_grad")
    big, small = (node.inputs[0], out) if grad else (out, node.inputs[0])
    N, C, H, W = small.shape
    OH, OW = big.shape[2:]
    linear = "bilinear" in op
    align = bool(a.get("align_corners") or False)
    scales = a.get("scales") or (None, None)
    src = node.inputs[0]
    acc = acc_type(src.dtype, out.dtype)
    rows = _upsample_dim(H, OH, scales[0], linear, align, "oh", "h", acc)
    cols = _upsample_dim(W, OW, scales[1], linear, align, "ow", "w", acc)
    ctx = dict(name=kernel_name, N=N, C=C, H=H, W=W, OH=OH, OW=OW, rows=rows, cols=cols, numel=out.numel,
               idx_t=index_type(out.numel, src.numel), acc=acc, out_t=out.dtype.ctype, store=storer(out.dtype, acc))
    if grad:
        ctx.update(g_t=src.dtype.ctype, load_g=loader(src.dtype, acc))
    else:
        ctx.update(x_t=src.dtype.ctype, load=loader(src.dtype, acc), copy=converter(src.dtype, out.dtype))
    kind = ("bilinear" if linear else "nearest") + ("_bwd" if grad else "_fwd")
    what = f"{shape_text(small.shape)} -> {OH}x{OW}" + (" align_corners" if linear and align else "")
    source = render_template("upsample.cu.j2", kind=kind, comment=node_comment(node, what), **ctx)
    return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what)]
