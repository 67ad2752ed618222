"""The conv2d family: conv2d, conv2d_grad_input, conv2d_grad_weight (templates/conv2d.cu.j2), and
the fused nodes anchored on a forward conv, and each conv's tile choice.

Implicit GEMM on the GEMM family's tile core (kernels/gemm.py; a plain GEMM indexing when the conv
is 1x1/stride 1/no padding), the tensor-core ones (16-bit, tf32) on _mma.j2, or on _wgmma.j2 when
rendered for sm_90; one-input-channel-per-group convs (depthwise) use direct kernels.
conv2d_grad_weight splits the reduction over batch x pixels across blocks when the weight alone
gives too few blocks: each split writes its partial sums to a scratch buffer and `<name>_combine`
adds them in split order (no atomics, so the same bits every run). A fused forward conv runs its
elementwise consumers (bias, folded BatchNorm shift, activation, residual add) in its epilogue.
A conv node's ``tile`` attribute (measured by runtime/autotune.py) overrides the cost model's SIMT tile.
"""
from __future__ import annotations

from flowgen import dtype as dt
from flowgen.codegen.fused import Emitter, anchor_epilogue
from flowgen.codegen.kernel import Blocks, BufferArg, Kernel, RenderContext, every_output_over
from flowgen.codegen.kernels.common import (BLOCK, acc_type, grid_1d, index_type, loader, node_args,
                                            node_comment, node_kernel, node_params, pair_of, render_template,
                                            row_blocks, storer)
from flowgen.codegen.kernels.gemm import (MMA_KINDS, WGMMA_ROW_BYTES, WGMMA_TILES, Tile, choose_tile, make_tile,
                                          mma_tile, mma_tile_config, ranked_tiles, staged_operand,
                                          tensor_core_kind, wgmma_tile_config)
from flowgen.codegen.target import chosen_shape, reduce_block, serial_blocks, target_blocks, warpgroup_mma
from flowgen.ir.graph import Value


def render(node, ctx: RenderContext) -> list:
    """A conv op, or a fused node anchored on a forward conv (passes/fusion.py)."""
    if node.op == "fused":
        return _fused_conv(node, ctx)
    return _conv2d_kernels(node, ctx.kernel_name(node, [node.op]), None)


def _fused_conv(node, ctx: RenderContext) -> list:
    """A forward conv with its elementwise consumers (bias, folded BatchNorm shift, activation,
    residual add) evaluated in the conv kernel's epilogue."""
    body = node.body
    conv, epilogue = body[0], body[1:]
    x, w = conv.inputs
    em = Emitter(node, ctx.producers, ctx.stream_values, names={x: "x", w: "w"})
    lines, pointwise = anchor_epilogue(em, epilogue, conv.output, tuple(conv.output.shape), ctx.producers, None)
    ops = [b.op for b in body]
    extra = f"; epilogue: {', '.join(b.op for b in epilogue)}" if epilogue else ""
    kernels = _conv2d_kernels(conv, ctx.kernel_name(node, ops),
                              fusion=dict(params=em.params, epilogue_lines=lines, what_extra=extra))
    kernels[-1].args, kernels[-1].ops = em.args, ops
    kernels[-1].in_place = every_output_over(node.outputs, pointwise - {x, w})
    return kernels


def _conv_geometry(node) -> dict:
    a = node.attrs
    if node.op == "conv2d":
        x, w = node.inputs
        x_shape, w_shape, y_shape = x.shape, w.shape, node.output.shape
    elif node.op == "conv2d_grad_input":
        g, w = node.inputs
        x_shape, w_shape, y_shape = tuple(a["input_shape"]), w.shape, g.shape
    else:
        g, x = node.inputs
        x_shape, w_shape, y_shape = x.shape, tuple(a["weight_shape"]), g.shape
    (SH, SW), (PH, PW) = pair_of(a.get("stride", 1)), pair_of(a.get("padding", 0))
    DH, DW = pair_of(a.get("dilation", 1))
    G = int(a.get("groups", 1))
    N, C, H, W = x_shape
    O, CG, KH, KW = w_shape
    OH, OW = y_shape[2:]
    return dict(N=N, C=C, H=H, W=W, O=O, CG=CG, KH=KH, KW=KW, OH=OH, OW=OW, G=G, OG=O // G,
                SH=SH, SW=SW, PH=PH, PW=PW, DH=DH, DW=DW)


