"""`benchmarks/gpu_session.py first-contact --dry-run`: the command a first GPU window runs, on the CPU
emulator, so it cannot break before it reaches a GPU (issue 29). The fast test runs the environment,
every tensor-core kernel family and one training model; the slow one every step (the fair
benchmarks' --smoke rows too). Both check what the device returns: at most 8 files, at most two
folders down, and the summary's fields. The GPU-only parts (the fair rows' command lines, the
memcheck steps) are checked as far as a machine without a GPU can: their arguments against the
benchmarks' own parsers.
"""
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpu_session
from first_contact import FAMILIES, check_gemm
from first_contact_cases import GemmCase, compare, gpu_arch, launch_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"device", "driver", "commit", "date_utc", "tests", "families", "mismatches", "errors", "training",
                "benchmarks", "sanitizer", "steps", "environment"}


def dry_run(out, *steps) -> dict:
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_session.py"), "first-contact", "--dry-run",
               "--out", str(out)] + (["--steps", *steps] if steps else [])
    subprocess.run(command, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=1500)
    with open(out / "results" / "first_contact_dry_run.json") as f:
        return json.load(f)


def returned_files(out) -> list:
    """What the device would bring back from $OUT: every file, checked at most two folders down."""
    files = [os.path.relpath(os.path.join(d, f), out) for d, _, names in os.walk(out) for f in names]
    assert all(path.count(os.sep) <= 2 for path in files), files
    return files


def test_first_contact_dry_run_kernel_families_and_a_training_model(tmp_path):
    steps = ["environment"] + [f"kernels_{f}" for f in FAMILIES] + ["training_mlp"]
    summary = dry_run(tmp_path, *steps)
    assert SUMMARY_KEYS <= set(summary) and summary["dry_run"] is True
    assert [r["step"] for r in summary["steps"]] == steps and all(r["status"] == "ok" for r in summary["steps"])
    assert summary["tests"]["failed"] == summary["tests"]["errors"] == 0 and summary["tests"]["passed"] > 50
    for family in FAMILIES + ["training_mlp"]:
        assert summary["families"][family]["verdict"] == "passed", (family, summary["families"][family])
    assert summary["families"]["training_gpt"]["verdict"] == "not run"
    # bf16 AMP runs on tensor cores, rendered for sm_90 as on an H100
    assert summary["training"]["mlp_bf16"]["tensor_core_kernels"].get("wgmma", 0) > 0
    assert summary["environment"]["nvrtc"] and summary["environment"]["flowgen_commit"]
    assert sorted(returned_files(tmp_path)) == ["logs/first_contact.log", "results/first_contact_dry_run.json"]


@pytest.mark.slow
def test_first_contact_dry_run_every_step(tmp_path):
    pytest.importorskip("torch")
    summary = dry_run(tmp_path)
    assert [r["step"] for r in summary["steps"]] == gpu_session.FIRST_CONTACT_STEP_NAMES
    statuses = {r["step"]: r["status"] for r in summary["steps"]}
    assert statuses.pop("memcheck_tensor_cores") == statuses.pop("memcheck_kernel_families") == "SKIPPED"
    assert all(status == "ok" for status in statuses.values()), statuses
    assert all(v["verdict"] == "passed" for v in summary["families"].values()), summary["families"]
    assert set(summary["benchmarks"]) == {"fair_gemm", "fair_gpt", "fair_convnets"}
    assert summary["benchmarks"]["fair_gemm"]["rows"][0]["flowgen_correct"]
    assert len(returned_files(tmp_path)) <= 8


def test_a_wrong_tensor_core_result_is_recorded_with_its_kernel_error_and_index():
    """The kernels step's check on a GEMM whose launch comes back with one element off: the record
    names the kernel's case, the largest error and the first element over the bound."""
    case = GemmCase("bf16", 20, 24, 40, prefix="fc_fault")
    launch = launch_kernels(case.kernels, "emulator")

    def faulty(name, grid, block, smem, arrays):
        launch(name, grid, block, smem, arrays)
        arrays[-1][3, 5] += 0.5

    details = check_gemm(case, faulty, np.random.default_rng(0))
    assert [d["values"] for d in details] == ["integers", "random"]
    for d in details:
        assert not d["ok"] and d["first_bad_index"] == [3, 5] and d["bad_elements"] == 1
        assert d["max_error"] == pytest.approx(0.5, rel=1e-2) and d["got"] - d["want"] == pytest.approx(0.5, rel=1e-2)
    assert all(d["ok"] for d in check_gemm(case, launch, np.random.default_rng(0)))


