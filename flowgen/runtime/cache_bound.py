"""A size bound on flowgen's build cache (toolchain.cache_dir): least recently used entries go first.

Without one the cache only grows: compiling ~20,000 distinct graphs (a program fuzzer; a
hyper-parameter search, a CI farm or a server building models do the same) filled 65 GB. An
entry is what one build writes as a unit, an immediate child of one of ENTRY_FOLDERS: a g++ chunk
with its object, a linked library, a program pickle, a precompiled header, an index record. A
read that reuses an entry marks it (`used`: its modification time becomes its last use);
`wrote`, called after a build added to the cache, checks the total at most once per
CHECK_INTERVAL_S in a process and, above the bound (`$FLOWGEN_CACHE_MAX_GB`, default
DEFAULT_GB; 0 or "none": unbounded), removes the least recently used entries until the cache is
at KEEP_FRACTION of it. An entry used in the last MIN_AGE_S stays whatever the total: another
process may be reading it (a link in progress). Every lookup checks that an entry's files are
there, so a removed one is built again.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from flowgen.runtime.toolchain import cache_dir

DEFAULT_GB = 5.0
KEEP_FRACTION = 0.8
CHECK_INTERVAL_S = 30.0
MIN_AGE_S = 600.0
ENVIRONMENT = "FLOWGEN_CACHE_MAX_GB"
# Folders of the cache whose immediate children are entries (cache_dir()-relative).
ENTRY_FOLDERS = ("cpu-kernels/chunks", "cpu-kernels/kernels", "cpu-kernels/sources", "cpu-libs", "cpu-pch", "cpu",
                 "programs", "host", "library", "nvrtc-kernels/chunks", "nvrtc-kernels/kernels",
                 "nvrtc-kernels/sources", "nvrtc", "tensor-core-check")

_last_check = [0.0]
_lock = threading.Lock()


def limit_bytes() -> int | None:
    """The bound in bytes from $FLOWGEN_CACHE_MAX_GB, None when unbounded."""
    text = os.environ.get(ENVIRONMENT, "").strip()
    if not text:
        return int(DEFAULT_GB * 2**30)
    if text.lower() == "none":
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise ValueError(f"{ENVIRONMENT}={text!r}: the build cache's size bound must be a number of gigabytes "
                         f"(0 or 'none' for no bound)")
    return None if gb == 0 else int(gb * 2**30)


def used(path) -> None:
    """Mark the entry holding `path` (a file or folder in the cache) as used now."""
    try:
        os.utime(path)
    except OSError:   # gone meanwhile: the caller finds out on reading it
        pass


def wrote() -> None:
    """After a build added to the cache: keep it within the bound (see the module doc)."""
    limit = limit_bytes()
    now = time.monotonic()
    if limit is None or now - _last_check[0] < CHECK_INTERVAL_S or not _lock.acquire(blocking=False):
        return
    try:
        _last_check[0] = now
        shrink(cache_dir(), limit, MIN_AGE_S)
    finally:
        _lock.release()


def shrink(root: Path, limit: int, min_age_s: float) -> int:
    """Remove the least recently used entries under `root` until it holds at most
    KEEP_FRACTION * `limit` bytes, if it holds more than `limit`; entries used within
    `min_age_s` stay. Returns the bytes removed."""
    entries = [(_last_use(path), size, path) for path, size in _entries(root)]
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return 0
    removed, newest = 0, time.time() - min_age_s
    for last_use, size, path in sorted(entries, key=lambda e: e[0]):
        if total - removed <= KEEP_FRACTION * limit or last_use > newest:
            break
        _remove(path)
        removed += size
    return removed


def _entries(root: Path):
    for folder in ENTRY_FOLDERS:
        try:
            children = list(os.scandir(root / folder))
        except OSError:
            continue
        for child in children:
            if child.name.startswith("."):   # a temporary file being written, or an entry being removed
                continue
            yield Path(child.path), _size(child)


def _size(entry) -> int:
    """Bytes on disk of a directory entry (a folder: everything in it)."""
    try:
        if not entry.is_dir(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_blocks * 512
        return sum(_size(child) for child in os.scandir(entry.path))
    except OSError:
        return 0


def _last_use(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove(path: Path) -> None:
    """Remove an entry: renamed aside first (readers see it whole or not at all), then deleted."""
    aside = path.with_name(f".evicted-{os.getpid()}-{path.name}")
    try:
        os.replace(path, aside)
    except OSError:
        return
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
