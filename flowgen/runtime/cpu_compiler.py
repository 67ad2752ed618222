"""Build generated CUDA C++ for the CPU emulator (g++ plus runtime_cpp/flowgen_emu.h) and
launch its kernels through ctypes, with the same argument convention as cuLaunchKernel.

`build_cpu_library` compiles one source as one library; `compile_kernel_objects` compiles a
generated kernels.cu kernel by kernel through `kernel_cache` (each distinct body once, object
files of several chunks by parallel g++ processes), which `build_kernel_library` links into one
library and `flowgen build --target cpu` (codegen/aot.py) into the standalone program.

`FLOWGEN_EMULATOR_CHECK=1` builds the checking emulator (runtime_cpp/flowgen_emu_check.h): the
kernels are compiled with g++'s ThreadSanitizer instrumentation, whose entry points the header
defines (the library is linked without libtsan, with flowgen_emu_check.ld), and a launch that
breaks a rule of the hardware raises EmulatorCheckError naming the kernel, block, thread and
address.

What the emulator models and what its checking mode reports: docs/emulator.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from flowgen.runtime import cache_bound, cpu_blas, precompiled_header
from flowgen.runtime.kernel_cache import KernelBuild, build_kernels, preamble_of
from flowgen.runtime.progress import reporting
from flowgen.runtime.toolchain import (
    CXX,
    CompileError,
    atomic_write_bytes,
    cache_dir,
    compiler_version,
    emulator_check,
    kernel_flags,
    kernel_params,
    link_flags,
    runtime_cpp_dir,
    safe_tag,
)


class EmulatorCheckError(RuntimeError):
    """A launch on the checking emulator broke a rule of the hardware (a shared-memory race, a
    divergent barrier, a misaligned or out-of-bounds access, ...); the message names the kernel,
    block, thread and address."""


def library_link_flags(source: str) -> list:
    """The libraries a generated kernels.cu links besides the emulator: OpenBLAS when it has the
    cpu target's native kernels (runtime/cpu_blas.py)."""
    return cpu_blas.link_flags() if cpu_blas.uses_blas(source) else []


def _build_key(source: str, flags: Sequence[str], runtime: Path) -> str:
    # The headers are part of what gets compiled, so editing them must invalidate the cache.
    digest = hashlib.sha256()
    for part in (source, compiler_version(), *flags):
        digest.update(part.encode() + b"\0")
    for header in sorted(runtime.glob("*.h")):
        digest.update(header.read_bytes() + b"\0")
    return digest.hexdigest()


# A chunk of kernels should hold at least this much source (about 2 s of g++ CPU): each g++
# call spends 0.25 to 0.5 s on the preamble's headers (precompiled_header.py).
_MIN_CHUNK_CHARS = 50_000


def compile_kernel_objects(source: str, optimisation: Sequence[str] | None = None) -> KernelBuild:
    """The kernels of a generated kernels.cu as object files, compiled with
    kernel_flags(optimisation) kernel by kernel through the kernel cache (`<cache>/cpu-kernels`;
    the flags are part of every key, so a sanitized build's objects are its own), with the
    preamble's headers precompiled once a cache has compiled a few chunks (precompiled_header.py).
    Each kernel's entry point in them is `flowgen_launch_<symbols[kernel name][1]>`."""
    runtime = runtime_cpp_dir()
    flags = [*kernel_flags(optimisation), "-c", f"-I{runtime}"]
    salt = _build_key("", flags, runtime)

    def compile_chunk(text: str, build_dir: Path) -> None:
        header = precompiled_header.header_for(preamble_of(text), flags, salt)
        if header is not None:
            try:
                _run_gxx([*flags, "-Winvalid-pch", "-include", str(header)], text, build_dir, "kernels.o")
                return
            except CompileError as error:
                failure = error.log
        # Without a .gch: none yet, or the chunk failed with it. A damaged .gch fails every chunk;
        # a chunk that fails by itself fails here again, with its own error.
        _run_gxx(flags, text, build_dir, "kernels.o")
        if header is not None:
            precompiled_header.discard(header, failure)

    return build_kernels(source, root=cache_dir() / "cpu-kernels", salt=salt, artifact="kernels.o",
                         compiler="g++", min_chunk_chars=_MIN_CHUNK_CHARS, compile_chunk=compile_chunk)


