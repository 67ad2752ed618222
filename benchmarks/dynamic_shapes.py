"""A graph with a dynamic batch (or sequence) against graphs compiled for exactly that size.

    PYTHONPATH=. python benchmarks/dynamic_shapes.py [--repeats 7] [--iters 20] [--out FILE]

Cases (inference, the cpu target's native kernels, one process): an MLP (Linear 256-512-512-10,
GELU) with a dynamic batch up to 64, a conv net (3x3 conv, a depthwise-separable block, BatchNorms
folded, a spatial mean) on 32x32 images with a dynamic batch up to 16 (MobileNetV2 is refused for
now: its adaptive average pool is an emulated kernel, whose grid follows the batch), and the small
GPT of examples/gpt_char.py (2 layers, 64 wide) on 32 tokens with a dynamic batch up to 16 (a
dynamic sequence is refused past 16 positions: the native attention pads the keys to a multiple of
16, a rounding codegen/dynamic.py cannot fit).
For each case and size (1, 8 and the maximum), two graphs of the same model: `dynamic` (one
compile, graph.config.dynamic_shapes, called at every size) and `exact` (compiled for that size
alone). Their calls alternate: `--repeats` rounds of `--iters` calls each, a round's median per
row, the row's number the median of its rounds (spread: min and max of the rounds). ratio =
dynamic / exact; the target (issue 27) is within 1.1x. A batch of 1 runs the dynamic graph's
variant for size 1 (compiled at its first call: a size of 1 has special cases, flowgen/dims.py),
the others its one variant for sizes 2 up. The standalone program and library take
fixed shapes for now, so this measures the Python graph, which runs the same kernels.
Writes JSON (default benchmarks/results/dynamic_shapes_cpu.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

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
    "gpt": (_gpt, lambda: [{0: flow.Dim("batch", min=1, max=16)}], lambda n: _tokens(n, 32), [1, 8, 16]),
}


def run_case(name, args) -> list:
    make, spec, inputs_at, sizes = CASES[name]
    flow.manual_seed(0)
    model = make().eval()
    dynamic = InferGraph(model)
    dynamic.config.dynamic_shapes(spec())
    start = time.perf_counter()
    dynamic(inputs_at(sizes[0]))
    compile_s = time.perf_counter() - start
    rows = []
    for size in sizes:
        x = inputs_at(size)
        exact = InferGraph(model)
        np.testing.assert_allclose(dynamic(x).numpy(), exact(x).numpy(), rtol=1e-4, atol=1e-5)
        rounds = {"dynamic": [], "exact": []}
        for _ in range(args.repeats):
            for row, graph in (("dynamic", dynamic), ("exact", exact)):
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    graph(x)
                    times.append((time.perf_counter() - start) * 1e3)
                rounds[row].append(statistics.median(times))
        med = {row: statistics.median(values) for row, values in rounds.items()}
        rows.append({"case": name, "size": list(x.shape), "dynamic_ms": med["dynamic"], "exact_ms": med["exact"],
                     "dynamic_spread_ms": [min(rounds["dynamic"]), max(rounds["dynamic"])],
                     "exact_spread_ms": [min(rounds["exact"]), max(rounds["exact"])],
                     "ratio": med["dynamic"] / med["exact"], "dynamic_compile_s": compile_s})
        log(f"{name} {list(x.shape)}: dynamic {med['dynamic']:.3f} ms, exact {med['exact']:.3f} ms")
    assert len(dynamic._variants) == (2 if 1 in sizes else 1)   # a batch of 1 is a variant of its own
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile (kept in the JSON)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "dynamic_shapes_cpu.json"))
    args = parser.parse_args(argv)
    rows = [row for name in args.cases for row in run_case(name, args)]
    print_table(rows, [("case", lambda r: r["case"]), ("size", lambda r: "x".join(map(str, r["size"]))),
                       ("dynamic ms", lambda r: f"{r['dynamic_ms']:.3f}"), ("exact ms", lambda r: f"{r['exact_ms']:.3f}"),
                       ("ratio", lambda r: f"{r['ratio']:.3f}")])
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.3f} (target <= {TARGET})")
    write_json(args.out, {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "cores": len(os.sched_getaffinity(0)),
                          "load_average": os.getloadavg(), "note": args.note, "target_ratio": TARGET,
                          "worst_ratio": worst, "rows": rows})


if __name__ == "__main__":
    main()
