"""Graph benchmarks: compile-time breakdown, launches before/after fusion, memory, step time;
kernel launches per call of MobileNetV2's training and inference graphs before/after fusion.

    python benchmarks/graph.py [--device cpu|cuda] [--steps N] [--cases NAME ...] [--out FILE]

Prints one table and writes JSON (default benchmarks/results/graph_<device>.json).
Training steps and eval-mode forwards (inference graph vs eager under no_grad) are compared side by side in one run (graph vs the eager loop on the
same inputs; on cuda also vs PyTorch eager and torch.compile when PyTorch is
installed), because these machines are noisy: read the ratios.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from fair_common import git_commit  # noqa: E402  (benchmarks/fair_common.py)
from graphs import InferGraph, TrainGraph  # noqa: E402  (tests/graphs.py)


def polyfit_case(device):
    x = flow.tensor(np.linspace(-math.pi, math.pi, 2000), dtype=flow.float32)
    y = flow.tensor(np.sin(x), dtype=flow.float32)
    xx = flow.cat([x.unsqueeze(-1).pow(1), x.unsqueeze(-1).pow(2), x.unsqueeze(-1).pow(3)], dim=1)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1)).to(device)
    loss_fn = nn.MSELoss(reduction="sum")
    return "polyfit_train", model, loss_fn, (lambda p: flow.optim.SGD(p, lr=1e-6)), (xx.to(device), y.to(device))


def mlp_case(device):
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    x = flow.randn(128, 64).to(device)
    y = flow.randint(0, 10, (128,)).to(device)
    return "mlp_train", model, nn.CrossEntropyLoss(), (lambda p: flow.optim.Adam(p, lr=1e-3)), (x, y)


def gpt_case(device):
    """examples/gpt_char.py's GPT (2 layers, 64 wide, block 32, batch 4) with its AdamW groups."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt_char

    flow.manual_seed(0)
    config = gpt_char.GPTConfig()
    gpt = gpt_char.define(flow)(config)

    class Logits(nn.Module):   # the logits as (B*T, V) rows, for CrossEntropyLoss
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx):
            logits, _ = self.gpt(idx)
            return logits.view(-1, logits.size(-1))

    x = flow.randint(0, config.vocab_size, (4, config.block_size)).to(device)
    y = flow.randint(0, config.vocab_size, (4 * config.block_size,)).to(device)
    model = Logits().to(device)
    return ("gpt_char_train", model, nn.CrossEntropyLoss(),
            (lambda p: gpt.configure_optimizer(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95))), (x, y))


def _convnet_case(name, device):
    """flowgen.models.<name> (10 classes) trained on a CIFAR-sized batch of 8 with SGD momentum."""
    flow.manual_seed(0)
    model = getattr(flow.models, name)(num_classes=10).to(device)
    x = flow.randn(8, 3, 32, 32).to(device)
    y = flow.randint(0, 10, (8,)).to(device)
    return (f"{name}_b8_train", model, nn.CrossEntropyLoss(),
            (lambda p: flow.optim.SGD(p, lr=0.01, momentum=0.9)), (x, y))


def mobilenet_case(device):
    return _convnet_case("mobilenet_v2", device)


def resnet18_case(device):
    return _convnet_case("resnet18", device)


CASES = {"polyfit": (polyfit_case, 1), "mlp": (mlp_case, 1), "gpt": (gpt_case, 2),
         "mobilenet_v2": (mobilenet_case, 10), "resnet18": (resnet18_case, 10)}   # steps divided by


