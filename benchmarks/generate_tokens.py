"""Tokens per second of text generation: examples/generate/run.c on flowgen --lib builds (cpu
target) against PyTorch running the same GPT with a KV cache, and of prompt processing.

    PYTHONPATH=. python benchmarks/generate_tokens.py [--repeats 15] [--steps 0] [--out FILE]

The model is examples/gpt_char.py's GPT (2 layers, 4 heads, 64 wide, 37 characters) with block
size 64, built by examples/generate/build.py (`--steps` training steps; 0, the default: its random
initial weights, which cost the same per token) as two libraries with a dynamic dimension each:
the prefill (a prompt of 1 to 64 tokens in one call) and the decoding step (caches of 1 to 63
positions, growing by one a call; each call's work follows the length).

generate (tokens generated per second): a repeat generates greedily from one token to the
capacity, 63 tokens, and its rate is those tokens over the time of the calls that gave them (the
host clock around the loop; loading and compiling not counted). Runners:

  flowgen run.c            run.c (a process per repeat; its own timing of the loop): the prefill
                           of the one-token prompt, then 62 calls of the decoding step, native cpu
                           kernels; the first call of a process includes making its workspace
  torch eager, KV cache    PyTorch eager on the same modules and weights, the way PyTorch code
                           decodes: each step appends its key and value to the caches (torch.cat)
                           and attends to the pos + 1 positions so far, from empty caches

(Until the step had a dynamic dimension, flowgen's step ran at the caches' full capacity, masked,
and a row "torch eager, at capacity" ran that same step on PyTorch; the step now grows its
caches as PyTorch's does, so that row is gone.)

prompt (prompt tokens per second): a 63-token prompt through the prefill, one call giving the
next token's logits and every layer's caches; a repeat's rate is 63 over the median time of 10
calls after one warm-up call (the process and the library warm, as the torch runner is):

  flowgen prefill          the prefill library called through flow.load_compiled (ctypes; its
                           per-call marshalling included) in a process of its own, pinned as run.c
  torch eager, prefill     examples/generate/prefill.py's module on PyTorch: the same one-pass
                           causal forward over the prompt

Each runner on every thread this process may use (os.sched_getaffinity; torch.set_num_threads to
the same; a flowgen library's thread pool sizes itself to its process's affinity) and on one
thread (the flowgen process pinned to one core, torch.set_num_threads(1)). Repeats are
interleaved runner by runner so the machine's load falls on all alike; the table gives each
runner's median and the spread (min, max) over them. The generate runners must generate the same
tokens, and the prompt runners pick the same next token (checked). Writes
benchmarks/results/generate_tokens.json.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "generate"))

import build as generate  # noqa: E402  examples/generate/build.py
import gpt_char  # noqa: E402
from prefill import define_prefill  # noqa: E402
from fair_common import environment, git_commit, print_table, write_json  # noqa: E402

BLOCK_SIZE = 64
PROMPT = BLOCK_SIZE - 1   # the prompt phase's prompt length
PROMPT_CALLS = 10         # timed prefill calls per repeat (their median), after one warm-up call

# The prompt runner's process: the prefill library through flow.load_compiled, warm; prints the
# median seconds of PROMPT_CALLS calls and the next token it picks.
PREFILL_TIMER = """
import sys, time, numpy as np, flowgen as flow
build, ids, calls = sys.argv[1], np.array([[int(i) for i in sys.argv[2].split(",")]], np.int64), int(sys.argv[3])
with flow.load_compiled(build) as prefill:
    logits = prefill(ids)[0]
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        prefill(ids)
        times.append(time.perf_counter() - start)
