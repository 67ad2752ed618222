"""Everything a session with a lent GPU must run, in a few device calls (benchmarks/README.md).

    FLOWGEN_COMMIT=<sha> python3 benchmarks/gpu_session.py PHASE [PHASE ...] [--out DIR] [--budget S]

Phases (each sized to fit one 10-minute device command; run them in this order):

  tests     pytest -m gpu (a JSON summary from its JUnit XML), then compute-sanitizer memcheck and
            racecheck over the same tests, then compile_time.py (NVRTC of MobileNetV2's program)
  bench     fair_gemm.py, graph.py --device cuda, mobilenet.py --device cuda, fair_convnets.py on
            mobilenet_v2 (the default rows)
  convnets  fair_convnets.py on resnet50 (the default rows)
  gpt       fair_gpt.py: GPT-2 124M bf16 training (the default rows), then batch-1 decoding
  autotune  fair_convnets.py's torch_compile_max_autotune rows for both models (if time is left)
  gpt_autotune  fair_gpt.py's torch_compile_max_autotune training row beside flowgen's (if time
                is left)
  first-contact  the first run on a GPU model nobody here has tried, in one 9-minute command
                (--budget 540): the environment; every tensor-core kernel family against the NumPy
                reference on the hardware, then training steps against eager (first_contact.py);
                the fair rows (fair_gemm bf16 4096^3 and GPT-2 shapes vs cuBLAS, GPT-2 124M bf16
                training vs eager and a CUDA graph, ResNet-50 bf16 training vs eager tuned and a
                CUDA graph); compute-sanitizer memcheck over the tensor-core kernels, then the
                kernel-family tests. DIR/results/first_contact_<gpu>.json is rewritten after
                every step (first_contact_summary). --dry-run runs the same steps on the CPU
                emulator (tiny shapes, the fair benchmarks' --smoke rows, no PyTorch CUDA rows);
                --steps picks some of them.

Every step runs in its own process session under a time limit: the smaller of its own and what
is left of the phase's budget (--budget, default 560 s per phase), so a phase ends inside the
device command's limit even when a step hangs; a step past its limit is killed and reported as
timed out. Results go to DIR/results/*.json (DIR: $OUT on the device machine, else
benchmarks/results/session), every step's output to DIR/logs/<phase>.log, and a summary to
DIR/results/session_<phase>.json; a short table of the steps is printed last. Few files per phase:
the device returns at most 8.

The device machine's copy of the tree has no git history: pass the commit as FLOWGEN_COMMIT so
every result file records it (fair_common.git_commit reads it first).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from fair_common import git_commit  # noqa: E402
from first_contact import FAMILIES, MODELS  # noqa: E402
from flowgen.runtime import cuda_driver  # noqa: E402

PYTHON = sys.executable
PHASES = ["tests", "bench", "convnets", "gpt", "autotune", "gpt_autotune", "first-contact"]
GPU_TESTS = [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider", "tests/"]


def find_sanitizer() -> str | None:
    """compute-sanitizer from PATH, the CUDA toolkit or the nvidia-cuda-sanitizer pip package."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = glob.glob("/usr/local/cuda*/bin/compute-sanitizer") + \
        glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer") + \
        glob.glob("/opt/nvidia/**/compute-sanitizer", recursive=True)
    for site in sys.path:
        candidates += glob.glob(os.path.join(site, "nvidia", "cuda_sanitizer_api", "compute-sanitizer",
                                             "compute-sanitizer"))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def steps_for(phase: str, results: str, work: str) -> list:
    """(name, argv or None, time limit s, result file or None, summarizer) per step."""
    sanitizer = find_sanitizer()

    def sanitized(tool):
        if sanitizer is None:
            return None
        return [sanitizer, "--tool", tool, "--target-processes", "all", "--print-limit", "50"] + GPU_TESTS

    r = lambda name: os.path.join(results, name)  # noqa: E731
    if phase == "tests":
        return [
            ("pytest_gpu", GPU_TESTS + ["--junitxml", os.path.join(work, "gpu_tests.xml")], 240,
             r("gpu_tests_cuda.json"), summarize_junit(os.path.join(work, "gpu_tests.xml"))),
            ("memcheck", sanitized("memcheck"), 200, None, summarize_sanitizer),
            ("racecheck", sanitized("racecheck"), 150, None, summarize_sanitizer),
            ("compile_time", [PYTHON, "benchmarks/compile_time.py", "--skip-cpu-build", "--out",
                              r("compile_time.json")], 150, r("compile_time.json"), None),
        ]
    if phase == "bench":
        return [
            ("fair_gemm", [PYTHON, "benchmarks/fair_gemm.py", "--out", r("fair_gemm_cuda.json")], 240,
             r("fair_gemm_cuda.json"), summarize_gemm),
            ("graph_cuda", [PYTHON, "benchmarks/graph.py", "--device", "cuda", "--out", r("graph_cuda.json")], 120,
             r("graph_cuda.json"), None),
            ("mobilenet_cuda", [PYTHON, "benchmarks/mobilenet.py", "--device", "cuda", "--out",
                                r("mobilenet_cuda.json")], 90, r("mobilenet_cuda.json"), None),
            ("fair_convnets_mobilenet_v2", [PYTHON, "benchmarks/fair_convnets.py", "--models", "mobilenet_v2",
                                            "--row-timeout", "60", "--out", r("fair_convnets_mobilenet_v2.json")],
             330, r("fair_convnets_mobilenet_v2.json"), summarize_convnets),
        ]
    if phase == "convnets":
        return [("fair_convnets_resnet50", [PYTHON, "benchmarks/fair_convnets.py", "--models", "resnet50",
                                            "--row-timeout", "105", "--out", r("fair_convnets_resnet50.json")],
                 560, r("fair_convnets_resnet50.json"), summarize_convnets)]
    if phase == "gpt":   # fair_gpt's --budget ends its rows inside the step's limit; its JSON keeps finished rows
        return [("fair_gpt_train", [PYTHON, "benchmarks/fair_gpt.py", "--tasks", "train", "--row-timeout", "150",
                                    "--budget", "345", "--out", r("fair_gpt_train.json")], 370,
                 r("fair_gpt_train.json"), summarize_gpt),
                ("fair_gpt_decode", [PYTHON, "benchmarks/fair_gpt.py", "--tasks", "decode", "--row-timeout", "90",
                                     "--budget", "160", "--out", r("fair_gpt_decode.json")], 180,
                 r("fair_gpt_decode.json"), summarize_gpt)]
    if phase == "gpt_autotune":
        return [("fair_gpt_max_autotune", [PYTHON, "benchmarks/fair_gpt.py", "--tasks", "train", "--rows", "flowgen",
                                           "torch_compile_max_autotune", "--row-timeout", "270", "--budget", "530",
                                           "--out", r("fair_gpt_max_autotune.json")],
                 560, r("fair_gpt_max_autotune.json"), summarize_gpt)]
    if phase == "autotune":
        return [("fair_convnets_max_autotune", [PYTHON, "benchmarks/fair_convnets.py", "--models", "mobilenet_v2",
                                                "resnet50", "--rows", "flowgen", "torch_compile_max_autotune",
                                                "--row-timeout", "250", "--out", r("fair_convnets_max_autotune.json")],
                 560, r("fair_convnets_max_autotune.json"), summarize_convnets)]
    raise SystemExit(f"unknown phase {phase!r}: choose from {', '.join(p for p in PHASES if p != 'first-contact')} "
                     f"(first-contact runs alone)")


