"""flowgen on the CPU against PyTorch on the CPU: training steps and inference, same thread count.

    PYTHONPATH=. python benchmarks/cpu_vs_torch.py [--cases CASE ...] [--rows ROW ...]
                                                  [--repeats 5] [--iters 5] [--profile] [--out FILE]

Cases (float32, seeded weights copied into a PyTorch twin so both sides run the same model):

  mobilenet_train   MobileNetV2-CIFAR (flowgen.models.mobilenet_v2, 10 classes, width 1.0) training
                    step on a batch of 8 32x32 images: cross entropy, backward, SGD momentum 0.9
  mobilenet_infer   the same network, eval mode, batch 1
  resnet18_train    ResNet-18 (10 classes) training step, batch 8 of 32x32, SGD momentum 0.9
  resnet18_infer    ResNet-18 eval, batch 1
  gpt_train         examples/gpt_char.py's GPT (2 layers, 64 wide, block 32) training step on a batch
                    of 4: loss, backward, clip_grad_norm_(1.0), AdamW with its decay groups
  gpt_decode        the same GPT, batch 1: the last position's logits over a 32-token context and
                    their argmax (one generated token, no KV cache on either side)
  mlp_train         Linear(64,256)-GELU-Linear(256,256)-ReLU-Linear(256,10), batch 128, cross
                    entropy, Adam

Rows: flowgen_graph (the compiled nn.Graph with the cpu target's native kernels: a whole call,
host copies of inputs and outputs included), flowgen_graph_emulator (the same graph with every
kernel the CUDA source on the emulator, FLOWGEN_CPU_KERNELS=emulator: the path before native
kernels), flowgen_eager (the same step in flowgen's eager mode), torch_eager, torch_compile
(torch.compile(model), Inductor's C++ backend; a failure is recorded in the row), and
torch_eager_1thread (torch.set_num_threads(1)). Every other row runs on the threads this process
may use (os.sched_getaffinity; torch.set_num_threads to the same): on a machine with more runnable
threads than cores, PyTorch's OpenMP regions wait at their barriers for threads the scheduler has
not run (a time slice each), which the one-thread row shows apart.

Timing: each row runs in a process of its own (so no row's idle thread pool spins inside another
row's timing), set up and warmed up there (first call = compile, then `--warmup` calls); then the
rows take turns: `--repeats` rounds, in each round every row runs `--iters` timed calls (the host
clock around each; the call returns a number read back to the host, so its work is done) while the
others wait. A row's number is the median of its round medians, its spread the min and max of
those: interleaving spreads a shared machine's load over all rows alike. Ratios (torch_eager /
row) are what to read.

`--profile` times every launch of the flowgen graph rows' step on its own (a few steps) and reports
where the time goes: per kernel, per kernel family (GEMM, conv, reduction, elementwise, ...) and
what the executor adds around the launches (Python, copies of inputs and outputs).

Prints a table last and writes JSON (default benchmarks/results/cpu_vs_torch.json) with the
date, commit, cores and load average.
"""
from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
import gpt_char  # noqa: E402  (examples/gpt_char.py)
from fair_common import environment, fmt, git_commit, log, print_table, write_json  # noqa: E402
from torch_vision_models import torch_mobilenet_v2, torch_resnet18  # noqa: E402  (tests/)

CASES = ["mobilenet_train", "mobilenet_infer", "resnet18_train", "resnet18_infer", "gpt_train", "gpt_decode",
         "mlp_train"]
ROWS = ["flowgen_graph", "flowgen_graph_emulator", "flowgen_eager", "torch_eager", "torch_eager_1thread",
        "torch_compile"]
# What a row's worker process sets before it starts: the graph rows' kernels (runtime_cpp's
# emulator for every kernel, or native GEMMs and convs where codegen/cpu/ has them).
ROW_ENV = {"flowgen_graph": {"FLOWGEN_CPU_KERNELS": "native"},
           "flowgen_graph_emulator": {"FLOWGEN_CPU_KERNELS": "emulator"}}
GPT_BATCH = 4


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---- the models, on both sides ----

def copy_weights(flow_model, torch_model):
    """Every state_dict entry of `flow_model` into the PyTorch twin of the same names."""
    source = {k: v.numpy() for k, v in flow_model.state_dict().items()}
    target = torch_model.state_dict()
    missing = [k for k in target if k not in source]
    if missing:
        raise KeyError(f"the PyTorch twin has entries flowgen's model lacks: {missing[:5]}")
    torch_model.load_state_dict({k: torch.from_numpy(np.array(source[k])).to(target[k].dtype) for k in target})
    return torch_model


