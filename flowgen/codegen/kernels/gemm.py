"""The GEMM family: matmul(a, b) and the fused nodes anchored on one, and the tile choice every
GEMM-shaped kernel shares (the implicit-GEMM convs of kernels/conv.py, runtime/autotune.py).

A tiled SIMT GEMM (templates/gemm.cu.j2 on _gemm_tile.j2; on the cpu target one thread per tile,
_gemm_tile_cpu.j2), batch dims broadcast through strides; bf16/fp16 operands (and float32 ones when
TF32 is allowed) run on tensor cores instead (gemm_mma.cu.j2 on _mma.j2: mma.sync, ldmatrix, a
cp.async pipeline); rendered for sm_90, they use warpgroup MMA (gemm_wgmma.cu.j2 on _wgmma.j2:
wgmma from 128B-swizzled shared-memory tiles through matrix descriptors, a cp.async pipeline; tf32
operands gathered into K-major tiles and rounded by cvt.rna on the way in). A fused node's
transposed operands are read in place, a transposed result is stored transposed, and its
elementwise consumers (bias, activation, residual) run in the kernel's epilogue (codegen/fused.py
emits their lines).
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.fused import Emitter, anchor_epilogue
from flowgen.codegen.kernel import Blocks, Kernel, RenderContext, every_output_over
from flowgen.codegen.kernels.common import (BLOCK, acc_type, contiguous_strides, coordinates, grid_1d, loader,
                                            node_args, node_comment, numel_of, offset_expr, render_template,
                                            shape_text, storer, zero_literal)
from flowgen.codegen.target import (allow_tf32, chosen_shape, serial_blocks, target_blocks, tensor_cores,
                                    warpgroup_mma)


def render(node, ctx: RenderContext) -> list:
    """A matmul, or a fused node anchored on one (passes/fusion.py)."""
    if node.op == "fused":
        return [_fused_gemm(node, ctx)]
    return _gemm(node, ctx.kernel_name(node, [node.op]))


def _fused_gemm(node, ctx: RenderContext) -> Kernel:
    """A matmul with transposes folded into its loads and an elementwise epilogue."""
    body = node.body
    mm_at = next(k for k, b in enumerate(body) if b.op == "matmul")
    mm, prologue, epilogue = body[mm_at], body[:mm_at], body[mm_at + 1:]
    transposed = {p.output: p.inputs[0] for p in prologue}   # operands read in place, transposed
    a_val, b_val = mm.inputs
    a_src, b_src = transposed.get(a_val, a_val), transposed.get(b_val, b_val)
    em = Emitter(node, ctx.producers, ctx.stream_values, buffered=(a_src, b_src))

    out_value = mm.output
    store_transposed = bool(epilogue) and epilogue[0].op == "permute"
    if store_transposed:   # (A @ B)^T: element (m, n) lands at (n, m)
        out_value, epilogue = epilogue[0].output, epilogue[1:]
    index_line = ("const long long i = c_base + (long long)n * GM + m;" if store_transposed
                  else "const long long i = c_base + (long long)m * GN + n;")
    lines, pointwise = anchor_epilogue(em, epilogue, out_value, tuple(out_value.shape), ctx.producers, index_line)
    ops = [b.op for b in body]
    name = ctx.kernel_name(node, [o for o in ops if o != "permute"])
    extra = f"; epilogue: {', '.join(b.op for b in epilogue)}" if epilogue else ""
    kernel = gemm_kernel(node, name, a_src, b_src, mm.output, params=em.params, args=em.args, epilogue_lines=lines,
                         a_trans=a_val in transposed, b_trans=b_val in transposed, ops=ops, what_extra=extra,
                         a_ptr=em.param_name[a_src], b_ptr=em.param_name[b_src])
    kernel.in_place = every_output_over(node.outputs, pointwise - {a_src, b_src})
    return kernel


# --------------------------------------------------------------------------
# gemm

# (BM, BN, TM, TN): every configuration uses 256 threads; k steps are 16 wide (8 for the largest tiles).
_TILES = ((128, 128, 8, 8), (128, 64, 8, 4), (64, 128, 4, 8), (64, 64, 4, 4), (32, 64, 2, 4), (64, 32, 4, 2),
          (32, 32, 2, 2), (16, 64, 1, 4), (64, 16, 4, 1), (16, 16, 1, 1))


# The cpu target's extra shapes (serial tiles, _gemm_tile_cpu.j2: one thread computes the whole
# tile, so TM x TN only names a nominal 256-thread split): each element of A and B that a tile
# packs feeds BM * BN / (BM + BN) multiply-adds, so wider tiles spend less of their time packing.
_CPU_TILES = ((256, 256, 16, 16), (256, 128, 16, 8), (128, 256, 8, 16))


class Tile(dict):
    """Tile configuration; a dict so Jinja reads `t.BM` etc."""

    __getattr__ = dict.__getitem__


def ranked_tiles(M: int, N: int, batch: int, acc: str, k_splits=None) -> list:
    """Tile shapes (BM, BN, TM, TN), best first by estimated time: padded work x per-multiply-add
    overhead (shared memory traffic falls with larger per-thread tiles), scaled up when there
    are too few blocks to fill the GPU. `k_splits(blocks)`, when given, says how many ways the
    k loop may be split across blocks (more blocks for the same tile)."""
    costed, best, best_cost = [], None, None
    serial = serial_blocks()
    for BM, BN, TM, TN in (_CPU_TILES + _TILES if serial else _TILES):
        if acc == "double" and TM * TN > 16:                 # keep double accumulators in registers
            continue
        blocks = -(-M // BM) * -(-N // BN) * batch
        if k_splits is not None:
            blocks *= k_splits(blocks)
        padded = -(-M // BM) * BM * -(-N // BN) * BN
        # per multiply-add: shared-memory traffic (GPU), or packing A and B (cpu)
        overhead = 16.0 / BM + 16.0 / BN if serial else 2.0 / TM + 2.0 / TN
        cost = padded * (1.0 + overhead) * max(1.0, target_blocks() / blocks)
        costed.append((cost, (BM, BN, TM, TN)))
        if best_cost is None or cost < best_cost * 0.999:   # near-ties keep the table's order
            best, best_cost = (BM, BN, TM, TN), cost
    return [best] + [dims for _, dims in sorted(costed, key=lambda c: c[0]) if dims != best]


def make_tile(dims, acc: str, a_order: str, b_order: str) -> Tile:
    BM, BN, TM, TN = dims
    return Tile(BM=BM, BN=BN, BK=16 if BM * BN <= 64 * 64 else 8, TM=TM, TN=TN, RX=BN // TN, RY=BM // TM,
                NT=(BM // TM) * (BN // TN), acc=acc, a_order=a_order, b_order=b_order)


def choose_tile(M: int, N: int, batch: int, acc: str, a_order: str, b_order: str, k_splits=None) -> Tile:
    return make_tile(ranked_tiles(M, N, batch, acc, k_splits)[0], acc, a_order, b_order)


def _batch_offset_lines(out_batch, a_batch, b_batch, a_mat: int, b_mat: int) -> list:
    """Offsets of batch entry `z` into a and b (right-aligned broadcasting, stride 0 where size 1)."""
    if numel_of(out_batch) == 1:
        return []
    lines, coords = coordinates(out_batch, "z", "z")

    def strides_for(shape, mat):
        shape = (1,) * (len(out_batch) - len(shape)) + tuple(shape)
        return [0 if size == 1 else s * mat for size, s in zip(shape, contiguous_strides(shape))]

    lines.append(f"const long long a_base = {offset_expr(coords, strides_for(a_batch, a_mat))};")
    lines.append(f"const long long b_base = {offset_expr(coords, strides_for(b_batch, b_mat))};")
    return lines


def _gemm(node, kernel_name: str) -> list:
    a, b = node.inputs
    c = node.output
    store = storer(c.dtype, acc_type(a.dtype, b.dtype))
    return [gemm_kernel(node, kernel_name, a, b, c, params=None, args=node_args(node), epilogue_lines=[
        f"c[c_base + (long long)m * GN + n] = {store('val')};"])]


def gemm_kernel(node, kernel_name, a, b, c, params, args, epilogue_lines, a_trans=False, b_trans=False,
                ops=None, what_extra="", a_ptr="a", b_ptr="b") -> Kernel:
    """One tiled GEMM kernel for c = op(a) @ op(b), where op transposes the last two dims when
    asked (the operand is then read in place: no transpose kernel). `params`/`args` default
    to (a, b, c); `epilogue_lines` run per output element with `val` (the accumulator), `m`,
    `n`, `c_base` in scope — the fusion pass puts bias adds and activations there."""
    if dt.bool_ in (a.dtype, b.dtype, c.dtype):
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): boolean matmul has no kernel")
    M, K = (a.shape[-1], a.shape[-2]) if a_trans else a.shape[-2:]
    N = b.shape[-2] if b_trans else b.shape[-1]
    out_batch = tuple(c.shape[:-2])
    batch = numel_of(out_batch)
    acc = acc_type(a.dtype, b.dtype)
    chosen = _chosen_sizes(a, b, c, a_trans, b_trans)   # what the form is chosen for
    # Shallow (small K) or tiny problems: one thread per output, no shared memory or barriers.
    direct = chosen.K <= 16 or (chosen.M * chosen.N * chosen.batch <= 256 and chosen.K <= 8192)
    if params is None:
        params = [f"const {a.dtype.ctype}* __restrict__ a", f"const {b.dtype.ctype}* __restrict__ b",
                  f"{c.dtype.ctype}* __restrict__ c"]
    kind = None if direct else tensor_core_kind(a.dtype, b.dtype)
    if kind is not None and warpgroup_mma():
        return _wgmma_gemm_kernel(node, kernel_name, kind, (a, b, c), (M, N, K), params, args, epilogue_lines,
                                  a_trans, b_trans, ops, what_extra, a_ptr, b_ptr, chosen)
    if kind is not None:
        return _mma_gemm_kernel(node, kernel_name, kind, (a, b, c), (M, N, K), params, args, epilogue_lines,
                                a_trans, b_trans, ops, what_extra, a_ptr, b_ptr, chosen)
    t = choose_tile(chosen.M, chosen.N, chosen.batch, acc, "m" if a_trans else "k", "k" if b_trans else "n")
    n_tiles, m_tiles, tile_grid = _grid_tiles(node, M, N, batch, t.BM, t.BN)
    serial = not direct and serial_blocks()
    what = (f"{shape_text(a.shape)}{'^T' if a_trans else ''} @ {shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" ({'direct GEMM' if direct else f'tiled GEMM {t.BM}x{t.BN}'}{', one thread per tile' if serial else ''})"
            f"{what_extra}")
    source = render_template(
        "gemm.cu.j2", name=kernel_name, comment=node_comment(node, what), params=params,
        a_ptr=a_ptr, b_ptr=b_ptr,
        a_desc=_operand_text("A", a_trans), b_desc=_operand_text("B", b_trans), acc=acc,
        a_index="(long long)k * GM + m" if a_trans else "(long long)m * GK + k",
        b_index="(long long)n * GK + k" if b_trans else "(long long)k * GN + n",
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles, t=t,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        load_a=loader(a.dtype, acc), load_b=loader(b.dtype, acc), epilogue_lines=epilogue_lines, direct=direct,
        serial=serial)
    if direct:
        grid, block = grid_1d(batch * M * N), (BLOCK, 1, 1)
    else:
        grid, block = tile_grid, (1 if serial else t.NT, 1, 1)
    return Kernel(name=kernel_name, source=source, args=args, grid=grid, block=block, smem=0,
                  needs_fibers=not (direct or serial), comment=node_comment(node, what), ops=ops or [node.op])


def _chosen_sizes(a, b, c, a_trans: bool, b_trans: bool) -> Tile:
    """M, N, K and batch of a GEMM's operands at the shapes its form is chosen for
    (codegen/target.py chosen_shape: the maximum sizes of a step with dynamic dimensions)."""
    a_shape, b_shape, c_shape = chosen_shape(a), chosen_shape(b), chosen_shape(c)
    M, K = (a_shape[-1], a_shape[-2]) if a_trans else a_shape[-2:]
    return Tile(M=M, N=b_shape[-2] if b_trans else b_shape[-1], K=K, batch=numel_of(c_shape[:-2]))


def _batch_text(shape) -> str:
    return "".join(f"{s}, " for s in shape)


def _operand_text(name: str, trans: bool) -> str:
    return f"{name}^T" if trans else name


def _grid_tiles(node, M: int, N: int, batch: int, BM: int, BN: int) -> tuple:
    """(column tiles, row tiles, grid) of a tiled GEMM: x = column tiles x batch entries, y = row
    tiles (Blocks: a step with dynamic dimensions computes them from its sizes)."""
    n_tiles, m_tiles = -(-N // BN), -(-M // BM)
    if m_tiles > 65535:
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): M = {M} needs more than 65535 row tiles")
    if n_tiles * batch >= 2 ** 31:
        raise NotImplementedError(f"{node.op} ({node.scope or 'graph'}): too many column tiles x batch entries")
    return n_tiles, m_tiles, (Blocks(N, BN, times=batch), Blocks(M, BM), 1)


# --------------------------------------------------------------------------
# gemm on tensor cores (templates/gemm_mma.cu.j2)

# Block tiles (BM, BN, WM, WN), four warps each; in table order when costs tie.
_MMA_TILES = ((128, 128, 64, 64), (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32))
# Per input precision: the mma.sync device function, its k, the block's k step, pipeline stages.
MMA_KINDS = {"bf16": ("mma_m16n8k16_bf16", 16, 32, 3), "f16": ("mma_m16n8k16_f16", 16, 32, 3),
             "tf32": ("mma_m16n8k8_tf32", 8, 16, 3)}


def tensor_core_kind(a_dtype, b_dtype):
    """The tensor-core precision of a GEMM with these operand dtypes: "bf16" / "f16" (16-bit
    operands, fp32 accumulation), "tf32" for float32 operands when the graph allows TF32
    (`rendering_for(..., allow_tf32=True)`), or None: the SIMT kernel (always with
    `rendering_for(..., tensor_cores=False)`)."""
    if a_dtype != b_dtype or not tensor_cores():
        return None
    if a_dtype == dt.bfloat16:
        return "bf16"
    if a_dtype == dt.float16:
        return "f16"
    if a_dtype == dt.float32 and allow_tf32():
        return "tf32"
    return None


def mma_tile(M: int, N: int, batch: int, tiles=_MMA_TILES, k_splits=None) -> tuple:
    """The entry of `tiles` ((BM, BN, ...) each) with the least padded work, scaled up when too
    few blocks fill the target; the first of near-ties. `k_splits(blocks)`, when given, says how
    many ways the k loop may be split across blocks (as in `ranked_tiles`)."""
    def cost(dims):
        BM, BN = dims[:2]
        blocks = -(-M // BM) * -(-N // BN) * batch
        if k_splits is not None:
            blocks *= k_splits(blocks)
        return -(-M // BM) * BM * -(-N // BN) * BN * max(1.0, target_blocks() / blocks)
    best = tiles[0]
    for dims in tiles[1:]:
        if cost(dims) < cost(best) * 0.999:
            best = dims
    return best


def _mma_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, kind, what):
    """How one operand's k tile is staged: rows over its non-contiguous dim, `vec` elements per
    copy (16-byte cp.async.cg where the contiguous length allows aligned vectors, else 8- or
    4-byte cp.async.ca, else plain loads for 16-bit rows of odd length); rows padded (`LD`)."""
    x = staged_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, what)
    pad = 4 if kind == "tf32" and k_contiguous else 8
    x.update(LD=x.C + pad, elems=x.R * (x.C + pad))
    return x


def staged_operand(name, ptr, k_contiguous, tile_mn, BK, mn_origin, mn_extent, mn_size, K, dtype, what):
    """The copy of one operand's k tile into shared memory (see `_mma_operand`), without a row layout."""
    contiguous_len = K if k_contiguous else mn_size
    item = dtype.itemsize
    vec = next(v for v in (16 // item, 8 // item, 4 // item, 1) if v >= 1 and contiguous_len % v == 0)
    copy_kind = "cg" if vec * item == 16 else "ca" if vec * item >= 4 else "plain"
    if k_contiguous:
        R, C, o0, O, i0, I, ld = tile_mn, BK, mn_origin, mn_extent, "k0", "GK", "GK"
    else:
        R, C, o0, O, i0, I, ld = BK, tile_mn, "k0", "GK", mn_origin, mn_extent, mn_extent
    return Tile(name=name, ptr=ptr, major="k" if k_contiguous else "mn", R=R, C=C, vec=vec, copy_kind=copy_kind,
                o0=o0, O=O, i0=i0, I=I, ld=ld, what=what)


def _mma_gemm_kernel(node, kernel_name, kind, operands, sizes, params, args, epilogue_lines, a_trans, b_trans, ops,
                     what_extra, a_ptr, b_ptr, chosen) -> Kernel:
    """c = op(a) @ op(b) on tensor cores; same arguments and epilogue contract as `gemm_kernel`."""
    a, b, c = operands
    M, N, K = sizes
    out_batch = tuple(c.shape[:-2])
    batch = numel_of(out_batch)
    BM, BN, WM, WN = mma_tile(chosen.M, chosen.N, chosen.batch)
    BK = MMA_KINDS[kind][2]
    n_tiles, m_tiles, grid = _grid_tiles(node, M, N, batch, BM, BN)
    a_op = _mma_operand("a", a_ptr, not a_trans, BM, BK, "m0", "GM", M, K, a.dtype, kind,
                        f"A(m, k), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})")
    b_op = _mma_operand("b", b_ptr, b_trans, BN, BK, "n0", "GN", N, K, b.dtype, kind,
                        f"B(k, n), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})")
    a_op["desc"], b_op["desc"] = _operand_text("A", a_trans), _operand_text("B", b_trans)
    t = mma_tile_config(kind, (BM, BN, WM, WN), a.dtype, a_op, b_op)
    what = (f"{shape_text(a.shape)}{'^T' if a_trans else ''} @ {shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" (tensor-core GEMM {BM}x{BN}, {kind} mma.sync){what_extra}")
    source = render_template(
        "gemm_mma.cu.j2", name=kernel_name, comment=node_comment(node, what), params=params, t=t,
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        epilogue_lines=epilogue_lines)
    return Kernel(name=kernel_name, source=source, args=args, grid=grid,
                  block=(t.NT, 1, 1), smem=t.smem, needs_fibers=True, comment=node_comment(node, what),
                  ops=ops or [node.op])


def mma_tile_config(kind, dims, dtype, a_op, b_op) -> Tile:
    """The `t` of _mma.j2: block and warp tiles, the mma, pipeline depth, operand staging, and
    `smem`, the dynamic shared memory of all stages in bytes."""
    BM, BN, WM, WN = dims
    mma, KSTEP, BK, STAGES = MMA_KINDS[kind]
    stage_elems = a_op.elems + b_op.elems
    return Tile(BM=BM, BN=BN, BK=BK, WM=WM, WN=WN, WARPS_M=BM // WM, NT=32 * (BM // WM) * (BN // WN), STAGES=STAGES,
                MI=WM // 16, NI=WN // 8, KSTEP=KSTEP, kind=kind, mma=mma, elem=dtype.ctype, elem_bytes=dtype.itemsize,
                zero=zero_literal(dtype), to_elem=storer(dtype, "float"), a=a_op, b=b_op, stage_elems=stage_elems,
                smem=STAGES * stage_elems * dtype.itemsize)


# --------------------------------------------------------------------------
# gemm on Hopper tensor cores (templates/gemm_wgmma.cu.j2), for programs rendered for sm_90

# The warpgroup MMA per input precision and tile width BN (fp32 accumulation), and its k.
_WGMMA_KINDS = {"bf16": ("wgmma_m64n{}k16_bf16", 16), "f16": ("wgmma_m64n{}k16_f16", 16),
                "tf32": ("wgmma_m64n{}k8_tf32", 8)}
# Block tiles (BM, BN): BM / 64 warpgroups of 64 x BN; in table order when costs tie.
WGMMA_TILES = ((128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
# The k step is one 128-byte swizzled row (64 16-bit or 32 tf32 elements). Pipeline stages: as
# many as fit in an sm_90 block's shared memory (227 KiB, less the 1 KiB alignment), at most 5.
# Copies run stages - 2 k tiles ahead of the MMAs; one more stage is read by the MMAs still in
# flight. Tiles with a gathered operand (conv, tf32) take 3: their loads are synchronous, so
# deeper prefetch gains nothing.
WGMMA_ROW_BYTES, _WGMMA_MAX_STAGES, _WGMMA_GATHER_STAGES, _SM90_SHARED_BYTES = 128, 5, 3, 227 * 1024


def _wgmma_gemm_kernel(node, kernel_name, kind, operands, sizes, params, args, epilogue_lines, a_trans, b_trans,
                       ops, what_extra, a_ptr, b_ptr, chosen) -> Kernel:
    """c = op(a) @ op(b) with warpgroup MMA; same arguments and epilogue contract as `gemm_kernel`.
    Block tiles: `WGMMA_TILES`. 16-bit operands are copied by cp.async in their own order;
    tf32 ones are gathered (K-major tiles only, rounded by cvt.rna as the mma.sync path does)."""
    a, b, c = operands
    M, N, K = sizes
    out_batch = tuple(c.shape[:-2])
    batch = numel_of(out_batch)
    BM, BN = mma_tile(chosen.M, chosen.N, chosen.batch, WGMMA_TILES)
    BK = WGMMA_ROW_BYTES // a.dtype.itemsize
    n_tiles, m_tiles, grid = _grid_tiles(node, M, N, batch, BM, BN)
    a_what = f"A(m, k), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})"
    b_what = f"B(k, n), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})"
    loads = {}
    if kind == "tf32":   # 4 elements (16 bytes) per load where the contiguous dim is a multiple of 4
        a_op = Tile(name="a", major="k", order="mn" if a_trans else "k", copy_kind="gather", what=a_what,
                    vec=4 if (M if a_trans else K) % 4 == 0 else 1, ptr=a_ptr,
                    index=f"a_base + {'(long long)k * GM + m' if a_trans else '(long long)m * GK + k'}")
        b_op = Tile(name="b", major="k", order="k" if b_trans else "mn", copy_kind="gather", what=b_what,
                    vec=4 if (K if b_trans else N) % 4 == 0 else 1, ptr=b_ptr,
                    index=f"b_base + {'(long long)n * GK + k' if b_trans else '(long long)k * GN + n'}")
        loads = dict(a_load=f"v = {a_ptr}[{a_op.index}];", b_load=f"v = {b_ptr}[{b_op.index}];")
    else:
        a_op = staged_operand("a", a_ptr, not a_trans, BM, BK, "m0", "GM", M, K, a.dtype, a_what)
        b_op = staged_operand("b", b_ptr, b_trans, BN, BK, "n0", "GN", N, K, b.dtype, b_what)
        for x in (a_op, b_op):
            x["address"] = f"{x.name}_base + (long long)go * {x.ld} + gi"
    a_op["desc"], b_op["desc"] = _operand_text("A", a_trans), _operand_text("B", b_trans)
    t = wgmma_tile_config(kind, BM, BN, a.dtype, a_op, b_op)
    what = (f"{shape_text(a.shape)}{'^T' if a_trans else ''} @ {shape_text(b.shape)}{'^T' if b_trans else ''}"
            f" (tensor-core GEMM {BM}x{BN}, {kind} wgmma){what_extra}")
    source = render_template(
        "gemm_wgmma.cu.j2", name=kernel_name, comment=node_comment(node, what), params=params, t=t,
        M=M, N=N, K=K, batch=batch, batch_text=_batch_text(out_batch), n_tiles=n_tiles, m_tiles=m_tiles,
        batch_lines=_batch_offset_lines(out_batch, a.shape[:-2], b.shape[:-2], M * K, K * N),
        epilogue_lines=epilogue_lines, **loads)
    return Kernel(name=kernel_name, source=source, args=args, grid=grid,
                  block=(t.NT, 1, 1), smem=t.smem, needs_fibers=True, comment=node_comment(node, what),
                  ops=ops or [node.op])


def wgmma_tile_config(kind, BM: int, BN: int, dtype, a_op, b_op) -> Tile:
    """The `t` of _wgmma.j2: block tile, the wgmma, pipeline depth, operand staging (tf32 tiles
    hold cvt.rna-rounded bit patterns), and `smem`: the stages, or the epilogue's fp32 tile of
    padded rows, whichever is larger (WGMMA_TILES all take the stages), + 1024: the tiles start
    at the first 1024-byte boundary of the shared window."""
    function, KSTEP = _WGMMA_KINDS[kind]
    elem_bytes = dtype.itemsize
    BK = WGMMA_ROW_BYTES // elem_bytes
    stage_bytes = (BM + BN) * WGMMA_ROW_BYTES
    if "gather" in (a_op.copy_kind, b_op.copy_kind):
        STAGES = _WGMMA_GATHER_STAGES
    else:
        STAGES = min(_WGMMA_MAX_STAGES, (_SM90_SHARED_BYTES - 1024) // stage_bytes)
    tf32 = kind == "tf32"
    return Tile(BM=BM, BN=BN, BK=BK, KSTEP=KSTEP, V=16 // elem_bytes, WGS=BM // 64, NT=2 * BM, STAGES=STAGES,
                wgmma=function.format(BN), elem="unsigned" if tf32 else dtype.ctype, elem_bytes=elem_bytes,
                zero="0u" if tf32 else zero_literal(dtype),
                to_elem=(lambda v: f"float_to_tf32({v})") if tf32 else storer(dtype, "float"),
                a=a_op, b=b_op, a_elems=BM * BK, stage_elems=(BM + BN) * BK,
                smem=max(STAGES * stage_bytes, BM * (BN + 8) * 4) + 1024)
