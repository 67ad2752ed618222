"""What `flow.load_compiled` adds to a call of a `flowgen build --lib` library, beside the step.

    PYTHONPATH=. python benchmarks/embed_overhead.py [--calls 3000] [--models mlp conv mobilenet_v2_b1] [--out FILE]

For each model (a small MLP, the conv net of tests/test_embed_library.py, MobileNetV2 at batch 1),
built for the cpu target with --lib, three ways to run one inference step are timed, interleaved
call by call so that the machine's load falls on all of them alike:

  step          flowgen_run called through ctypes with its flowgen_tensor arrays filled once:
                the library's own work (argument checks, input copies, the kernels, output
                copies) plus about a microsecond of ctypes
  load_compiled model(x): the loader's whole call (argument checks, filling the structs,
                flowgen_run, NumPy arrays of the outputs)
  graph         the nn.Graph the library was built from, graph(x) (Python executor), for scale

overhead_us = median(load_compiled) - median(step); the target is under 50 us. Medians of the
per-call times over --calls calls each; the host clock (time.perf_counter_ns). Where the step
takes milliseconds (MobileNetV2) the machine's noise is larger than the overhead, which can then
come out negative; the small models measure it. Each row also has calls per second from 1 and 2
threads sharing one loaded model (on shared cores they follow the load). Writes JSON (default
benchmarks/results/embed_overhead.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from flowgen.codegen import aot  # noqa: E402
from flowgen.models import mobilenet_v2  # noqa: E402
from flowgen.serialization import write_file_atomic  # noqa: E402
from graphs import InferGraph  # noqa: E402

TARGET_US = 50.0


MODELS = {   # name: (the eval-mode module, made when its row runs; input shape)
    "mlp": (lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), (8, 32)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Flatten(), nn.Linear(8 * 4 * 4, 5)), (2, 3, 8, 8)),
    "mobilenet_v2_b1": (lambda: mobilenet_v2(num_classes=10), (1, 3, 32, 32)),
}


def raw_step(model):
    """A call of flowgen_run with the structs filled once (the loader's `_fill` for the one input)."""
    inputs, outputs = model._tensors()

    def call(x):
        model._fill(inputs[0], 0, x)
        return lambda: model._lib.flowgen_run(model._handle, inputs, 1, outputs, len(model.outputs))
    return call


def median_us(samples):
    return float(np.median(samples)) / 1e3


def time_interleaved(functions: dict, calls: int) -> dict:
    samples = {name: [] for name in functions}
    for _ in range(max(calls // 20, 5)):   # warm-up
        for f in functions.values():
            f()
    for _ in range(calls):
        for name, f in functions.items():
            start = time.perf_counter_ns()
            f()
            samples[name].append(time.perf_counter_ns() - start)
    return {name: median_us(s) for name, s in samples.items()}


def calls_per_second(model, x, threads: int, seconds: float = 1.0) -> float:
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def work(k):
        while time.perf_counter() < stop:
            model(x)
            counts[k] += 1

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "embed_overhead.json"))
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="flowgen-embed-bench-") as tmp:
        for name in args.models:
            flow.manual_seed(0)
            make, shape = MODELS[name]
            graph = InferGraph(make().eval())
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            x_tensor = flow.tensor(x)
            expected = graph(x_tensor).numpy()
            os.makedirs(os.path.join(tmp, name))
            flow.save(graph, os.path.join(tmp, name, "saved"))
            aot.build(os.path.join(tmp, name, "saved"), os.path.join(tmp, name, "out"), target="cpu", lib=True)
            model = flow.load_compiled(os.path.join(tmp, name, "out"))
            if not np.array_equal(model(x), expected):
                raise SystemExit(f"{name}: the library's output differs from the graph's")
            step = raw_step(model)(x)
            timing = time_interleaved({"step": step, "load_compiled": lambda: model(x),
                                       "graph": lambda: graph(x_tensor)}, args.calls)
            rows.append({"model": name, "input": list(shape), "step_us": timing["step"],
                         "load_compiled_us": timing["load_compiled"], "graph_us": timing["graph"],
                         "overhead_us": timing["load_compiled"] - timing["step"],
                         "calls_per_s_1_thread": calls_per_second(model, x, 1),
                         "calls_per_s_2_threads": calls_per_second(model, x, 2)})
            model.close()

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "embed_overhead", "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "flowgen_commit": commit, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "target_overhead_us": TARGET_US,
              "calls": args.calls, "rows": rows}
    data = (json.dumps(result, indent=1) + "\n").encode()
    write_file_atomic(args.out, lambda f: f.write(data))

    print(f"{'model':<18}{'step us':>10}{'load_compiled us':>18}{'overhead us':>13}{'graph us':>11}"
          f"{'calls/s 1 thr':>15}{'2 thr':>9}")
    for r in rows:
        print(f"{r['model']:<18}{r['step_us']:>10.1f}{r['load_compiled_us']:>18.1f}{r['overhead_us']:>13.1f}"
              f"{r['graph_us']:>11.1f}{r['calls_per_s_1_thread']:>15.0f}{r['calls_per_s_2_threads']:>9.0f}")
    worst = max(r["overhead_us"] for r in rows)
    print(f"largest loader overhead measured over the step: {worst:.1f} us (target < {TARGET_US:.0f} us); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