def summarize_junit(path):
    def summarize(output: str, result_file: str | None) -> str:
        if not os.path.exists(path):
            return "no JUnit report (see the log)"
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        failures = []
        for case in suite.iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if problem is not None:
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                 "message": (problem.get("message") or "").splitlines()[0][:300] if
                                 problem.get("message") else ""})
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        with open(result_file, "w") as f:
            json.dump({"command": "python -m pytest -m gpu -q tests/", "environment": device_info(),
                       "counts": counts, "seconds": float(suite.get("time", 0)), "failures": failures}, f, indent=2)
        return (f"{counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
                f"{counts['skipped']} skipped")
    return summarize


def summarize_sanitizer(output: str, result_file: str | None) -> str:
    totals = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", output)]
    tests = re.findall(r"(\d+) passed", output)
    # a run cut off by its limit prints no summary: count the reports it printed so far
    reports = len(SANITIZER_REPORT.findall(output))
    return (f"{sum(totals)} errors in {len(totals)} processes" if totals else
            f"no ERROR SUMMARY line; {reports} reports printed") + (f"; pytest: {tests[-1]} passed" if tests else "")


# The first line of each compute-sanitizer report ("========= Invalid __global__ read of size 4 ...").
SANITIZER_REPORT = re.compile(r"^========= (?:Invalid|Program hit|Out-of-range|Misaligned|Barrier|Race|"
                              r"Uninitialized|Malformed|Error)", re.MULTILINE)