def time_calls(fn, steps, repeats=3):
    """(median, min, max) over `repeats` runs of the mean seconds per call of `steps` calls."""
    fn()  # warm
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        means.append((time.perf_counter() - start) / steps)
    means.sort()
    return means[len(means) // 2], means[0], means[-1]


def bench_training(case, device, steps):
    name, model, loss_fn, make_opt, (x, y) = case
    eager_model = copy.deepcopy(model)
    graph = TrainGraph(model, loss_fn, make_opt(model.parameters()))
    # Cold start: fresh cache directory so compile time is measured, then a warm start.
    start = time.perf_counter()
    graph(x, y)
    first_call = time.perf_counter() - start
    compiled = graph.compiled
    warm_graph = TrainGraph(copy.deepcopy(model), loss_fn, make_opt(model.parameters()))
    start = time.perf_counter()
    warm_graph(x, y)
    warm_start = time.perf_counter() - start

    graph_step, graph_min, graph_max = time_calls(lambda: graph(x, y).numpy(), steps)
    opt = make_opt(eager_model.parameters())

    def eager_step():
        loss = loss_fn(eager_model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.numpy()

    eager_step_time, eager_min, eager_max = time_calls(eager_step, max(1, steps // 4))
    mem = compiled.memory
    row = {
        "graph": name, "device": str(device),
        "trace_s": compiled.timings["trace"], "passes_s": compiled.timings["passes"],
        "codegen_s": compiled.timings["codegen"], "compile_s": compiled.timings["compile"],
        "first_call_s": first_call, "warm_start_s": warm_start,
        "kernels_unfused": compiled.kernels_before_fusion, "kernels_fused": compiled.num_launches,
        "arena_bytes": mem.arena_bytes, "lower_bound_bytes": mem.lower_bound_bytes, "naive_bytes": mem.naive_bytes,
        "arena_over_lower_bound": mem.arena_bytes / max(mem.lower_bound_bytes, 1),
        "graph_step_ms": graph_step * 1e3, "eager_step_ms": eager_step_time * 1e3,
        "graph_step_ms_range": [graph_min * 1e3, graph_max * 1e3],
        "eager_step_ms_range": [eager_min * 1e3, eager_max * 1e3], "repeats": 3,
        "eager_over_graph": eager_step_time / graph_step,
    }
    row.update(torch_baselines(name, model, x, y, device, steps))
    row.update(bench_inference(eager_model, x, steps))
    return row


def bench_inference(model, x, steps):
    """The model's eval-mode forward: an inference graph vs eager under no_grad, same inputs."""
    model.eval()
    graph = InferGraph(model)
    graph(x)

    def eager_forward():
        with flow.no_grad():
            return model(x).numpy()

    graph_ms, graph_min, graph_max = (t * 1e3 for t in time_calls(lambda: graph(x).numpy(), steps))
    eager_ms, eager_min, eager_max = (t * 1e3 for t in time_calls(eager_forward, steps))
    return {"graph_infer_ms": graph_ms, "eager_infer_ms": eager_ms, "graph_infer_ms_range": [graph_min, graph_max],
            "eager_infer_ms_range": [eager_min, eager_max], "eager_over_graph_infer": eager_ms / graph_ms}


def convnet_launches(device):
    """MobileNetV2 (CIFAR-10 shapes, full width): kernel launches per call of its training and
    inference graphs, before and after fusion (one call each; step times are benchmarks/mobilenet.py's)."""
    from flowgen.models import mobilenet_v2

    flow.manual_seed(0)
    batch = 64 if device.type == "cuda" else 2
    model = mobilenet_v2(num_classes=10).to(device)
    x, y = flow.randn(batch, 3, 32, 32).to(device), flow.randint(0, 10, (batch,)).to(device)
    train = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    train(x, y)
    model.eval()
    infer = InferGraph(model)
    infer(x[:1])
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    return [{"graph": f"mobilenet_v2_{kind}", "device": str(device), "batch": b, "convs": convs,
             "kernels_unfused": g.compiled.kernels_before_fusion, "kernels_fused": g.compiled.num_launches}
            for kind, g, b in (("train", train, batch), ("infer", infer, 1))]


def torch_baselines(name, model, x, y, device, steps):
    """PyTorch eager and torch.compile on the same GPU and the same problem (cuda only)."""
    if device.type != "cuda" or name not in ("polyfit_train", "mlp_train"):
        return {}
    try:
        import torch
    except ImportError:
        return {}
    tmodel = _to_torch(model).cuda()
    tx = torch.from_numpy(x.numpy()).cuda()
    ty = torch.from_numpy(y.numpy()).cuda()
    loss_fn = torch.nn.MSELoss(reduction="sum") if name == "polyfit_train" else torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(tmodel.parameters(), lr=1e-6) if name == "polyfit_train" else \
        torch.optim.Adam(tmodel.parameters(), lr=1e-3)

    def step(m):
        loss = loss_fn(m(tx), ty)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    out = {"torch_eager_step_ms": time_calls(lambda: step(tmodel), steps)[0] * 1e3}
    try:
        compiled = torch.compile(tmodel)
        out["torch_compile_step_ms"] = time_calls(lambda: step(compiled), steps)[0] * 1e3
    except Exception as exc:  # report, don't fail the benchmark
        out["torch_compile_error"] = str(exc)[:200]
    return out


def _to_torch(model):
    import torch

    layers = []
    for m in model.children() if isinstance(model, nn.Sequential) else [model]:
        kind = type(m).__name__
        if kind == "Linear":
            lin = torch.nn.Linear(m.in_features, m.out_features)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(m.weight.numpy()))
                lin.bias.copy_(torch.from_numpy(m.bias.numpy()))
            layers.append(lin)
        elif kind == "Flatten":
            layers.append(torch.nn.Flatten(m.start_dim, m.end_dim))
        elif kind in ("ReLU", "GELU"):
            layers.append(getattr(torch.nn, kind)())
        else:
            raise TypeError(f"no torch twin for {kind}")
    return torch.nn.Sequential(*layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if flow.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    device = flow.device(args.device)
    cache = tempfile.mkdtemp(prefix="flowgen-bench-cache-")
    os.environ["FLOWGEN_CACHE"] = cache
    try:
        rows = [bench_training(CASES[name][0](device), device, max(2, args.steps // CASES[name][1]))
                for name in args.cases]
        if "polyfit" in args.cases:   # the target: the whole 2000-step poly-fit through the graph
            name, model, loss_fn, make_opt, (x, y) = polyfit_case(device)
            graph = TrainGraph(model, loss_fn, make_opt(model.parameters()))
            start = time.perf_counter()
            for _ in range(2000):
                loss = graph(x, y)
            rows[args.cases.index("polyfit")]["polyfit_2000_steps_s"] = time.perf_counter() - start
            rows[args.cases.index("polyfit")]["polyfit_final_loss"] = float(loss.numpy())
        launches = convnet_launches(device)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    cols = ["graph", "trace_s", "passes_s", "codegen_s", "compile_s", "warm_start_s", "kernels_unfused",
            "kernels_fused", "arena_over_lower_bound", "graph_step_ms", "eager_step_ms", "eager_over_graph",
            "graph_infer_ms", "eager_infer_ms", "eager_over_graph_infer"]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.4f}" if isinstance(r[c], float) else f"{str(r[c]):>14}" for c in cols))
    print()
    print(" | ".join(f"{c:>20}" for c in ("graph", "convs", "kernels_unfused", "kernels_fused")))
    for r in launches:
        print(" | ".join(f"{str(r[c]):>20}" for c in ("graph", "convs", "kernels_unfused", "kernels_fused")))
    for r in rows:
        extra = {k: v for k, v in r.items() if k.startswith(("torch", "polyfit"))}
        if extra:
            print(r["graph"], json.dumps(extra))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"graph_{device.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    payload = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "flowgen_commit": git_commit(), "machine": platform.node(), "cores": os.cpu_count(),
               "load_average_after": os.getloadavg(), "python": platform.python_version(), "rows": rows,
               "launches": launches}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
