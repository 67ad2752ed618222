"""What the fair benchmarks (fair_gemm.py, fair_convnets.py) share: device-side timing, the
correctness measure, the run's provenance and the result files.

Timing: on a GPU each timed call sits between two CUDA events recorded on the stream it runs
on (flowgen's executor stream, reached from PyTorch as an ExternalStream, or PyTorch's current
stream); whatever must happen before a call (rotating the inputs, flushing L2) runs before the
start event, on that same stream. On a CPU the host clock brackets each call (its work is
synchronous). A measurement is `repeats` groups of `iters` timed calls after `warmup` untimed
ones: the median of each group, then the median of those and their min and max (the spread).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# ||out - ref|| / ||ref|| against a float64 reference of the same (rounded) inputs, per the
# precision the arithmetic runs in (.library/device/METHOD.md: float32 far under 1e-3, TF32 near
# 3e-4, bf16/fp16 operands between 1e-3 and 1e-2). A row over its threshold is wrong, not timed.
REL_ERR_LIMIT = {"fp32": 1e-4, "tf32": 2e-3, "bf16": 1e-2, "fp16": 1e-2, "amp_bf16": 1e-2, "amp_fp16": 1e-2}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN when either holds a non-finite value."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} differs from the reference's {ref.shape}")
    if not (np.isfinite(out).all() and np.isfinite(ref).all()):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def passes(err: float, precision: str) -> bool:
    return math.isfinite(err) and err <= REL_ERR_LIMIT[precision]


class HostTimer:
    """CPU: the host clock around each call (the call returns when its work is done)."""

    kind = "host perf_counter"

    def measure(self, run, prepare, *, warmup: int, iters: int, repeats: int) -> dict:
        for i in range(warmup):
            prepare(i)
            run()
        medians = []
        for r in range(repeats):
            times = []
            for i in range(iters):
                prepare(r * iters + i)
                start = time.perf_counter()
                run()
                times.append((time.perf_counter() - start) * 1e3)
            medians.append(statistics.median(times))
        return summarize(medians, iters)


class CudaEventTimer:
    """GPU: CUDA events around each call on `stream` (a torch.cuda.Stream or ExternalStream);
    `prepare` and `run` are issued with that stream current, so everything is ordered on it."""

    kind = "cuda events"

    def __init__(self, torch, stream):
        self.torch = torch
        self.stream = stream

    def measure(self, run, prepare, *, warmup: int, iters: int, repeats: int) -> dict:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            for i in range(warmup):
                prepare(i)
                run()
            self.stream.synchronize()
            medians = []
            for r in range(repeats):
                events = []
                for i in range(iters):
                    prepare(r * iters + i)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                    run()
                    end.record(self.stream)
                    events.append((start, end))
                self.stream.synchronize()
                medians.append(statistics.median(s.elapsed_time(e) for s, e in events))
        return summarize(medians, iters)


def summarize(medians: list, iters: int) -> dict:
    return {"median_ms": statistics.median(medians), "min_ms": min(medians), "max_ms": max(medians),
            "repeat_medians_ms": medians, "iters_per_repeat": iters}


def add_row_arguments(parser, precisions: list, rows: list, iters_help: str) -> None:
    """The options every fair benchmark shares: which precisions and rows, the time box of a row
    (its own process), warm-up, timed iterations and repeats, the JSON path, and the hidden flags
    the parent passes to a row's worker process."""
    parser.add_argument("--precisions", nargs="*", default=["bf16"], choices=precisions)
    parser.add_argument("--rows", nargs="*", default=None, choices=rows)
    parser.add_argument("--row-timeout", type=float, default=None, help="seconds per row (its own process)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=None, help=iters_help)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--precision", "--row", "--result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)


def parse_row_arguments(parser, argv):
    """`parser.parse_args(argv)` with the shared checks: at least 3 repeats (the spread needs several
    groups); --iters defaults to 2 timed steps per repeat with --smoke, else 5."""
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the spread needs several groups)")
    args.iters = args.iters or (2 if args.smoke else 5)
    return args


def plan_rows(parser, args, torch, name: str, smoke_rows: list, default_rows: list, smoke_timeout: float):
    """(device, rows, JSON path) of a fair benchmark's run: the cpu target with --smoke (its JSON in
    the temporary directory), else 'cuda' (benchmarks/results/<name>_cuda.json); refuses what the
    machine cannot run, and sets the rows' default time box (--smoke: `smoke_timeout`, else 240 s)."""
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on a machine without a GPU")
    rows = args.rows or (smoke_rows if args.smoke else default_rows)
    if device == "cpu" and "torch_cuda_graph" in rows:
        parser.error("torch_cuda_graph needs a GPU")
    args.row_timeout = args.row_timeout or (smoke_timeout if args.smoke else 240.0)
    out = args.out or (os.path.join(tempfile.gettempdir(), f"{name}_smoke.json") if args.smoke
                       else os.path.join(ROOT, "benchmarks", "results", f"{name}_{device}.json"))
    return device, rows, out


def git_commit() -> str:
    """$FLOWGEN_COMMIT when set (the device machine's copy of the tree has no git history), else
    HEAD of the flowgen checkout, with '+dirty' when tracked files differ from it."""
    if os.environ.get("FLOWGEN_COMMIT"):
        return os.environ["FLOWGEN_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout; set FLOWGEN_COMMIT)"
    return head + ("+dirty" if dirty else "")


def environment(torch, device: str) -> dict:
    """Where and when the numbers were taken: device name, date, flowgen commit, versions."""
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flowgen_commit": git_commit(), "machine": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "device_type": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm=f"sm_{props.major}{props.minor}",
                    multiprocessors=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None),
                    cuda_runtime=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        info.update(device=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)
    print(f"wrote {path}", flush=True)


def print_table(rows: list, columns: list) -> None:
    """`columns`: (header, function of a row -> str). Printed last: the device call's reply
    carries the end of the output."""
    cells = [[header for header, _ in columns]] + [[fn(row) for _, fn in columns] for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for n, line in enumerate(cells):
        print("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(line, widths)))


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
