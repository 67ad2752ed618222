"""The build cache's size bound (flowgen/runtime/cache_bound.py): least recently used entries
go, recently used ones stay, and a graph whose entries went compiles again with the same numbers."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.runtime import cache_bound
from graphs import InferGraph


@pytest.mark.parametrize("text, expected", [("", int(cache_bound.DEFAULT_GB * 2**30)), ("none", None), ("0", None),
                                            ("2.5", int(2.5 * 2**30))])
def test_the_bound_comes_from_the_environment(monkeypatch, text, expected):
    monkeypatch.setenv("FLOWGEN_CACHE_MAX_GB", text)
    assert cache_bound.limit_bytes() == expected


@pytest.mark.parametrize("text", ["lots", "-1", "nan"])
def test_a_bad_bound_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("FLOWGEN_CACHE_MAX_GB", text)
    with pytest.raises(ValueError, match=f"FLOWGEN_CACHE_MAX_GB='{text}': the build cache's size bound"):
        cache_bound.limit_bytes()


def _entry(root, folder, name, nbytes, age_s):
    path = root / folder / name
    path.mkdir(parents=True)
    (path / "data").write_bytes(b"x" * nbytes)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_least_recently_used_entries_go_first_and_recent_ones_stay(tmp_path):
    old = _entry(tmp_path, "cpu-libs", "old", 40_000, 5000)
    older = _entry(tmp_path, "cpu-kernels/chunks", "older", 40_000, 6000)
    used = _entry(tmp_path, "cpu-libs", "used", 40_000, 4000)
    cache_bound.used(used)                                    # a hit just now
    recent = _entry(tmp_path, "programs", "recent", 40_000, 60)
    other = tmp_path / "jinja" / "kept"                       # not an entry folder: never removed
    other.parent.mkdir()
    other.write_bytes(b"y" * 40_000)
    removed = cache_bound.shrink(tmp_path, limit=100_000, min_age_s=600)
    assert not older.exists() and not old.exists()
    assert used.exists() and recent.exists() and other.exists()
    assert removed >= 80_000
    assert cache_bound.shrink(tmp_path, limit=100_000, min_age_s=600) == 0   # within the bound now
    # above the bound but every entry used within min_age_s: nothing goes
    assert cache_bound.shrink(tmp_path, limit=10_000, min_age_s=10_000) == 0


def test_graphs_compile_within_a_small_bound_and_again_after_eviction(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLOWGEN_CACHE_MAX_GB", str(3 * 2**20 / 2**30))   # 3 MiB
    monkeypatch.setattr(cache_bound, "CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(cache_bound, "MIN_AGE_S", 0.0)

    def run(width):
        flow.manual_seed(width)
        model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3)).eval()
        x = flow.randn(4, 8)
        np.testing.assert_allclose(InferGraph(model)(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)

    for width in (16, 24, 32, 40, 48):
        run(width)
    entries = list(cache_bound._entries(tmp_path / "cache"))
    total = sum(size for _, size in entries)
    biggest = max(size for _, size in entries)
    assert total <= 3 * 2**20 + biggest, total
    run(16)   # its entries were evicted: compiled again, the same numbers
