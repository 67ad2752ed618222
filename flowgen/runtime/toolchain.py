"""Where flowgen finds its headers and the CUDA headers, where it caches builds, how compile
failures are reported, and the compilers' command lines: the one place that knows their flags
(the emulator's kernels: cpu_compiler.py; NVRTC: nvrtc.py; the standalone program's g++, nvcc
and MPI commands: codegen/aot.py)."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import shutil
import site
import subprocess
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


class BuildError(RuntimeError):
    """A build step failed; the message says which and why."""


# ----------------------------------------------------------------------------- compiler flags
CXX = "g++"
CXX_STANDARD = "-std=c++17"   # g++, NVRTC and nvcc alike
# Link kernel objects that may define one body twice (the same kernel compiled into two chunks by
# concurrent processes; the index-error record, a weak definition in every chunk): one copy is kept.
MULDEFS = "-Wl,-z,muldefs"


def _host_cpu_flags() -> frozenset:
    """The instruction-set flags of this x86 CPU (/proc/cpuinfo), empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split()) if platform.machine() in ("x86_64", "AMD64") else frozenset()


# Kernels call fmaf (one rounding, as the GPU's FFMA): with -mfma g++ inlines it instead of calling
# libm, and -ffp-contract=off keeps g++ from fusing any other a * b + c (eager rounds those twice).
# With AVX2 as well, vectorized loops keep integer lanes (flowgen_cpu_math.h's exponent bits) as
# wide as their float lanes. Neither changes a number: the same IEEE operations, other instructions.
_HOST_FLAGS = _host_cpu_flags()
_ISA_FLAGS = (("-mfma", "-ffp-contract=off") if "fma" in _HOST_FLAGS else ()) + \
    (("-mavx2",) if {"fma", "avx2"} <= _HOST_FLAGS else ())
# Floating-point operations raise no trap a kernel could observe (none unmasks one), so g++ may
# compute both sides of a select and blend them: without this, a loop with `c ? a : b` over floats
# (flowgen_cpu_math.h's clamps, a ReLU before a division) does not vectorize. Values are unchanged.
_NO_TRAPS = "-fno-trapping-math"
_OPT_LEVELS = ("0", "1", "2")


def emulator_optimisation() -> tuple:
    """The emulator's g++ optimisation flags: `$FLOWGEN_EMULATOR_OPT` (0, 1 or 2; default 2) is
    the level: 0 compiles kernels about 3x faster and runs them slower, for many small graphs
    (tests, fuzzing). No level enables fast-math, and on x86-64 g++ fuses no a * b + c of its
    own (no -mfma, or -ffp-contract=off with it), so every level computes the same IEEE
    operations in the same order: the same numbers."""
    level = os.environ.get("FLOWGEN_EMULATOR_OPT", "2").strip() or "2"
    if level not in _OPT_LEVELS:
        raise ValueError(f"FLOWGEN_EMULATOR_OPT={level!r}: the emulator's g++ optimisation level must be one of "
                         f"{', '.join(_OPT_LEVELS)}")
    return (f"-O{level}",)


def emulator_check() -> bool:
    """Whether `$FLOWGEN_EMULATOR_CHECK` asks for the checking emulator ("1"; "0" or unset: not)."""
    value = os.environ.get("FLOWGEN_EMULATOR_CHECK", "0").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"FLOWGEN_EMULATOR_CHECK={value!r}: must be 1 (check every launch) or 0")
    return value == "1"


# The checking emulator's compile flags: g++ instruments every memory access of the kernels with a
# call to a ThreadSanitizer entry point (runtime_cpp/flowgen_emu_check.h defines them), without the
# per-function entry/exit calls.
_CHECK_FLAGS = ("-DFLOWGEN_EMU_CHECK", "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0")


def kernel_flags(optimisation: Sequence[str] | None = None) -> list:
    """g++ flags of emulated kernels (objects or libraries, position-independent, so an object
    links into a library or a program alike): `optimisation` replaces emulator_optimisation()
    (a sanitized program's kernels: -O0 -g -fsanitize=..., which never run checked). Under
    `$FLOWGEN_EMULATOR_CHECK=1` they build the checking emulator; such objects are linked
    without -fsanitize=thread (link_flags)."""
    opt = emulator_optimisation() if optimisation is None else tuple(optimisation)
    check = _CHECK_FLAGS if optimisation is None and emulator_check() else ()
    return [CXX_STANDARD, *opt, "-fopenmp", "-fPIC", "-DFLOWGEN_EMULATOR", *_ISA_FLAGS, _NO_TRAPS, *check]


def link_flags() -> list:
    """g++ flags that link kernel objects into a library: the checking emulator's objects get the
    link script that puts guard bytes around their `__shared__` variables."""
    check = [f"-Wl,-T,{runtime_cpp_dir() / 'flowgen_emu_check.ld'}"] if emulator_check() else []
    return ["-shared", "-fopenmp", MULDEFS, *check]


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


def nvrtc_options(target: str) -> list[str]:
    """NVRTC's options for GPU architecture `target` (sm_90, sm_90a, ...)."""
    # No --use_fast_math: kernels opt into fast intrinsics (__expf, ...) explicitly.
    # FLOWGEN_NVRTC_LINEINFO=1 adds source lines to the cubins, so compute-sanitizer and Nsight
    # Compute name the line of kernels.cu (in the NVRTC build folder) behind each report.
    includes = [runtime_cpp_dir(), *cuda_include_dirs()]
    lineinfo = ["-lineinfo"] if os.environ.get("FLOWGEN_NVRTC_LINEINFO") == "1" else []
    return [f"--gpu-architecture={target}", CXX_STANDARD, "-DFLOWGEN_CUDA", *lineinfo] + [
        f"-I{d}" for d in includes
    ]


