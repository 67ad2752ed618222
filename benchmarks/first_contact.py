"""First contact with a GPU: the checks `gpu_session.py first-contact` runs, one process per step.

    python benchmarks/first_contact.py environment --out FILE
    python benchmarks/first_contact.py kernels --family FAMILY [--family ...] --out FILE [--dry-run]
    python benchmarks/first_contact.py training --model MODEL --out FILE [--dry-run]

environment  the GPU, its driver, the CUDA driver API, NVRTC, PyTorch and the tools the session uses
kernels      every tensor-core kernel family (FAMILIES, each at two shapes with ragged edges) on the
             GPU against the op's float64 NumPy reference: small integers (every sum exact, so the
             result must be too) and random values (within the precision's rounding bound). A
             mismatch records the kernel, the largest error (and its ratio to the bound) and the
             first element over the bound with both values.
training     three SGD steps of a small model (MODELS) as a 'cuda' nn.Graph in fp32 and under bf16 AMP
             against the same steps in eager flowgen (NumPy; bf16 under flow.autocast): losses and
             parameter updates, and the runtime's first-call check of the graph's tensor-core kernels
             against SIMT ones (flowgen/runtime/tensor_core_check.py: what it found and cost).

Each writes FILE again after every check, so a step cut off by its time limit keeps what it
finished. --dry-run runs on the CPU emulator instead (FLOWGEN_EMULATE_CUDA=1, rendered for sm_90 as
an H100's programs are, tiny shapes): every code path but the CUDA launches. The kernel cases come
from first_contact_cases.py, which the tensor-core tests share.
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, HERE)

import gpt_char  # noqa: E402  (examples/gpt_char.py)

import flowgen as flow  # noqa: E402
import flowgen.nn as nn  # noqa: E402
from fair_common import git_commit  # noqa: E402
from first_contact_cases import (KINDS, U_FP32, U_OUT, AttentionCase, ConvCase, GemmCase, compare, gpu_arch,  # noqa: E402
                                 launch_kernels, small_ints, tensor_core_family)
from flowgen.models import mobilenet_v2  # noqa: E402
from flowgen.runtime import cuda_driver, nvrtc  # noqa: E402

# ---------------------------------------------------------------------------------------
# Kernel families: (name, [case]) per family; every case at two shapes, shapes with ragged edges
# (dims not multiples of the tiles). The dry run keeps the kernels and shrinks what the emulator
# would spend long on (attention's sequence lengths).

CONV_3X3 = ("3x3_s1_p1", 2, 8, 7, 7, 20, (3, 3), (1, 1), (1, 1), (1, 1), 1)
CONV_STRIDED = ("3x2_s2_p10_g2", 2, 8, 9, 8, 12, (3, 2), (2, 2), (1, 0), (1, 1), 2)
CONV_1X1 = ("1x1", 2, 24, 5, 6, 18, (1, 1), (1, 1), (0, 0), (1, 1), 1)
CONV_1X1_STRIDED = ("1x1_s2_g2", 3, 16, 8, 6, 12, (1, 1), (2, 2), (0, 0), (1, 1), 2)
# Weight gradients reducing over batch x pixels deep enough to split k on either tile width.
SPLIT_K_GEOMETRIES = [("3x3_24x24", 2, 4, 24, 24, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1),
                      ("3x3_32x30", 4, 8, 32, 30, 12, (3, 3), (1, 1), (1, 1), (1, 1), 1)]
SPLIT_K_GEOMETRIES_DRY = [SPLIT_K_GEOMETRIES[0], ("3x3_26x20", 2, 4, 26, 20, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1)]
CONV_OPS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
ATTENTION_OPS = ("attention", "attention_backward", "attention_dropout", "attention_dropout_backward")


def attention_shapes(dry_run: bool) -> list:
    """(B, H, L, S, E, Ev, causal) of the two attention shapes: head dims 64 (causal) and 128."""
    if dry_run:
        return [(1, 1, 20, 20, 64, 64, True), (1, 1, 12, 33, 128, 128, False)]
    return [(1, 2, 70, 70, 64, 64, True), (1, 2, 40, 100, 128, 128, False)]


def family_cases(family: str, dry_run: bool) -> list:
    """The cases of one family, rendered (kernel names start with fc_)."""
    if family == "mma_sync_gemm":
        shapes = [(37, 45, 70), (40, 72, 48, True, True) if dry_run else (200, 136, 264, True, True)]
        return [GemmCase(kind, *shape, prefix="fc_mma") for kind in ("bf16", "f16", "tf32") for shape in shapes]
    if family == "wgmma_gemm":   # A K-major (plain) or M-major (trans), B N-major (plain) or K-major (trans)
        shapes = [(70, 72, 40), (37, 45, 90)] if dry_run else [(250, 250, 100), (128, 192, 520)]
        return [GemmCase("bf16", *shape, a_trans, b_trans, arch="sm_90", prefix="fc_wg") for shape in shapes
                for a_trans in (False, True) for b_trans in (False, True)] + [
            GemmCase("tf32", *shape, arch="sm_90", prefix="fc_wg") for shape in shapes]
    if family == "split_k":
        return [ConvCase(kind, "conv2d_grad_weight", g, arch=arch, prefix=f"fc_split_{arch or 'mma'}")
                for g in (SPLIT_K_GEOMETRIES_DRY if dry_run else SPLIT_K_GEOMETRIES) for kind, arch in (("bf16", None), ("bf16", "sm_90"), ("tf32", "sm_90"))]
    if family == "mma_sync_conv":
        return [ConvCase("bf16", op, g, prefix="fc_mma") for g in (CONV_3X3, CONV_STRIDED) for op in CONV_OPS]
    if family == "wgmma_conv":
        return [ConvCase("bf16", op, g, arch="sm_90", prefix="fc_wg")
                for g in (CONV_3X3, CONV_STRIDED, CONV_1X1, CONV_1X1_STRIDED) for op in CONV_OPS] + [
            ConvCase("tf32", "conv2d", g, arch="sm_90", prefix="fc_wg") for g in (CONV_3X3, CONV_1X1)]
    if family == "attention":
        shapes = attention_shapes(dry_run)
        return [AttentionCase(op, flow.bfloat16, B, H, L, S, E, Ev, causal=causal,
                              dropout_p=0.1 if "dropout" in op else 0.0, prefix="fc")
                for B, H, L, S, E, Ev, causal in shapes for op in ATTENTION_OPS] + [
            AttentionCase(op, flow.float16, *shapes[0][:6], causal=shapes[0][6], prefix="fc")
            for op in ATTENTION_OPS[:2]]
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


FAMILIES = ["mma_sync_gemm", "wgmma_gemm", "split_k", "mma_sync_conv", "wgmma_conv", "attention"]


def needs_sm_90(case) -> bool:
    return any("wgmma_m64n" in k.source for k in case.kernels)


def check_gemm(case: GemmCase, launch, rng) -> list:
    a, b = case.operands(lambda shape: small_ints(rng, shape))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    details = [dict(output="c", values="integers", **compare(case.run(launch, a, b), exact, 0.0))]
    a, b = case.operands(lambda shape: rng.standard_normal(shape))
    want, magnitude = case.reference(a, b)
    # fp32 sums of K exact products (the inputs as the tensor cores read them; each addition off
    # by at most 2^-23 of the magnitude, also where the hardware truncates instead of rounding)
    details.append(dict(output="c", values="random",
                        **compare(case.run(launch, a, b), want, 2 * case.K * U_FP32 * magnitude + 1e-30)))
    return details


def check_conv(case: ConvCase, launch, rng) -> list:
    arrays = [rng.integers(-1, 2, size=shape).astype(KINDS[case.kind]) for shape in case.shapes]
    # every sum exact in fp32, then rounded once to the output type (16-bit for bf16 inputs)
    exact = case.reference(arrays)[0].astype(case.out.dtype.np_dtype).astype(np.float64)
    details = [dict(output="out", values="integers", **compare(case.run(launch, arrays), exact, 0.0))]
    arrays = [rng.standard_normal(shape).astype(KINDS[case.kind]) for shape in case.shapes]
    want, magnitude = case.reference(arrays)
    # fp32 sums of K products (each addition off by at most 2^-23 of the magnitude even where the
    # tensor cores truncate), then one rounding to a 16-bit output
    u_out = U_OUT.get(case.kind, 0.0)
    bound = (1 + u_out) * 2 * case.reduction_length * U_FP32 * magnitude + u_out * np.abs(want) + 1e-30
    details.append(dict(output="out", values="random", **compare(case.run(launch, arrays), want, bound)))
    return details


def check_attention(case: AttentionCase, launch, rng) -> list:
    arrays = case.arrays(rng)
    names = ("dq", "dk", "dv") if case.op.endswith("_backward") else ("o", "lse")
    return [dict(output=name, values="random", **compare(got, want, bound))
            for name, got, (want, bound) in zip(names, case.run(launch, arrays), case.expected(arrays))]


def check_case(case, launch, rng) -> list:
    if isinstance(case, GemmCase):
        return check_gemm(case, launch, rng)
    if isinstance(case, ConvCase):
        return check_conv(case, launch, rng)
    return check_attention(case, launch, rng)


def describe(case) -> dict:
    """The case's name (its first kernel's, less the prefix), kernels and what they compute."""
    return {"case": case.kernels[0].name.removeprefix("fc_"), "kernels": [k.name for k in case.kernels],
            "what": case.kernels[0].comment}


def error_text(exc: BaseException) -> str:
    """The exception and the end of its traceback (a compile error's log can be long)."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) < 4000 else text[:1500] + "\n...\n" + text[-2500:]


def run_kernels_step(families: list, dry_run: bool, out: str) -> dict:
    target = "emulator" if dry_run else "gpu"
    arch = None if dry_run else gpu_arch()
    if not dry_run and arch is None:
        raise SystemExit("no GPU: run with --dry-run to check on the emulator")
    record = {"step": "kernels", "target": target, "arch": arch, "dry_run": dry_run, "checks": []}
    for family in families:
        start = time.perf_counter()
        try:
            cases = family_cases(family, dry_run)
        except Exception as exc:   # a rendering failure is the family's error, the others still run
            record["checks"].append({"family": family, "case": "(rendering)", "status": "error",
                                     "error": error_text(exc)})
            write_json(out, record)
            continue
        runnable = [c for c in cases if dry_run or arch == "sm_90" or not needs_sm_90(c)]
        for case in cases:
            if case not in runnable:
                record["checks"].append(dict(describe(case), family=family, status="skipped",
                                             reason=f"warpgroup MMA needs an sm_90 GPU; this one is {arch}"))
        render_s = time.perf_counter() - start
        if not runnable:
            write_json(out, record)
            continue
        start = time.perf_counter()
        try:
            launch = launch_kernels([k for c in runnable for k in c.kernels], target)
        except Exception as exc:
            record["checks"] += [dict(describe(c), family=family, status="error", error=error_text(exc))
                                 for c in runnable]
            write_json(out, record)
            continue
        compile_s = time.perf_counter() - start
        record.setdefault("families", {})[family] = {"render_s": round(render_s, 2), "compile_s": round(compile_s, 2),
                                                     "cases": len(cases), "runnable": len(runnable)}
        rng = np.random.default_rng(29)
        for case in runnable:
            start = time.perf_counter()
            entry = dict(describe(case), family=family)
            try:
                details = check_case(case, launch, rng)
                entry.update(status="passed" if all(d["ok"] for d in details) else "failed", details=details)
            except Exception as exc:   # a failing launch (a CUDA error names the kernel) is this case's error
                entry.update(status="error", error=error_text(exc))
            entry["seconds"] = round(time.perf_counter() - start, 3)
            record["checks"].append(entry)
            write_json(out, record)
            print(f"  {family} {entry['case']}: {entry['status']}", flush=True)
    write_json(out, record)
    return record


# ---------------------------------------------------------------------------------------
# Training steps on the GPU against eager flowgen

# The small MobileNetV2: its stem, a t=1 block with a residual, expanded blocks with stride 2 and
# residual adds, depthwise convs, BatchNorm (training), ReLU6 (t, c, n, s as in the paper's table).
MOBILENET_SETTING = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]
MODELS = ["mlp", "mobilenet_v2", "gpt"]
PRECISIONS = ["fp32", "bf16"]
STEPS, LR = 3, 0.05
# Relative differences that pass: |loss_graph - loss_eager| / |loss_eager| at every step, and
# ||update_graph - update_eager|| / ||update_eager|| over all parameters after the first step. bf16
# (the graph under enable_amp, eager under flow.autocast: the same ops in bf16) differ where the
# graph keeps activations and gradients in 16 bits and BatchNorm over few samples amplifies that
# (seen on the emulator: MobileNetV2 17% of the first update at the dry run's 16 samples per
# channel, 7% at 256; the MLP 3%, the GPT 0.5%); the kernel families are checked to their rounding
# bounds by the kernels step, this is the end-to-end check. A bf16 graph must run on tensor cores.
# fp32: the GPU sums in other orders than NumPy (tests/test_graph_gpu.py's MobileNet: losses within
# 2e-4), BatchNorm amplifying it.
LOSS_LIMIT = {"fp32": 5e-4, "bf16": 1e-1}
UPDATE_LIMIT = {"fp32": 5e-3, "bf16": 3e-1}


