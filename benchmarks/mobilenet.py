"""MobileNetV2 on CIFAR-10 shapes: training images/s (batch 64) and batch-1 inference latency.

    python benchmarks/mobilenet.py [--device cuda|cpu] [--steps N] [--batch B] [--width W] [--out FILE]

flowgen's compiled nn.Graph vs PyTorch eager and torch.compile on the same device, in one
run (the ratios are what to read; these machines are noisy). Also reports kernel launches per
step before and after fusion for the training and the inference graph. PyTorch comparisons
run only where torch is installed. Writes JSON (default benchmarks/results/mobilenet_<device>.json).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from flowgen.models import mobilenet_v2  # noqa: E402
from graphs import InferGraph, TrainGraph  # noqa: E402  (tests/graphs.py)


def _timed(fn, steps, sync=lambda: None):
    fn()
    fn()   # second call: CUDA-graph capture on flowgen, autotune/warm-up elsewhere
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_flowgen(model, device, batch, steps, x_train, y_train, x_one):
    train_model = copy.deepcopy(model).to(device)
    graph = TrainGraph(train_model, nn.CrossEntropyLoss(), flow.optim.SGD(train_model.parameters(), lr=1e-3))
    xt, yt = x_train.to(device), y_train.to(device)
    start = time.perf_counter()
    graph(xt, yt)
    compile_s = time.perf_counter() - start
    step = _timed(lambda: graph(xt, yt).numpy(), steps)
    infer_model = copy.deepcopy(model).to(device).eval()
    infer = InferGraph(infer_model)
    x1 = x_one.to(device)
    infer(x1)
    latency = _timed(lambda: infer(x1).numpy(), steps * 4)
    return {
        "train_images_per_s": batch / step, "train_step_ms": step * 1e3, "first_call_s": compile_s,
        "train_launches_fused": graph.compiled.num_launches,
        "train_launches_unfused": graph.compiled.kernels_before_fusion,
        "infer_latency_ms": latency * 1e3,
        "infer_launches_fused": infer.compiled.num_launches,
        "infer_launches_unfused": infer.compiled.kernels_before_fusion,
        "infer_prepare_launches": len(infer.compiled.program.prepare),
        "train_arena_mb": graph.compiled.memory.arena_bytes / 1e6,
        "train_lower_bound_mb": graph.compiled.memory.lower_bound_bytes / 1e6,
    }


def bench_torch(model, device, batch, steps, x_train, y_train, x_one, width):
    try:
        import torch
        from torch_vision_models import copy_into_torch, torch_mobilenet_v2
    except ImportError:
        return {}
    dev = "cuda" if device.type == "cuda" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    results = {}
    for mode in ("eager", "compile"):
        tmodel = torch_mobilenet_v2(num_classes=10, width_mult=width)
        copy_into_torch(model, tmodel)
        tmodel = tmodel.to(dev).train()
        runner = torch.compile(tmodel) if mode == "compile" else tmodel
        opt = torch.optim.SGD(tmodel.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()
        xt = torch.from_numpy(x_train.numpy()).to(dev)
        yt = torch.from_numpy(y_train.numpy()).to(dev)

        def train_step():
            loss = loss_fn(runner(xt), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()

        try:
            step = _timed(train_step, steps, sync)
            tmodel.eval()
            x1 = x_one.numpy()

            def infer():
                with torch.no_grad():
                    return runner(torch.from_numpy(x1).to(dev)).cpu()

            latency = _timed(infer, steps * 4, sync)
            results[f"torch_{mode}_train_images_per_s"] = batch / step
            results[f"torch_{mode}_train_step_ms"] = step * 1e3
            results[f"torch_{mode}_infer_latency_ms"] = latency * 1e3
        except Exception as exc:   # a torch.compile failure is reported, not fatal
            results[f"torch_{mode}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if flow.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="default: 64 on cuda, 8 on cpu")
    parser.add_argument("--width", type=float, default=None, help="width_mult (default 1.0 on cuda, 0.25 on cpu)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = flow.device(args.device)
    batch = args.batch or (64 if device.type == "cuda" else 8)
    width = args.width or (1.0 if device.type == "cuda" else 0.25)
    flow.manual_seed(0)
    model = mobilenet_v2(num_classes=10, width_mult=width)
    rng = np.random.default_rng(0)
    x_train = flow.tensor(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y_train = flow.tensor(rng.integers(0, 10, batch).astype(np.int64))
    x_one = flow.tensor(rng.standard_normal((1, 3, 32, 32)).astype(np.float32))

    row = {"device": str(device), "batch": batch, "width_mult": width, "steps": args.steps}
    row.update(bench_flowgen(model, device, batch, args.steps, x_train, y_train, x_one))
    row.update(bench_torch(model, device, batch, args.steps, x_train, y_train, x_one, width))
    for mode in ("eager", "compile"):
        if f"torch_{mode}_train_step_ms" in row:
            row[f"train_speedup_vs_torch_{mode}"] = row[f"torch_{mode}_train_step_ms"] / row["train_step_ms"]
            row[f"infer_speedup_vs_torch_{mode}"] = row[f"torch_{mode}_infer_latency_ms"] / row["infer_latency_ms"]

    width_col = max(len(k) for k in row)
    for k, v in row.items():
        print(f"{k:<{width_col}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width_col}}  {v}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"mobilenet_{device.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"machine": platform.node(), "python": platform.python_version(), "result": row}, f, indent=2)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
