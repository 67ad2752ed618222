"""GEMM throughput: flowgen's generated matmul kernels vs torch.matmul (cuBLAS) on the same device.

    python benchmarks/fair_gemm.py [--shapes NAME ...] [--precisions P ...] [--iters N] [--repeats R]
                                   [--out FILE]
    python benchmarks/fair_gemm.py --smoke      # no GPU: tiny shapes, cpu target vs torch CPU

Each row is one C[M, N] = A[M, K] @ B[K, N] in one precision:

  fp32      float32 operands, float32 arithmetic (torch: set_float32_matmul_precision("highest"))
  tf32      float32 operands on tensor cores with TF32 inputs (flowgen: graph.config.allow_tf32;
            torch: set_float32_matmul_precision("high"))
  bf16/fp16 operands stored in that type, float32 accumulation (both sides take them as they are)
  amp_bf16/amp_fp16  float32 operands cast by the program (flowgen: graph.config.enable_amp(True,
            dtype); torch: autocast): the casts are part of the timed work on both sides

flowgen's side is an nn.Graph whose build() is one flow.matmul. Before anything is timed, each side
computes two fresh random products (flowgen: the graph's first call and its second, CUDA-graph
captured, call) and ||out - ref|| / ||ref|| against a float64 product of the same rounded inputs
must be under the precision's limit (fair_common.REL_ERR_LIMIT); a side over it is reported as
WRONG and not timed. After timing, flowgen's output of the last timed call is checked again.

Timing (fair_common.py): flowgen's step alone (`Executor.launch_step`: one CUDA-graph replay, no
host copies) and torch.matmul, each between CUDA events on the stream it runs on. Before each
timed call, outside the events, both sides move to the next of several input sets (together larger
than twice L2; flowgen's set is copied into its graph's input buffers) and a buffer of twice the
L2 size is overwritten, so neither side finds its operands in cache. `--warmup` untimed calls,
then `--repeats` groups of `--iters`: median of group medians, min/max as spread. TFLOP/s count
2*M*N*K; `ratio` is flowgen's TFLOP/s over torch's (> 1: flowgen faster).

Prints a table last and writes JSON (default benchmarks/results/fair_gemm_<device>.json; with
--smoke, a file in the temporary directory) with the device, date, flowgen commit and versions.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from fair_common import (CudaEventTimer, HostTimer, environment, fmt, log, passes, print_table,  # noqa: E402
                         write_json)

# (M, K, N). GPT-2 124M at batch 8 x 1024 tokens: the MLP's c_fc and c_proj, attention's c_attn.
SHAPES = {
    "square4096": (4096, 4096, 4096),
    "gpt2_mlp_fc": (8192, 768, 3072),
    "gpt2_mlp_proj": (8192, 3072, 768),
    "gpt2_attn_qkv": (8192, 768, 2304),
}
SMOKE_SHAPES = {"smoke_a": (64, 48, 80), "smoke_b": (32, 96, 40)}
PRECISIONS = ["fp32", "tf32", "bf16", "fp16", "amp_bf16", "amp_fp16"]
SMOKE_PRECISIONS = ["fp32", "tf32", "bf16", "amp_bf16"]

# precision -> (flowgen operand dtype, torch operand dtype, flowgen config call or None, autocast dtype)
MODES = {
    "fp32": (flow.float32, torch.float32, None, None),
    "tf32": (flow.float32, torch.float32, lambda c: c.allow_tf32(True), None),
    "bf16": (flow.bfloat16, torch.bfloat16, None, None),
    "fp16": (flow.float16, torch.float16, None, None),
    "amp_bf16": (flow.float32, torch.float32, lambda c: c.enable_amp(True, flow.bfloat16), torch.bfloat16),
    "amp_fp16": (flow.float32, torch.float32, lambda c: c.enable_amp(True, flow.float16), torch.float16),
}


class MatmulGraph(nn.Graph):
    def __init__(self, precision: str):
        super().__init__()
        configure = MODES[precision][2]
        if configure is not None:
            configure(self.config)

    def build(self, a, b):
        return flow.matmul(a, b)


@contextlib.contextmanager
def torch_precision(precision: str, device: str):
    """torch's float32 matmul precision and autocast for one row, restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    autocast = MODES[precision][3]
    try:
        with torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_float32_matmul_precision(before)


