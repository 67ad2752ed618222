"""Eager-mode benchmark: the seed-004 poly-fit (2000 SGD steps) on flowgen's NumPy reference.

Prints a table (end-to-end time and a per-phase split of one step) and writes
``benchmarks/results/eager_<hostname>.json``. Target: the 2000 steps in < 2 s.

    python benchmarks/eager.py [--steps 2000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import flowgen as flow  # noqa: E402
import polyfit_eager  # noqa: E402

TARGET_S = 2.0


def end_to_end(steps: int) -> tuple[float, float]:
    """Seconds for the example's main() and its last logged loss."""
    flow.manual_seed(0)
    start = time.perf_counter()
    losses, _ = polyfit_eager.main(steps=steps, verbose=False)
    return time.perf_counter() - start, losses[-1][1] if losses else float("nan")


def phases(steps: int) -> dict:
    """Mean microseconds per step of each phase of the same training loop."""
    flow.manual_seed(0)
    x = flow.tensor(np.linspace(-math.pi, math.pi, 2000), dtype=flow.float32)
    y = flow.tensor(np.sin(x), dtype=flow.float32)
    xx = flow.cat([x.unsqueeze(-1).pow(1), x.unsqueeze(-1).pow(2), x.unsqueeze(-1).pow(3)], dim=1)
    model = flow.nn.Sequential(flow.nn.Linear(3, 1), flow.nn.Flatten(0, 1))
    loss_fn = flow.nn.MSELoss(reduction="sum")
    optimizer = flow.optim.SGD(model.parameters(), lr=1e-6)
    totals = dict.fromkeys(["forward", "loss", "zero_grad", "backward", "optimizer.step"], 0.0)
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        y_pred = model(xx)
        t1 = clock()
        loss = loss_fn(y_pred, y)
        t2 = clock()
        optimizer.zero_grad()
        t3 = clock()
        loss.backward()
        t4 = clock()
        optimizer.step()
        t5 = clock()
        for name, dt_ in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            totals[name] += dt_
    return {name: 1e6 * total / steps for name, total in totals.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", f"eager_{socket.gethostname()}.json"))
    args = parser.parse_args(argv)

    runs = [end_to_end(args.steps) for _ in range(args.repeats)]
    times = [t for t, _ in runs]
    split = phases(args.steps)
    result = {
        "benchmark": "eager_polyfit",
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "flowgen": flow.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "seconds": {"min": min(times), "median": statistics.median(times), "all": times},
        "us_per_step": 1e6 * min(times) / args.steps,
        "final_loss": runs[-1][1],
        "phase_us_per_step": split,
        "target_seconds": TARGET_S,
        "meets_target": min(times) < TARGET_S * args.steps / 2000,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    print(f"eager poly-fit, {args.steps} steps, best of {args.repeats} (target < {TARGET_S:.1f} s per 2000 steps)")
    print(f"{'measure':<22}{'value':>14}")
    print("-" * 36)
    print(f"{'total (min)':<22}{min(times):>12.3f} s")
    print(f"{'total (median)':<22}{statistics.median(times):>12.3f} s")
    print(f"{'per step':<22}{result['us_per_step']:>11.1f} us")
    print(f"{'final loss':<22}{result['final_loss']:>14.4f}")
    for name, us in split.items():
        print(f"{'  ' + name:<22}{us:>11.1f} us")
    print(f"{'meets target':<22}{str(result['meets_target']):>14}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
