"""The whole compile story on one screen: an ordered list of named passes over the step.

`step_passes` is the list a graph's compile runs: first the stages of a training step
(autodiff, gradient reduction over the ranks, output combining, optimizer lowering, ZeRO, the
pipeline split, random streams: passes/step_stages.py), then the IR passes (`default_passes`,
each IR -> IR, applied to `step.ir`). Every pass is `fn(step) -> step`; a stage that does not
apply to the graph (no optimizer, one rank, no ZeRO, ...) returns the step unchanged, and
`run_passes` says so. The IR passes come last and read the IR alone, so the program cache
(runtime/program_cache.py), keyed on the IR after the stages, may skip them: `ir_passes_start`
says where they begin.
"""
from __future__ import annotations

import functools
import time

from flowgen.ir.verify import IRError, verify
from flowgen.ops.lowering import View
from flowgen.ops.registry import get_op
from flowgen.passes.checkpointing import checkpoint_activations
from flowgen.passes.fusion import fuse
from flowgen.passes.rematerialize import MIN_NUMEL, rematerialize
from flowgen.passes.schedule import hoist, schedule
from flowgen.passes.simplify import compose_permutes, cse, dce, fold_constants
from flowgen.passes.step import Step
from flowgen.passes.step_stages import (bind_step_random_streams, combine_data_parallel_outputs, differentiate,
                                        lower_step_optimizers, reduce_gradients, shard_for_zero,
                                        split_pipeline_stage)


def step_passes(settings, config, checkpointed_scopes=()) -> list:
    """The pass list of a graph's compile: the step stages, then the IR passes."""
    def stage(fn):
        return functools.partial(fn, settings=settings)

    return [
        ("autodiff", stage(differentiate)),
        ("gradient_all_reduce", stage(reduce_gradients)),
        ("combine_outputs", stage(combine_data_parallel_outputs)),
        ("lower_optimizers", stage(lower_step_optimizers)),
        ("zero", stage(shard_for_zero)),
        ("pipeline_split", stage(split_pipeline_stage)),
        ("random_streams", stage(bind_step_random_streams)),
    ] + [(name, OnIR(fn)) for name, fn in default_passes(config, checkpointed_scopes)]


def default_passes(config, checkpointed_scopes=()):
    """The IR passes (IR -> IR), which run on the step's IR after its stages."""
    return [
        ("fold_constants", fold_constants),
        ("cse", cse),
        ("compose_permutes", compose_permutes),
        ("dce", dce),
        ("activation_checkpointing", lambda g: checkpoint_activations(g, checkpointed_scopes)),
        ("rematerialize", lambda g: (rematerialize(g, 0 if config.dynamic is not None else MIN_NUMEL)
                                     if config.fusion else g)),
        ("hoist_views_and_updates", lambda g: hoist(g, _hoistable)),
        ("fusion", lambda g: fuse(g, enabled=config.fusion, model_update=config.fuse_model_update_ops,
                                  add_to_output=config.fuse_add_to_output, cast_scale=config.fuse_cast_scale,
                                  multi_tensor_update=config.multi_tensor_update)),
        ("schedule", lambda g: schedule(g, straighten=config.straighten)),
    ]


class OnIR:
    """An IR pass as a pass over the step: it replaces `step.ir` and nothing else."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, step: Step) -> Step:
        ir = self.fn(step.ir)
        return step if ir is step.ir else step.with_ir(ir)


def ir_passes_start(passes: list) -> int:
    """Index of the first pass of the list's tail of IR passes (those after it read the IR alone)."""
    start = len(passes)
    while start > 0 and isinstance(passes[start - 1][1], OnIR):
        start -= 1
    return start


def _hoistable(node) -> bool:
    """Views (no kernel) and optimizer updates (scope "optimN...") go right after their inputs,
    where they can join the kernel that produced them (an update joins its gradient's reduction)."""
    return isinstance(get_op(node.op).lowering, View) or node.scope.startswith("optim")


def _ir_of(subject):
    return subject.ir if isinstance(subject, Step) else subject


def run_passes(subject, passes, log=None, check: bool = False, check_types: bool = True):
    """Apply `passes` in order to `subject`: a Step and passes over steps (a graph's compile), or
    an IR graph and IR passes (`default_passes` alone). Every pass is timed and reported to `log`
    (level 1: a line with its node count and time, or "no change" where it returned its input;
    level 2: the IR after it). The IR is verified after each pass when `check`, else once after
    the last: a pass that broke the IR's contract -- an update whose value no longer matches its
    state's type -- raises IRError naming the first pass whose IR fails, instead of compiling
    into wrong numbers. `check_types` False leaves out re-inferring each node's type (passes whose
    nodes a Tracer emitted, typed by their op's shape rule). Returns (subject, {pass name: seconds})."""
    timings, after = {}, [(None, _ir_of(subject))]
    for name, fn in passes:
        start = time.perf_counter()
        result = fn(subject)
        timings[name] = time.perf_counter() - start
        ir = _ir_of(result)
        after.append((name, ir))
        if check:
            _verify_after(name, ir, check_types)
        if log is not None:
            if result is subject:
                log(1, f"(PASS:{name}) no change, {timings[name] * 1e3:.1f} ms")
            else:
                log(1, f"(PASS:{name}) {len(ir.nodes)} nodes, {timings[name] * 1e3:.1f} ms")
                log(2, str(ir))
        subject = result
    if not check:
        try:
            verify(_ir_of(subject), check_types)
        except IRError:
            for name, ir in after:   # the first IR that fails: the one given, or a pass's
                _verify_after(name, ir, check_types)
            raise
    return subject, timings


def _verify_after(name: str | None, ir, check_types: bool) -> None:
    try:
        verify(ir, check_types)
    except IRError as exc:
        raise IRError(f"{'the IR given to the passes' if name is None else f'after pass {name}'}: {exc}") from exc