def random_operands(m, k, n, dtype, device, generator):
    a = torch.randn(m, k, generator=generator, device=device).to(dtype)
    b = torch.randn(k, n, generator=generator, device=device).to(dtype)
    return a, b


def reference(a, b):
    """The float64 product, on the operands' device."""
    return a.double() @ b.double()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the device (no large copies to the host); NaN when
    `out` holds a non-finite value."""
    out = out.to(ref.device, torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref).clamp_min(1e-300))


def from_host(array) -> "torch.Tensor":
    """A flowgen result (NumPy, bf16/fp16 via ml_dtypes) as a float32 torch tensor."""
    return torch.from_numpy(np.asarray(array, np.float32))


def to_flowgen(t, dtype, device):
    """The same (already rounded) values as a flowgen tensor on `device`."""
    return flow.tensor(t.float().cpu().numpy()).to(dtype).to(device)


class Side:
    """One side of a row: a callable that computes a product, and its timing hooks."""

    def __init__(self, name):
        self.name = name
        self.result = {"side": name}

    def check(self, a, b, precision, label) -> bool:
        err = rel_err(self.compute(a, b), reference(a, b))
        self.result[f"rel_err_{label}"] = err
        ok = passes(err, precision)
        self.result["correct"] = self.result.get("correct", True) and ok
        return ok


class FlowgenSide(Side):
    def __init__(self, precision, device):
        super().__init__("flowgen")
        self.precision, self.device = precision, device
        self.dtype = MODES[precision][0]
        self.graph = MatmulGraph(precision)

    def compute(self, a, b):
        start = time.perf_counter()
        out = self.graph(to_flowgen(a, self.dtype, self.device), to_flowgen(b, self.dtype, self.device))
        if "compile_s" not in self.result:   # the first call traces, compiles and runs once
            self.result["compile_s"] = time.perf_counter() - start
        return from_host(out.numpy())

    @property
    def executor(self):
        return self.graph.compiled.executor

    def timing_hooks(self, sets, flush):
        """(prepare, run): prepare copies input set i into the graph's input buffers (device to
        device, on the executor's stream) and flushes L2; run launches one step."""
        executor = self.executor
        inputs = [executor.address[v] for v in executor.program.graph.inputs]

        def prepare(i):
            for address, tensor in zip(inputs, sets[i % len(sets)]):
                executor.backend.copy(address, tensor.data_ptr(), tensor.numel() * tensor.element_size())
            flush()
        return prepare, executor.launch_step

    def last_output(self):
        executor = self.executor
        return from_host(executor.read_value(executor.program.graph.outputs[0]))


class TorchSide(Side):
    def __init__(self, precision, device):
        super().__init__("torch")
        self.precision, self.device = precision, device

    def compute(self, a, b):
        with torch_precision(self.precision, self.device):
            return torch.matmul(a, b)

    def timing_hooks(self, sets, flush):
        current = {}

        def prepare(i):
            current["ab"] = sets[i % len(sets)]
            flush()

        def run():
            with torch_precision(self.precision, self.device):
                torch.matmul(*current["ab"])
        return prepare, run


