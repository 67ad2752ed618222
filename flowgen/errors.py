"""flowgen's errors that any layer raises: `TraceError` (build() did what a graph cannot trace)
and `FlowgenInternalError` (an internal check of flowgen failed while it compiled a graph).

flowgen's stages check their own invariants as they go: an `assert`, an `AssertionError` a stage
raises on its own contract (codegen/program.py's `declare_shared_memory`: two buffers of one
launch share memory outside the kernel's in-place pairs), the IR verifier's `ir.verify.IRError`.
Such a failure is a bug in flowgen, never in the user's program, and a bare AssertionError from
deep inside the compiler says neither. `internal_checks(graph_name)` wraps a compilation (a graph's
first call for an input signature, `compile_step`; a saved graph's program, `SavedGraph.program`)
and reports an AssertionError raised in flowgen's own code as a `FlowgenInternalError` naming the
graph, the stage, the check's message (which names the kernel, node or op) and where it was raised,
and asking for a report. An AssertionError raised by the user's code (a `unittest` assertion inside
`build()` or a module's `forward`) is the user's and passes through unchanged.
"""
from __future__ import annotations

import contextlib
import os
import traceback

_FLOWGEN_DIR = os.path.dirname(os.path.abspath(__file__))


class TraceError(RuntimeError):
    """nn.Graph cannot trace what build() did (raised while tracing, flowgen/ir/trace.py, and by the
    eager functions that refuse to run inside build()); the message names the op and module path."""


class FlowgenInternalError(RuntimeError):
    """A flowgen bug found while compiling graph `graph_name`: `check` is the internal check that
    failed (also the exception's `__cause__`), `where` the flowgen source line that raised it."""

    def __init__(self, graph_name: str, stage: str, check: AssertionError, where: str):
        self.graph_name, self.stage, self.check, self.where = graph_name, stage, check, where
        during = f" ({stage})" if stage else ""
        detail = str(check) or type(check).__name__
        super().__init__(
            f"flowgen bug while compiling graph '{graph_name}'{during}: {detail} [internal check at {where}]. "
            f"This is not an error in your program: please report it to flowgen with this message "
            f"(graph.debug(2) prints the IR after each pass).")


def _flowgen_frame(exc: BaseException):
    """The innermost traceback frame of `exc` if it is in flowgen's own source, else None."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    path = os.path.abspath(last.filename)
    return last if path.startswith(_FLOWGEN_DIR + os.sep) else None


@contextlib.contextmanager
def internal_checks(graph_name: str, stage=lambda: ""):
    """Report an internal check failing inside the block as a `FlowgenInternalError` naming
    `graph_name` and `stage()` (the stage running when it failed: trace, passes, codegen...)."""
    try:
        yield
    except AssertionError as exc:
        frame = _flowgen_frame(exc)
        if frame is None:      # the user's own assertion (build(), forward, a hook): theirs to see
            raise
        where = f"{os.path.relpath(frame.filename, os.path.dirname(_FLOWGEN_DIR))}:{frame.lineno} ({frame.name})"
        raise FlowgenInternalError(graph_name, stage(), exc, where) from exc
