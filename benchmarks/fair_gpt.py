"""GPT-2 124M training and batch-1 decoding: flowgen's nn.Graph vs PyTorch's best settings.

    python benchmarks/fair_gpt.py [--tasks train decode] [--precisions bf16 tf32 fp32] [--rows ROW ...]
                                  [--batch 8] [--decode-context 128] [--row-timeout S] [--budget S]
                                  [--out FILE]
    python benchmarks/fair_gpt.py --smoke      # no GPU: a tiny GPT, cpu target vs torch CPU

Model: examples/gpt_char.py's nanoGPT-style GPT (`define(flow)` / `define(torch)`) at GPT-2 124M's
size: 12 layers, 12 heads, 768 wide, block 1024, vocabulary 50304, bias, dropout 0, the output
layer tied to the token embedding. Same weights on both sides (the flowgen model's state_dict,
from flow.manual_seed(0), loaded into the PyTorch twin); token ids from a seeded NumPy generator.

Tasks, each row of each task in its own process (a time box per row: --row-timeout, and none
past --budget seconds from the start; a row with too little left is not started):

  train   one step on (batch, 1024) tokens: forward, cross entropy, backward,
          clip_grad_norm_(1.0), AdamW (the model's configure_optimizer: weight decay 0.1 on the
          matrices only, lr 6e-4, betas 0.9/0.95), as nanoGPT trains. tokens/s = batch*1024 / step.
  decode  batch 1: one forward over --decode-context tokens returning the last position's logits
          and its greedy (argmax) token: the latency of one generated token without a KV cache
          (the model has none, on either side).

Rows (run in this order):

  flowgen                        the compiled nn.Graph; its step (one CUDA-graph replay) is timed
                                 alone (Executor.launch_step: no host copies of inputs or outputs)
  torch_eager                    F.scaled_dot_product_attention (the model's), AdamW(fused=True)
  torch_cuda_graph               the eager step captured whole with torch.cuda.graph on static
                                 inputs and replayed (train: forward, backward, clipping and
                                 AdamW(fused, capturable); decode: the forward)
  torch_compile_reduce_overhead  torch.compile(model, mode="reduce-overhead") (CUDA graphs through
                                 Inductor)
  torch_compile                  torch.compile(model), default mode (train only)
  torch_compile_max_autotune     mode="max-autotune" (not in the default rows: compiles for minutes)

Precisions, the same on both sides (fair_convnets.torch_precision): bf16 (flowgen
enable_amp(True, flow.bfloat16); torch autocast bfloat16), tf32, fp32.

Timing as fair_convnets (fair_common.py): CUDA events around each step on the stream it runs on,
`--warmup` steps, then `--repeats` groups of `--iters` (decode: 4x): median of the group medians,
min/max as spread. `first_call_s`: wall time of the first call (flowgen: trace, passes, codegen,
NVRTC and one step; torch.compile: Dynamo + Inductor); `warmup_s`: the next calls (CUDA-graph
capture, autotuning).

Peak memory: PyTorch: torch.cuda.max_memory_allocated() over the timed steps, the peak statistics
reset after the warm-up (model, gradients, optimizer state and the CUDA-graph pool included; the
allocator's cached but unused blocks not). flowgen: the bytes its executor allocates for the
graph (`flowgen_device_bytes`): the memory plan's arena (activations, gradients, temporaries) plus
the inputs, the state (parameters, AdamW moments, hyper-parameters), the prepare kernels' outputs
and the constants, allocated once when the graph is built: a step allocates nothing, so that is
its peak. Neither side counts the CUDA context or kernel code. On a CPU only flowgen's is reported.

Agreement with the torch_eager row: train: the losses of the first three steps on the same batch
(the first from the initial weights, the next two after one and two AdamW steps), relative
difference under LOSS_AGREE_LIMIT; decode: the last position's logits, under LOGITS_AGREE_LIMIT.
A row over its limit is flagged DIFFERS and left out of the headline. Headline per task and
precision: flowgen's step time over the fastest agreeing PyTorch row's (with the spread: flowgen's
min over torch's max to flowgen's max over torch's min), the tokens/s ratio, and flowgen's memory
over that row's and over the least any PyTorch row needed.

Prints a table last and writes JSON, rewritten after every row (default benchmarks/results/fair_gpt_<device>.json; with
--smoke, a file in the temporary directory) with the device, date, flowgen commit and versions.
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import flowgen as flow  # noqa: E402
import gpt_char  # noqa: E402  (examples/gpt_char.py)
from fair_common import (add_row_arguments, environment, fmt, log, parse_row_arguments, plan_rows,  # noqa: E402
                         print_table, rel_err, write_json)
from fair_convnets import COMPILE_MODES, capture, make_timer, measure, status, torch_precision  # noqa: E402

# In the order they run: the cheap rows first, so a run cut short by its time limit still has them.
ROWS = ["flowgen", "torch_eager", "torch_cuda_graph", "torch_compile_reduce_overhead", "torch_compile",
        "torch_compile_max_autotune"]
DEFAULT_ROWS = [r for r in ROWS if r != "torch_compile_max_autotune"]
# On a CPU, torch.compile of even the tiny GPT costs tens of seconds per row (Inductor's C++ builds)
SMOKE_ROWS = ["flowgen", "torch_eager"]
TASK_ROWS = {"train": ROWS, "decode": [r for r in ROWS if r != "torch_compile"]}
TASKS = ["train", "decode"]
PRECISIONS = ["bf16", "tf32", "fp32"]
# Relative difference from the torch_eager row above which a row is flagged. Logits: two correct
# programs differ by their rounding compounded over the layers (fair_convnets' limits). Losses:
# a mean over all tokens averages the roundings, so they agree closer.
LOGITS_AGREE_LIMIT = {"fp32": 1e-3, "tf32": 3e-2, "bf16": 1e-1}
LOSS_AGREE_LIMIT = {"fp32": 1e-4, "tf32": 1e-3, "bf16": 1e-2}
LR, BETAS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0
RECORDED_LOSSES = 3
MIN_ROW_S = 15   # a row given less than this (of --budget) is not started


def gpt_config(smoke: bool):
    if smoke:
        return gpt_char.GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
    return gpt_char.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0)


def make_data(config, batch: int, context: int) -> dict:
    """Random token ids: a training batch of (batch, block) inputs and next-token targets, and a
    decoding context of (1, context)."""
    rng = np.random.default_rng(0)
    ids = lambda shape: rng.integers(0, config.vocab_size, shape).astype(np.int64)  # noqa: E731
    return {"x": ids((batch, config.block_size)), "y": ids((batch, config.block_size)), "context": ids((1, context))}


def flow_model(config):
    flow.manual_seed(0)
    return gpt_char.define(flow)(config)


# ---- flowgen ----

class TrainStep(flow.nn.Graph):
    """nanoGPT's step: loss, backward, gradient clipping, then the optimizer's update."""

    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)

    def build(self, x, y):
        _, loss = self.model(x, y)
        loss.backward()
        flow.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        return loss


class DecodeStep(flow.nn.Graph):
    """One generated token: the last position's logits and its argmax."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, idx):
        logits, _ = self.model(idx)
        last = logits[:, -1, :]
        return last, last.argmax(dim=-1)