def l2_bytes() -> int:
    """The GPU's L2 size (64 MiB, more than an H100's 50, where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)


def make_timer_and_flush(device, stream=None):
    if device == "cpu":
        return HostTimer(), lambda: None
    scratch = torch.empty(max(2 * l2_bytes(), 1 << 20), dtype=torch.uint8, device="cuda")
    return CudaEventTimer(torch, stream or torch.cuda.current_stream()), scratch.zero_


def input_sets(m, k, n, dtype, device, generator, l2):
    """Enough operand pairs that together they exceed twice L2 (at least 2, at most 16)."""
    pair_bytes = (m * k + k * n) * torch.empty((), dtype=dtype).element_size()
    count = min(16, max(2, math.ceil(2 * l2 / pair_bytes)))
    return [random_operands(m, k, n, dtype, device, generator) for _ in range(count)]


def run_row(shape_name, m, k, n, precision, device, args, generator):
    tdtype = MODES[precision][1]
    row = {"shape": shape_name, "m": m, "k": k, "n": n, "precision": precision,
           "gflop": 2 * m * n * k / 1e9}
    sides = [FlowgenSide(precision, flow.device(device)), TorchSide(precision, device)]
    sets = input_sets(m, k, n, tdtype, device, generator, l2_bytes() if device == "cuda" else 0)
    for side in sides:
        row[side.name] = side.result
        try:
            ok = all([side.check(*random_operands(m, k, n, tdtype, device, generator), precision, f"check{j}")
                      for j in (1, 2)])
            if not ok:
                log(f"  {shape_name} {precision} {side.name}: WRONG ({side.result})")
                continue
            stream = None
            if device == "cuda" and isinstance(side, FlowgenSide):
                stream = torch.cuda.ExternalStream(int(side.executor.backend.stream))
            timer, flush = make_timer_and_flush(device, stream)
            prepare, run = side.timing_hooks(sets, flush)
            timing = timer.measure(run, prepare, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
            timing["tflops"] = row["gflop"] / timing["median_ms"]   # GFLOP / ms = TFLOP/s
            timing["timer"] = timer.kind
            side.result.update(timing)
            if isinstance(side, FlowgenSide):   # the replayed step computed the product too
                last = (args.repeats * args.iters - 1) % len(sets)
                err = rel_err(side.last_output(), reference(*sets[last]))
                side.result["rel_err_after_timing"] = err
                side.result["correct"] = passes(err, precision)
        except Exception as exc:   # one failing row is reported, the others still run
            side.result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            side.result["correct"] = False
            log(f"  {shape_name} {precision} {side.name}: {side.result['error']}")
            traceback.print_exc()
    f, t = row["flowgen"].get("tflops"), row["torch"].get("tflops")
    row["ratio_flowgen_over_torch"] = f / t if f and t and row["flowgen"]["correct"] else None
    return row


def status(side: dict) -> str:
    if "error" in side:
        return "ERROR"
    return "ok" if side.get("correct") else "WRONG"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the cpu target vs torch CPU")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"of {list(SHAPES)} (smoke: {list(SMOKE_SHAPES)})")
    parser.add_argument("--precisions", nargs="*", default=None, choices=PRECISIONS)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the spread needs several groups)")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on a machine without a GPU")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = args.shapes or list(shapes)
    unknown = [s for s in names if s not in shapes]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {list(shapes)}")
    precisions = args.precisions or (SMOKE_PRECISIONS if args.smoke else PRECISIONS)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.iters = args.iters or (3 if args.smoke else 20)
    out = args.out or (os.path.join(tempfile.gettempdir(), "fair_gemm_smoke.json") if args.smoke
                       else os.path.join(HERE, "results", f"fair_gemm_{device}.json"))

    env = environment(torch, device)
    log(f"fair_gemm on {env['device']} ({device}), flowgen {env['flowgen_commit']}, torch {env['torch']}")
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    rows = []
    for name in names:
        m, k, n = shapes[name]
        for precision in precisions:
            log(f"{name} [{m}x{k}] @ [{k}x{n}] {precision}")
            rows.append(run_row(name, m, k, n, precision, device, args, generator))
    write_json(out, {"benchmark": "fair_gemm", "environment": env, "smoke": args.smoke,
                     "settings": {"warmup": args.warmup, "iters": args.iters, "repeats": args.repeats},
                     "rows": rows})
    print_table(rows, [
        ("shape", lambda r: r["shape"]), ("MxKxN", lambda r: f"{r['m']}x{r['k']}x{r['n']}"),
        ("prec", lambda r: r["precision"]),
        ("flowgen", lambda r: status(r["flowgen"])), ("err", lambda r: fmt(r["flowgen"].get("rel_err_check1"), ".1e")),
        ("ms", lambda r: fmt(r["flowgen"].get("median_ms"), ".4g")),
        ("min-max", lambda r: f"{fmt(r['flowgen'].get('min_ms'), '.4g')}-{fmt(r['flowgen'].get('max_ms'), '.4g')}"),
        ("TFLOP/s", lambda r: fmt(r["flowgen"].get("tflops"), ".4g")),
        ("torch", lambda r: status(r["torch"])), ("t.err", lambda r: fmt(r["torch"].get("rel_err_check1"), ".1e")),
        ("t.ms", lambda r: fmt(r["torch"].get("median_ms"), ".4g")),
        ("t.TFLOP/s", lambda r: fmt(r["torch"].get("tflops"), ".4g")),
        ("ratio", lambda r: fmt(r["ratio_flowgen_over_torch"], ".3f")),
    ])
    return rows


if __name__ == "__main__":
    main()
