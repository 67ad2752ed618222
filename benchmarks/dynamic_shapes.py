"""A graph with a dynamic batch (or sequence) against graphs compiled for exactly that size.

    PYTHONPATH=. python benchmarks/dynamic_shapes.py [--repeats 7] [--iters 20] [--out FILE]

Cases (inference, the cpu target's native kernels, one process): an MLP (Linear 256-512-512-10,
GELU) with a dynamic batch up to 64, a conv net (3x3 conv, a depthwise-separable block, BatchNorms
folded, a spatial mean) on 32x32 images with a dynamic batch up to 16, MobileNetV2 (flow.models,
10 classes) on 32x32 images with a dynamic batch up to 16, and the small
GPT of examples/gpt_char.py (2 layers, 64 wide) on 32 tokens with a dynamic batch up to 16, and
the same GPT on a batch of 4 with a dynamic sequence up to its block size, 32 (`gpt_seq`).
For each case and size (1, 8 and the maximum), two builds of the same model: `dynamic` (one
compile for every size) and `exact` (compiled for that size alone), at two levels: `graph`, the
Python nn.Graph (graph.config.dynamic_shapes), and `library`, what `flowgen build --lib` makes of
the saved graph, called through flow.load_compiled with NumPy arrays (the program's kernels, no
Python between them; each library timed in a process of its own, _LibraryInProcess). The rows
alternate: `--repeats` rounds of `--iters` calls each (a library's after as many to warm up), a
round's median per row, the row's number the median of its rounds (spread: min and max of them).
ratio = dynamic / exact; the target (issue 27) is within 1.1x for the program (library level).
A batch of 1 runs a program of its own where the step compiles to other kernels at 1 (the
graph's variant for size 1; a second program in the build, flowgen/codegen/aot.py), the others
the one fitted for sizes 2 up.
Writes JSON (default benchmarks/results/dynamic_shapes_cpu.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
os.environ.setdefault("FLOWGEN_CPU_KERNELS", "native")

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
import gpt_char  # noqa: E402  (examples/gpt_char.py)
from fair_common import git_commit, log, print_table, write_json  # noqa: E402
from flowgen.codegen import aot  # noqa: E402
from graphs import FirstOutput, InferGraph  # noqa: E402

TARGET = 1.1


class _SpatialMean(nn.Module):
    """Global average pooling as a mean (a reduction, native); avg_pool2d's kernel is emulated."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


def _gpt():
    config = gpt_char.GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    return FirstOutput(gpt_char.define(flow)(config))


def _tokens(batch, seq):
    return flow.tensor(np.random.default_rng(0).integers(0, 65, (batch, seq)).astype(np.int64))


# name: (model maker, the Dims' spec maker, input at a size, sizes)
CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)),
            lambda: [{0: flow.Dim("batch", min=1, max=64)}], lambda n: flow.randn(n, 256), [1, 8, 64]),
    "convnet": (lambda: nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=32), nn.BatchNorm2d(32),
                                      nn.ReLU6(), nn.Conv2d(32, 64, 1), nn.BatchNorm2d(64), nn.ReLU(),
                                      _SpatialMean(), nn.Linear(64, 10)),
                lambda: [{0: flow.Dim("batch", min=1, max=16)}], lambda n: flow.randn(n, 3, 32, 32), [1, 8, 16]),
    "mobilenet_v2": (lambda: flow.models.mobilenet_v2(num_classes=10), lambda: [{0: flow.Dim("batch", min=1, max=16)}],
                     lambda n: flow.randn(n, 3, 32, 32), [1, 8, 16]),
    "gpt": (_gpt, lambda: [{0: flow.Dim("batch", min=1, max=16)}], lambda n: _tokens(n, 32), [1, 8, 16]),
    "gpt_seq": (_gpt, lambda: [{1: flow.Dim("seq", min=1, max=32)}], lambda n: _tokens(4, n), [1, 8, 32]),
}


def _library(graph, where: Path) -> Path:
    """`graph` saved and built with --lib for the cpu: the build directory."""
    where.mkdir()
    flow.save(graph, where / "saved")
    aot.build(where / "saved", where / "out", target="cpu", lib=True)
    return where / "out"


class _LibraryInProcess:
    """Times a library's calls in a process of its own: two libraries in one process each hold an
    OpenBLAS whose idle threads spin for a while after a call, taking the cores from the other's
    next calls (measured: the MLP at batch 64 1.16x slower interleaved, equal alone)."""

    def __init__(self, out: Path):
        self.out = out

    def rounds(self, x_path: Path, args) -> list:
        proc = subprocess.run([sys.executable, __file__, "--time-library", str(self.out), str(x_path),
                               str(args.iters)], capture_output=True, text=True, check=True)
        return [float(proc.stdout.split()[-1])]