def build_kernel_library(source: str) -> tuple[Path, KernelBuild]:
    """A library with every kernel of a generated kernels.cu, and the build's name map
    (`symbols[kernel name][1]` is the function's name in the library).

    Objects come from compile_kernel_objects; the linked library lives in
    `<cache>/cpu-libs/<hash of its objects>/kernels.so`.
    """
    build = compile_kernel_objects(source)
    flags = link_flags() + library_link_flags(source)
    key = hashlib.sha256("\0".join([compiler_version(), *flags, *map(str, build.artifacts)]).encode())
    library = cache_dir() / "cpu-libs" / key.hexdigest()[:32] / "kernels.so"
    if library.is_file():
        cache_bound.used(library.parent)
    else:
        with reporting("compile") as progress:
            progress.stage("link")
            # The same body compiled twice by concurrent processes may sit in two chunks:
            # muldefs lets the linker keep either copy (they are the same code).
            _link(flags, build.artifacts, library)
        cache_bound.wrote()
    return library, build


def _link(flags: list, objects: list, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=library.parent, prefix=".kernels.", suffix=".so")
    os.close(fd)
    command = [CXX, *flags, *map(str, objects), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        Path(partial).unlink(missing_ok=True)
        raise RuntimeError(f"linking the emulator library failed:\n{' '.join(command)}\n{result.stderr}")
    os.replace(partial, library)


def _run_gxx(flags: list, source: str, build_dir: Path, artifact: str) -> None:
    """Compile `source` into `build_dir / artifact` next to source.cu and compile.log. g++
    writes to a private name that is renamed into place, so a concurrent process never loads
    a half-written file."""
    source_path = build_dir / "source.cu"
    atomic_write_bytes(source_path, source.encode())
    fd, partial = tempfile.mkstemp(dir=build_dir, prefix=f".{artifact}.", suffix=Path(artifact).suffix)
    os.close(fd)
    command = [CXX, *flags, "-x", "c++", str(source_path), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True)
    log = " ".join(command) + "\n" + result.stdout + result.stderr
    atomic_write_bytes(build_dir / "compile.log", log.encode())
    if result.returncode != 0:
        Path(partial).unlink(missing_ok=True)
        raise CompileError("g++", log, source, source_path)
    os.replace(partial, build_dir / artifact)


def build_cpu_library(source: str, tag: str) -> Path:
    """Compile `source` into a shared library for the emulator and return its path.

    The build lives in `<cache>/cpu/<tag>-<hash>/` next to `source.cu` and `compile.log`;
    the same source, compiler and flags give the same directory, so a rebuild is skipped.
    """
    runtime = runtime_cpp_dir()
    # The prelude, as NVRTC gets it (runtime/nvrtc.py): with -DFLOWGEN_EMULATOR it pulls in the
    # emulator, and it declares what kernels share (the index-error record, Philox).
    flags = [*kernel_flags(), f"-I{runtime}", "-include", str(runtime / "flowgen_cuda_prelude.h")]
    build_dir = cache_dir() / "cpu" / f"{safe_tag(tag)}-{_build_key(source, [*flags, *link_flags()], runtime)[:20]}"
    library = build_dir / "kernels.so"
    if library.is_file():
        return library

    if emulator_check():   # compiled with -fsanitize=thread, linked without libtsan
        _run_gxx([*flags, "-c"], source, build_dir, "kernels.o")
        _link(link_flags(), [build_dir / "kernels.o"], library)
    else:
        _run_gxx([*flags, "-shared"], source, build_dir, "kernels.so")
    return library


def _dim3(value: Sequence[int], what: str) -> ctypes.Array:
    dims = tuple(int(v) for v in value)
    if len(dims) != 3 or min(dims) < 0:
        raise ValueError(f"{what} must be three non-negative integers, got {value!r}")
    return (ctypes.c_uint * 3)(*dims)


def _bound_openmp_spinning() -> None:
    """OpenMP team members with nothing to do spin before they sleep (libgomp: 300,000 turns by
    default). Where other processes share the cores, a spinning member holds the core that a
    descheduled one needs: an emulator step of MobileNetV2's training graph took twice as long
    (1.1 s against 0.5 s, load average 6 on 2 cores). Unless the user chose a wait policy, the
    team spins 10,000 turns (microseconds), then sleeps. libgomp reads the variable when it is
    loaded, which is with the first emulator library unless something loaded it before."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


class _Launch(ctypes.Structure):
    """runtime_cpp/flowgen_emu.h's FlowgenLaunch."""
    _fields_ = [("launch", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("dyn_smem_bytes", ctypes.c_size_t), ("args", ctypes.POINTER(ctypes.c_void_p))]


class CpuModule:
    """An emulator library built by `build_cpu_library` or `build_kernel_library`; `symbols`
    maps a kernel name to its function's name in the library where they differ. A library of the
    checking emulator (it exports flowgen_emu_check_report) raises EmulatorCheckError from a
    launch that breaks a rule of the hardware."""

    def __init__(self, library: Path, symbols: dict | None = None):
        self.path = Path(library)
        _bound_openmp_spinning()
        self._library = ctypes.CDLL(str(self.path))
        self._symbols = symbols or {}
        self._launchers: dict[str, ctypes._CFuncPtr] = {}
        self.checked = hasattr(self._library, "flowgen_emu_check_report")
        if self.checked:
            self._library.flowgen_emu_check_collect.argtypes = [ctypes.c_int]
            self._library.flowgen_emu_check_collect(1)   # reports come back here instead of aborting
            self._library.flowgen_emu_check_report.restype = ctypes.c_char_p

    def global_address(self, name: str) -> int:
        """Address of the library's `extern "C"` variable `name` (a `__device__` global)."""
        return ctypes.addressof(ctypes.c_char.in_dll(self._library, name))

    def _launcher(self, kernel_name: str) -> ctypes._CFuncPtr:
        if kernel_name not in self._launchers:
            try:
                launcher = getattr(self._library, f"flowgen_launch_{self._symbols.get(kernel_name, kernel_name)}")
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

    def launcher(self, kernel_name: str, context: str = ""):
        """A function (grid3, block3, dynamic shared bytes, kernel params) that runs the kernel; on
        the checking emulator it raises EmulatorCheckError after a failed launch, the report
        followed by `context` (where the kernel came from)."""
        launcher = self._launcher(kernel_name)
        if not self.checked:
            return launcher

        def checked_launch(grid, block, dyn_smem, params):
            launcher(grid, block, dyn_smem, params)
            self.raise_check_report(context)
        return checked_launch

    def launch_sequence(self, launches) -> Callable[[], None] | None:
        """One call running `launches`, (kernel name, grid, block, dynamic shared bytes, kernel
        params) tuples, in order in the library (flowgen_run_launches), or None on the checking
        emulator, whose launches each go through `launcher` to raise their report, and for no
        launches (a library without kernels has no flowgen_emu.h). The params arrays must outlive
        the returned function."""
        if self.checked or not launches:
            return None
        table = (_Launch * len(launches))()
        for entry, (name, grid, block, smem, params) in zip(table, launches):
            entry.launch = ctypes.cast(self._launcher(name), ctypes.c_void_p)
            entry.grid[:], entry.block[:] = tuple(grid), tuple(block)
            entry.dyn_smem_bytes = smem
            entry.args = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        run, count = self._library.flowgen_run_launches, len(launches)
        run.restype, run.argtypes = None, [ctypes.POINTER(_Launch), ctypes.c_int]
        return lambda: run(table, count)

    def raise_check_report(self, context: str = "") -> None:
        """Raise EmulatorCheckError if the last launch on the checking emulator reported a hazard."""
        report = self._library.flowgen_emu_check_report().decode()
        if report:
            self._library.flowgen_emu_check_clear()
            raise EmulatorCheckError(f"{report}\n  {context}" if context else report)

    def launch(
        self,
        kernel_name: str,
        grid: Sequence[int],
        block: Sequence[int],
        dyn_smem: int,
        args: Sequence[ctypes._SimpleCData],
    ) -> None:
        """Run the kernel to completion on the CPU (ctypes releases the GIL meanwhile)."""
        launcher = self.launcher(kernel_name)
        launcher(_dim3(grid, "grid"), _dim3(block, "block"), int(dyn_smem), kernel_params(args))
