"""What a long compile is doing, on one line.

A compile that takes longer than `DELAY_S` shows `flowgen: <title> | <stage> <done>/<total> | <elapsed>`:
on a terminal one line rewritten in place, otherwise plain lines (when a stage starts, at most
every `PLAIN_INTERVAL_S` while it runs, and when it is done). `$FLOWGEN_PROGRESS` chooses:

    auto (default)   show it once the compile has taken DELAY_S
    1 / always       show it from the start (tests, logs)
    0 / off          never

Stages report into the innermost `reporting(...)` block of the thread, so a graph compile
(trace, passes, codegen) and the kernel builds it starts share one line.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

DELAY_S = 1.0
PLAIN_INTERVAL_S = 5.0
_TICK_S = 0.25

_local = threading.local()


def mode() -> str:
    """'auto', 'always' or 'off', from $FLOWGEN_PROGRESS."""
    value = os.environ.get("FLOWGEN_PROGRESS", "auto").strip().lower()
    if value in ("0", "off", "false", "no", "quiet"):
        return "off"
    if value in ("1", "on", "always", "true", "yes"):
        return "always"
    return "auto"


class Progress:
    """One compile's progress line. `stage(name, total)` starts a stage, `advance(n)` counts
    work in it; `close()` ends the line. Thread-safe; quiet when `$FLOWGEN_PROGRESS` is off."""

    def __init__(self, title: str, stream=None):
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode()
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.stage_name, self.done, self.total = "", 0, 0
        self.shown = False          # something was printed (the line exists on a terminal)
        self._last_plain = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None
        if self.mode != "off":
            self._ticker = threading.Thread(target=self._tick, name="flowgen-progress", daemon=True)
            self._ticker.start()

    def line(self) -> str:
        count = f" {self.done}/{self.total}" if self.total else ""
        return f"flowgen: {self.title} | {self.stage_name}{count} | {time.perf_counter() - self.start:.1f} s"

    def stage(self, name: str, total: int = 0) -> None:
        with self._lock:
            self.stage_name, self.done, self.total = name, 0, int(total)
            self._render(plain=True)

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self._render(plain=False)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self.shown:
                self.stage_name, self.total = "done", 0
                self._write(self.line(), final=True)

    def _due(self) -> bool:
        return self.mode == "always" or time.perf_counter() - self.start >= DELAY_S

    def _render(self, plain: bool) -> None:
        """Show the line if it is due: always on a terminal; as a plain line when a stage starts
        (`plain`) or when PLAIN_INTERVAL_S passed since the last one."""
        if self.mode == "off" or not self._due():
            return
        now = time.perf_counter()
        if self.terminal or plain or not self.shown or now - self._last_plain >= PLAIN_INTERVAL_S:
            self._last_plain = now
            self._write(self.line(), final=False)

    def _write(self, text: str, final: bool) -> None:
        if self.terminal:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def _tick(self) -> None:
        # Keeps the elapsed time moving on a terminal and shows a compile that passed DELAY_S
        # while one long compiler call runs.
        while not self._stop.wait(_TICK_S):
            with self._lock:
                if self.terminal or not self.shown:
                    self._render(plain=False)


@contextlib.contextmanager
def reporting(title: str):
    """The thread's current `Progress`, or a new one titled `title` for the block."""
    current = getattr(_local, "progress", None)
    if current is not None:
        yield current
        return
    progress = Progress(title)
    _local.progress = progress
    try:
        yield progress
    finally:
        _local.progress = None
        progress.close()
