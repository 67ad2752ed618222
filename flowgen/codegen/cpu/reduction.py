"""Fused reductions of the cpu target as native kernels (templates/cpu_reduction.cpp.j2): the
lines of codegen/fused.py's reduction kernel (the same emitter: the loop's prologue per element,
each reduction's accumulator, the epilogue per output), an output per iteration of a loop spread
over the pool, its elements combined in order. The emulated kernel runs a block per output on the
cpu target and, with few outputs, splits them into partial sums and a second kernel; here one pass
per output (the same accumulator types: sums of float32 in double, rounded once)."""
from __future__ import annotations

import numpy as np

from flowgen.codegen import fused
from flowgen.codegen.cpu.elementwise import element_loop, grain, piece_lines
from flowgen.codegen.kernel import Kernel, RenderContext, every_output_over
from flowgen.codegen.templates import get_template
from flowgen.ops.registry import get_op


def render_reduction(node, ctx: RenderContext):
    """A fused reduction node (fused.render_reduction's input) as one native kernel, or None."""
    producers, stream_values = ctx.producers, ctx.stream_values
    body = node.body
    prologue, reds, epilogue = fused._split_reduction_body(body)
    in_shape, _, dims = fused._reduce_geometry(reds[0])
    if any(fused._reduce_geometry(r) != fused._reduce_geometry(reds[0]) for r in reds[1:]):
        return None   # the emulated renderer says why
    reduce_shape = [in_shape[d] for d in dims]
    reduce_size = int(np.prod(reduce_shape, dtype=np.int64))
    out_shape = tuple(reds[0].output.shape)
    numel_out = max(int(np.prod(out_shape, dtype=np.int64)), 1)
    em = fused.Emitter(node, producers, stream_values)
    prologue_values = {v for b in prologue for v in b.inputs} | {r.inputs[0] for r in reds}
    prologue_values -= {o for b in prologue for o in b.outputs}
    inside = {o for b in body for o in b.outputs}
    epilogue_inputs = {v for b in epilogue for v in b.inputs} - inside

    kept = [d for d in range(len(in_shape)) if d not in dims]
    out_coordinates = fused.coordinate_lines([in_shape[d] for d in kept], "o", "k") if kept else []
    in_coordinates = fused.coordinate_lines(reduce_shape, "j", "r") if dims else []
    coord = {d: f"k{pos}" for pos, d in enumerate(kept)} | {d: f"r{pos}" for pos, d in enumerate(dims)}
    full_coords = [coord[d] for d in range(len(in_shape))]

    prologue_lines = em.load_inputs(prologue_values, fused._prologue_offset(prologue, in_shape, full_coords, producers))
    for b in prologue:
        prologue_lines.append(em.compute(b, index_var="flat"))
    sources = [em.var[r.inputs[0]] for r in reds]
    # Variables declared inside the loop are out of scope in the epilogue (literals stay usable).
    em.var = {v: n for v, n in em.var.items() if fused.scalar_constant(v, producers) is not None}
    red_ctx = []
    for r, source_var in zip(reds, sources):
        lowering = get_op(r.op).lowering
        value_type = fused.COMPUTE_TYPE[r.output.dtype]
        acc_type = fused.sum_accumulator(r.output.dtype) if lowering.combine == "sum" else value_type
        reduced_var = em.fresh()
        em.var[r.output] = reduced_var
        identity = fused.IDENTITY[lowering.combine] if acc_type in ("float", "double") else \
            {"sum": "0", "max": "LLONG_MIN", "min": "LLONG_MAX"}[lowering.combine]
        red_ctx.append({"acc_type": acc_type, "value_type": value_type, "identity": identity,
                        "source_var": source_var, "reduced_var": reduced_var,
                        "fn": fused._combine_fn(lowering.combine, acc_type),
                        # a mean divides the accumulated sum by the count before rounding it once
                        "divisor": f"{float(reduce_size)!r}" if lowering.average else None})
    epi_numel = int(np.prod(out_shape, dtype=np.int64))
    epilogue_index_lines, epi_offset = fused._flat_index_reads(reds + epilogue, epilogue_inputs, epi_numel, producers,
                                                               prefix="e")
    epilogue_lines = em.load_inputs(epilogue_inputs, epi_offset)
    for b in epilogue:
        epilogue_lines.append(em.compute(b, index_var="i"))
    epilogue_lines += em.stores(set(node.outputs), "i")

    # `flat` is the input element's linear index, for prologue ops that use {idx} (dropout).
    flat = fused.broadcast_offset(in_shape, in_shape, full_coords)
    flat_line = fused.declared_if_read([f"const long long flat = {flat};"], prologue_lines)
    prologue_lines, costly = element_loop(prologue_lines)
    epilogue_lines, _ = element_loop(epilogue_lines)
    ops = [b.op for b in body]
    name = ctx.kernel_name(node, ops)
    source = get_template("cpu_reduction.cpp.j2").render(
        name=name, comment=f"{node.scope or 'graph'}: reduction", ops=ops, reds=red_ctx, params=em.params,
        in_shape_text=str(list(in_shape)), out_shape_text=str(list(out_shape)), reduce_size=reduce_size,
        numel_out=numel_out, out_index_lines=fused.declared_if_read(out_coordinates, prologue_lines + flat_line),
        in_index_lines=fused.declared_if_read(in_coordinates, prologue_lines + flat_line) + flat_line,
        prologue_lines=prologue_lines,
        epilogue_index_lines=fused.declared_if_read(epilogue_index_lines, epilogue_lines),
        epilogue_lines=epilogue_lines, grain=f"flowgen_cpu::per_piece({grain(costly)}, {reduce_size})",
        piece_lines=piece_lines(prologue_lines + epilogue_lines))
    in_place = every_output_over(node.outputs, [v for v in epilogue_inputs
                                                if v.numel == epi_numel and v not in prologue_values])
    return [Kernel(name, source, em.args, (1, 1, 1), (1, 1, 1), native=True,
                   comment=f"{node.scope or 'graph'}: {', '.join(ops)} (an output per iteration)", ops=ops,
                   in_place=in_place)]


