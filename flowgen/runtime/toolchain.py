"""Where flowgen finds its headers and the CUDA headers, where it caches builds, and how
compile failures are reported."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import site
import sys
import tempfile
from pathlib import Path
from typing import Sequence


def cache_dir() -> Path:
    """Root of the build cache: `$FLOWGEN_CACHE`, else `~/.cache/flowgen`."""
    root = os.environ.get("FLOWGEN_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "flowgen"
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` so that readers (other processes sharing the cache) never see a partial
    file: write a temporary file in the same directory, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_file_atomically(source: Path, dest: Path) -> None:
    """Copy `source` (mode bits included) to `dest` through a temporary file and a rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copy2(source, tmp)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def runtime_cpp_dir() -> Path:
    """The `runtime_cpp/` headers: package data when installed, else the source checkout."""
    package = Path(__file__).resolve().parent.parent
    candidates = (package / "_data" / "runtime_cpp", package.parent / "runtime_cpp")
    for candidate in candidates:
        if (candidate / "flowgen_emu.h").is_file():
            return candidate
    raise FileNotFoundError(
        "flowgen runtime headers not found; looked in " + ", ".join(str(c) for c in candidates)
    )


def _python_dirs() -> list[Path]:
    dirs = [*sys.path, *site.getsitepackages(), site.getusersitepackages()]
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def cuda_include_dirs() -> list[Path]:
    """Directories holding the CUDA headers (cuda_fp16.h, ...) that NVRTC needs: an explicit
    `$CUDA_HOME` first, then the pip wheels (`nvidia/cuda_runtime/include` for CUDA 12,
    `nvidia/cu13/include` for CUDA 13), then a system toolkit."""
    found: list[Path] = []
    if os.environ.get("CUDA_HOME"):
        found.append(Path(os.environ["CUDA_HOME"]) / "include")
    for root in _python_dirs():
        found.extend(header.parent for header in sorted(root.glob("nvidia/*/include/cuda_fp16.h")))
    found.append(Path("/usr/local/cuda/include"))
    return [d for d in dict.fromkeys(found) if d.is_dir()]


def safe_tag(tag: str) -> str:
    """`tag` reduced to characters that are safe in a directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag) or "kernels"


def kernel_params(args: Sequence[ctypes._SimpleCData]) -> ctypes.Array:
    """The `void**` array of pointers to each argument that cuLaunchKernel and the emulator's
    `flowgen_launch_<kernel>` expect. The ctypes values must outlive the launch."""
    try:
        return (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    except TypeError:
        raise TypeError(
            "kernel arguments must be ctypes values (c_void_p for device pointers, c_int, "
            f"c_float, ...), got {[type(a).__name__ for a in args]}"
        ) from None


_CONTEXT_LINES = 3
_MAX_SNIPPETS = 10


class CompileError(RuntimeError):
    """A generated source failed to compile. The message holds the compiler log, the source
    lines around each reported error, and the path of the source file that was compiled."""

    def __init__(self, compiler: str, log: str, source: str, source_path: Path):
        self.log = log
        self.source_path = Path(source_path)
        super().__init__(_describe_failure(compiler, log, source, self.source_path))


def _error_lines(log: str, file_name: str) -> list[int]:
    # g++ reports `path/source.cu:12:5: error: ...`, NVRTC `kernels.cu(12): error: ...`.
    where = re.compile(rf"(?:^|[\s/]){re.escape(file_name)}(?::(\d+)|\((\d+)\))[^\n]*?\berror\b")
    lines: dict[int, None] = {}
    for match in where.finditer(log):
        lines[int(match.group(1) or match.group(2))] = None
    return list(lines)[:_MAX_SNIPPETS]


def _snippet(source_lines: list[str], line: int) -> str:
    first = max(1, line - _CONTEXT_LINES)
    last = min(len(source_lines), line + _CONTEXT_LINES)
    width = len(str(last))
    rows = [f"around line {line}:"]
    for n in range(first, last + 1):
        marker = ">>" if n == line else "  "
        rows.append(f"{marker} {n:>{width}} | {source_lines[n - 1]}")
    return "\n".join(rows)


def _describe_failure(compiler: str, log: str, source: str, source_path: Path) -> str:
    source_lines = source.splitlines()
    parts = [f"{compiler} failed to compile {source_path.name}:", log.rstrip()]
    parts += [
        _snippet(source_lines, line)
        for line in _error_lines(log, source_path.name)
        if 1 <= line <= len(source_lines)
    ]
    parts.append(f"generated source: {source_path}")
    return "\n\n".join(parts)
