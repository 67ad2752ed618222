"""The optimisation story on one screen: an ordered list of named IR -> IR passes."""
from __future__ import annotations

import time

from flowgen.ir.verify import verify
from flowgen.passes.fusion import fuse
from flowgen.passes.simplify import cse, dce, fold_constants


def default_passes(config):
    return [
        ("fold_constants", fold_constants),
        ("cse", cse),
        ("dce", dce),
        ("fusion", lambda g: fuse(g, enabled=config.fusion)),
    ]


def run_passes(graph, passes, log=None, check: bool = False):
    """Apply `passes` in order; verify after each when `check`; report timings to `log`."""
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
    return graph, timings
