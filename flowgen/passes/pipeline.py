"""The optimisation story on one screen: an ordered list of named IR -> IR passes."""
from __future__ import annotations

import time

from flowgen.ir.verify import verify
from flowgen.passes.checkpointing import checkpoint_activations
from flowgen.passes.fusion import fuse
from flowgen.passes.rematerialize import rematerialize
from flowgen.ops.lowering import View
from flowgen.ops.registry import get_op
from flowgen.passes.schedule import hoist, schedule
from flowgen.passes.simplify import cse, dce, fold_constants


def default_passes(config, checkpointed_scopes=()):
    """The pass list for a graph (autodiff and optimizer lowering have already run)."""
    return [
        ("fold_constants", fold_constants),
        ("cse", cse),
        ("dce", dce),
        ("activation_checkpointing", lambda g: checkpoint_activations(g, checkpointed_scopes)),
        ("rematerialize", lambda g: rematerialize(g) if config.fusion else g),
        ("hoist_views_and_updates", lambda g: hoist(g, _hoistable)),
        ("fusion", lambda g: fuse(g, enabled=config.fusion, model_update=config.fuse_model_update_ops,
                                  add_to_output=config.fuse_add_to_output, cast_scale=config.fuse_cast_scale,
                                  multi_tensor_update=config.multi_tensor_update)),
        ("schedule", lambda g: schedule(g, straighten=config.straighten)),
    ]


def _hoistable(node) -> bool:
    """Views (no kernel) and optimizer updates (scope "optimN...") go right after their inputs,
    where they can join the kernel that produced them (an update joins its gradient's reduction)."""
    return isinstance(get_op(node.op).lowering, View) or node.scope.startswith("optim")


def run_passes(graph, passes, log=None, check: bool = False):
    """Apply `passes` in order; verify after each when `check`, else once after the last (a pass
    that broke the IR's contract -- an update whose value no longer matches its state's type --
    raises IRError here instead of compiling into wrong numbers); report timings to `log`."""
    timings = {}
    for name, fn in passes:
        start = time.perf_counter()
        graph = fn(graph)
        timings[name] = time.perf_counter() - start
        if check:
            verify(graph)
        if log is not None:
            log(1, f"(PASS:{name}) {len(graph.nodes)} nodes, {timings[name] * 1e3:.1f} ms")
            log(2, str(graph))
    if not check:
        verify(graph)
    return graph, timings