def summarize_gemm(output: str, result_file: str) -> str:
    rows = json.load(open(result_file))["rows"]
    wrong = [f"{r['shape']}/{r['precision']}" for r in rows if not r["flowgen"].get("correct")]
    ratios = sorted(r["ratio_flowgen_over_torch"] for r in rows if r["ratio_flowgen_over_torch"])
    span = f"ratio to cuBLAS {ratios[0]:.2f}..{ratios[-1]:.2f}" if ratios else "no ratios"
    return f"{len(rows) - len(wrong)}/{len(rows)} rows correct, {span}" + (f"; wrong: {wrong}" if wrong else "")


def summarize_convnets(output: str, result_file: str) -> str:
    heads = json.load(open(result_file))["headline"]
    return "; ".join(f"{h['model']} {h['precision']} {h['task']}: {h['flowgen_speedup_vs_best_torch']:.2f}x vs "
                     f"{h['best_torch_row']}" for h in heads) or "no headline (see the log)"


def summarize_gpt(output: str, result_file: str) -> str:
    heads = json.load(open(result_file))["headline"]
    return "; ".join(f"{h['task']} {h['precision']}: time {h['flowgen_time_over_best_torch']:.2f}x "
                     f"{h['best_torch_row']}'s" + (f", memory {h['flowgen_mem_over_best_torch']:.2f}x"
                                                   if "flowgen_mem_over_best_torch" in h else "")
                     for h in heads) or "no headline (see the log)"


def device_info() -> dict:
    info = {"flowgen_commit": git_commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def run_step(argv, limit: float, log, work: str, env: dict | None = None) -> tuple:
    """Run argv in its own session (with `env` added to the environment), its output into `log`
    too; (status, seconds, output)."""
    start = time.perf_counter()
    step_log = os.path.join(work, "step.log")
    with open(step_log, "w") as out:
        child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        try:
            child.wait(timeout=limit)
            status = "ok" if child.returncode == 0 else f"FAILED rc={child.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)   # the step and every process it started
            child.wait()
            status = f"TIMEOUT after {limit:.0f} s"
    with open(step_log, errors="replace") as f:
        output = f.read()
    log.write(output)
    log.flush()
    return status, time.perf_counter() - start, output


# ---------------------------------------------------------------------------------------
# first-contact: one prepared command for the first window of GPU time on a new GPU

FIRST_CONTACT_BUDGET = 540.0   # 9 minutes, inside the device's 10-minute command
# (step, limit s, cap s), in the order they run. A step gets what is left of the budget once the
# later steps' limits are set aside, at most its cap: time a step leaves unused flows to the next
# ones, and a step that hangs costs only its share. Limit 0: only what earlier steps left.
FIRST_CONTACT_STEPS = (
    [("environment", 20, 40)]
    + [(f"kernels_{family}", 25, 90) for family in FAMILIES]
    + [(f"training_{model}", 30, 90) for model in MODELS]
    + [("fair_gemm", 45, 100), ("fair_gpt", 100, 180), ("fair_convnets", 80, 220),
       ("memcheck_tensor_cores", 35, 120), ("memcheck_kernel_families", 0, 200)])
FIRST_CONTACT_STEP_NAMES = [name for name, _, _ in FIRST_CONTACT_STEPS]
FAIR_GEMM_SHAPES = ["square4096", "gpt2_mlp_fc", "gpt2_mlp_proj", "gpt2_attn_qkv"]
MEMCHECK_TESTS = ["tests/test_kernel_families.py", "tests/test_tensor_cores.py", "tests/test_wgmma.py",
                  "tests/test_wgmma_conv.py"]


def gpu_slug(name: str | None) -> str:
    """A file-name part for a GPU: "h100" for "NVIDIA H100 80GB HBM3"."""
    if not name:
        return "unknown_gpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    return (model.group(1) if model else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")).lower()


