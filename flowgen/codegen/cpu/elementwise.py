"""Elementwise chains and multi-tensor updates of the cpu target as native kernels
(templates/cpu_elementwise.cpp.j2): the per-element lines of codegen/fused.py's kernels (the same
emitter, so the same expression per element and the same numbers), run by loops spread over the
thread pool (runtime_cpp/flowgen_cpu_pool.h) instead of by emulated threads, one loop per launch.

`element_loop` adapts such lines (here and in the GEMM, conv and reduction loops) to a loop: float
exp, erf, erfc and tanh are runtime_cpp/flowgen_cpu_math.h's (NATIVE_MATH), which g++ vectorizes, not
libm's scalar calls; dropout's Philox draws go through a per-piece block cache (flowgen_cpu::Philox:
one Philox4x32 block per four consecutive elements, not one per element; the same words), and
lines calling a costly function (exp, erf, a Philox draw, ...) are split over the pool in smaller
pieces. The emulated CUDA kernels keep libm's."""
from __future__ import annotations

import re

import numpy as np

from flowgen.codegen import fused
from flowgen.codegen.kernel import Kernel, RenderContext, every_output_over
from flowgen.codegen.templates import get_template


# Calls that cost tens of cycles per element or more: a loop of them is worth splitting finer.
_COSTLY = re.compile(r"\b(flowgen_philox_\w+|philox\.uniform|expm1f?|expf?|log1pf?|logf?|erfcf?|erff?|tanhf?|powf?|"
                     r"flowgen_pow|sinf?|cosf?|atan2f?)\(")
_PHILOX = "flowgen_philox_uniform("
# The native loops' float math: libm's name -> runtime_cpp/flowgen_cpu_math.h's (inline and
# branch-free, so a loop of them vectorizes; the same bits at every g++ optimisation level).
NATIVE_MATH = {"expf": "flowgen_cpu::expf", "erff": "flowgen_cpu::erff", "erfcf": "flowgen_cpu::erfcf",
               "tanhf": "flowgen_cpu::tanhf"}
_LIBM_CALL = re.compile(r"(?<![\w:.])(" + "|".join(NATIVE_MATH) + r")\(")


def element_loop(lines) -> tuple:
    """(lines, costly) of per-element `lines` run in a pool loop: the lines with NATIVE_MATH's
    functions for libm's and each flowgen_philox_uniform call drawn through the piece's `philox`
    block cache (piece_lines declares it), and whether they call a costly function."""
    lines = [_LIBM_CALL.sub(lambda call: NATIVE_MATH[call.group(1)] + "(", line).replace(_PHILOX, "philox.uniform(")
             for line in lines]
    return lines, any(_COSTLY.search(line) for line in lines)


def grain(costly: bool) -> str:
    """The minimum piece of a loop over elements (a constant of runtime_cpp/flowgen_cpu.h)."""
    return "flowgen_cpu::kParallelCostly" if costly else "flowgen_cpu::kParallelElements"


def piece_lines(lines) -> list:
    """The lines opening each piece of a loop running `lines` (element_loop's)."""
    return ["flowgen_cpu::Philox philox;   // the last Philox block drawn (dropout)"] \
        if any("philox.uniform(" in line for line in lines) else []


# The shortest run of elements worth a loop of its own (below it, a row costs more than the
# divisions it saves).
_MIN_ROW = 8