class _TorchMlp(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                         torch.nn.Linear(256, 10))


def _flow_mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _gpt_config():
    return gpt_char.GPTConfig(vocab_size=gpt_char.Corpus().vocab_size)


class Spec:
    """One case: the flowgen model and its twin, the inputs, training or inference and the optimizer."""

    def __init__(self, name):
        self.name = name
        family, self.task = name.rsplit("_", 1)
        rng = np.random.default_rng(0)
        flow.manual_seed(0)
        if family in ("mobilenet", "resnet18"):
            self.flow_model = (flow.models.mobilenet_v2 if family == "mobilenet" else flow.models.resnet18)(
                num_classes=10)
            twin = torch_mobilenet_v2(num_classes=10) if family == "mobilenet" else torch_resnet18(num_classes=10)
            batch = 8 if self.task == "train" else 1
            self.inputs = [rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)]
            self.target = rng.integers(0, 10, batch).astype(np.int64)
            self.optimizer = ("sgd", dict(lr=0.01, momentum=0.9))
        elif family == "gpt":
            config = _gpt_config()
            self.flow_model = gpt_char.define(flow)(config)
            twin = gpt_char.define(torch)(config)
            batch = GPT_BATCH if self.task == "train" else 1
            self.inputs = [rng.integers(0, config.vocab_size, (batch, config.block_size)).astype(np.int64)]
            self.target = rng.integers(0, config.vocab_size, (batch, config.block_size)).astype(np.int64)
            self.optimizer = ("adamw_groups", dict(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95)))
        elif family == "mlp":
            self.flow_model = _flow_mlp()
            twin = _TorchMlp()
            self.inputs = [rng.standard_normal((128, 64)).astype(np.float32)]
            self.target = rng.integers(0, 10, 128).astype(np.int64)
            self.optimizer = ("adam", dict(lr=1e-3))
        else:
            raise ValueError(f"unknown case {name!r}")
        self.family = family
        self.twin = copy_weights(self.flow_model, twin)

    def make_optimizer(self, framework, model):
        kind, options = self.optimizer
        if kind == "adamw_groups":
            return model.configure_optimizer(**options)
        return {"sgd": framework.optim.SGD, "adam": framework.optim.Adam}[kind](model.parameters(), **options)

    def loss(self, framework, model, x, y):
        """The training loss of `model` on (x, y) in `framework` (flowgen or torch)."""
        if self.family == "gpt":
            return model(x, y)[1]
        return framework.nn.functional.cross_entropy(model(x), y)

    def infer(self, model, x):
        """What an inference call returns: the logits (the GPT: the last position's and their argmax)."""
        if self.family == "gpt":
            last = model(x)[0][:, -1, :]
            return last, last.argmax(dim=-1)
        return model(x)

    def clip(self, framework, model):
        if self.family == "gpt":
            framework.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


# ---- the rows: set up, return a step() that runs one call and returns a host number ----