def first_contact_argv(step: str, allotted: float, dry_run: bool, work: str, results: str):
    """(argv, reason) of one first-contact step given `allotted` seconds: argv None with the reason
    when the step cannot run here."""
    script = os.path.join(HERE, "first_contact.py")
    dry = ["--dry-run"] if dry_run else []
    if step == "environment":
        return [PYTHON, script, "environment", "--out", os.path.join(work, "environment.json")], None
    if step.startswith("kernels_"):
        family = step.removeprefix("kernels_")
        return [PYTHON, script, "kernels", "--family", family, "--out", os.path.join(work, f"{step}.json")] + dry, None
    if step.startswith("training_"):
        model = step.removeprefix("training_")
        return [PYTHON, script, "training", "--model", model, "--out", os.path.join(work, f"{step}.json")] + dry, None
    if step.startswith("fair_"):
        if importlib.util.find_spec("torch") is None:
            return None, "PyTorch is not installed: the fair rows compare against it"
        out = ["--out", os.path.join(results, f"{step}_first_contact.json")]
        if step == "fair_gemm":
            return [PYTHON, "benchmarks/fair_gemm.py", "--precisions", "bf16", "--repeats", "3"] + (
                ["--smoke", "--shapes", "smoke_a", "--warmup", "1", "--iters", "2"] if dry_run else
                ["--shapes", *FAIR_GEMM_SHAPES, "--warmup", "3", "--iters", "10"]) + out, None
        rows = ["flowgen", "torch_eager"] + ([] if dry_run else ["torch_cuda_graph"])   # graphs need a GPU
        common = ["--precisions", "bf16", "--rows", *rows, "--warmup", "2", "--iters", "3", "--repeats", "3"] + (
            ["--smoke"] if dry_run else [])
        if step == "fair_gpt":   # its --budget ends the rows inside the step; its JSON keeps finished rows
            return [PYTHON, "benchmarks/fair_gpt.py", "--tasks", "train", *common,
                    "--row-timeout", f"{max(30, allotted - 20):.0f}", "--budget", f"{allotted - 10:.0f}"] + out, None
        # fair_convnets: each row (inference, then the training step) in its own process
        return [PYTHON, "benchmarks/fair_convnets.py", "--models", "mobilenet_v2" if dry_run else "resnet50",
                *common, "--row-timeout", f"{max(20, (allotted - 15) / len(rows)):.0f}"] + out, None
    sanitizer = find_sanitizer()
    if dry_run:
        return None, "dry run: no GPU for compute-sanitizer to watch"
    if sanitizer is None:
        return None, ("compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt/nvidia, pip "
                      "nvidia/cuda_sanitizer_api): nothing was sanitized")
    memcheck = [sanitizer, "--tool", "memcheck", "--target-processes", "all", "--print-limit", "50"]
    if step == "memcheck_tensor_cores":   # the kernels the steps above compiled (cached): launches only
        return memcheck + [PYTHON, script, "kernels", "--family", "all",
                           "--out", os.path.join(work, "memcheck_tensor_cores.json")], None
    return memcheck + [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                       "--junitxml", os.path.join(work, "memcheck_tests.xml"), *MEMCHECK_TESTS], None


def summarize_checks(path: str) -> str:
    with open(path) as f:
        checks = json.load(f)["checks"]
    counts = {status: sum(c["status"] == status for c in checks) for status in ("passed", "failed", "error", "skipped")}
    bad = [c["case"] for c in checks if c["status"] in ("failed", "error")]
    return ", ".join(f"{n} {status}" for status, n in counts.items() if n) + (f"; not passed: {bad[:6]}" if bad else "")


