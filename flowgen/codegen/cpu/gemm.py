"""GEMMs of the cpu target as native kernels: OpenBLAS sgemm per batch entry, then the fused
epilogue as a loop over the output elements (templates/cpu_gemm.cpp.j2). Small products (the
sizes ops/linalg.py's `is_fma_chain` names) are one fused multiply-add chain per output in k
order instead, as eager and the emulated kernels compute them: a graph's small matmuls equal
eager's bit for bit (OpenBLAS's small-matrix and GEMV paths sum in other orders).

The fused node is read as codegen/fused.py's `render_gemm` reads it (transposes folded into the
operands, an optional transposed store, the epilogue's lines from the same emitter), so both
renderings compute the same expression per element; only the products' summation order is
BLAS's. float32 only: other dtypes keep the emulated kernel.
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen import fused
from flowgen.codegen.cpu.elementwise import element_loop, grain, piece_lines
from flowgen.codegen.kernels.common import node_args, node_comment, numel_of, shape_text
from flowgen.codegen.kernels.gemm import _batch_offset_lines, _batch_text
from flowgen.codegen.kernel import Kernel, RenderContext, every_output_over
from flowgen.codegen.templates import get_template
from flowgen.ops.linalg import SMALL_MATMUL_K, SMALL_MATMUL_MACS, is_fma_chain

NATIVE_DTYPES = (dt.float32,)


def _native(*values) -> bool:
    return all(v.dtype in NATIVE_DTYPES for v in values)


def _loop_coordinates(lines, rows_cols, batch: int, names: str) -> list:
    """The epilogue's `lines` with the flat index's coordinates along C's rows and columns as
    stored (`rows_cols`; codegen/fused.py's coordinate_lines: `(i / cols) % rows`, `(i) % cols`,
    and `i / cols` without a batch) read as the loop's own (`names`: m, n; n, m when stored
    transposed), which equal them: a broadcast read (a bias) is then affine in the inner loop, which
    g++ vectorizes, where a read at i % cols is a gather it does not."""
    rows, cols = rows_cols
    row, col = names
    known = {f"(i) % {cols}LL": col, f"(i / {cols}LL) % {rows}LL": row}
    if batch == 1:
        known[f"i / {cols}LL"] = row
    out = []
    for line in lines:
        declared, _, value = line.partition(" = ")
        known_value = known.get(value.rstrip(";")) if declared.startswith("const long long ") else None
        out.append(f"{declared} = {known_value};" if known_value else line)
    return out


def gemm_source(node, name, a, b, c, params, epilogue_lines, a_trans, b_trans, a_ptr, b_ptr, what_extra="",
                transposed=False):
    """The native kernel computing c = op(a) @ op(b) then `epilogue_lines` per element (with
    `val`, `m`, `n`, `c_base`, `GM`, `GN` in scope, as in the emulated gemm template). With
    `transposed` (an epilogue storing element (m, n) at c_base + n * GM + m) BLAS computes the
    transposed product, so the epilogue walks both the accumulators and the stores in order."""
    M, K = (a.shape[-1], a.shape[-2]) if a_trans else a.shape[-2:]
    N = b.shape[-2] if b_trans else b.shape[-1]
    out_batch = tuple(c.shape[:-2])
    epilogue_lines, costly = element_loop(epilogue_lines)
    epilogue_lines = _loop_coordinates(epilogue_lines, (N, M) if transposed else (M, N), numel_of(out_batch),
                                       "nm" if transposed else "mn")
    chain = is_fma_chain(K, numel_of(out_batch) * M * N)
    what = (f"{shape_text(a.shape)}{'^T' if a_trans else ''} @ {shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" ({'fused multiply-add chains' if chain else 'OpenBLAS sgemm'}){what_extra}")
    # A batch over A alone, A not transposed and not broadcast, C not transposed: [batch, M, K] @
    # [K, N] is one [batch * M, K] @ [K, N] product, whose accumulators are laid out alike (one BLAS
    # call, not one per batch entry).
    stacked = numel_of(out_batch) > 1 and not a_trans and not transposed and numel_of(b.shape[:-2]) == 1 and \
        tuple(a.shape[:-2]) == out_batch
    source = get_template("cpu_gemm.cpp.j2").render(
        name=name, comment=node_comment(node, what), params=params, M=M, N=N, K=K, batch=numel_of(out_batch),
        stacked=stacked, transposed=transposed, small_k=SMALL_MATMUL_K, small_macs=SMALL_MATMUL_MACS,
        product_text="one fused multiply-add chain per output" if chain else "OpenBLAS sgemm",
        batch_text=_batch_text(out_batch), a_desc="A^T" if a_trans else "A", b_desc="B^T" if b_trans else "B",
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        a_trans=a_trans, b_trans=b_trans, a_ptr=a_ptr, b_ptr=b_ptr, lda=M if a_trans else K, ldb=K if b_trans else N,
        epilogue_lines=epilogue_lines, grain=grain(costly), piece_lines=piece_lines(epilogue_lines))
    return source, node_comment(node, what)


def render(node, ctx: RenderContext):
    """A matmul, or a fused node anchored on one (passes/fusion.py), as one native kernel, or None
    where its operands are not float32."""
    return render_fused_gemm(node, ctx) if node.op == "fused" else render_matmul(node, ctx)


def render_fused_gemm(node, ctx: RenderContext):
    """A fused GEMM node (codegen/fused.py render_gemm's input) as one native kernel, or None
    where its operands are not float32."""
    producers, stream_values = ctx.producers, ctx.stream_values
    body = node.body
    mm_at = next(k for k, b in enumerate(body) if b.op == "matmul")
    mm, prologue, epilogue = body[mm_at], body[:mm_at], body[mm_at + 1:]
    transposed = {p.output: p.inputs[0] for p in prologue}
    a_val, b_val = mm.inputs
    a_src, b_src = transposed.get(a_val, a_val), transposed.get(b_val, b_val)
    if not _native(a_src, b_src, mm.output):
        return None
    em = fused.Emitter(node, producers, stream_values, buffered=(a_src, b_src))
    out_value = mm.output
    store_transposed = bool(epilogue) and epilogue[0].op == "permute"
    if store_transposed:
        out_value, epilogue = epilogue[0].output, epilogue[1:]
    index_line = ("const long long i = c_base + (long long)n * GM + m;" if store_transposed
                  else "const long long i = c_base + (long long)m * GN + n;")
    lines, pointwise = fused.anchor_epilogue(em, epilogue, out_value, tuple(out_value.shape), producers, index_line)
    ops = [b.op for b in body]
    name = ctx.kernel_name(node, [o for o in ops if o != "permute"])
    extra = f"; epilogue: {', '.join(b.op for b in epilogue)}" if epilogue else ""
    source, comment = gemm_source(node, name, a_src, b_src, mm.output, em.params, lines, a_val in transposed,
                                  b_val in transposed, em.param_name[a_src], em.param_name[b_src], extra,
                                  transposed=store_transposed)
    return [Kernel(name, source, em.args, (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=ops,
                   in_place=every_output_over(node.outputs, pointwise - {a_src, b_src}))]


def render_matmul(node, ctx: RenderContext):
    """An unfused `matmul` node as one native kernel, or None where it is not float32."""
    name = ctx.kernel_name(node, [node.op])
    a, b = node.inputs
    c = node.output
    if not _native(a, b, c):
        return None
    params = ["const float* __restrict__ a", "const float* __restrict__ b", "float* __restrict__ c"]
    source, comment = gemm_source(node, name, a, b, c, params, ["c[c_base + (long long)m * GN + n] = val;"],
                                  False, False, "a", "b")
    return [Kernel(name, source, node_args(node), (1, 1, 1), (1, 1, 1), native=True, comment=comment, ops=[node.op])]
