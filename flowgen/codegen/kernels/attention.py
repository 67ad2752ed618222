"""attention: softmax(q k^T * scale + mask) v and its gradients without the [L, S] scores.

attention(q, k, v[, mask]) writes the output and the rows' logsumexp; attention_backward runs the
dQ kernel, which also writes D = rowsum(dO * O) to a scratch buffer, then the dK/dV kernel. The
`_dropout` variants drop P_ij with F.dropout's Philox mask, reading the rng state like randperm.
The [L, S] scores never reach memory; no atomics. On a GPU (templates/attention_tiled.cu.j2): a
block of 4 warps per (slice, 64 query rows), or 64 key rows for dK/dV, streaming K/V (Q/dO) tiles
of 64 rows (16 or 32 in the backward kernels at wide head dims) through shared memory (cp.async,
double-buffered, for 16-bit inputs), an online softmax across key tiles, causal tiles above the diagonal
never loaded; float16/bfloat16 on tensor cores (mma.sync m16n8k16, fp32 accumulation and
statistics, P and dS fed from the accumulators as A fragments), float32/float64 on scalar loops.
On the cpu target (and head dims over 128, or float64 tiles over the shared memory)
attention.cu.j2: a thread per query row (forward, dQ) or key row (dK/dV), no barriers.
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.kernel import Blocks, BufferArg, Kernel, RenderContext
from flowgen.codegen.kernels.common import (BLOCK, acc_type, contiguous_strides, f32_literal, grid_1d, index_type,
                                            loader, neg_inf, node_comment, numel_of, render_template, shape_text,
                                            store_as, storer)
from flowgen.codegen.target import serial_blocks, tensor_cores
from flowgen.ir.graph import Value


def render(node, ctx: RenderContext) -> list:
    return _attention(node, ctx.kernel_name(node, [node.op]), ctx.rng_state(node))


def _attention(node, kernel_name, rng=None):
    """`attention`: one forward kernel (output + logsumexp); `attention_backward`: the dQ kernel
    (which also saves D = rowsum(dO * O) in a scratch buffer) then the dK/dV kernel. The
    `_dropout` variants also read the graph's rng state `rng` (seed, base offset) when their
    stream is bound (passes/random_streams.py), else their own seed/offset attributes. On a GPU
    the kernels are tiled (attention_tiled.cu.j2, `_attention_tiling`); on the cpu target, a
    thread per row (attention.cu.j2)."""
    q, k, v = node.inputs[:3]
    L, E, S, Ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if S == 0:
        raise NotImplementedError(f"{node.op}: no keys (S = 0) in {shape_text(k.shape)}")
    plain = 6 if node.op.endswith("_backward") else 3   # inputs before the optional mask
    mask = node.inputs[plain] if len(node.inputs) > plain else None
    acc = acc_type(q.dtype)
    causal = bool(node.attrs["causal"])
    ctx = dict(slices=numel_of(q.shape[:-2]), L=L, S=S, E=E, Ev=Ev, causal=causal,
               causal_text=", causal (keys j <= i)" if causal else "", q_t=q.dtype.ctype, acc=acc,
               load=loader(q.dtype, acc), store=storer(q.dtype, acc),
               exp="exp" if acc == "double" else "expf", log="log" if acc == "double" else "logf",
               one="1.0" if acc == "double" else "1.0f", neg_inf=neg_inf(acc), out_t=q.dtype.ctype,
               scale=repr(float(node.attrs["scale"])) if acc == "double" else f32_literal(node.attrs["scale"]),
               keys_of_row=f"(i + 1 < {S} ? i + 1 : {S})" if causal else str(S), first_query="j" if causal else "0",
               dropout=_attention_dropout(node.attrs, rng is not None),
               **_attention_mask_context(mask, q.shape[:-2], L, S, acc))
    tiling = _attention_tiling(q.dtype, E, Ev, acc, dropout=ctx["dropout"] is not None)
    shapes = f"{shape_text(q.shape)} x {shape_text(k.shape)}" + (" causal" if causal else "") + \
        (f" mask {shape_text(mask.shape)}" if mask is not None else "") + \
        (f" dropout {node.attrs['dropout_p']}" if ctx["dropout"] else "")
    extra = [(mask, "mask")] if mask is not None else []
    extra += [(rng, "rng")] if rng is not None else []
    if node.op.endswith("_backward"):
        return _attention_backward(node, kernel_name, ctx, tiling, shapes, extra)
    y, lse = node.outputs
    what = f"{shapes} -> {shape_text(y.shape)} + logsumexp ({_attention_layout(tiling, 'query')}, online softmax)"
    return [_attention_kernel(node, ctx, tiling, kernel_name, "forward", what, L,
                              [(q, "q"), (k, "k"), (v, "v"), *extra], [(y, "y"), (lse, "lse")])]


def _attention_dropout(attrs, streamed: bool):
    """The dropout's p (a float32 literal) and its seed/offset as C++: read from the rng state
    when the stream is bound, else the attributes; None without dropout."""
    if "dropout_p" not in attrs:
        return None
    seed, offset = ("(unsigned long long)rng[0]", f"(unsigned long long)(rng[1] + {attrs['offset']}LL)") \
        if streamed else (f"{attrs['seed'] & (2 ** 64 - 1)}ULL", f"{attrs['offset']}ULL")
    return dict(p=f32_literal(attrs["dropout_p"]), text=attrs["dropout_p"], seed=seed, offset=offset)


def _attention_mask_context(mask, lead, L, S, acc) -> dict:
    """How the kernels index a mask broadcast to [*lead, L, S]: `mask_slice` (the offset of the
    (batch x head) slice, a term "(slice / 3LL % 2LL) * 12LL" per non-broadcast lead dim) and the
    strides of i and j (0 where the mask's dim is 1)."""
    if mask is None:
        return dict(mask=None, mask_text="")
    full = (*lead, L, S)
    shape = (1,) * (len(full) - len(mask.shape)) + tuple(mask.shape)
    strides = [0 if n == 1 else st for n, st in zip(shape, contiguous_strides(shape))]
    inner = contiguous_strides(lead)
    slice_terms = [f"(slice / {inner[d]}LL % {lead[d]}LL) * {strides[d]}LL" for d in range(len(lead)) if strides[d]]
    kind = "bool" if mask.dtype == dt.bool_ else "float"
    return dict(mask=kind, mask_slice=slice_terms, mask_stride_i=strides[-2], mask_stride_j=strides[-1],
                load_mask=loader(mask.dtype, acc),
                mask_text=f", {kind} mask {shape_text(mask.shape)} broadcast to {shape_text(full)}")


# Tiled attention (attention_tiled.cu.j2): blocks of ATTENTION_THREADS threads (4 warps), each over
# a tile of ATTENTION_TILE rows (queries, or keys for dK/dV) against streamed tiles of as many rows.
ATTENTION_THREADS, ATTENTION_TILE = 128, 64
# Head dims up to this run tiled (the accumulators of a [64, 128] tile per block fill the registers).
ATTENTION_MAX_HEAD_DIM = 128
# Shared memory a tiled attention kernel may take (of an H100's 227 KiB per block).
ATTENTION_SMEM_LIMIT = 200 * 1024


def _attention_tiling(dtype, E: int, Ev: int, acc: str, dropout: bool):
    """The tiled kernels' constants, or None for a thread per row: on the cpu target (one thread
    per block there: the tiles' barriers and shuffles would run as fibers, while a thread per row
    streams K and V from cache), and for head dims over ATTENTION_MAX_HEAD_DIM or tiles over
    ATTENTION_SMEM_LIMIT (float64 with head dims over 64). 16-bit inputs run on tensor cores
    ("mma" engine; a thread per row when rendered without tensor cores), float32/float64 on scalar
    loops ("simt"). The mma engine copies tiles with cp.async, `vec_e`/`vec_v` elements per copy
    (16 bytes where the head dim allows), and double-buffers the streamed tiles."""
    mma = dtype in (dt.bfloat16, dt.float16)
    if serial_blocks() or max(E, Ev) > ATTENTION_MAX_HEAD_DIM or (mma and not tensor_cores()):
        return None
    EP, EvP = -(-E // 16) * 16, -(-Ev // 16) * 16        # head dims zero-padded to the k step
    pad = 8 if mma else 1                                # 16 bytes (ldmatrix rows); 1 (odd: no bank conflicts)
    T = ATTENTION_TILE
    tiling = dict(engine="mma" if mma else "simt", NT=ATTENTION_THREADS, BM=T,
                  RA=2 if mma else T // (ATTENTION_THREADS // 16), EP=EP, EvP=EvP, LDE=EP + pad, LDV=EvP + pad,
                  LDP=T + 1, smem_t=dtype.ctype if mma else acc, elem_bytes=dtype.itemsize if mma else
                  (4 if acc == "float" else 8), acc_bytes=4 if acc == "float" else 8, stages=2 if mma else 1,
                  vec_e=_copy_vector(E) if mma else 1, vec_v=_copy_vector(Ev) if mma else 1,
                  mma=f"mma_m16n8k16_{'bf16' if dtype == dt.bfloat16 else 'f16'}" if mma else None,
                  to_smem=(lambda expr: expr) if mma else loader(dtype, acc),
                  smem_zero=store_as("0.0f", dtype) if mma else "0")
    # Key (query) rows per streamed tile, by kernel: narrower score tiles where the accumulators of the
    # rows' gradients fill the registers (dQ: EP / 2 floats a thread; dK and dV: EP / 2 + EvP / 2).
    # ptxas, sm_90, bf16, head dim 128 (double-buffered tiles): dQ 249 registers with 64 columns, 172
    # with 32; dK/dV 248 with 32, 233 with 16. With dropout (the Philox rounds' state too), dK/dV at
    # head dim 64: 253 registers with 64 columns.
    wide = max(EP, EvP)
    tiling["BN_of"] = {"forward": T, "backward_dq": T if wide <= 96 else T // 2,
                       "backward_dkdv": T if wide <= (32 if dropout else 64) else T // 2 if wide <= 96 else T // 4}
    if max(_shared_tiles(kind, dict(tiling, BN=BN), acc)[1] for kind, BN in tiling["BN_of"].items()) \
            > ATTENTION_SMEM_LIMIT:
        return None
    return tiling


def _copy_vector(width: int) -> int:
    """16-bit elements per cp.async of a row of `width` (rows start 16-byte aligned when width is a
    multiple of 8): 8 (16 bytes), 4 or 2; 1: plain stores (odd widths)."""
    return next(v for v in (8, 4, 2, 1) if width % v == 0)


def _shared_tiles(kind: str, tiling: dict, acc: str) -> tuple:
    """([(name, ctype, rows, row length, buffers, byte offset)], total bytes): the shared-memory
    tiles of a tiled kernel `kind` (tiling["BN"]: its streamed tiles' rows), 16-byte aligned one after another; the streamed tiles (the K and V
    tiles, or Q and dO for dK/dV) have `stages` buffers. The launch requests the total."""
    t = tiling
    BN = t["BN"]
    e, stages = t["smem_t"], t["stages"]
    if kind == "backward_dkdv":
        tiles = [("ks", e, t["BM"], t["LDE"], 1), ("vs", e, t["BM"], t["LDV"], 1),
                 ("qs", e, BN, t["LDE"], stages), ("dos", e, BN, t["LDV"], stages),
                 ("col_lse", acc, 1, BN, stages), ("col_d", acc, 1, BN, stages)]
    else:
        tiles = [("qs", e, t["BM"], t["LDE"], 1)]
        if kind == "backward_dq":
            tiles += [("dos", e, t["BM"], t["LDV"], 1), ("row_lse", acc, 1, t["BM"], 1), ("row_d", acc, 1, t["BM"], 1)]
        tiles += [("ks", e, BN, t["LDE"], stages), ("vs", e, BN, t["LDV"], stages)]
    if t["engine"] == "simt":
        tiles.append(("ps", acc, t["BM"], t["LDP"], 1))   # the probabilities between the two products
    layout, offset = [], 0
    for name, ctype, rows, length, buffers in tiles:
        layout.append((name, ctype, rows, length, buffers, offset))
        size = {"float": 4, "double": 8}.get(ctype, t["elem_bytes"]) * rows * length * buffers
        offset += -(-size // 16) * 16
    return layout, offset


def _attention_layout(tiling, rows: str) -> str:
    """How a kernel's work is split, for its comment."""
    if tiling is None:
        return f"thread per {rows} row"
    where = f"tensor cores, {tiling['mma'].rsplit('_', 1)[1]} mma.sync" if tiling["engine"] == "mma" else "SIMT"
    return f"block per {tiling['BM']} {rows} rows, {where}"


def _attention_backward(node, kernel_name, ctx, tiling, shapes, extra) -> list:
    """Two kernels: over query rows (D -> scratch, dQ), then over key rows (dK, dV). `extra`: the
    (mask, rng) arguments the node has."""
    q, k, v, o, dout, lse = node.inputs[:6]
    dq, dk, dv = node.outputs
    rowdot = Value(f"{dq.name}_rowdot", tuple(lse.shape), dt.float64 if ctx["acc"] == "double" else dt.float32)
    dq_what = f"{shapes} -> dQ {shape_text(dq.shape)} ({_attention_layout(tiling, 'query')}; " \
              f"D = rowsum(dO * O) to scratch)"
    dkdv_what = f"{shapes} -> dK {shape_text(dk.shape)}, dV {shape_text(dv.shape)} ({_attention_layout(tiling, 'key')})"
    return [
        _attention_kernel(node, ctx, tiling, f"{kernel_name}_dq", "backward_dq", dq_what, ctx["L"],
                          [(q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout"), (lse, "lse"), *extra],
                          [(dq, "dq_out"), (rowdot, "rowdot")]),
        _attention_kernel(node, ctx, tiling, f"{kernel_name}_dkdv", "backward_dkdv", dkdv_what, ctx["S"],
                          [(q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (lse, "lse"), (rowdot, "rowdot"), *extra],
                          [(dk, "dk_out"), (dv, "dv_out")]),
    ]


def _attention_kernel(node, ctx, tiling, name, kind, what, rows_per_slice, reads, writes) -> Kernel:
    """One kernel over the `rows_per_slice` rows of every slice: a thread per row, or with `tiling` a
    block per tile of rows; `reads`/`writes`: (Value, parameter name) in argument order."""
    args = [BufferArg(x, f"const {x.dtype.ctype}*") for x, _ in reads] + \
        [BufferArg(x, f"{x.dtype.ctype}*") for x, _ in writes]
    params = [f"const {x.dtype.ctype}* __restrict__ {n}" for x, n in reads] + \
        [f"{x.dtype.ctype}* __restrict__ {n}" for x, n in writes]
    comment = node_comment(node, what)
    if tiling is None:
        rows = ctx["slices"] * rows_per_slice
        source = render_template("attention.cu.j2", kind=kind, name=name, comment=comment, rows=rows,
                                 idx_t=index_type(rows), params=params, **ctx)
        return Kernel(name=name, source=source, args=args, grid=grid_1d(rows), block=(BLOCK, 1, 1),
                      needs_fibers=False, comment=comment, ops=[node.op])
    tiling = dict(tiling, BN=tiling["BN_of"][kind])
    tiles, smem = _shared_tiles(kind, tiling, ctx["acc"])
    blocks_per_slice = -(-rows_per_slice // tiling["BM"])
    source = render_template("attention_tiled.cu.j2", kind=kind, name=name, comment=comment, params=params,
                             tiles_per_slice=blocks_per_slice, shared_tiles=tiles, smem=smem, **ctx, **tiling)
    grid = (Blocks(rows_per_slice, tiling["BM"], times=ctx["slices"]), 1, 1)   # blocks_per_slice x slices
    return Kernel(name=name, source=source, args=args, grid=grid,
                  block=(tiling["NT"], 1, 1), smem=smem, needs_fibers=True, comment=comment,
                  ops=[node.op])