def flowgen_device_bytes(compiled) -> int:
    """What the graph's Executor allocates (its __init__): the arena, inputs, state, prepare
    kernels' outputs and constants."""
    program = compiled.program
    graph = program.graph
    return (program.plan.arena_bytes + sum(v.nbytes for v in graph.inputs) + sum(s.value.nbytes for s in graph.state)
            + sum(v.nbytes for v in program.persistent_values) + sum(v.nbytes for v in program.constants))


def flowgen_task(task, config, data, precision, device, args) -> dict:
    model = flow_model(config).to(flow.device(device))
    if task == "train":
        graph = TrainStep(model.train(), model.configure_optimizer(WEIGHT_DECAY, LR, BETAS))
        inputs = (flow.tensor(data["x"]).to(device), flow.tensor(data["y"]).to(device))
    else:
        graph = DecodeStep(model.eval())
        inputs = (flow.tensor(data["context"]).to(device),)
    if precision == "tf32":
        graph.config.allow_tf32(True)
    elif precision == "bf16":
        graph.config.enable_amp(True, flow.bfloat16)
    start = time.perf_counter()
    out = graph(*inputs)
    first = time.perf_counter() - start
    start = time.perf_counter()
    later = [graph(*inputs) for _ in range(RECORDED_LOSSES - 1)]   # the second call is captured into a CUDA graph
    result = {"first_call_s": first, "warmup_s": time.perf_counter() - start, "launches": graph.compiled.num_launches,
              "peak_mem_bytes": flowgen_device_bytes(graph.compiled),
              "arena_bytes": graph.compiled.memory.arena_bytes}
    if task == "train":
        result["output"] = [float(loss.numpy()) for loss in [out] + later]
    else:
        result["output"] = np.asarray(out[0].numpy(), np.float64).ravel().tolist()
        result["token"] = int(out[1].numpy()[0])
    executor = graph.compiled.executor
    stream = torch.cuda.ExternalStream(int(executor.backend.stream)) if device == "cuda" else None
    result.update(measure(make_timer(device, stream), executor.launch_step, args, task))
    return result