def _time_library(out: str, x_path: str, iters: int) -> float:
    """The median ms of `iters` calls of the library in `out` on the array in `x_path`, after as
    many calls to warm up (run in a process of its own by _LibraryInProcess)."""
    model, x = flow.load_compiled(out), np.load(x_path)
    times = []
    for k in range(2 * iters):
        start = time.perf_counter()
        model(x)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[iters:])


def _timed(callables: dict, x, args) -> dict:
    """{row: the median over rounds of each round's median ms}, with the rounds' spread; rows
    alternate round by round."""
    rounds = {row: [] for row in callables}
    for _ in range(args.repeats):
        for row, call in callables.items():
            if isinstance(call, _LibraryInProcess):
                rounds[row] += call.rounds(x, args)
                continue
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                call(x)
                times.append((time.perf_counter() - start) * 1e3)
            rounds[row].append(statistics.median(times))
    return {row: (statistics.median(values), [min(values), max(values)]) for row, values in rounds.items()}


def run_case(name, level, args, tmp: Path) -> list:
    make, spec, inputs_at, sizes = CASES[name]
    flow.manual_seed(0)
    model = make().eval()
    dynamic = InferGraph(model)
    dynamic.config.dynamic_shapes(spec())
    start = time.perf_counter()
    dynamic(inputs_at(sizes[-1]))
    compile_s = time.perf_counter() - start
    dynamic_build = _library(dynamic, tmp / f"{name}_dynamic") if level == "library" else None
    rows = []
    for size in sizes:
        x = inputs_at(size)
        exact = InferGraph(model)
        want = exact(x).numpy()
        np.testing.assert_allclose(dynamic(x).numpy(), want, rtol=1e-4, atol=1e-5)
        if level == "graph":
            callables, given = {"dynamic": dynamic, "exact": exact}, x
        else:
            exact_build = _library(exact, tmp / f"{name}_exact_{size}")
            with flow.load_compiled(dynamic_build) as library:
                np.testing.assert_allclose(library(x.numpy()), want, rtol=1e-4, atol=1e-5)
            given = tmp / f"{name}_{size}.npy"
            np.save(given, x.numpy())
            callables = {"dynamic": _LibraryInProcess(dynamic_build), "exact": _LibraryInProcess(exact_build)}
        med = _timed(callables, given, args)
        rows.append({"case": name, "level": level, "size": list(x.shape), "dynamic_ms": med["dynamic"][0],
                     "exact_ms": med["exact"][0], "dynamic_spread_ms": med["dynamic"][1],
                     "exact_spread_ms": med["exact"][1], "ratio": med["dynamic"][0] / med["exact"][0],
                     "dynamic_compile_s": compile_s})
        log(f"{name} {level} {list(x.shape)}: dynamic {med['dynamic'][0]:.3f} ms, exact {med['exact'][0]:.3f} ms")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--levels", nargs="*", default=["graph", "library"], choices=["graph", "library"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile (kept in the JSON)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "dynamic_shapes_cpu.json"))
    parser.add_argument("--time-library", nargs=3, metavar=("OUT", "X_NPY", "ITERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.time_library:
        out, x_path, iters = args.time_library
        print(_time_library(out, x_path, int(iters)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        # Every graph row first: a loaded library's idle threads are not around while graphs run.
        rows = [row for level in args.levels for name in args.cases for row in run_case(name, level, args, Path(tmp))]
    print_table(rows, [("case", lambda r: r["case"]), ("level", lambda r: r["level"]),
                       ("size", lambda r: "x".join(map(str, r["size"]))),
                       ("dynamic ms", lambda r: f"{r['dynamic_ms']:.3f}"), ("exact ms", lambda r: f"{r['exact_ms']:.3f}"),
                       ("ratio", lambda r: f"{r['ratio']:.3f}")])
    worst = max(r["ratio"] for r in rows if r["level"] == "library" or "library" not in args.levels)
    print(f"worst ratio of the programs {worst:.3f} (target <= {TARGET})")
    write_json(args.out, {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "cores": len(os.sched_getaffinity(0)),
                          "load_average": os.getloadavg(), "note": args.note, "target_ratio": TARGET,
                          "worst_ratio": worst, "rows": rows})


if __name__ == "__main__":
    main()
