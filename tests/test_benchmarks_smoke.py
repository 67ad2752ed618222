"""The fair benchmarks' --smoke modes (cpu target vs torch CPU) run end to end and write rows with
their correctness fields. No timing is asserted: only that each timed side has a median inside
its own min..max spread."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run_benchmark(script, out, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", "--out", str(out), *args],
                   check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=1200)
    with open(out) as f:
        return json.load(f)


def check_environment(env):
    for key in ("device", "date_utc", "flowgen_commit", "torch", "python"):
        assert env[key], key


def check_timing(side):
    assert side["min_ms"] <= side["median_ms"] <= side["max_ms"]
    assert len(side["repeat_medians_ms"]) >= 3


@pytest.mark.slow
def test_fair_gemm_smoke(tmp_path):
    result = run_benchmark("fair_gemm.py", tmp_path / "gemm.json", "--shapes", "smoke_a",
                           "--precisions", "fp32", "bf16")
    check_environment(result["environment"])
    rows = result["rows"]
    assert [(r["shape"], r["precision"]) for r in rows] == [("smoke_a", "fp32"), ("smoke_a", "bf16")]
    limits = {"fp32": 1e-4, "bf16": 1e-2}
    for row in rows:
        assert (row["m"], row["k"], row["n"]) == (64, 48, 80)
        for name in ("flowgen", "torch"):
            side = row[name]
            assert side["correct"], side
            for check in ("rel_err_check1", "rel_err_check2"):
                assert math.isfinite(side[check]) and side[check] <= limits[row["precision"]]
            check_timing(side)
            assert side["tflops"] > 0
        assert row["flowgen"]["rel_err_after_timing"] <= limits[row["precision"]]
        assert row["flowgen"]["compile_s"] > 0
        assert row["ratio_flowgen_over_torch"] > 0


@pytest.mark.slow
def test_fair_convnets_smoke(tmp_path):
    result = run_benchmark("fair_convnets.py", tmp_path / "convnets.json", "--models", "mobilenet_v2",
                           "--precisions", "fp32", "--rows", "flowgen", "torch_eager")
    check_environment(result["environment"])
    rows = {(r["task"], r["row"]): r for r in result["rows"]}
    assert set(rows) == {(t, r) for t in ("train", "infer") for r in ("flowgen", "torch_eager")}
    for (task, name), row in rows.items():
        assert "error" not in row, row
        check_timing(row)
        assert row["first_call_s"] > 0
        assert row["agrees"], row   # logits / first loss within the fp32 limit of torch eager's
    assert rows[("infer", "flowgen")]["rel_diff_vs_torch_eager"] < 1e-4
    assert {(h["model"], h["task"]) for h in result["headline"]} == {("mobilenet_v2", "train"),
                                                                      ("mobilenet_v2", "infer")}


@pytest.mark.slow
def test_fair_gpt_smoke(tmp_path):
    result = run_benchmark("fair_gpt.py", tmp_path / "gpt.json", "--precisions", "fp32", "bf16")
    check_environment(result["environment"])
    rows = {(r["task"], r["precision"], r["row"]): r for r in result["rows"]}
    assert set(rows) == {(t, p, r) for t in ("train", "decode") for p in ("fp32", "bf16")
                         for r in ("flowgen", "torch_eager")}
    for (task, precision, name), row in rows.items():
        assert "error" not in row, row
        check_timing(row)
        assert row["first_call_s"] > 0 and row["tokens_per_s"] > 0
        assert row["agrees"], row   # first three losses / last logits within the limit of torch eager's
    for task in ("train", "decode"):
        flowgen = rows[(task, "fp32", "flowgen")]
        assert flowgen["rel_diff_vs_torch_eager"] < 1e-4
        assert flowgen["peak_mem_bytes"] >= flowgen["arena_bytes"] > 0
    assert rows[("decode", "fp32", "flowgen")]["token"] == rows[("decode", "fp32", "torch_eager")]["token"]
    assert {(h["task"], h["precision"]) for h in result["headline"]} == {(t, p) for t in ("train", "decode")
                                                                         for p in ("fp32", "bf16")}
    for head in result["headline"]:
        low, high = head["flowgen_time_over_best_torch_range"]
        assert 0 < low <= head["flowgen_time_over_best_torch"] <= high