# ---- PyTorch ----

def torch_model(config, device):
    """PyTorch's GPT with the flowgen model's weights."""
    state = flow_model(config).state_dict()
    model = gpt_char.define(torch)(config)
    model.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in state.items()})
    return model.to(device)


def torch_train_step(row, model, data, precision, device):
    """(step, body, optimizer): `body` is forward, loss, backward, clipping and AdamW; `step` adds
    clearing the gradients (outside a CUDA graph capture, which keeps its gradient buffers)."""
    cuda = device == "cuda"
    model.train()
    options = {"fused": True, "capturable": row == "torch_cuda_graph"} if cuda else {}
    optimizer = model.configure_optimizer(WEIGHT_DECAY, LR, BETAS, **options)
    runner = torch.compile(model, mode=COMPILE_MODES[row]) if row in COMPILE_MODES else model
    x, y = (torch.from_numpy(data[k]).to(device) for k in ("x", "y"))

    def body():
        with torch_precision(precision, device):
            _, loss = runner(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss

    def step():
        if row in ("torch_compile_reduce_overhead", "torch_compile_max_autotune"):
            torch.compiler.cudagraph_mark_step_begin()
        loss = body()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step, body, optimizer


def torch_decode_step(row, model, data, precision, device):
    """(step, step, None): the last position's logits and argmax, compiled together for the
    torch.compile rows."""
    model.eval()
    idx = torch.from_numpy(data["context"]).to(device)

    def decode(idx):
        logits, _ = model(idx)
        last = logits[:, -1, :]
        return last, last.argmax(dim=-1)
    runner = torch.compile(decode, mode=COMPILE_MODES[row]) if row in COMPILE_MODES else decode

    def step():
        if row in ("torch_compile_reduce_overhead", "torch_compile_max_autotune"):
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), torch_precision(precision, device):
            return runner(idx)
    return step, step, None