def _conv_text(geo) -> str:
    text = f"{geo['KH']}x{geo['KW']}"
    if (geo["SH"], geo["SW"]) != (1, 1):
        text += f" stride {geo['SH']}" if geo["SH"] == geo["SW"] else f" stride {geo['SH']}x{geo['SW']}"
    if (geo["PH"], geo["PW"]) != (0, 0):
        text += f" pad {geo['PH']}" if geo["PH"] == geo["PW"] else f" pad {geo['PH']}x{geo['PW']}"
    if (geo["DH"], geo["DW"]) != (1, 1):
        text += f" dilation {geo['DH']}" if geo["DH"] == geo["DW"] else f" dilation {geo['DH']}x{geo['DW']}"
    if geo["G"] > 1:
        text += f" groups {geo['G']}"
    return text


def conv_key(node) -> str:
    """What a conv kernel's speed depends on: the op, its geometry and dtype."""
    geo = _conv_geometry(node)
    return f"{node.op}:{node.inputs[0].dtype.name}:" + ",".join(f"{k}={geo[k]}" for k in sorted(geo))


def conv_tile_candidates(node, count: int = 4) -> list:
    """The cost model's `count` best tiles for an implicit-GEMM conv; [] for depthwise convs."""
    geo = _conv_geometry(node)
    if geo["CG"] == 1:
        return []
    acc = acc_type(*(v.dtype for v in node.inputs), node.output.dtype)
    GM, GN = {"conv2d": (geo["OG"], geo["N"] * geo["OH"] * geo["OW"]),
              "conv2d_grad_input": (geo["CG"], geo["N"] * geo["H"] * geo["W"]),
              "conv2d_grad_weight": (geo["OG"], geo["CG"] * geo["KH"] * geo["KW"])}[node.op]
    return ranked_tiles(GM, GN, geo["G"], acc)[:count]