def build_model(name: str, dry_run: bool):
    """(model, loss function, batches of (inputs, targets)) of a small model, seeded."""
    flow.manual_seed(0)
    rng = np.random.default_rng(0)
    if name == "mlp":
        batch, width = (16, 64) if dry_run else (64, 256)
        model = nn.Sequential(nn.Linear(72, width), nn.GELU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 10))
        data = [(rng.standard_normal((batch, 72)).astype(np.float32), rng.integers(0, 10, batch))
                for _ in range(STEPS)]
        return model, nn.CrossEntropyLoss(), data
    if name == "mobilenet_v2":
        batch, hw, width = (4, 16, 0.25) if dry_run else (16, 32, 0.5)
        model = mobilenet_v2(width_mult=width, num_classes=10, inverted_residual_setting=MOBILENET_SETTING,
                             dropout=0.0)
        data = [(rng.standard_normal((batch, 3, hw, hw)).astype(np.float32), rng.integers(0, 10, batch))
                for _ in range(STEPS)]
        return model, nn.CrossEntropyLoss(), data
    if name == "gpt":   # head dim 64: the tiled attention on tensor cores under bf16
        block, batch = (16, 2) if dry_run else (64, 4)
        config = gpt_char.GPTConfig(block_size=block, vocab_size=96, n_layer=2, n_head=2, n_embd=128, dropout=0.0)
        model = gpt_char.define(flow)(config)
        data = [(rng.integers(0, 96, (batch, block)), rng.integers(0, 96, (batch, block))) for _ in range(STEPS)]
        return model, None, data
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