def torch_task(task, row, config, data, precision, device, args) -> dict:
    cuda = device == "cuda"
    model = torch_model(config, device)
    make_step = torch_train_step if task == "train" else torch_decode_step
    step, body, optimizer = make_step(row, model, data, precision, device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    out = step()
    sync()
    first = time.perf_counter() - start
    if task == "train":
        result = {"output": [out.item()] + [step().item() for _ in range(RECORDED_LOSSES - 1)]}
    else:
        result = {"output": out[0].detach().double().cpu().numpy().ravel().tolist(), "token": int(out[1][0])}
    del out   # the loss keeps its autograd graph (AccumulateGrad nodes) alive, which breaks a capture
    start = time.perf_counter()
    run = capture(step, body, optimizer) if row == "torch_cuda_graph" else step
    for _ in range(2):
        run()
    sync()
    result.update(first_call_s=first, warmup_s=time.perf_counter() - start)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result.update(measure(make_timer(device), run, args, task))
    if cuda:
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
    return result


# ---- one row in this process ----

def worker(args, config) -> None:
    device = "cpu" if args.smoke else "cuda"
    data = make_data(config, args.batch, args.decode_context)
    log(f"{args.task} {args.precision} {args.row}")
    try:
        if args.row == "flowgen":
            result = flowgen_task(args.task, config, data, args.precision, device, args)
        else:
            result = torch_task(args.task, args.row, config, data, args.precision, device, args)
    except Exception as exc:   # reported in the row; the other rows still run
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    with open(args.result, "w") as f:
        json.dump(result, f)


def run_row(task, precision, row, args, deadline: float) -> dict:
    """Run one row of one task in a child process (its own session, so a time-out kills its
    compiler workers too), for at most --row-timeout seconds and never past `deadline` (the
    perf_counter time at which --budget runs out): a caller that kills this process at its own
    limit leaves no row running on."""
    timeout = min(args.row_timeout, deadline - time.perf_counter())
    if timeout < MIN_ROW_S:
        return {"error": f"timed out: less than {MIN_ROW_S} s of --budget {args.budget:.0f} s left, not started"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--task", task, "--precision", precision,
               "--row", row, "--result", result_path, "--batch", str(args.batch), "--decode-context",
               str(args.decode_context), "--warmup", str(args.warmup), "--iters", str(args.iters),
               "--repeats", str(args.repeats)] + (["--smoke"] if args.smoke else [])
    start = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        os.unlink(result_path)
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        result = {"error": f"the row's process exited with status {child.returncode} and no result"}
    finally:
        if os.path.exists(result_path):
            os.unlink(result_path)
    result["process_wall_s"] = time.perf_counter() - start
    return result


def summarize(task, precision, results: dict, tokens_per_step: int) -> list:
    """One table row per benchmark row: agreement with torch_eager, tokens/s, flowgen's ratio."""
    reference = results.get("torch_eager", {}).get("output")
    flowgen_ms = results.get("flowgen", {}).get("median_ms")
    limit = (LOSS_AGREE_LIMIT if task == "train" else LOGITS_AGREE_LIMIT)[precision]
    out = []
    for name, result in results.items():
        r = dict(result, task=task, precision=precision, row=name)
        if "median_ms" in r:
            r["tokens_per_s"] = tokens_per_step / (r["median_ms"] * 1e-3)
            if flowgen_ms and name != "flowgen":
                r["flowgen_speedup"] = r["median_ms"] / flowgen_ms
        if reference is not None and r.get("output") is not None:
            r["rel_diff_vs_torch_eager"] = rel_err(r["output"], reference)
            r["agrees"] = bool(r["rel_diff_vs_torch_eager"] <= limit)
        out.append(r)
    return out


def headline(table: list) -> list:
    """Per task and precision: flowgen against the fastest agreeing PyTorch row."""
    heads = []
    for key in sorted({(r["task"], r["precision"]) for r in table}):
        rows = [r for r in table if (r["task"], r["precision"]) == key and "median_ms" in r]
        flowgen_row = next((r for r in rows if r["row"] == "flowgen"), None)
        torch_rows = [r for r in rows if r["row"] != "flowgen" and r.get("agrees", True)]
        if not (flowgen_row and torch_rows):
            continue
        best = min(torch_rows, key=lambda r: r["median_ms"])
        head = {"task": key[0], "precision": key[1], "flowgen_ms": flowgen_row["median_ms"],
                "flowgen_agrees": flowgen_row.get("agrees"), "best_torch_row": best["row"],
                "best_torch_ms": best["median_ms"],
                "flowgen_time_over_best_torch": flowgen_row["median_ms"] / best["median_ms"],
                "flowgen_time_over_best_torch_range": [flowgen_row["min_ms"] / best["max_ms"],
                                                       flowgen_row["max_ms"] / best["min_ms"]],
                "flowgen_tokens_per_s_over_best_torch": flowgen_row["tokens_per_s"] / best["tokens_per_s"]}
        with_mem = [r for r in torch_rows if r.get("peak_mem_bytes")]
        if flowgen_row.get("peak_mem_bytes") and best.get("peak_mem_bytes"):
            least = min(with_mem, key=lambda r: r["peak_mem_bytes"])
            head.update(flowgen_mem_over_best_torch=flowgen_row["peak_mem_bytes"] / best["peak_mem_bytes"],
                        least_mem_torch_row=least["row"],
                        flowgen_mem_over_least_torch=flowgen_row["peak_mem_bytes"] / least["peak_mem_bytes"])
        heads.append(head)
    return heads


def write_results(out, env, args, config, table) -> list:
    """The JSON file as it stands (rewritten after every row, so a run cut short keeps what it
    measured); returns the headline."""
    heads = headline(table)
    write_json(out, {"benchmark": "fair_gpt", "environment": env, "smoke": args.smoke,
                     "settings": {"config": vars(config), "batch": args.batch, "decode_context": args.decode_context,
                                  "warmup": args.warmup, "iters": args.iters, "repeats": args.repeats,
                                  "row_timeout_s": args.row_timeout, "budget_s": args.budget, "lr": LR, "betas": BETAS,
                                  "weight_decay": WEIGHT_DECAY, "clip": CLIP},
                     "rows": [{k: v for k, v in r.items() if k != "output"} for r in table], "headline": heads})
    return heads


def mib(value) -> str:
    return "-" if value is None else f"{value / 2 ** 20:.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the cpu target vs torch CPU")
    parser.add_argument("--tasks", nargs="*", default=TASKS, choices=TASKS)
    add_row_arguments(parser, PRECISIONS, ROWS, "timed training steps per repeat (decode: 4x)")
    parser.add_argument("--batch", type=int, default=None, help="training batch (default 8; --smoke 2)")
    parser.add_argument("--decode-context", type=int, default=None, help="decoding context (default 128; --smoke 16)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run: a row gets at most what is left (default: no limit)")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    args = parse_row_arguments(parser, argv)
    args.batch = args.batch or (2 if args.smoke else 8)
    args.decode_context = args.decode_context or (16 if args.smoke else 128)
    config = gpt_config(args.smoke)
    if not 0 < args.decode_context <= config.block_size:
        parser.error(f"--decode-context must be 1..{config.block_size} (the model's block size)")
    if args.worker:
        return worker(args, config)
    device, rows, out = plan_rows(parser, args, torch, "fair_gpt", SMOKE_ROWS, DEFAULT_ROWS, smoke_timeout=300.0)

    env = environment(torch, device)
    log(f"fair_gpt on {env['device']} ({device}), flowgen {env['flowgen_commit']}, torch {env['torch']}: "
        f"{args.tasks} x {args.precisions} x {rows}")
    table, heads = [], []
    deadline = time.perf_counter() + (args.budget or float("inf"))
    for task in args.tasks:
        tokens_per_step = args.batch * config.block_size if task == "train" else 1
        for precision in args.precisions:
            results = {}
            for row in (r for r in rows if r in TASK_ROWS[task]):
                results[row] = run_row(task, precision, row, args, deadline)
                heads = write_results(out, env, args, config, table + summarize(task, precision, results,
                                                                                 tokens_per_step))
            table += summarize(task, precision, results, tokens_per_step)
    print_table(table, [
        ("task", lambda r: r["task"]), ("prec", lambda r: r["precision"]), ("row", lambda r: r["row"]),
        ("status", status), ("ms", lambda r: fmt(r.get("median_ms"), ".4g")),
        ("min-max", lambda r: f"{fmt(r.get('min_ms'), '.4g')}-{fmt(r.get('max_ms'), '.4g')}"),
        ("tokens/s", lambda r: fmt(r.get("tokens_per_s"), ".4g")),
        ("peak MiB", lambda r: mib(r.get("peak_mem_bytes"))),
        ("first call s", lambda r: fmt(r.get("first_call_s"), ".3g")),
        ("diff vs eager", lambda r: fmt(r.get("rel_diff_vs_torch_eager"), ".1e")),
        ("flowgen x", lambda r: fmt(r.get("flowgen_speedup"), ".3f")),
    ])
    print()
    print_table(heads, [
        ("task", lambda h: h["task"]), ("prec", lambda h: h["precision"]),
        ("flowgen ms", lambda h: fmt(h["flowgen_ms"], ".4g")), ("best torch row", lambda h: h["best_torch_row"]),
        ("torch ms", lambda h: fmt(h["best_torch_ms"], ".4g")),
        ("flowgen/torch time", lambda h: fmt(h["flowgen_time_over_best_torch"], ".3f")),
        ("spread", lambda h: "-".join(fmt(v, ".3f") for v in h["flowgen_time_over_best_torch_range"])),
        ("flowgen/torch mem", lambda h: fmt(h.get("flowgen_mem_over_best_torch"), ".3f")),
        ("flowgen agrees", lambda h: str(h["flowgen_agrees"])),
    ])
    return table


if __name__ == "__main__":
    main()