def first_contact_summarizer(step: str, work: str, results: str):
    if step == "environment":
        return lambda output, result: "see environment"
    if step.startswith(("kernels_", "training_")):
        return lambda output, result: summarize_checks(os.path.join(work, f"{step}.json"))
    if step.startswith("fair_"):
        return {"fair_gemm": summarize_gemm, "fair_gpt": summarize_gpt, "fair_convnets": summarize_convnets}[step]
    return summarize_sanitizer


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def family_verdict(checks: list, step_status: str | None) -> dict:
    """passed / failed / error / skipped over a family's checks; "not run" without any, and
    `incomplete` where its step ended before finishing (a time-out or a crash)."""
    statuses = [c["status"] for c in checks]
    if not statuses:
        verdict = "not run"
    elif "failed" in statuses:
        verdict = "failed"
    elif "error" in statuses:
        verdict = "error"
    elif all(s == "skipped" for s in statuses):
        verdict = "skipped"
    else:
        verdict = "passed"
    entry = {"verdict": verdict, "checks": len(statuses),
             "passed": statuses.count("passed"), "not_passed": [c["case"] for c in checks
                                                                 if c["status"] in ("failed", "error")]}
    if step_status is not None and step_status != "ok":
        entry["incomplete"] = step_status
    return entry


def benchmark_rows(step: str, payload: dict) -> dict:
    """The rows of a fair benchmark's JSON worth a glance (the file itself comes back beside it)."""
    if step == "fair_gemm":
        return {"rows": [{"shape": r["shape"], "precision": r["precision"],
                          "flowgen_tflops": r["flowgen"].get("tflops"), "flowgen_correct": r["flowgen"].get("correct"),
                          "cublas_tflops": r["torch"].get("tflops"), "ratio": r.get("ratio_flowgen_over_torch"),
                          "errors": {side: r[side]["error"] for side in ("flowgen", "torch") if "error" in r[side]}}
                         for r in payload.get("rows", [])]}
    keep = ("task", "precision", "row", "median_ms", "min_ms", "max_ms", "tokens_per_s", "images_per_s",
            "first_call_s", "agrees", "rel_diff_vs_torch_eager", "peak_mem_bytes", "error", "model")
    return {"headline": payload.get("headline", []),
            "rows": [{k: r[k] for k in keep if k in r} for r in payload.get("rows", [])]}


def first_contact_summary(records: list, work: str, results: str, dry_run: bool, budget: float, started: float,
                          gpu_name: str | None) -> dict:
    """issue 29's first_contact_<gpu>.json from what the steps so far left behind."""
    environment = read_json(os.path.join(work, "environment.json")) or {}
    status = {r["step"]: r["status"] for r in records}
    checks, families = [], {}
    for step in FIRST_CONTACT_STEP_NAMES:
        if not step.startswith(("kernels_", "training_")):
            continue
        payload = read_json(os.path.join(work, f"{step}.json")) or {"checks": []}
        checks += payload["checks"]
        families[step.removeprefix("kernels_")] = family_verdict(payload["checks"], status.get(step))
    statuses = [c["status"] for c in checks]
    mismatches = [dict(family=c["family"], case=c["case"], kernels=c.get("kernels"), **d)
                  for c in checks if c["status"] == "failed" for d in c.get("details", []) if not d["ok"]]
    training = {c["case"]: {k: v for k, v in c.items() if k not in ("family", "case")}
                for c in checks if c["family"].startswith("training_")}
    for c in checks:
        if c["family"].startswith("training_") and c["status"] == "failed":
            mismatches.append({"family": c["family"], "case": c["case"], "loss_rel_diffs": c["loss_rel_diffs"],
                               "update_rel_diffs": c["update_rel_diffs"], "tensor_core_kernels": c["tensor_core_kernels"]})
    benchmarks = {}
    for step in ("fair_gemm", "fair_gpt", "fair_convnets"):
        payload = read_json(os.path.join(results, f"{step}_first_contact.json"))
        if payload is not None:
            benchmarks[step] = dict(benchmark_rows(step, payload), file=f"results/{step}_first_contact.json")
    return {
        "phase": "first-contact", "dry_run": dry_run,
        "device": environment.get("gpu") or gpu_name or ("CPU emulator" if dry_run else None),
        "driver": environment.get("nvidia_smi") or environment.get("driver_api"),
        "commit": git_commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tests": {"passed": statuses.count("passed"), "failed": statuses.count("failed"),
                  "errors": statuses.count("error"), "skipped": statuses.count("skipped")},
        "families": families, "mismatches": mismatches,
        "errors": [{"family": c["family"], "case": c["case"], "error": c["error"][-1500:]}
                   for c in checks if c["status"] == "error"],
        "training": training, "benchmarks": benchmarks,
        "sanitizer": {r["step"]: {"status": r["status"], "summary": r["summary"]} for r in records
                      if r["step"].startswith("memcheck")},
        "steps": records, "budget_s": budget, "wall_s": round(time.perf_counter() - started, 1),
        "environment": dict(environment, compute_sanitizer=find_sanitizer()),
    }