class Step(nn.Graph):
    """One SGD step: the loss (the model's own for the GPT), backward, the update."""

    def __init__(self, model, loss_fn, optimizer):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = self.model(x, y)[1] if self.loss_fn is None else self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def eager_loss(model, loss_fn, x, y):
    return model(x, y)[1] if loss_fn is None else loss_fn(model(x), y)


def relative_update_difference(graph_params, eager_params, before) -> float:
    """||update_graph - update_eager|| / ||update_eager|| over all parameters together."""
    diff = norm = 0.0
    for g, e, b in zip(graph_params, eager_params, before):
        diff += float(np.sum(((g - b) - (e - b)).astype(np.float64) ** 2))
        norm += float(np.sum((e - b).astype(np.float64) ** 2))
    return float(np.sqrt(diff / max(norm, 1e-300))) if np.isfinite(diff) else float("inf")


def train_compare(name: str, precision: str, dry_run: bool) -> dict:
    """STEPS SGD steps of the model as a 'cuda' graph and eagerly on the same batches (bf16: the graph
    under enable_amp, eager under flow.autocast). The verdict
    reads the first step (its loss: the forward; its update: the gradients) and the later losses;
    the later updates are reported, not judged (BatchNorm over few samples amplifies bf16 rounding
    from step to step)."""
    model, loss_fn, data = build_model(name, dry_run)
    eager = copy.deepcopy(model)
    before = [p.numpy().copy() for p in model.parameters()]
    model.to("cuda")
    graph = Step(model, loss_fn, flow.optim.SGD(model.parameters(), lr=LR))
    if precision == "bf16":
        graph.config.enable_amp(True, dtype=flow.bfloat16)
    eager_opt = flow.optim.SGD(eager.parameters(), lr=LR)
    autocast = flow.autocast("cuda", dtype=flow.bfloat16, enabled=precision == "bf16")
    graph_losses, eager_losses, seconds, update_diffs = [], [], [], []
    for x, y in data:
        x, y = flow.tensor(x), flow.tensor(y)
        start = time.perf_counter()
        graph_losses.append(float(graph(x.to("cuda"), y.to("cuda"))))
        seconds.append(time.perf_counter() - start)
        eager_opt.zero_grad()
        with autocast:
            loss = eager_loss(eager, loss_fn, x, y)
        loss.backward()
        eager_opt.step()
        eager_losses.append(float(loss))
        update_diffs.append(relative_update_difference([p.numpy() for p in model.parameters()],
                                                       [p.numpy() for p in eager.parameters()], before))
    loss_diffs = [abs(g - e) / max(abs(e), 1e-30) for g, e in zip(graph_losses, eager_losses)]
    kernels = graph.compiled.program.kernels
    families = {}   # kernels on tensor cores, by their instructions (the comment names them: "bf16 wgmma")
    for k in kernels:
        for found in set(re.findall(r"\b(?:bf16|f16|tf32) (mma\.sync|wgmma)\b", k.comment)):
            families[found] = families.get(found, 0) + 1
    ok = (max(loss_diffs) <= LOSS_LIMIT[precision] and update_diffs[0] <= UPDATE_LIMIT[precision]
          and (precision != "bf16" or families))
    check = graph.compiled.executor.tensor_core_check   # the runtime's first-call check against SIMT kernels
    check = check and {"groups": check["groups"], "cached": check["cached"], "mismatches": check["mismatches"],
                       "seconds": check["seconds"], "prepare_s": check["prepare_s"]}
    return {"status": "passed" if ok else "failed", "graph_losses": graph_losses, "eager_losses": eager_losses,
            "loss_rel_diffs": loss_diffs, "loss_limit": LOSS_LIMIT[precision],
            "update_rel_diffs": update_diffs, "update_limit_first_step": UPDATE_LIMIT[precision],
            "first_call_s": round(seconds[0], 2), "step_s": [round(s, 4) for s in seconds[1:]],
            "kernels": len(kernels), "tensor_core_kernels": families, "tensor_core_check": check}