def test_compare_passes_matching_infinities_and_fails_nan():
    want = np.array([1.0, -np.inf, 2.0])
    assert compare(np.array([1.0, -np.inf, 2.0]), want, 0.0)["ok"]
    result = compare(np.array([1.0, -np.inf, np.nan]), want, 1.0)
    assert not result["ok"] and result["first_bad_index"] == [2]


def test_summary_records_a_failed_family_with_its_mismatch(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    results.mkdir()
    bad = {"ok": False, "max_error": 3.0, "max_error_over_bound": 1e9, "first_bad_index": [0, 7], "got": 4.0,
           "want": 1.0, "bad_elements": 2, "elements": 10}
    checks = [{"family": "wgmma_gemm", "case": "wg_bf16_8x8x8", "kernels": ["fc_wg_bf16_8x8x8"], "status": "failed",
               "details": [dict(bad, output="c", values="integers")]},
              {"family": "wgmma_gemm", "case": "wg_bf16_9x9x9", "kernels": ["k"], "status": "passed", "details": []}]
    (work / "kernels_wgmma_gemm.json").write_text(json.dumps({"checks": checks}))
    records = [{"step": "kernels_wgmma_gemm", "status": "TIMEOUT after 30 s", "seconds": 30.0, "summary": ""}]
    summary = gpu_session.first_contact_summary(records, str(work), str(results), False, 540.0, 0.0, "NVIDIA H100")
    assert summary["tests"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 0}
    assert summary["families"]["wgmma_gemm"] == {"verdict": "failed", "checks": 2, "passed": 1,
                                                 "not_passed": ["wg_bf16_8x8x8"], "incomplete": "TIMEOUT after 30 s"}
    (mismatch,) = summary["mismatches"]
    assert mismatch["kernels"] == ["fc_wg_bf16_8x8x8"] and mismatch["first_bad_index"] == [0, 7]
    assert summary["families"]["attention"]["verdict"] == "not run"


def test_gpu_names_make_file_names():
    assert gpu_session.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_session.gpu_slug("NVIDIA H200") == "h200"
    assert gpu_session.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_session.gpu_slug(None) == "unknown_gpu"


def test_steps_share_the_budget_in_order():
    """Limits of all steps fit the 9 minutes; every step's cap is at least its limit."""
    assert sum(limit for _, limit, _ in gpu_session.FIRST_CONTACT_STEPS) <= gpu_session.FIRST_CONTACT_BUDGET
    assert all(cap >= limit for _, limit, cap in gpu_session.FIRST_CONTACT_STEPS)


@pytest.mark.skipif(gpu_arch() is not None, reason="a GPU is present")
def test_first_contact_without_a_gpu_asks_for_the_dry_run(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_session.py"), "first-contact",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert result.returncode != 0 and "--dry-run runs it on the CPU emulator" in result.stderr


def test_the_gpu_commands_parse_with_the_benchmarks_own_options(tmp_path, monkeypatch):
    """The fair rows' command lines as a GPU run builds them, each given to its script's parser
    (with --help last: argparse checks every option before it, then exits without running)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(gpu_session, "find_sanitizer", lambda: "/usr/bin/compute-sanitizer")
    for step in ("fair_gemm", "fair_gpt", "fair_convnets"):
        argv, reason = gpu_session.first_contact_argv(step, 150.0, False, str(tmp_path), str(tmp_path))
        assert reason is None and "--smoke" not in argv and argv[1] == f"benchmarks/{step}.py"
        if step != "fair_gemm":
            assert "torch_cuda_graph" in argv and ("resnet50" in argv) == (step == "fair_convnets")
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(step).main(argv[2:] + ["--help"])
        assert exit_.value.code == 0, step
    memcheck, _ = gpu_session.first_contact_argv("memcheck_tensor_cores", 60.0, False, str(tmp_path), str(tmp_path))
    assert memcheck[:3] == ["/usr/bin/compute-sanitizer", "--tool", "memcheck"] and "--dry-run" not in memcheck
    tests, _ = gpu_session.first_contact_argv("memcheck_kernel_families", 60.0, False, str(tmp_path), str(tmp_path))
    assert ["-m", "gpu"] in [tests[i:i + 2] for i in range(len(tests))]
    assert all(os.path.exists(os.path.join(ROOT, t)) for t in gpu_session.MEMCHECK_TESTS)


def test_a_shorter_budget_shortens_every_step_instead_of_skipping_the_first():
    steps = gpu_session.FIRST_CONTACT_STEPS
    total = sum(limit for _, limit, _ in steps)
    for budget in (total, 430.0):   # 430 s: the budget of the 2026-11-27 H200 run
        first = gpu_session.step_allotment(steps, 0, budget, budget)
        assert first >= min(steps[0][2], steps[0][1] * budget / total) - 1e-9, (budget, first)
        assert first >= 15, f"a {budget} s budget leaves the first step {first:.0f} s"