def _conv2d_kernels(node, kernel_name, fusion):
    """Conv kernels. `fusion` (forward only) gives the fused node's params, the epilogue
    statements (run per output with `val` and its flat index `i`) and the comment's tail."""
    geo = _conv_geometry(node)
    out = node.output
    first, second = node.inputs
    acc = acc_type(first.dtype, second.dtype, out.dtype)
    op = {"conv2d": "fwd", "conv2d_grad_input": "dgrad", "conv2d_grad_weight": "wgrad"}[node.op]
    names = {"fwd": ("x", "w", "y"), "dgrad": ("grad", "w", "dx"), "wgrad": ("grad", "x", "dw")}[op]
    loads = {"fwd": dict(load_x=loader(first.dtype, acc), load_w=loader(second.dtype, acc), x_t=first.dtype.ctype,
                         w_t=second.dtype.ctype),
             "dgrad": dict(load_g=loader(first.dtype, acc), load_w=loader(second.dtype, acc), g_t=first.dtype.ctype,
                           w_t=second.dtype.ctype),
             "wgrad": dict(load_g=loader(first.dtype, acc), load_x=loader(second.dtype, acc), g_t=first.dtype.ctype,
                           x_t=second.dtype.ctype)}[op]
    ctx = dict(geo, name=kernel_name, acc=acc, store=storer(out.dtype, acc), out_t=out.dtype.ctype, op=op,
               params=fusion["params"] if fusion else node_params(node, names[:2], names[2:]),
               epilogue_lines=fusion["epilogue_lines"] if fusion else None, **loads)
    text = _conv_text(geo)
    N, C, H, W, O, CG, OG, G = (geo[k] for k in ("N", "C", "H", "W", "O", "CG", "OG", "G"))
    KH, KW, OH, OW = geo["KH"], geo["KW"], geo["OH"], geo["OW"]

    if CG == 1:                                             # depthwise (one input channel per group)
        kind = "dw_" + op
        if op == "wgrad":
            # cpu: a thread sums in order; else a block over the chosen batch's pixels (target.chosen_shape)
            block = 1 if serial_blocks() else reduce_block(chosen_shape(first)[0] * OH * OW)
            what = f"{text} (depthwise, block per weight)"  # grad_weight: never fused
            source = render_template("conv2d.cu.j2", kind=kind, comment=node_comment(node, what), block=block, **ctx)
            return [node_kernel(node, kernel_name, source, row_blocks(O * KH * KW), (block, 1, 1),
                                block > 1, what)]
        what = f"{text} (depthwise, direct)" + (fusion["what_extra"] if fusion else "")
        source = render_template("conv2d.cu.j2", kind=kind, comment=node_comment(node, what), numel=out.numel,
                                 idx_t=index_type(out.numel), **ctx)
        return [node_kernel(node, kernel_name, source, grid_1d(out.numel), (BLOCK, 1, 1), False, what)]

    pointwise = (KH, KW) == (1, 1) and (geo["SH"], geo["SW"], geo["PH"], geo["PW"]) == (1, 1, 0, 0)
    GM, GN, GK = _igemm_sizes(op, N, geo)
    a_order, b_order = ("k", "k") if op == "wgrad" else ("k", "n")
    # the sizes its tiles and split are chosen for (codegen/target.py chosen_shape: a dynamic step's
    # maximum batch)
    cGM, cGN, cGK = _igemm_sizes(op, chosen_shape(first)[0], geo)
    if max(GM, GN, GK) >= 2 ** 31 - 2 ** 16:
        raise NotImplementedError(f"{node.op}: implicit GEMM of {GM}x{GN}x{GK} overflows int indexing")
    # grad_weight's reduction (batch x pixels) splits across blocks when its tiles alone leave the
    # GPU idle; 16-bit outputs too: the partials stay float32 and are rounded once (`_split_k_wgrad_kernels`)
    can_split = op == "wgrad" and out.dtype in (dt.float16, dt.bfloat16, dt.float32, dt.float64)

    def k_splits(blocks, bk):   # at the chosen batch: both operands scale with it, as GK does
        return _wgrad_k_splits(cGK, G, blocks, bk, out.numel * (8 if acc == "double" else 4),
                               (first.numel * first.dtype.itemsize + second.numel * second.dtype.itemsize) * cGK // GK)

    kind = tensor_core_kind(first.dtype, second.dtype)
    warpgroup = kind is not None and warpgroup_mma()   # rendered for sm_90: wgmma instead of mma.sync
    chosen = node.attrs.get("tile")   # (BM, BN, TM, TN) measured by runtime/autotune.py; else the cost model
    split_rule = k_splits if can_split else None
    if warpgroup:
        t = _wgmma_implicit_gemm_tile(kind, geo, (cGM, cGN, G), op, pointwise, first.dtype, split_rule)
    elif kind is not None:
        t = _mma_implicit_gemm_tile(kind, cGM, cGN, G, first.dtype, op, split_rule)
    elif chosen:
        t = make_tile(chosen, acc, a_order, b_order)
    else:
        t = choose_tile(cGM, cGN, G, acc, a_order, b_order, split_rule and (lambda blocks: k_splits(blocks, 16)))
    m_tiles = -(-GM // t.BM)
    splits, kchunk = 1, GK
    if can_split:
        want = k_splits(-(-cGM // t.BM) * -(-cGN // t.BN) * G, t.BK)
        if want > 1:   # chunks of whole k tiles (the mainloops step k_begin by BK)
            kchunk = -(-(-(-cGK // want)) // t.BK) * t.BK
            splits = -(-GK // kchunk)
    if G * splits > 65535 or m_tiles > 65535:
        raise NotImplementedError(f"{node.op}: grid too large ({G} groups x {splits} splits, {m_tiles} row tiles)")
    serial = kind is None and serial_blocks()
    what = f"{text} ({'1x1 as GEMM' if pointwise else 'implicit GEMM'} {t.BM}x{t.BN}" + \
        (f" on tensor cores, {kind} {'wgmma' if warpgroup else 'mma.sync'}" if kind else "") + \
        (f", split-k {splits}" if splits > 1 else "") + (", one thread per tile" if serial else "") + ")" + \
        (fusion["what_extra"] if fusion else "")
    if splits == 1:
        source = render_template("conv2d.cu.j2", kind="igemm", comment=node_comment(node, what), GM=GM, GN=GN,
                                 GK=GK, t=t, splits=splits, kchunk=kchunk, pointwise=pointwise, tensor_cores=kind,
                                 warpgroup=warpgroup, serial=serial, **ctx)
        return [node_kernel(node, kernel_name, source, (Blocks(GN, t.BN), Blocks(GM, t.BM), G),
                            (1 if serial else t.NT, 1, 1), not serial, what, smem=t.smem if kind else 0)]
    return _split_k_wgrad_kernels(node, kernel_name, ctx, what, splits, dict(
        GM=GM, GN=GN, GK=GK, t=t, kchunk=kchunk, pointwise=pointwise, tensor_cores=kind, warpgroup=warpgroup,
        serial=serial),
        grid=(Blocks(GN, t.BN), Blocks(GM, t.BM), Blocks(GK, kchunk, times=G)), block=(1 if serial else t.NT, 1, 1),
        smem=t.smem if kind else 0)


def _igemm_sizes(op: str, N: int, geo: dict) -> tuple:
    """(GM, GN, GK) of a conv's implicit GEMM ("fwd", "dgrad" or "wgrad") at batch `N`."""
    if op == "fwd":
        return geo["OG"], N * geo["OH"] * geo["OW"], geo["CG"] * geo["KH"] * geo["KW"]
    if op == "dgrad":
        return geo["CG"], N * geo["H"] * geo["W"], geo["OG"] * geo["KH"] * geo["KW"]
    return geo["OG"], geo["CG"] * geo["KH"] * geo["KW"], N * geo["OH"] * geo["OW"]


# --------------------------------------------------------------------------
# implicit-GEMM tiles on tensor cores (mma.sync, and wgmma for sm_90)

def _mma_implicit_gemm_tile(kind, GM: int, GN: int, groups: int, dtype, op: str, k_splits=None) -> Tile:
    """The `t` of an implicit-GEMM conv on tensor cores: both operands gathered by the conv
    template's load statements, A (GM x GK) staged k-major and B (GK x GN) n-major. `k_splits(blocks,
    BK)`: as in `mma_tile`, for split-k grad_weight."""
    BK = MMA_KINDS[kind][2]
    BM, BN, WM, WN = mma_tile(GM, GN, groups, k_splits=k_splits and (lambda blocks: k_splits(blocks, BK)))
    names = {"fwd": ("weights", "input windows"), "dgrad": ("weights", "output-gradient taps"),
             "wgrad": ("output gradients", "input windows")}[op]
    a_op = Tile(name="a", major="k", R=BM, C=BK, LD=BK + (4 if kind == "tf32" else 8), copy_kind="gather",
                what=f"A(m, k) ({names[0]}), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})")
    b_op = Tile(name="b", major="mn", R=BK, C=BN, LD=BN + 8, copy_kind="gather",
                what=f"B(k, n) ({names[1]}), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})")
    a_op["elems"], b_op["elems"] = a_op.R * a_op.LD, b_op.R * b_op.LD
    return mma_tile_config(kind, (BM, BN, WM, WN), dtype, a_op, b_op)


def _wgmma_implicit_gemm_tile(kind, geo: dict, sizes, op: str, pointwise: bool, dtype, k_splits=None) -> Tile:
    """The `t` of an implicit-GEMM conv on warpgroup MMA. An operand that is contiguous in memory
    along its tile's rows (16-bit only: tf32 inputs are rounded on the way in) is copied by
    cp.async (`_wgmma_conv_copies`); the others are gathered by the conv template's load
    statements: A (weights or output gradients) K-major; B M/N-major for 16-bit forward /
    grad_input (consecutive threads on consecutive pixels), K-major for grad_weight (consecutive k
    = pixels) and for tf32 (the only layout wgmma reads it in). `k_splits(blocks, BK)`: as in
    `mma_tile`, for split-k grad_weight."""
    GM, GN, groups = sizes
    BK = WGMMA_ROW_BYTES // dtype.itemsize
    BM, BN = mma_tile(GM, GN, groups, WGMMA_TILES, k_splits and (lambda blocks: k_splits(blocks, BK)))
    names = {"fwd": ("weights", "input windows"), "dgrad": ("weights", "output-gradient taps"),
             "wgrad": ("output gradients", "input windows")}[op]
    a_what = f"A(m, k) ({names[0]}), m in [m0, m0 + {BM}), k in [k0, k0 + {BK})"
    b_what = f"B(k, n) ({names[1]}), n in [n0, n0 + {BN}), k in [k0, k0 + {BK})"
    b_order = "k" if op == "wgrad" else "mn"
    a_op = Tile(name="a", major="k", order="k", copy_kind="gather", what=a_what)
    b_op = Tile(name="b", major="k" if kind == "tf32" else b_order, order=b_order, copy_kind="gather", what=b_what)
    if kind != "tf32":
        copies = _wgmma_conv_copies(geo, op, pointwise, (BM, BN, BK), dtype, (a_what, b_what))
        a_op, b_op = copies.get("a", a_op), copies.get("b", b_op)
    else:
        a_op.update(_tf32_vector_gather(geo, op))
    return wgmma_tile_config(kind, BM, BN, dtype, a_op, b_op)


def _tf32_vector_gather(geo: dict, op: str) -> dict:
    """How a tf32 conv's A tile is gathered 4 float32 elements (one 16-byte load) at a time, where
    its rows are runs of memory whose length is a multiple of 4 (so no 4 cross from one run to the
    next): forward weights (rows of GK) and grad_weight's output gradients (runs of OH x OW
    pixels); {} (element by element) otherwise. `index`: the element offset of (m, k)."""
    O, OG, OHW, GK = geo["O"], geo["OG"], geo["OH"] * geo["OW"], geo["CG"] * geo["KH"] * geo["KW"]
    if op == "fwd" and GK % 4 == 0:
        return dict(vec=4, ptr="w", index=f"(long long)(grp * {OG} + m) * GK + k")
    if op == "wgrad" and OHW % 4 == 0:
        return dict(vec=4, ptr="grad", index=f"((long long)(k / {OHW}) * {O} + grp * {OG} + m) * {OHW} + k % {OHW}")
    return {}


def _wgmma_conv_copies(geo: dict, op: str, pointwise: bool, tile, dtype, whats) -> dict:
    """The conv operands that cp.async can copy, by name ("a", "b"): those whose tile rows are runs
    of memory that aligned vectors of 2 to 8 elements tile (the run length a multiple of the
    vector's, so no vector crosses from one run to the next, e.g. one image to the next). Each gives `address`,
    the element offset of (row go, column gi) in its buffer. Forward weights are rows of GK; output
    gradients (grad_weight's A) runs of OH x OW pixels; a 1x1 conv's input / output-gradient
    pixels runs of H x W, and grad_input's 1x1 weights runs of CG channels."""
    BM, BN, BK = tile
    C, O, CG, OG = (geo[k] for k in ("C", "O", "CG", "OG"))
    HW, OHW, GK = geo["H"] * geo["W"], geo["OH"] * geo["OW"], geo["CG"] * geo["KH"] * geo["KW"]
    a_what, b_what = whats
    # (name, buffer, k-major?, run length, address of (go, gi))
    found = []
    if op == "fwd":
        found.append(("a", "w", True, GK, f"(long long)(grp * {OG} + go) * GK + gi"))
    if op == "wgrad":
        found.append(("a", "grad", True, OHW,
                      f"((long long)(gi / {OHW}) * {O} + grp * {OG} + go) * {OHW} + gi % {OHW}"))
    if pointwise and op == "fwd":
        found.append(("b", "x", False, HW, f"((long long)(gi / {HW}) * {C} + grp * {CG} + go) * {HW} + gi % {HW}"))
    if pointwise and op == "dgrad":
        found.append(("a", "w", False, CG, f"(long long)(grp * {OG} + go) * {CG} + gi"))
        found.append(("b", "grad", False, HW, f"((long long)(gi / {HW}) * {O} + grp * {OG} + go) * {HW} + gi % {HW}"))
    if pointwise and op == "wgrad":
        found.append(("b", "x", True, HW, f"((long long)(gi / {HW}) * {C} + grp * {CG} + go) * {HW} + gi % {HW}"))
    copies = {}
    for name, ptr, k_major, run, address in found:
        mn = (BM, "m0", "GM") if name == "a" else (BN, "n0", "GN")
        x = staged_operand(name, ptr, k_major, mn[0], BK, mn[1], mn[2], run, run, dtype,
                           a_what if name == "a" else b_what)
        if x.copy_kind != "plain":
            # k runs to this block's k_end (split-k), not GK
            x.update(address=address, **({"I": "k_end"} if k_major else {"O": "k_end"}))
            copies[name] = x
    return copies


# --------------------------------------------------------------------------
# split-k grad_weight

# Split-k grad_weight: at least this many k tiles per split (each block's pipeline fills and drains
# once), and at most this much scratch for the partials. The scratch is arena memory at the
# backward's peak, written once by the implicit GEMM and read once by the combine: 2 x its size in
# memory traffic, a traffic the unsplit kernel does not have. So splits stop where that traffic
# would pass the conv's own (reading its two operands once; below it the extra traffic costs less
# than the idle SMs it fills), and at 64 MiB whatever the operands' size (a few tens of
# microseconds of an H100's HBM; an arena slot well below a ResNet-50 batch's activations).
_SPLIT_K_MIN_K_TILES, _SPLIT_K_SCRATCH_BYTES = 16, 64 << 20


def _wgrad_k_splits(GK: int, G: int, blocks: int, bk: int, split_bytes: int, operand_bytes: int) -> int:
    """Ways to split grad_weight's reduction of GK (batch x pixels) terms across blocks, for a
    grid of `blocks` tiles (all G groups) with k tiles of `bk`: enough blocks to fill the target
    (`target_blocks`), at least _SPLIT_K_MIN_K_TILES k tiles per split, G x splits within the
    grid's z limit, and the scratch (`split_bytes` of partial sums per split) within the cap above
    (`operand_bytes`: the conv's two inputs)."""
    scratch_cap = min(_SPLIT_K_SCRATCH_BYTES, operand_bytes // 2)
    return max(1, min(-(-target_blocks() // blocks), -(-GK // (bk * _SPLIT_K_MIN_K_TILES)), 65535 // G,
                      scratch_cap // split_bytes))


def _split_k_wgrad_kernels(node, kernel_name, ctx, what, splits, igemm, grid, block, smem) -> list:
    """A split-k grad_weight as two kernels, deterministic (the same bits every run): the
    implicit GEMM writes each split's partial dw, unrounded (float32; float64 for float64
    convs), to its own slice of a scratch buffer (placed in the arena by the memory planner,
    like fused.py's split reductions), then `<name>_combine` adds the slices in split order, one
    thread per weight (no barrier, no atomics), and rounds once to dw's dtype (bf16/fp16 under
    AMP: one rounding, as the unsplit kernel's). Against the unsplit kernel only the grouping of
    the sum changes (each split's chunk of batch x pixels, then the chunks' sums): both are
    within the accumulator's summation error of the exact (float64) sum, and equal where every
    partial sum is exact (small integer inputs)."""
    out, acc = node.output, ctx["acc"]
    scratch = Value(f"{out.name}_partials", (splits * out.numel,), dt.float64 if acc == "double" else dt.float32)
    params = node_params(node, ["grad", "x"], [])[:2] + [f"{acc}* __restrict__ partials"]
    args = node_args(node)[:2] + [BufferArg(scratch, f"{acc}*")]
    what = f"{what} -> partial sums per split"
    source = render_template("conv2d.cu.j2", kind="igemm", comment=node_comment(node, what), splits=splits,
                             **dict(ctx, params=params), **igemm)
    partial = Kernel(name=kernel_name, source=source, args=args, grid=tuple(grid), block=tuple(block), smem=smem,
                     needs_fibers=not igemm["serial"], comment=node_comment(node, what), ops=[node.op])
    combine_what = f"(combine {splits} split-k partials in order)"
    source = render_template("conv2d.cu.j2", kind="splitk_combine", comment=node_comment(node, combine_what),
                             splits=splits, numel=out.numel, idx_t=index_type(out.numel),
                             **dict(ctx, name=f"{kernel_name}_combine"))
    combine = Kernel(name=f"{kernel_name}_combine", source=source,
                     args=[BufferArg(scratch, f"const {acc}*"), BufferArg(out, f"{out.dtype.ctype}*")],
                     grid=grid_1d(out.numel), block=(BLOCK, 1, 1), needs_fibers=False,
                     comment=node_comment(node, combine_what), ops=[node.op])
    return [partial, combine]
