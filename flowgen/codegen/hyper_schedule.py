"""The standalone program's per-step hyper state: C++ statements, run before step s (graph call
t = start_step + s), that set each hyper scalar the way the Python runtime sets it before each
call, from the plain-data `schedule` the state carries (passes/optimizer.py,
passes/random_streams.py).

The LR of every optimizer follows its scheduler's formula (optim/closed_form.py; Adam's step
size and AdamW's decay are computed from it in the step); without one, or with one that runs
Python code (passes/optimizer.lr_schedule), it keeps the saved LR. `u` counts the updates
applied (calls minus the ones a GradScaler skipped): SGD's first momentum step, Adam's bias
corrections and Adagrad's lr_decay follow it; the LR schedule and the Philox offsets follow t
and s.
"""
from __future__ import annotations

from flowgen.optim.closed_form import to_cpp
from flowgen.runtime.toolchain import BuildError


def schedule_lines(ir) -> list:
    """The C++ lines of program.cu's step loop that advance `ir`'s hyper state."""
    lines = []
    for j, st in enumerate(ir.state):
        sched = st.schedule or {"kind": "constant"}
        kind = sched["kind"]
        if kind == "constant":
            continue
        try:
            lines += _statements(j, st, sched, kind)
        except (KeyError, TypeError, ValueError) as e:
            raise BuildError(f"state {st.name}: malformed {kind} schedule ({type(e).__name__}: {e})") from None
    return lines


def _statements(j: int, st, sched: dict, kind: str) -> list:
    if kind == "philox_offset":
        return [f"{{  // {st.name}: seed, then the Philox offset of this step ({sched['count']} per step)",
                f"  long long rng[2] = {{hyper_start[{j}][0], hyper_start[{j}][1] + s * {int(sched['count'])}LL}};",
                f"  dev.upload(m.state[{j}], rng, sizeof rng);",
                "}"]
    ctype = "double" if st.value.dtype.name == "float64" else "float"
    suffix = "" if ctype == "double" else "f"
    lines = [f"{{  // {st.name}: {kind}"]
    if kind == "first_step":
        value = f"(u == 0 ? {float(sched['first'])!r}{suffix} : {float(sched['then'])!r}{suffix})"
    elif kind == "bias_correction":
        value = (f"({ctype})({float(sched['scale'])!r} / std::pow(1.0 - std::pow({float(sched['beta'])!r}, "
                 f"(double)(u + {int(sched['offset'])}LL)), {float(sched['power'])!r}))")
    elif kind == "inverse_linear":   # Adagrad's lr_decay: 1 / (1 + (k - 1) * lr_decay) at update k
        value = f"({ctype})(1.0 / (1.0 + (double)(u + {int(sched['offset'])}LL) * {float(sched['rate'])!r}))"
    elif kind.startswith("lr_"):   # the scheduler's formula at epoch e
        if "formula" not in sched:
            raise BuildError(f"state {st.name}: its {kind} schedule has no formula (an older flowgen saved the "
                             f"scheduler's parameters instead); save the graph again with this flowgen")
        lines.append(f"  const double e = (double)(t + {int(sched['offset'])}LL);  // the scheduler's epoch")
        value = f"({ctype})({float(sched['scale'])!r} * {to_cpp(sched['formula'], 'e')})"
    else:
        raise BuildError(f"state {st.name}: unknown per-step schedule {kind!r} (saved by a newer flowgen?)")
    return lines + [f"  const {ctype} v = {value};", f"  dev.upload(m.state[{j}], &v, sizeof v);", "}"]