def rows_of(coords) -> dict | None:
    """Runs of consecutive elements over which the broadcast inputs' coordinates (`coords`,
    fused.Coordinate) are computed once, not per element: their 64-bit divisions do not vectorize,
    and the inputs they index (a BatchNorm's per-channel statistics) become loop-invariant.
    {"length", "row_lines", "inner_lines"}, or None where the runs would be too short:
    - every coordinate's stride a multiple of `length` (>= _MIN_ROW): all are the same along a run
      (an NCHW channel's H*W pixels), computed from `row` = i / length;
    - the coordinates of stride 1 all of one size, `length`, and the others' strides multiples of
      it (a bias along the last dim): those are `i - row_start` inside the run, the others as above."""
    if not coords:
        return None
    length = int(np.gcd.reduce([c.stride for c in coords]))
    inner = []
    if length < _MIN_ROW:
        inner = [c for c in coords if c.stride == 1]
        sizes = {c.size for c in inner}
        length = sizes.pop() if len(sizes) == 1 and not any(c.outermost for c in inner) else 0
        if length < _MIN_ROW or any(c.stride % length for c in coords if c not in inner):
            return None
    row_lines = [fused.Coordinate(c.name, c.stride // length, c.size, c.outermost).line("row")
                 for c in coords if c not in inner]
    return {"length": length, "row_lines": row_lines,
            "inner_lines": [f"const long long {c.name} = i - row_start;" for c in inner]}


def _source(name, comment, ops, params, segments, what, rows=None) -> str:
    loops = [element_loop(seg["body_lines"]) for seg in segments]
    segments = [dict(seg, body_lines=lines) for seg, (lines, _) in zip(segments, loops)]
    return get_template("cpu_elementwise.cpp.j2").render(
        name=name, comment=comment, ops=ops, params=params, segments=segments, what=what, rows=rows,
        total=sum(seg["numel"] for seg in segments), grain=grain(any(costly for _, costly in loops)),
        piece_lines=piece_lines([line for lines, _ in loops for line in lines]))


def render_elementwise(node, ctx: RenderContext) -> list:
    """A fused elementwise node (fused.render_elementwise's input) as one native kernel: a loop
    over the elements, or over rows of them (rows_of) where inputs are broadcast."""
    producers = ctx.producers
    em = fused.Emitter(node, producers, ctx.stream_values)
    shape, coords, lines = fused.elementwise_coordinates(em, node.body, node.inputs, node.outputs, producers)
    numel = int(np.prod(shape, dtype=np.int64))
    ops = [b.op for b in node.body]
    name = ctx.kernel_name(node, ops)
    shape_text = f"[{', '.join(map(str, shape))}]"
    source = _source(name, f"{node.scope or 'graph'}: elementwise", ops, em.params,
                     [{"numel": numel, "index_lines": [c.line("i") for c in coords], "body_lines": lines,
                       "what": shape_text}],
                     f"one iteration per element of {shape_text}", rows=rows_of(coords))
    return [Kernel(name, source, em.args, (1, 1, 1), (1, 1, 1), native=True,
                   comment=f"{node.scope or 'graph'}: {', '.join(ops)}", ops=ops,
                   in_place=every_output_over(node.outputs, [v for v in node.inputs if v.numel == numel]))]


def render_segments(node, ctx: RenderContext) -> list:
    """A multi-tensor node (fused.render_segments' input: independent elementwise bodies, a
    parameter update) as one native kernel: the segments' elements laid end to end as one loop."""
    producers = ctx.producers
    em = fused.Emitter(node, producers, ctx.stream_values)
    segments, ops, in_place = [], [], set()
    for positions in node.attrs["segments"]:
        body = [node.body[p] for p in positions]
        inside = {v for b in body for v in b.outputs}
        inputs = [v for v in node.inputs if any(v in b.inputs for b in body)]
        em.var = {v: n for v, n in em.var.items() if fused.scalar_constant(v, producers) is not None}
        outputs = [v for v in node.outputs if v in inside]
        shape, index_lines, lines = fused._elementwise_lines(em, body, inputs, outputs, producers)
        numel = int(np.prod(shape, dtype=np.int64))
        in_place |= every_output_over(outputs, [v for v in inputs if v.numel == numel])
        segments.append({"numel": numel, "index_lines": index_lines, "body_lines": lines,
                         "what": f"{body[-1].scope}: {', '.join(b.op for b in body)} over "
                                 f"[{', '.join(map(str, shape))}]"})
        ops += [b.op for b in body]
    name = ctx.kernel_name(node, ["multi_tensor"] + sorted(set(ops)))
    source = _source(name, f"{node.scope or 'graph'}: multi-tensor", sorted(set(ops)), em.params, segments,
                     f"{len(segments)} independent segments (a multi-tensor update)")
    return [Kernel(name, source, em.args, (1, 1, 1), (1, 1, 1), native=True,
                   comment=f"{node.scope or 'graph'}: {len(segments)} segments of {', '.join(sorted(set(ops)))}",
                   ops=ops, in_place=frozenset(in_place), horizontal=True)]
