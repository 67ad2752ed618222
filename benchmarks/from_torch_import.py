"""How long bringing a PyTorch model to flowgen takes: `flow.from_torch` of a 12-layer Hugging Face
GPT-2 (GPT2Config's default sizes: 12 layers, 768 wide, 12 heads, 50257-token vocabulary; random
weights, nothing downloaded), and its first nn.Graph compile.

    PYTHONPATH=. python benchmarks/from_torch_import.py [--batch 1] [--seq 64] [--layers 12]
                                                        [--note TEXT] [--out FILE]

Stages (wall and CPU seconds, in one process, after the model is built):

  torch.export            torch.export.export of the eval-mode model (PyTorch's share)
  from_torch(program)     flow.from_torch of that ExportedProgram: core-ATen decompositions, the
                          table lookup of every op, parameters shared through DLPack (flowgen's share)
  from_torch(module)      flow.from_torch of the nn.Module, export included: what a user waits for
                          (target: under 10 s on 2 cores)
  first eager call        the imported module's first call (flowgen ops run one by one)
  first graph call        an nn.Graph of the imported module: trace, passes, codegen, g++ build (an
                          empty build cache, $FLOWGEN_CACHE in a temporary directory) and one run
  second graph call       the compiled graph's run alone

Each output is checked against PyTorch's (1e-4 of the logits' scale). Writes JSON (default
benchmarks/results/from_torch_import.json) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _cpu_seconds():
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "from_torch_import.json"))
    args = parser.parse_args()

    os.environ["FLOWGEN_CACHE"] = tempfile.mkdtemp(prefix="flowgen_from_torch_bench_")
    sys.path.insert(0, ROOT)
    import numpy as np
    import torch
    import transformers

    import flowgen as flow

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    with torch.no_grad():
        expected = model(idx).logits.numpy()
    scale = float(np.abs(expected).max())
    tokens = flow.from_dlpack(idx)

    class Inference(flow.nn.Graph):
        def __init__(self, imported):
            super().__init__()
            self.model = imported

        def build(self, x):
            return self.model(x)["logits"]

    rows, state = [], {}

    def stage(name, fn, check=None):
        load_before = os.getloadavg()
        wall, cpu = time.perf_counter(), _cpu_seconds()
        result = fn()
        wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
        row = {"stage": name, "wall_s": wall, "cpu_s": cpu, "load_average_before": list(load_before)}
        if check is not None:
            got = check(result).numpy()
            row["max_abs_diff"] = float(np.abs(got - expected).max())
            assert row["max_abs_diff"] <= 1e-4 * scale, f"{name}: max |flowgen - torch| = {row['max_abs_diff']}"
        rows.append(row)
        print(f"  {name:22s} {wall:8.2f} s wall {cpu:8.2f} s CPU"
              + (f"   max |flowgen - torch| {row['max_abs_diff']:.1e}" if "max_abs_diff" in row else ""), flush=True)
        return result

    print(f"GPT-2 {args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"tokens {tuple(idx.shape)}, {os.cpu_count()} cores (torch {torch.__version__}, "
          f"transformers {transformers.__version__})")
    program = stage("torch.export", lambda: torch.export.export(model, (idx,)))
    stage("from_torch(program)", lambda: flow.from_torch(program, (idx,)))
    state["imported"] = stage("from_torch(module)", lambda: flow.from_torch(model, (idx,)))
    stage("first eager call", lambda: state["imported"](tokens), check=lambda out: out["logits"])
    graph = Inference(state["imported"])
    stage("first graph call", lambda: graph(tokens), check=lambda out: out)
    stage("second graph call", lambda: graph(tokens), check=lambda out: out)

    report = {
        "model": "transformers.GPT2LMHeadModel(GPT2Config(n_layer=%d, use_cache=False)), random weights" % args.layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": args.batch, "seq": args.seq, "layers": args.layers,
        "cores": os.cpu_count(), "machine": platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "target_from_torch_module_s": 10.0,
        "note": args.note,
        "stages": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
