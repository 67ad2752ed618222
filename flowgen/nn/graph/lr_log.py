"""Debug mode's learning-rate log, as OneFlow writes it: with `ONEFLOW_DEBUG_MODE` (OneFlow's
variable) or `FLOWGEN_DEBUG_MODE` set to a true value, a training graph writes the learning rate
each step used to `log/flowgen/<pid>-train_step2lr.csv` ("train_step, lr" lines), so a schedule
the graph replays can be checked against eager. The file is started afresh by the first step of
each graph; the LR is the first parameter group's of the graph's first optimizer.
"""
from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")


def enabled() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE
               for name in ("ONEFLOW_DEBUG_MODE", "FLOWGEN_DEBUG_MODE"))


def path() -> str:
    return os.path.join("log", "flowgen", f"{os.getpid()}-train_step2lr.csv")


def record(step: int, lr: float, first: bool) -> None:
    """Append `step, lr` to the log; the graph's first step starts the file with its header."""
    target = path()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w" if first else "a") as f:
        if first:
            f.write("train_step, lr\n")
        f.write(f"{step}, {lr!r}\n")