# ----------------------------------------------------------- the standalone program's commands
def mpi_flags() -> list:
    """g++ flags that compile and link against MPI: `mpicxx -show` of the MPICH that `pip install
    mpich` puts next to this Python (or the first mpicxx on PATH), without the compiler name."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    wrapper = shutil.which("mpicxx", path=search)
    install = "install MPI with `pip install mpich` (it provides mpi.h, libmpi and mpicxx)"
    if wrapper is None:
        raise BuildError(f"this program all-reduces over several ranks and needs MPI to build, but mpicxx is not "
                         f"next to {sys.executable} or on PATH: {install}")
    shown = subprocess.run([wrapper, "-show"], capture_output=True, text=True)
    flags = shown.stdout.split()[1:]
    if shown.returncode != 0 or not flags:
        raise BuildError(f"`{wrapper} -show` did not print MPICH's compile flags ({shown.stderr.strip()[:200]}); "
                         f"{install}")
    includes = [Path(f[2:]) for f in flags if f.startswith("-I")]
    if not any((d / "mpi.h").is_file() for d in includes):
        raise BuildError(f"mpi.h is not in the include directories `{wrapper} -show` gives "
                         f"({', '.join(map(str, includes)) or 'none'}): {install}")
    return flags


def _sanitizer_flags(sanitize: str) -> list:
    # Sanitized builds are for testing: -O0 compiles fastest and optimises nothing away.
    return ["-O0", "-g", f"-fsanitize={sanitize}", f"-fno-sanitize-recover={sanitize}", "-fno-omit-frame-pointer"]


def _mpi_compile_flags(mpi: list) -> list:
    return [flag for flag in mpi if flag.startswith(("-I", "-D"))]


def host_command(target: str, output: str, sanitize: str | None, mpi: list = ()) -> list:
    """The g++ command of the program's host code; `mpi`: mpi_flags() for a program run by
    mpiexec. On the cpu target it compiles program.cu's host unit into an object (`output`) that
    `link_command` links with the kernels; on the cuda target, the whole binary.

    Launch lists, file readers and the step loop, nothing hot: on the cuda target -O1 builds
    MobileNetV2's training program in 11 s of CPU where -O2 took 28 s. On the cpu target, whose
    launches run emulated kernels, -O0 (2.5 s of CPU for a small model's host unit, 4 s at -O1)."""
    if sanitize:
        optimise = _sanitizer_flags(sanitize)
    else:
        optimise = ["-O0"] if target == "cpu" else ["-O1"]
    if target == "cpu":
        return [CXX, CXX_STANDARD, *optimise, "-DFLOWGEN_EMULATOR", "-DFLOWGEN_HOST_UNIT", "-I.", "-c",
                "-x", "c++", "program.cu", "-o", output, *_mpi_compile_flags(mpi)]
    return [CXX, CXX_STANDARD, *optimise, "-I.", "-x", "c++", "program.cu", "-o", output, "-ldl", *mpi]


def program_kernel_optimisation(sanitize: str | None) -> list | None:
    """The cpu program's kernel flags besides kernel_flags' own: None keeps the emulator's level
    (so the objects a graph's run compiled are reused), a sanitized build its sanitizers
    (kernels included: they index the buffers the files fill)."""
    return _sanitizer_flags(sanitize) if sanitize else None


def kernels_command(sanitize: str | None) -> list:
    """g++ compiling the kernel half of program.cu into one object: what `flowgen build` does in chunks."""
    return [CXX, *kernel_flags(program_kernel_optimisation(sanitize)), "-DFLOWGEN_DEVICE_PASS", "-I.", "-include",
            "flowgen_emu.h", "-c", "-x", "c++", "program.cu", "-o", "program_kernels.o"]


def link_command(binary: str, objects: list, sanitize: str | None, mpi: list) -> list:
    sanitizers = [f"-fsanitize={sanitize}"] if sanitize else []
    return [CXX, "-fopenmp", *sanitizers, *objects, "-o", binary,
            *[flag for flag in mpi if flag not in _mpi_compile_flags(mpi)]]


def nvcc_command(arch: str) -> list:
    return ["nvcc", "-cubin", f"-arch={arch}", CXX_STANDARD, "-DFLOWGEN_DEVICE_PASS", "-I.", "-x", "cu",
            "program.cu", "-o", "program.cubin"]


def program_build_commands(target: str, binary: str, sanitize: str | None, mpi: list, compiler: str,
                           device_arch: str, libraries: tuple = ()) -> list:
    """The lines of program.cu's header that say how to build OUT by hand; `libraries`: the
    link flags of what the kernels call (OpenBLAS for the cpu target's native kernels)."""
    if target == "cuda":
        device = (" ".join(nvcc_command(device_arch)) if compiler == "nvcc"
                  else f"NVRTC --gpu-architecture={device_arch} {CXX_STANDARD} -I<runtime_cpp> -I<CUDA include> "
                       f"program.cu -> cubin")
        return [f"device: {device} (written as program_cubin.inc)",
                f"host:   {' '.join(host_command(target, binary, sanitize, mpi))}"]
    link = link_command(binary, ["program_kernels.o", "program_host.o", *libraries], sanitize, mpi)
    return [f"kernels: {' '.join(kernels_command(sanitize))}",
            "         (flowgen build compiles the kernels with these flags in parallel chunks, cached and",
            "         shared with the emulator's; each renamed by its body's hash, named back at the link)",
            f"host:    {' '.join(host_command(target, 'program_host.o', sanitize, mpi))}",
            f"link:    {' '.join(link)}"]
