"""Tokens per second of text generation: examples/generate/run.c on a flowgen --lib build (cpu
target) against PyTorch running the same GPT with a KV cache.

    PYTHONPATH=. python benchmarks/generate_tokens.py [--repeats 15] [--steps 0] [--out FILE]

The model is examples/gpt_char.py's GPT (2 layers, 4 heads, 64 wide, 37 characters) with block
size 64, built by examples/generate/build.py (`--steps` training steps; 0, the default: its random
initial weights, which cost the same per token). A repeat generates greedily from one token to
the capacity, 63 calls of the decoding step, and its rate is those calls over their time (the
host clock around the loop; loading and compiling not counted). Runners:

  flowgen run.c            run.c (a process per repeat; its own timing of the loop): the decoding
                           step of examples/generate/decode.py at capacity, native cpu kernels
  torch eager, KV cache    PyTorch eager on the same modules and weights, the way PyTorch code
                           decodes: each step appends its key and value to the caches (torch.cat)
                           and attends to the pos + 1 positions so far
  torch eager, at capacity PyTorch eager running decode.py's step itself (fixed-capacity caches,
                           a masked attention over all block_size positions): flowgen's work

Each runner on every thread this process may use (os.sched_getaffinity; torch.set_num_threads to
the same; run.c's thread pool sizes itself to its affinity) and on one thread (run.c pinned to one
core, torch.set_num_threads(1)). Repeats are interleaved runner by runner so the machine's load
falls on all alike; the table gives each runner's median and the spread (min, max) over them.
All runners must generate the same tokens (checked). Writes benchmarks/results/generate_tokens.json.
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
from decode import define_decode_step  # noqa: E402
from fair_common import environment, git_commit, print_table, write_json  # noqa: E402

BLOCK_SIZE = 64


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_c(binary: Path, build: Path, n_threads: int) -> tuple:
    """One generation by run.c: (token ids, tokens/s it measured)."""
    cores = sorted(os.sched_getaffinity(0))[:n_threads]
    proc = subprocess.run([str(binary), str(build), "-i", "0", "-n", str(BLOCK_SIZE), "-r"], capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if proc.returncode != 0:
        raise SystemExit(f"run.c failed: {proc.stderr}")
    rate = float(re.search(r"([0-9.]+) tok/s", proc.stderr).group(1))
    return [int(w) for w in proc.stdout.split()], rate


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


def torch_at_capacity(torch, gpt):
    """decode.py's step on PyTorch: the computation the flowgen library runs."""
    decode_step = define_decode_step(torch)(gpt)

    def generate_ids():
        ids, caches = [0], decode_step.empty_caches()
        start = time.perf_counter()
        for pos in range(BLOCK_SIZE - 1):
            logits, *caches = decode_step(torch.tensor([[ids[-1]]]), torch.tensor([pos]), *caches)
            ids.append(int(logits.argmax(-1)))
        return ids, (BLOCK_SIZE - 1) / (time.perf_counter() - start)
    return generate_ids


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
    with tempfile.TemporaryDirectory(prefix="flowgen-generate-bench-") as tmp:
        tmp = Path(tmp)
        manifest = generate.export(model, corpus, tmp)
        binary = tmp / "run"
        subprocess.run(generate.compile_command(manifest, tmp / "build", binary), check=True, capture_output=True,
                       text=True)
        thread_counts = sorted({threads(), 1}, reverse=True)
        runners = {}
        for n in thread_counts:
            runners["flowgen run.c", n] = lambda n=n: run_c(binary, tmp / "build", n)
            runners["torch eager, KV cache", n] = torch_growing_cache(torch, twin)
            runners["torch eager, at capacity", n] = torch_at_capacity(torch, twin)
        rates = {key: [] for key in runners}
        tokens = {}
        with torch.inference_mode():
            for repeat in range(args.repeats + 1):   # the first is a warm-up
                for (name, n), generate_ids in runners.items():
                    torch.set_num_threads(n)
                    ids, rate = generate_ids()
                    tokens.setdefault(name, ids)
                    if repeat:
                        rates[name, n].append(rate)
    if len({tuple(ids) for ids in tokens.values()}) != 1:
        raise SystemExit(f"the runners generated different tokens: {tokens}")

    rows = [{"runner": name, "threads": n, "median_tokens_per_s": statistics.median(r), "min_tokens_per_s": min(r),
             "max_tokens_per_s": max(r), "repeat_tokens_per_s": r} for (name, n), r in rates.items()]
    env = environment(torch, "cpu")
    env.update(cpu_threads=threads(), load_average_start=load_at_start, load_average_end=os.getloadavg(),
               flowgen_commit=git_commit())
    write_json(args.out, {"benchmark": "generate_tokens", "environment": env,
                          "model": {"n_layer": model.config.n_layer, "n_head": model.config.n_head,
                                    "n_embd": model.config.n_embd, "vocab_size": model.config.vocab_size,
                                    "block_size": BLOCK_SIZE, "training_steps": args.steps},
                          "calls_per_repeat": BLOCK_SIZE - 1, "repeats": args.repeats,
                          "tokens": tokens["flowgen run.c"], "rows": rows})
    print(f"\n{BLOCK_SIZE - 1} greedy steps from one token, {args.repeats} repeats; load average "
          f"{env['load_average_start']} at the start, {env['load_average_end']} at the end")
    print_table(rows, [("runner", lambda r: r["runner"]), ("threads", lambda r: str(r["threads"])),
                       ("median tok/s", lambda r: f"{r['median_tokens_per_s']:.0f}"),
                       ("min", lambda r: f"{r['min_tokens_per_s']:.0f}"),
                       ("max", lambda r: f"{r['max_tokens_per_s']:.0f}")])


if __name__ == "__main__":
    main()