def run_training_step(name: str, dry_run: bool, out: str) -> dict:
    record = {"step": "training", "model": name, "dry_run": dry_run,
              "target": "emulator" if dry_run else "gpu", "arch": None if dry_run else gpu_arch(),
              "expected_tensor_cores": tensor_core_family("sm_90" if dry_run else gpu_arch()), "checks": []}
    for precision in PRECISIONS:
        start = time.perf_counter()
        entry = {"family": f"training_{name}", "case": f"{name}_{precision}"}
        try:
            entry.update(train_compare(name, precision, dry_run))
        except Exception as exc:
            entry.update(status="error", error=error_text(exc))
        entry["seconds"] = round(time.perf_counter() - start, 2)
        record["checks"].append(entry)
        write_json(out, record)
        print(f"  training {name} {precision}: {entry['status']}", flush=True)
    return record


# ---------------------------------------------------------------------------------------
# Environment

def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(argv: list) -> str | None:
    """The first line a command prints, or None when it cannot run."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (result.stdout or result.stderr).strip()
    return text.splitlines()[0] if text else None


def environment(out: str) -> dict:
    info = {"step": "environment", "flowgen_commit": git_commit(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "nvidia_smi": command_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                        "--format=csv,noheader"]),
            "nvrtc": ".".join(map(str, nvrtc.nvrtc_version())), "cxx": command_line(["g++", "--version"]),
            "packages": {name: package_version(name) for name in (
                "numpy", "ml_dtypes", "jinja2", "cuda-python", "cuda-bindings", "nvidia-cuda-nvrtc",
                "nvidia-cuda-nvrtc-cu12", "torch")}}
    if cuda_driver.available():
        ctx = cuda_driver.CudaContext.get()
        info.update(gpu=ctx.name, arch=ctx.arch, driver_api=".".join(map(str, ctx.driver_version())),
                    multiprocessors=ctx.multiprocessor_count)
    else:
        info.update(gpu=None, arch=None, driver_api=None)
    write_json(out, info)
    # PyTorch last: the benchmarks' baselines need its CUDA build (a missing or CPU-only torch is
    # reported, not fatal). Imported here, not at the top: it takes seconds and only this step reads it.
    try:
        import torch   # noqa: PLC0415
        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "sees_gpu": torch.cuda.is_available(),
                         "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    except ImportError as exc:
        info["torch"] = {"version": None, "error": str(exc)}
    write_json(out, info)
    return info


def write_json(path: str, payload: dict) -> None:
    """Atomically (a reader never sees half a file: the session merges these after every step)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["environment", "kernels", "training"])
    parser.add_argument("--out", required=True, help="the step's JSON")
    parser.add_argument("--family", action="append", choices=FAMILIES + ["all"], help="kernels: which families")
    parser.add_argument("--model", choices=MODELS, help="training: which model")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU emulator, tiny shapes")
    args = parser.parse_args(argv)
    if args.dry_run:   # 'cuda' graphs on the emulator, rendered for sm_90 as on an H100, checked as on a GPU
        os.environ["FLOWGEN_EMULATE_CUDA"] = "1"
        os.environ["FLOWGEN_EMULATE_CUDA_ARCH"] = "sm_90"
        os.environ.setdefault("FLOWGEN_TENSOR_CORE_CHECK", "always")
    if args.step == "environment":
        environment(args.out)
    elif args.step == "kernels":
        families = FAMILIES if not args.family or "all" in args.family else args.family
        run_kernels_step(families, args.dry_run, args.out)
    else:
        if args.model is None:
            parser.error("training needs --model")
        run_training_step(args.model, args.dry_run, args.out)


if __name__ == "__main__":
    main()