def step_allotment(steps: list, i: int, left: float, budget: float) -> float:
    """Seconds for step `i` of `steps` ((name, limit, cap) each) with `left` of `budget` to go:
    what is left once the later steps' limits are set aside, at most its cap. The limits are
    scaled down when they add up to more than the budget, so a shorter budget shortens every step
    instead of skipping the first ones (a 430 s run skipped the first four: 545 s of limits)."""
    scale = min(1.0, budget / max(1.0, sum(limit for _, limit, _ in steps)))
    return min(steps[i][2], left - scale * sum(later for _, later, _ in steps[i + 1:]))


def run_first_contact(args, results: str, logs: str, work: str) -> list:
    """The first-contact phase: its steps in order, each under its allotment; the summary JSON
    rewritten after every step. Returns the steps' records."""
    gpu_name = None if args.dry_run else first_gpu_name()
    if not args.dry_run and gpu_name is None:
        if not cuda_driver.available():
            raise SystemExit("first-contact: no GPU found (nvidia-smi, the CUDA driver); --dry-run runs it on the "
                             "CPU emulator")
        gpu_name = "unknown GPU (no nvidia-smi)"   # the environment step names it
    budget = args.budget or FIRST_CONTACT_BUDGET
    steps = [step for step in FIRST_CONTACT_STEPS if not args.steps or step[0] in args.steps]
    # the dry run: the emulator's kernels at -O0 (they compile about 3x faster; same numbers)
    env = {"FLOWGEN_EMULATOR_OPT": os.environ.get("FLOWGEN_EMULATOR_OPT", "0")} if args.dry_run else {}
    summary_path = os.path.join(results, f"first_contact_{'dry_run' if args.dry_run else gpu_slug(gpu_name)}.json")
    started = time.perf_counter()
    records = []
    with open(os.path.join(logs, "first_contact.log"), "a") as log:
        log.write(f"== first-contact{' --dry-run' if args.dry_run else ''}: {json.dumps(device_info())}\n")
        for i, (name, limit, cap) in enumerate(steps):
            allotted = step_allotment(steps, i, budget - (time.perf_counter() - started), budget)
            argv, reason = first_contact_argv(name, allotted, args.dry_run, work, results)
            if argv is None:
                record = {"step": name, "status": "SKIPPED", "seconds": 0.0, "limit_s": 0, "summary": reason}
            elif allotted < 15:
                record = {"step": name, "status": "SKIPPED", "seconds": 0.0, "limit_s": round(allotted),
                          "summary": f"budget spent ({budget:.0f} s for the phase)"}
            else:
                print(f"[{time.strftime('%H:%M:%S')}] first-contact/{name}: {' '.join(argv)} (limit {allotted:.0f} s)",
                      flush=True)
                log.write(f"\n== {name}: {' '.join(argv)}\n")
                log.flush()
                # the fair rows time flowgen as a benchmark does: without the first-call tensor-core check
                # (the training steps report it); a wrong tensor-core kernel shows there as a WRONG row
                step_env = dict(env, FLOWGEN_TENSOR_CORE_CHECK="0") if name.startswith("fair_") else env
                status, seconds, output = run_step(argv, allotted, log, work, step_env)
                record = {"step": name, "status": status, "seconds": round(seconds, 1), "limit_s": round(allotted),
                          "summary": ""}
                try:
                    record["summary"] = first_contact_summarizer(name, work, results)(
                        output, os.path.join(results, f"{name}_first_contact.json"))
                except Exception as exc:   # a summary that cannot be read is reported, not fatal
                    record["summary"] = f"summary failed: {type(exc).__name__}: {exc}"
            records.append(record)
            print(f"    {record['status']}  {record['seconds']} s  {record['summary']}", flush=True)
            summary = first_contact_summary(records, work, results, args.dry_run, budget, started, gpu_name)
            with open(summary_path + ".tmp", "w") as f:
                json.dump(summary, f, indent=1, default=str)
            os.replace(summary_path + ".tmp", summary_path)
    print("\nfamilies: " + ", ".join(f"{k} {v['verdict']}" for k, v in summary["families"].items()))
    print(f"tests: {summary['tests']}; summary: {summary_path}")
    return records


