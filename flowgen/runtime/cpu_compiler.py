"""Build generated CUDA C++ for the CPU emulator (g++ plus runtime_cpp/flowgen_emu.h) and
launch its kernels through ctypes, with the same argument convention as cuLaunchKernel."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from flowgen.runtime.toolchain import (
    CompileError,
    atomic_write_bytes,
    cache_dir,
    kernel_params,
    runtime_cpp_dir,
    safe_tag,
)

_CXX = "g++"
_FLAGS = ("-std=c++17", "-O2", "-fopenmp", "-shared", "-fPIC", "-DFLOWGEN_EMULATOR")


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    return subprocess.run([_CXX, "--version"], capture_output=True, text=True, check=True).stdout


def _build_key(source: str, flags: Sequence[str], runtime: Path) -> str:
    # The headers are part of what gets compiled, so editing them must invalidate the cache.
    digest = hashlib.sha256()
    for part in (source, _compiler_version(), *flags):
        digest.update(part.encode() + b"\0")
    for header in sorted(runtime.glob("*.h")):
        digest.update(header.read_bytes() + b"\0")
    return digest.hexdigest()


def build_cpu_library(source: str, tag: str) -> Path:
    """Compile `source` into a shared library for the emulator and return its path.

    The build lives in `<cache>/cpu/<tag>-<hash>/` next to `source.cu` and `compile.log`;
    the same source, compiler and flags give the same directory, so a rebuild is skipped.
    """
    runtime = runtime_cpp_dir()
    # The prelude, as NVRTC gets it (runtime/nvrtc.py): with -DFLOWGEN_EMULATOR it pulls in the
    # emulator, and it declares what kernels share (the index-error record, Philox).
    flags = [*_FLAGS, f"-I{runtime}", "-include", str(runtime / "flowgen_cuda_prelude.h")]
    build_dir = cache_dir() / "cpu" / f"{safe_tag(tag)}-{_build_key(source, flags, runtime)[:20]}"
    library = build_dir / "kernels.so"
    if library.is_file():
        return library

    source_path = build_dir / "source.cu"
    atomic_write_bytes(source_path, source.encode())
    # g++ writes to a private name that is renamed into place, so a concurrent process
    # never loads a half-written library.
    fd, partial = tempfile.mkstemp(dir=build_dir, prefix=".kernels.", suffix=".so")
    os.close(fd)
    command = [_CXX, *flags, "-x", "c++", str(source_path), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True)
    log = " ".join(command) + "\n" + result.stdout + result.stderr
    atomic_write_bytes(build_dir / "compile.log", log.encode())
    if result.returncode != 0:
        Path(partial).unlink(missing_ok=True)
        raise CompileError("g++", log, source, source_path)
    os.replace(partial, library)
    return library


def _dim3(value: Sequence[int], what: str) -> ctypes.Array:
    dims = tuple(int(v) for v in value)
    if len(dims) != 3 or min(dims) < 0:
        raise ValueError(f"{what} must be three non-negative integers, got {value!r}")
    return (ctypes.c_uint * 3)(*dims)


class CpuModule:
    """An emulator library built by `build_cpu_library`."""

    def __init__(self, library: Path):
        self.path = Path(library)
        self._library = ctypes.CDLL(str(self.path))
        self._launchers: dict[str, ctypes._CFuncPtr] = {}

    def global_address(self, name: str) -> int:
        """Address of the library's `extern "C"` variable `name` (a `__device__` global)."""
        return ctypes.addressof(ctypes.c_char.in_dll(self._library, name))

    def _launcher(self, kernel_name: str) -> ctypes._CFuncPtr:
        if kernel_name not in self._launchers:
            try:
                launcher = getattr(self._library, f"flowgen_launch_{kernel_name}")
            except AttributeError:
                raise KeyError(
                    f"kernel {kernel_name!r} is not in {self.path}: its source must define "
                    f'extern "C" __global__ void {kernel_name}(...) followed by '
                    f"FLOWGEN_EMU_KERNEL({kernel_name}, needs_fibers)"
                ) from None
            launcher.restype = None
            launcher.argtypes = [
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_void_p),
            ]
            self._launchers[kernel_name] = launcher
        return self._launchers[kernel_name]

    def launch(
        self,
        kernel_name: str,
        grid: Sequence[int],
        block: Sequence[int],
        dyn_smem: int,
        args: Sequence[ctypes._SimpleCData],
    ) -> None:
        """Run the kernel to completion on the CPU (ctypes releases the GIL meanwhile)."""
        launcher = self._launcher(kernel_name)
        launcher(_dim3(grid, "grid"), _dim3(block, "block"), int(dyn_smem), kernel_params(args))
