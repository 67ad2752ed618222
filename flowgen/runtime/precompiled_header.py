"""The precompiled header of the emulator's kernel chunks (cpu_compiler.compile_kernel_objects).

Every chunk of a generated kernels.cu starts with the same preamble: `#include
"flowgen_cuda_prelude.h"`, which pulls in flowgen_emu.h and the standard headers, and `#include
"flowgen_cpu.h"` where the cpu target's native kernels are in the source. g++ spends about 0.5 s
of CPU on them per chunk. `<cache>/cpu-pch/<key>/` holds that preamble as `preamble.h` and,
precompiled, `preamble.h.gch`: a chunk compiled with `-include preamble.h` loads the .gch in
about 0.25 s instead, and its own #include lines then find their `#pragma once` headers read
already. The key is the preamble and the kernel cache's salt (compiler version and flags, the
runtime headers' contents), so an edited header, another flag or another g++ gets its own.

Building the .gch costs about 1.2 s of CPU: more than the four chunks of a cold build of
MobileNetV2's training graph on two cores would save with it. So it is bought as in ski rental:
chunks compile without it, each counted in `plain-compiles`, until what four of them spent
beyond the .gch's cost would have paid for building it; the next one builds it. A cache then
never spends much more than twice what the better choice in hindsight would have: a first graph
compiles at its cheapest, a second graph or a test suite gets the .gch.

Failures fall back to the plain headers and are not tried again under that key: a .gch that
cannot be built, or one that made a chunk fail that then compiled without it (a damaged file;
g++ ignores a foreign one by itself, with a warning, and reads preamble.h), leaves `failed`
with the compiler's log.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

from flowgen.runtime import cache_bound
from flowgen.runtime.toolchain import CXX, atomic_write_bytes, cache_dir

# Plain compiles of one preamble after which the next builds its .gch: four chunks' header
# parsing beyond loading the .gch (4 x 0.25 s) is about what building it costs (1.2 s).
PLAIN_COMPILES_BEFORE_BUILD = 4

_building = threading.Lock()   # chunks compile in parallel threads; one of them builds the .gch


def _directory(preamble: str, salt: str) -> Path:
    key = hashlib.sha256(f"{salt}\0{preamble}".encode()).hexdigest()[:32]
    return cache_dir() / "cpu-pch" / key


def header_for(preamble: str, flags: list, salt: str) -> Path | None:
    """The header a chunk starting with `preamble` is compiled with (`-include` it; `flags`: the
    chunk's g++ flags, which the .gch is built with) while its .gch is there, building it once
    the plain compiles have paid for it; None: compile the chunk as it is (counted)."""
    directory = _directory(preamble, salt)
    header = directory / "preamble.h"
    if (directory / "preamble.h.gch").is_file():
        cache_bound.used(directory)
        return header
    if (directory / "failed").is_file():
        return None
    if _plain_compiles(directory) >= PLAIN_COMPILES_BEFORE_BUILD and _building.acquire(blocking=False):
        try:
            if (directory / "preamble.h.gch").is_file() or _build(directory, preamble, flags):
                return header
            return None
        finally:
            _building.release()
    _count_plain_compile(directory)
    return None


def discard(header: Path, log: str) -> None:
    """Give up the .gch of `header`: a chunk failed with it (`log`) and compiled without it."""
    atomic_write_bytes(header.parent / "failed", f"a chunk failed with this .gch and compiled without it:\n{log}".encode())
    Path(f"{header}.gch").unlink(missing_ok=True)


def _plain_compiles(directory: Path) -> int:
    try:
        return (directory / "plain-compiles").stat().st_size
    except FileNotFoundError:
        return 0


def _count_plain_compile(directory: Path) -> None:
    # One byte per compile, appended: concurrent processes each add theirs.
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "plain-compiles", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)


def _build(directory: Path, preamble: str, flags: list) -> bool:
    """Build `preamble.h.gch` (written to a private name, renamed into place); False when g++ failed."""
    header = directory / "preamble.h"
    if not header.is_file():
        atomic_write_bytes(header, preamble.encode())
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".preamble.h.", suffix=".gch")
    os.close(fd)
    command = [CXX, *flags, "-x", "c++-header", str(header), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        Path(partial).unlink(missing_ok=True)
        atomic_write_bytes(directory / "failed", (" ".join(command) + "\n" + result.stdout + result.stderr).encode())
        return False
    os.replace(partial, directory / "preamble.h.gch")
    return True