def first_gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi, or None without one."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return lines[0].strip() if lines else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", nargs="+", choices=PHASES)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results", "session"))
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds per phase (default 560; first-contact {FIRST_CONTACT_BUDGET:.0f})")
    parser.add_argument("--dry-run", action="store_true",
                        help="first-contact: on the CPU emulator (tiny shapes, no PyTorch CUDA rows)")
    parser.add_argument("--steps", nargs="+", choices=FIRST_CONTACT_STEP_NAMES, metavar="STEP",
                        help=f"first-contact: only these steps, of {', '.join(FIRST_CONTACT_STEP_NAMES)}")
    args = parser.parse_args(argv)
    if (args.dry_run or args.steps) and args.phases != ["first-contact"]:
        parser.error("--dry-run and --steps belong to the first-contact phase alone")
    results, logs = os.path.join(args.out, "results"), os.path.join(args.out, "logs")
    work = os.path.join(tempfile.gettempdir(), "flowgen_gpu_session")
    for d in (results, logs, work):
        os.makedirs(d, exist_ok=True)
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if args.phases == ["first-contact"]:   # its step files in a folder of this run's own
        return run_first_contact(args, results, logs, tempfile.mkdtemp(prefix="first_contact_", dir=work))
    args.budget = args.budget or 560.0
    table = []
    for phase in args.phases:
        phase_start = time.perf_counter()
        records = []
        with open(os.path.join(logs, f"{phase}.log"), "a") as log:
            log.write(f"== phase {phase}: {json.dumps(device_info())}\n")
            for name, argv, limit, result_file, summarize in steps_for(phase, results, work):
                left = args.budget - (time.perf_counter() - phase_start)
                if argv is None:
                    record = {"step": name, "status": "SKIPPED", "seconds": 0.0,
                              "summary": "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt/nvidia, "
                                         "pip nvidia/cuda_sanitizer_api): nothing was sanitized"}
                elif left < 20:
                    record = {"step": name, "status": "SKIPPED", "seconds": 0.0,
                              "summary": f"phase budget spent ({args.budget:.0f} s)"}
                else:
                    print(f"[{time.strftime('%H:%M:%S')}] {phase}/{name}: {' '.join(argv)} "
                          f"(limit {min(limit, left):.0f} s)", flush=True)
                    log.write(f"\n== {name}: {' '.join(argv)}\n")
                    log.flush()
                    status, seconds, output = run_step(argv, min(limit, left), log, work)
                    record = {"step": name, "status": status, "seconds": round(seconds, 1), "summary": ""}
                    try:
                        if summarize is not None:
                            record["summary"] = summarize(output, result_file)
                        elif result_file is not None and not os.path.exists(result_file):
                            record["summary"] = "no result file"
                    except FileNotFoundError:
                        record["summary"] = "no result file"
                    except Exception as exc:   # a summary that cannot be read is reported, not fatal
                        record["summary"] = f"summary failed: {type(exc).__name__}: {exc}"
                    if result_file and os.path.exists(result_file):
                        record["result"] = os.path.relpath(result_file, args.out)
                records.append(record)
                print(f"    {record['status']}  {record['seconds']} s  {record['summary']}", flush=True)
        with open(os.path.join(results, f"session_{phase}.json"), "w") as f:
            json.dump({"phase": phase, "environment": device_info(), "steps": records}, f, indent=2)
        table += [dict(r, phase=phase) for r in records]
    print()
    for r in table:
        print(f"{r['phase']:<12} {r['step']:<27} {r['status']:<18} {r['seconds']:>6} s  {r['summary']}")


if __name__ == "__main__":
    main()
