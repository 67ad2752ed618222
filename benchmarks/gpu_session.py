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
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from fair_common import git_commit  # noqa: E402

PYTHON = sys.executable
PHASES = ["tests", "bench", "convnets", "gpt", "autotune", "gpt_autotune"]
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
    raise SystemExit(f"unknown phase {phase!r}: choose from {', '.join(PHASES)}")


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
    return (f"{sum(totals)} errors in {len(totals)} processes" if totals else "no ERROR SUMMARY line") + \
        (f"; pytest: {tests[-1]} passed" if tests else "")


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


def run_step(argv, limit: float, log, work: str) -> tuple:
    """Run argv in its own session, its output into `log` too; (status, seconds, output)."""
    start = time.perf_counter()
    step_log = os.path.join(work, "step.log")
    with open(step_log, "w") as out:
        child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", nargs="+", choices=PHASES)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results", "session"))
    parser.add_argument("--budget", type=float, default=560.0, help="seconds per phase")
    args = parser.parse_args()
    results, logs = os.path.join(args.out, "results"), os.path.join(args.out, "logs")
    work = os.path.join("/tmp", "flowgen_gpu_session")
    for d in (results, logs, work):
        os.makedirs(d, exist_ok=True)
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
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
