"""ConvNet training steps and batch-1 inference: flowgen's nn.Graph vs PyTorch's best settings.

    python benchmarks/fair_convnets.py [--models resnet50 mobilenet_v2] [--precisions bf16 tf32 fp32]
                                       [--rows ROW ...] [--row-timeout S] [--out FILE]
    python benchmarks/fair_convnets.py --smoke      # no GPU: tiny shapes, cpu target vs torch CPU

Models (same weights on both sides: the flowgen model's state_dict copied into a torchvision-free
PyTorch twin with the same module names; dropout 0 so both compute the same function):

  resnet50      224x224 images, 1000 classes, training batch 128
  mobilenet_v2  CIFAR-10 shapes (32x32, 10 classes, width 1.0), training batch 64

Each model runs a training step (cross-entropy, SGD momentum 0.9) and batch-1 inference, each row
in its own process (a time box per row: --row-timeout; a row past it is reported as timed out):

  flowgen                        the compiled nn.Graph; its step (one CUDA-graph replay) is timed
                                 alone (Executor.launch_step: no host copies of inputs or outputs)
  torch_eager                    cudnn.benchmark, channels_last, SGD(fused=True)
  torch_compile                  torch.compile(model) of the same, default mode
  torch_compile_reduce_overhead  mode="reduce-overhead" (CUDA graphs through Inductor)
  torch_compile_max_autotune     mode="max-autotune" (not in the default rows: compiles for minutes)
  torch_cuda_graph               the eager step (forward, backward, fused SGD) captured whole with
                                 torch.cuda.graph on static inputs and replayed

Precisions, the same on both sides: fp32 (torch: float32 matmul precision "highest" and
cudnn.allow_tf32 off), tf32 (flowgen allow_tf32; torch "high" and cudnn TF32), bf16 (flowgen
enable_amp(True, flow.bfloat16); torch autocast bfloat16).

Timing (fair_common.py): CUDA events around each step on the stream it runs on, warm-up first,
`--repeats` groups of `--iters` steps: median of group medians, min/max as spread. Inputs stay on
the device on both sides. `first_call_s` is the wall time of the first call (flowgen: trace,
passes, codegen, NVRTC, one step; torch.compile: Dynamo + Inductor) and `warmup_s` that of the
whole warm-up (CUDA-graph capture, autotuning); the build caches are as the machine has them
(flowgen: $FLOWGEN_CACHE or ~/.cache/flowgen; Inductor: its /tmp cache), say so when comparing.
Agreement: each row's inference logits and first training loss are compared with the
torch_eager row's (relative difference; `agrees` under AGREE_LIMIT for the precision, ten times
that for the loss), so a row that computes something else is flagged (DIFFERS) and left out of
the headline. The headline is flowgen's time over the best PyTorch
row's, per model, precision and task.

Prints a table last and writes JSON (default benchmarks/results/fair_convnets_<device>.json; with
--smoke, a file in the temporary directory) with the device, date, flowgen commit and versions.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from fair_common import (CudaEventTimer, HostTimer, add_row_arguments, environment, fmt, log,  # noqa: E402
                         parse_row_arguments, plan_rows, print_table, rel_err, write_json)
from flowgen.models import mobilenet_v2, resnet50  # noqa: E402
from graphs import InferGraph, TrainGraph  # noqa: E402  (tests/graphs.py)
from torch_vision_models import copy_into_torch, torch_mobilenet_v2  # noqa: E402  (tests/)

ROWS = ["flowgen", "torch_eager", "torch_compile", "torch_compile_reduce_overhead", "torch_compile_max_autotune",
        "torch_cuda_graph"]
DEFAULT_ROWS = [r for r in ROWS if r != "torch_compile_max_autotune"]
SMOKE_ROWS = ["flowgen", "torch_eager", "torch_compile"]
COMPILE_MODES = {"torch_compile": "default", "torch_compile_reduce_overhead": "reduce-overhead",
                 "torch_compile_max_autotune": "max-autotune"}
PRECISIONS = ["bf16", "tf32", "fp32"]
# Relative difference of the inference logits from the torch_eager row's above which a row is
# flagged: two correct programs differ by their rounding, compounded over ~50 layers. The first
# training loss gets TRAIN_AGREE_FACTOR times more: it goes through BatchNorm's batch statistics,
# which amplify rounding where a channel's few values nearly agree (late layers at 1x1 spatial).
AGREE_LIMIT = {"fp32": 1e-3, "tf32": 3e-2, "bf16": 1e-1}
TRAIN_AGREE_FACTOR = 10
LR, MOMENTUM = 0.01, 0.9


def model_spec(name: str, smoke: bool) -> dict:
    """How to build the model on each side, its input shape and batch sizes."""
    if name == "resnet50":
        classes = 10 if smoke else 1000
        return {"flow": lambda: resnet50(num_classes=classes), "torch": lambda: torch_resnet50(classes),
                "hw": 32 if smoke else 224, "classes": classes, "batch": 2 if smoke else 128}
    if name == "mobilenet_v2":
        width = 0.25 if smoke else 1.0
        return {"flow": lambda: mobilenet_v2(num_classes=10, width_mult=width, dropout=0.0),
                "torch": lambda: torch_mobilenet_v2(num_classes=10, width_mult=width, dropout=0.0),
                "hw": 32, "classes": 10, "batch": 2 if smoke else 64}
    raise ValueError(f"unknown model {name!r}; choose from resnet50, mobilenet_v2")


def torch_resnet50(num_classes: int):
    """ResNet-50 (torchvision's layout and names, "V1.5": stride in the 3x3) in plain torch.nn."""
    tnn = torch.nn

    class Bottleneck(tnn.Module):
        def __init__(self, inplanes, planes, stride):
            super().__init__()
            self.conv1 = tnn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(planes)
            self.conv2 = tnn.Conv2d(planes, planes, 3, stride, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(planes)
            self.conv3 = tnn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = tnn.BatchNorm2d(planes * 4)
            self.relu = tnn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or inplanes != planes * 4:
                self.downsample = tnn.Sequential(tnn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                                 tnn.BatchNorm2d(planes * 4))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet50(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = tnn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = tnn.BatchNorm2d(64)
            self.relu = tnn.ReLU(inplace=True)
            self.maxpool = tnn.MaxPool2d(3, 2, 1)
            inplanes = 64
            for i, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
                layer = []
                for j in range(blocks):
                    layer.append(Bottleneck(inplanes, planes, 2 if i > 0 and j == 0 else 1))
                    inplanes = planes * 4
                setattr(self, f"layer{i + 1}", tnn.Sequential(*layer))
            self.avgpool = tnn.AdaptiveAvgPool2d((1, 1))
            self.fc = tnn.Linear(2048, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet50()


def make_data(spec: dict) -> dict:
    rng = np.random.default_rng(0)
    hw = spec["hw"]
    return {"x": rng.standard_normal((spec["batch"], 3, hw, hw)).astype(np.float32),
            "y": rng.integers(0, spec["classes"], spec["batch"]).astype(np.int64),
            "x1": rng.standard_normal((1, 3, hw, hw)).astype(np.float32)}


def make_timer(device: str, stream=None):
    if device == "cpu":
        return HostTimer()
    return CudaEventTimer(torch, stream or torch.cuda.current_stream())


def measure(timer, run, args, task: str) -> dict:
    iters = args.iters if task == "train" else args.iters * 4
    return timer.measure(run, lambda i: None, warmup=args.warmup, iters=iters, repeats=args.repeats)


# ---- flowgen ----

def flowgen_task(task, spec, flow_model, data, precision, device, args) -> dict:
    model = copy.deepcopy(flow_model).to(flow.device(device))
    if task == "train":
        model.train()
        graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
        inputs = (flow.tensor(data["x"]).to(device), flow.tensor(data["y"]).to(device))
    else:
        model.eval()
        graph = InferGraph(model)
        inputs = (flow.tensor(data["x1"]).to(device),)
    if precision == "tf32":
        graph.config.allow_tf32(True)
    elif precision == "bf16":
        graph.config.enable_amp(True, flow.bfloat16)
    start = time.perf_counter()
    out = graph(*inputs)
    first = time.perf_counter() - start
    start = time.perf_counter()
    graph(*inputs)   # the second call is captured into a CUDA graph
    result = {"first_call_s": first, "warmup_s": time.perf_counter() - start,
              "launches": graph.compiled.num_launches, "output": np.asarray(out.numpy(), np.float64).ravel().tolist()}
    executor = graph.compiled.executor
    stream = torch.cuda.ExternalStream(int(executor.backend.stream)) if device == "cuda" else None
    result.update(measure(make_timer(device, stream), executor.launch_step, args, task))
    return result


# ---- PyTorch ----

@contextlib.contextmanager
def torch_precision(precision: str, device: str):
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    with torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
        yield


def torch_task(task, row, spec, flow_model, data, precision, device, args) -> dict:
    cuda = device == "cuda"
    model = copy_into_torch(flow_model, spec["torch"]()).to(device)
    layout = torch.channels_last if cuda else torch.contiguous_format
    model = model.to(memory_format=layout)
    torch.backends.cudnn.benchmark = True
    x = torch.from_numpy(data["x" if task == "train" else "x1"]).to(device).contiguous(memory_format=layout)
    y = torch.from_numpy(data["y"]).to(device)
    runner = torch.compile(model, mode=COMPILE_MODES[row]) if row in COMPILE_MODES else model
    mark_step = row in ("torch_compile_reduce_overhead", "torch_compile_max_autotune")

    if task == "train":
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, fused=cuda)
        loss_fn = torch.nn.CrossEntropyLoss()

        def body():
            with torch_precision(precision, device):
                loss = loss_fn(runner(x), y)
            loss.backward()
            optimizer.step()
            return loss

        def step():
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            loss = body()
            optimizer.zero_grad(set_to_none=True)
            return loss
    else:
        model.eval()

        def step():
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), torch_precision(precision, device):
                return runner(x)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    out = step()
    sync()
    first = time.perf_counter() - start
    output = out.detach().double().cpu().numpy().ravel().tolist()
    del out   # the loss keeps its autograd graph (AccumulateGrad nodes) alive, which breaks a capture
    start = time.perf_counter()
    run = capture(step, body if task == "train" else step, optimizer if task == "train" else None) \
        if row == "torch_cuda_graph" else step
    for _ in range(2):
        run()
    sync()
    result = {"first_call_s": first, "warmup_s": time.perf_counter() - start, "output": output}
    result.update(measure(make_timer(device), run, args, task))
    return result


def capture(step, body, optimizer):
    """The whole step as one CUDA graph (torch.cuda.graphs' whole-network capture): warm up on a
    side stream, clear the gradients, capture forward, backward and the optimizer step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


# ---- one row in this process ----

def worker(args) -> None:
    device = "cpu" if args.smoke else "cuda"
    spec = model_spec(args.model, args.smoke)
    flow.manual_seed(0)
    flow_model = spec["flow"]()
    data = make_data(spec)
    result = {}
    for task in ("infer", "train"):
        log(f"{args.model} {args.precision} {args.row} {task}")
        try:
            if args.row == "flowgen":
                result[task] = flowgen_task(task, spec, flow_model, data, args.precision, device, args)
            else:
                result[task] = torch_task(task, args.row, spec, flow_model, data, args.precision, device, args)
        except Exception as exc:   # reported in the row; the other task and rows still run
            traceback.print_exc()
            result[task] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    with open(args.result, "w") as f:
        json.dump(result, f)


def run_row(model, precision, row, args) -> dict:
    """Run one row in a child process (its own session, so a time-out kills its compiler workers too)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--precision", precision,
               "--row", row, "--result", result_path, "--warmup", str(args.warmup), "--iters", str(args.iters),
               "--repeats", str(args.repeats)] + (["--smoke"] if args.smoke else [])
    start = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)
    try:
        child.wait(timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        os.unlink(result_path)
        return {task: {"error": f"timed out after {args.row_timeout:.0f} s"} for task in ("infer", "train")}
    wall = time.perf_counter() - start
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        result = {task: {"error": f"the row's process exited with status {child.returncode} and no result"}
                  for task in ("infer", "train")}
    finally:
        if os.path.exists(result_path):
            os.unlink(result_path)
    result["process_wall_s"] = wall
    return result


def summarize(model, precision, task, rows: dict, batch: int) -> list:
    """One table row per benchmark row: agreement with torch_eager, images/s, flowgen's ratio."""
    reference = rows.get("torch_eager", {}).get(task, {}).get("output")
    flowgen_ms = rows.get("flowgen", {}).get(task, {}).get("median_ms")
    out = []
    for name, result in rows.items():
        r = dict(result.get(task, {}), model=model, precision=precision, task=task, row=name)
        if "median_ms" in r:
            r["images_per_s"] = (batch if task == "train" else 1) / (r["median_ms"] * 1e-3)
            if flowgen_ms and name != "flowgen":
                r["flowgen_speedup"] = r["median_ms"] / flowgen_ms
        if reference is not None and r.get("output") is not None:
            r["rel_diff_vs_torch_eager"] = rel_err(r["output"], reference)
            limit = AGREE_LIMIT[precision] * (TRAIN_AGREE_FACTOR if task == "train" else 1)
            r["agrees"] = bool(r["rel_diff_vs_torch_eager"] <= limit)
        out.append(r)
    return out


def headline(table: list) -> list:
    """Per model, precision and task: flowgen against the fastest PyTorch row."""
    heads = []
    for key in sorted({(r["model"], r["precision"], r["task"]) for r in table}):
        rows = [r for r in table if (r["model"], r["precision"], r["task"]) == key and "median_ms" in r]
        flowgen_row = next((r for r in rows if r["row"] == "flowgen"), None)
        torch_rows = [r for r in rows if r["row"] != "flowgen" and r.get("agrees", True)]
        if flowgen_row and torch_rows:
            best = min(torch_rows, key=lambda r: r["median_ms"])
            heads.append({"model": key[0], "precision": key[1], "task": key[2], "flowgen_ms": flowgen_row["median_ms"],
                          "flowgen_agrees": flowgen_row.get("agrees"),
                          "best_torch_row": best["row"], "best_torch_ms": best["median_ms"],
                          "flowgen_speedup_vs_best_torch": best["median_ms"] / flowgen_row["median_ms"]})
    return heads


def status(r: dict) -> str:
    if "error" in r:
        return "TIMEOUT" if r["error"].startswith("timed out") else "ERROR"
    return "ok" if r.get("agrees", True) else "DIFFERS"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models on the cpu target vs torch CPU")
    parser.add_argument("--models", nargs="*", default=["mobilenet_v2", "resnet50"],
                        choices=["mobilenet_v2", "resnet50"])
    add_row_arguments(parser, PRECISIONS, ROWS, "timed training steps per repeat (inference: 4x)")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parse_row_arguments(parser, argv)
    if args.worker:
        return worker(args)
    device, rows, out = plan_rows(parser, args, torch, "fair_convnets", SMOKE_ROWS, DEFAULT_ROWS, smoke_timeout=900.0)

    env = environment(torch, device)
    log(f"fair_convnets on {env['device']} ({device}), flowgen {env['flowgen_commit']}, torch {env['torch']}: "
        f"{args.models} x {args.precisions} x {rows}")
    table = []
    for model in args.models:
        spec = model_spec(model, args.smoke)
        for precision in args.precisions:
            results = {row: run_row(model, precision, row, args) for row in rows}
            for task in ("train", "infer"):
                table += summarize(model, precision, task, results, spec["batch"])
    heads = headline(table)
    for r in table:
        r.pop("output", None)
    write_json(out, {"benchmark": "fair_convnets", "environment": env, "smoke": args.smoke,
                     "settings": {"warmup": args.warmup, "iters": args.iters, "repeats": args.repeats,
                                  "row_timeout_s": args.row_timeout, "lr": LR, "momentum": MOMENTUM,
                                  "batches": {m: model_spec(m, args.smoke)["batch"] for m in args.models}},
                     "rows": table, "headline": heads})
    print_table(table, [
        ("model", lambda r: r["model"]), ("prec", lambda r: r["precision"]), ("task", lambda r: r["task"]),
        ("row", lambda r: r["row"]), ("status", status),
        ("ms", lambda r: fmt(r.get("median_ms"), ".4g")),
        ("min-max", lambda r: f"{fmt(r.get('min_ms'), '.4g')}-{fmt(r.get('max_ms'), '.4g')}"),
        ("img/s", lambda r: fmt(r.get("images_per_s"), ".4g")),
        ("first call s", lambda r: fmt(r.get("first_call_s"), ".3g")),
        ("diff vs eager", lambda r: fmt(r.get("rel_diff_vs_torch_eager"), ".1e")),
        ("flowgen x", lambda r: fmt(r.get("flowgen_speedup"), ".3f")),
    ])
    print()
    print_table(heads, [
        ("model", lambda h: h["model"]), ("prec", lambda h: h["precision"]), ("task", lambda h: h["task"]),
        ("flowgen ms", lambda h: fmt(h["flowgen_ms"], ".4g")), ("best torch row", lambda h: h["best_torch_row"]),
        ("torch ms", lambda h: fmt(h["best_torch_ms"], ".4g")),
        ("flowgen speedup", lambda h: fmt(h["flowgen_speedup_vs_best_torch"], ".3f")),
        ("flowgen agrees", lambda h: str(h["flowgen_agrees"])),
    ])
    return table


if __name__ == "__main__":
    main()