def flowgen_graph_row(spec):
    model = copy.deepcopy(spec.flow_model)
    x = [flow.tensor(a) for a in spec.inputs]
    if spec.task == "train":
        model.train()
        optimizer = spec.make_optimizer(flow, model)

        class Step(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(optimizer)

            def build(self, inp, target):
                loss = spec.loss(flow, self.model, inp, target)
                loss.backward()
                spec.clip(flow, self.model)
                return loss

        graph = Step()
        y = flow.tensor(spec.target)
        call = lambda: graph(*x, y)  # noqa: E731
    else:
        model.eval()

        class Infer(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = model

            def build(self, inp):
                return spec.infer(self.model, inp)

        graph = Infer()
        call = lambda: graph(*x)  # noqa: E731
    return (lambda: _first(call()).numpy().ravel()[0]), graph


def eager_row(spec, framework, model, runner, tensor, host_number):
    """(step, None) of an eager row: one training step of `model` (loss, backward, clip, optimizer
    step) or one inference call, in `framework` (flowgen or torch), the model called through
    `runner` (itself, or torch.compile's wrapper); inputs made by `tensor` from NumPy arrays. The
    step returns a host number (the loss, or `host_number` of the first output), so its work is done."""
    x = [tensor(a) for a in spec.inputs]
    if spec.task == "train":
        model.train()
        optimizer = spec.make_optimizer(framework, model)
        y = tensor(spec.target)

        def step():
            loss = spec.loss(framework, runner, *x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            spec.clip(framework, model)
            optimizer.step()
            return loss.item()
        return step, None
    model.eval()

    def infer():
        with framework.no_grad():
            return host_number(_first(spec.infer(runner, *x)))
    return infer, None


def flowgen_eager_row(spec):
    model = copy.deepcopy(spec.flow_model)
    return eager_row(spec, flow, model, model, flow.tensor, lambda out: out.numpy().ravel()[0])


def torch_row(spec, compiled: bool):
    model = copy.deepcopy(spec.twin)
    return eager_row(spec, torch, model, torch.compile(model) if compiled else model, torch.from_numpy,
                     lambda out: float(out.reshape(-1)[0]))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


ROW_SETUP = {"flowgen_graph": flowgen_graph_row, "flowgen_graph_emulator": flowgen_graph_row,
             "flowgen_eager": flowgen_eager_row,
             "torch_eager": lambda spec: torch_row(spec, False), "torch_eager_1thread": lambda spec: torch_row(spec, False),
             "torch_compile": lambda spec: torch_row(spec, True)}


# ---- profiling the graph's step ----

def kernel_family(kernel) -> str:
    return _family(kernel) + (" (native)" if kernel.native else "")


def _family(kernel) -> str:
    ops = set(kernel.ops)
    if any(o.startswith("conv") for o in ops):
        return "conv"
    if ops & {"matmul", "bmm", "linear"}:
        return "gemm"
    if any(o in ops for o in ("sum", "mean", "max", "min", "var", "reduce_sum")) or "reduction" in kernel.name:
        return "reduction"
    if ops & {"batch_norm", "layer_norm", "softmax", "log_softmax", "cross_entropy"}:
        return "row"
    if kernel.collective is not None:
        return "collective"
    return "elementwise/other"


def profile_graph(graph, call, steps: int = 5) -> dict:
    """Each launch of the graph's step timed on its own over `steps` steps (medians), grouped per
    kernel and family; the whole call's time minus the launches is the executor's share."""
    executor = graph.compiled.executor
    kernels = graph.compiled.program.kernels
    per_launch = [[] for _ in kernels]
    calls = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        calls.append(time.perf_counter() - start)
        for k, launch in enumerate(executor.launches):
            start = time.perf_counter()
            launch()
            per_launch[k].append(time.perf_counter() - start)
    launch_ms = [statistics.median(t) * 1e3 for t in per_launch]
    families = defaultdict(float)
    for kernel, ms in zip(kernels, launch_ms):
        families[kernel_family(kernel)] += ms
    total_launch = sum(launch_ms)
    call_ms = statistics.median(calls) * 1e3
    top = sorted(zip(launch_ms, (k.name for k in kernels)), reverse=True)[:10]
    return {"call_ms": call_ms, "launches": len(kernels), "launch_sum_ms": total_launch,
            "executor_overhead_ms": call_ms - total_launch,
            "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [{"kernel": name, "ms": ms} for ms, name in top]}


def print_profile(case: str, prof: dict) -> None:
    print(f"\n{case}: graph call {prof['call_ms']:.2f} ms, {prof['launches']} launches summing to "
          f"{prof['launch_sum_ms']:.2f} ms, executor and copies {prof['executor_overhead_ms']:.2f} ms")
    for family, ms in prof["families_ms"].items():
        print(f"  {family:<18} {ms:8.2f} ms  {100 * ms / max(prof['launch_sum_ms'], 1e-9):5.1f}%")
    for entry in prof["top_kernels_ms"][:6]:
        print(f"    {entry['ms']:7.2f} ms  {entry['kernel'][:100]}")


# ---- the run: one worker process per row, the rows taking turns ----

def row_worker(case: str, row: str, conn, warmup: int, profile: bool) -> None:
    """Set up `row` of `case` in this process, then time calls on request: ("time", iters) ->
    the calls' milliseconds; ("stop", None) ends. Its own process, so no row's thread pool (two
    OpenMP runtimes, OpenBLAS, torch's intra-op pool) waits or spins inside another row's timing."""
    torch.set_num_threads(1 if row == "torch_eager_1thread" else threads())
    os.environ.update(ROW_ENV.get(row, {}))
    result = {"case": case, "row": row}
    try:
        step, graph = ROW_SETUP[row](Spec(case))
        start = time.perf_counter()
        step()
        result["first_call_s"] = time.perf_counter() - start
        for _ in range(warmup):
            step()
        if graph is not None:
            result["launches"] = graph.compiled.num_launches
            result["native_launches"] = sum(k.native for k in graph.compiled.program.kernels)
            if profile:
                result["profile"] = profile_graph(graph, step)
    except Exception as exc:   # a row that cannot run (torch.compile on this machine) is recorded
        text = str(exc).strip()
        result["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
        result["traceback"] = traceback.format_exc()
        step = None
    conn.send(result)
    while True:
        command, iters = conn.recv()
        if command == "stop":
            return
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        conn.send(times)


def run_case(name, rows, args) -> tuple[list, dict | None]:
    """Every row of case `name` in its own worker, set up one after the other; then `repeats`
    rounds in which each row runs `iters` timed calls in turn."""
    log(f"{name}: setting up {', '.join(rows)}")
    context = multiprocessing.get_context("spawn")
    workers, results, profiles = {}, {}, {}
    for row in rows:
        parent, child = context.Pipe()
        process = context.Process(target=row_worker, args=(name, row, child, args.warmup, args.profile), daemon=True)
        process.start()
        if parent.poll(args.setup_timeout):
            result = parent.recv()
        else:   # torch.compile on a loaded machine: recorded, not waited for
            process.terminate()
            result = {"case": name, "row": row, "error": f"set-up (first call and warm-up) took over "
                                                           f"{args.setup_timeout:.0f} s on this machine; not timed"}
        if "error" in result:
            log(f"{name} {row} failed: {result['error']}")
            if args.verbose and "traceback" in result:
                print(result["traceback"])
            if process.exitcode is None and "traceback" in result:   # the worker waits for a command
                parent.send(("stop", None))
            process.join()
        else:
            workers[row] = (process, parent)
        result.pop("traceback", None)
        if "profile" in result:
            profiles[row] = result.pop("profile")
        results[row] = result
    medians = defaultdict(list)
    for _ in range(args.repeats):
        for row, (_, conn) in workers.items():
            conn.send(("time", args.iters))
            medians[row].append(statistics.median(conn.recv()))
    for process, conn in workers.values():
        conn.send(("stop", None))
        process.join()
    for row, values in medians.items():
        results[row].update(median_ms=statistics.median(values), min_ms=min(values), max_ms=max(values),
                            round_medians_ms=values)
    base = results.get("torch_eager", {}).get("median_ms")
    for result in results.values():
        if base and result.get("median_ms"):
            result["speed_vs_torch_eager"] = base / result["median_ms"]
    return list(results.values()), profiles


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=CASES, choices=CASES)
    parser.add_argument("--rows", nargs="*", default=ROWS, choices=ROWS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--setup-timeout", type=float, default=600.0,
                        help="seconds a row may take to set up (first call, warm-up) before it is recorded as an error")
    parser.add_argument("--profile", action="store_true", help="per-kernel times of the flowgen graph rows")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_vs_torch.json"))
    parser.add_argument("--verbose", action="store_true", help="print a failing row's traceback")
    args = parser.parse_args(argv)
    if args.setup_timeout <= 0:
        parser.error("--setup-timeout must be positive")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the spread needs several rounds)")
    torch.set_num_threads(threads())
    env = environment(torch, "cpu")
    env.update(threads=threads(), load_average_start=os.getloadavg(), flowgen_commit=git_commit(),
               row_env=ROW_ENV)
    all_rows, profiles = [], {}
    for case in args.cases:
        rows, case_profiles = run_case(case, args.rows, args)
        all_rows += rows
        profiles.update({f"{case} {row}": p for row, p in case_profiles.items()})
        env["load_average_end"] = os.getloadavg()
        write_json(args.out, {"benchmark": "cpu_vs_torch", "environment": env, "rows": all_rows,
                              "profiles": profiles})
    for case, prof in profiles.items():
        print_profile(case, prof)
    print(f"\n{threads()} threads per side; load average {env['load_average_start']} at the start, "
          f"{env['load_average_end']} at the end")
    print_table(all_rows, [
        ("case", lambda r: r["case"]), ("row", lambda r: r["row"]),
        ("median ms", lambda r: fmt(r.get("median_ms"), ".2f")),
        ("spread ms", lambda r: f"{r['min_ms']:.2f}-{r['max_ms']:.2f}" if "min_ms" in r else "-"),
        ("vs torch eager", lambda r: fmt(r.get("speed_vs_torch_eager"), ".2f") + ("x" if "speed_vs_torch_eager" in r else "")),
        ("first call s", lambda r: fmt(r.get("first_call_s"), ".1f")),
        ("error", lambda r: r.get("error", "")[:60]),
    ])


if __name__ == "__main__":
    main()