print(sorted(times)[calls // 2], int(logits.argmax()))
"""


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pinned(n_threads: int):
    cores = sorted(os.sched_getaffinity(0))[:n_threads]
    return lambda: os.sched_setaffinity(0, cores)


def run_c(binary: Path, build: Path, n_threads: int) -> tuple:
    """One generation by run.c: (token ids, tokens/s it measured)."""
    proc = subprocess.run([str(binary), str(build), "-i", "0", "-n", str(BLOCK_SIZE), "-r"], capture_output=True,
                          text=True, timeout=120, preexec_fn=_pinned(n_threads))
    if proc.returncode != 0:
        raise SystemExit(f"run.c failed: {proc.stderr}")
    rate = float(re.search(r"tokens? generated in [0-9.]+ s: ([0-9.]+) tok/s", proc.stderr).group(1))
    return [int(w) for w in proc.stdout.split()], rate


def flowgen_prefill(build: Path, prompt: list, n_threads: int) -> tuple:
    """The prefill library on `prompt` in a process pinned to `n_threads` cores: (the next token,
    prompt tokens/s)."""
    proc = subprocess.run([sys.executable, "-c", PREFILL_TIMER, str(build), ",".join(map(str, prompt)),
                           str(PROMPT_CALLS)], capture_output=True, text=True, timeout=300,
                          preexec_fn=_pinned(n_threads), env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"the prefill timer failed: {proc.stderr}")
    seconds, token = proc.stdout.split()
    return int(token), len(prompt) / float(seconds)


def torch_growing_cache(torch, gpt):
    """PyTorch's usual decoding: caches that grow by one position a step (torch.cat)."""
    F = torch.nn.functional
    config = gpt.config
    head_dim = config.n_embd // config.n_head

    def step(token, pos, caches):
        transformer = gpt.transformer
        x = transformer.wte(token) + transformer.wpe(pos)
        grown = []
        for block, (k_past, v_past) in zip(transformer.h, caches):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(config.n_embd, dim=2)
            q, k, v = (t.view(1, 1, config.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
            if k_past is not None:
                k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
            y = F.scaled_dot_product_attention(q, k, v)   # every position so far is visible
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, 1, config.n_embd))
            x = x + block.mlp(block.ln_2(x))
            grown.append((k, v))
        return gpt.lm_head(transformer.ln_f(x))[:, -1], grown

    def generate_ids():
        ids, caches = [0], [(None, None)] * config.n_layer
        start = time.perf_counter()
        for pos in range(BLOCK_SIZE - 1):
            logits, caches = step(torch.tensor([[ids[-1]]]), torch.tensor([pos]), caches)
            ids.append(int(logits.argmax(-1)))
        return ids, (BLOCK_SIZE - 1) / (time.perf_counter() - start)
    return generate_ids


def torch_prefill(torch, gpt, prompt: list):
    """prefill.py's module on PyTorch: the prompt in one causal forward; (the next token, prompt
    tokens/s) as flowgen_prefill measures them."""
    prefill = define_prefill(torch)(gpt)
    tokens = torch.tensor([prompt])

    def run():
        logits = prefill(tokens)[0]
        times = []
        for _ in range(PROMPT_CALLS):
            start = time.perf_counter()
            prefill(tokens)
            times.append(time.perf_counter() - start)
        return int(logits.argmax()), len(prompt) / sorted(times)[PROMPT_CALLS // 2]
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0, help="training steps before the build (0: random weights)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generate_tokens.json"))
    args = parser.parse_args(argv)

    load_at_start = os.getloadavg()
    model, corpus = generate.make_model(args.steps, seed=0, block_size=BLOCK_SIZE)
    twin = gpt_char.define(torch)(model.config).eval()
    twin.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in model.state_dict().items()})
    prompt = corpus.ids[:PROMPT].tolist()
    with tempfile.TemporaryDirectory(prefix="flowgen-generate-bench-") as tmp:
        tmp = Path(tmp)
        generate.export(model, corpus, tmp)
        binary = tmp / "run"
        subprocess.run(generate.compile_command(tmp, binary), check=True, capture_output=True, text=True)
        thread_counts = sorted({threads(), 1}, reverse=True)
        runners = {}   # (phase, runner, threads) -> a repeat: (tokens or the next token, tokens/s)
        for n in thread_counts:
            runners["generate", "flowgen run.c", n] = lambda n=n: run_c(binary, tmp, n)
            runners["generate", "torch eager, KV cache", n] = torch_growing_cache(torch, twin)
            runners["prompt", "flowgen prefill", n] = lambda n=n: flowgen_prefill(tmp / "prefill", prompt, n)
            runners["prompt", "torch eager, prefill", n] = torch_prefill(torch, twin, prompt)
        rates = {key: [] for key in runners}
        results = {}
        with torch.inference_mode():
            for repeat in range(args.repeats + 1):   # the first is a warm-up
                for (phase, name, n), run in runners.items():
                    torch.set_num_threads(n)
                    result, rate = run()
                    results.setdefault((phase, name), result)
                    if repeat:
                        rates[phase, name, n].append(rate)
    for phase in ("generate", "prompt"):
        if len({str(result) for (p, _), result in results.items() if p == phase}) != 1:
            raise SystemExit(f"the {phase} runners disagree: {results}")

    rows = [{"phase": phase, "runner": name, "threads": n, "median_tokens_per_s": statistics.median(r),
             "min_tokens_per_s": min(r), "max_tokens_per_s": max(r), "repeat_tokens_per_s": r}
            for (phase, name, n), r in rates.items()]
    rows.sort(key=lambda row: row["phase"])   # generate, then prompt
    env = environment(torch, "cpu")
    env.update(cpu_threads=threads(), load_average_start=load_at_start, load_average_end=os.getloadavg(),
               flowgen_commit=git_commit())
    write_json(args.out, {"benchmark": "generate_tokens", "environment": env,
                          "model": {"n_layer": model.config.n_layer, "n_head": model.config.n_head,
                                    "n_embd": model.config.n_embd, "vocab_size": model.config.vocab_size,
                                    "block_size": BLOCK_SIZE, "training_steps": args.steps},
                          "calls_per_repeat": BLOCK_SIZE - 1, "prompt_tokens": PROMPT,
                          "prompt_calls_per_repeat": PROMPT_CALLS, "repeats": args.repeats,
                          "tokens": results["generate", "flowgen run.c"], "rows": rows})
    print(f"\ngenerate: {BLOCK_SIZE - 1} greedy tokens from one token; prompt: {PROMPT} tokens in one call (the "
          f"median of {PROMPT_CALLS}); {args.repeats} repeats; load average {env['load_average_start']} at the "
          f"start, {env['load_average_end']} at the end")
    print_table(rows, [("phase", lambda r: r["phase"]), ("runner", lambda r: r["runner"]),
                       ("threads", lambda r: str(r["threads"])),
                       ("median tok/s", lambda r: f"{r['median_tokens_per_s']:.0f}"),
                       ("min", lambda r: f"{r['min_tokens_per_s']:.0f}"),
                       ("max", lambda r: f"{r['max_tokens_per_s']:.0f}")])


if __name__ == "__main__":
    main()
