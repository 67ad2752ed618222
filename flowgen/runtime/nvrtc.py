"""Compile generated CUDA C++ with NVRTC into a cubin (or PTX), with a disk cache.

`compile_cuda` compiles one source as one program (one cubin); `compile_kernels` compiles a
generated kernels.cu kernel by kernel through `kernel_cache` (each distinct body once, chunks
in parallel threads: NVRTC releases the GIL), giving several cubins and a name map."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from cuda.bindings import nvrtc

from flowgen.runtime.kernel_cache import KernelBuild, build_kernels
from flowgen.runtime.toolchain import (
    CompileError,
    atomic_write_bytes,
    cache_dir,
    nvrtc_options,
    runtime_cpp_dir,
    safe_tag,
)

PRELUDE = "flowgen_cuda_prelude.h"
# NVRTC names the program in its log; using the stored file's name makes errors point at it.
_SOURCE_NAME = "kernels.cu"


def _check(result: tuple, what: str):
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, message = nvrtc.nvrtcGetErrorString(status)
        raise RuntimeError(f"{what} failed: {message.decode()}")
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    return _check(nvrtc.nvrtcVersion(), "nvrtcVersion")


def _arch_number(arch: str) -> str:
    match = re.fullmatch(r"(?:sm|compute)_(\d+[a-z]?)", arch)
    if not match:
        raise ValueError(f"expected an architecture like 'sm_90', got {arch!r}")
    return match.group(1)


# A call of a Hopper warpgroup MMA (flowgen_cuda_prelude.h): the source needs sm_90a.
_WGMMA_CALL = re.compile(r"\bwgmma_m64n\d+k\d+_[a-z0-9]+")


def _arch_number_for(source: str, arch: str) -> str:
    """`arch`'s number, with the architecture-specific suffix "a" on sm_90 when the source uses
    warpgroup MMA (wgmma exists only in the sm_90a feature set; such a cubin runs on sm_90 GPUs)."""
    number = _arch_number(arch)
    return "90a" if number == "90" and _WGMMA_CALL.search(source) else number


def cubin_arch(source: str, arch: str) -> str:
    """The real architecture a cubin of `source` for the GPU `arch` is compiled for: `arch`, or
    sm_90a for an sm_90 source with warpgroup MMA."""
    return f"sm_{_arch_number_for(source, arch)}"


def compile_cuda(source: str, arch: str = "sm_90", tag: str = "kernels") -> bytes:
    """A cubin for `arch` (e.g. "sm_90"; sm_90a for a source with warpgroup MMA): machine code
    the driver loads as is."""
    return _compile(source, cubin_arch(source, arch), tag, "kernels.cubin")


def compile_ptx(source: str, arch: str = "sm_90", tag: str = "kernels") -> bytes:
    """NUL-terminated PTX for the virtual architecture `compute_XY` matching `arch`; the
    driver JIT-compiles it, which also works where it cannot load this NVRTC's cubins."""
    return _compile(source, f"compute_{_arch_number_for(source, arch)}", tag, "kernels.ptx")


def _salt(options: list[str]) -> str:
    """Everything besides the source that changes NVRTC's output: its version, the options
    and flowgen's headers."""
    digest = hashlib.sha256()
    for part in (*options, repr(nvrtc_version())):
        digest.update(part.encode() + b"\0")
    for header in sorted(runtime_cpp_dir().glob("*.h")):
        digest.update(header.read_bytes() + b"\0")
    return digest.hexdigest()


def _build_key(text: str, options: list[str]) -> str:
    return hashlib.sha256(text.encode() + b"\0" + _salt(options).encode()).hexdigest()


# A chunk of kernels should hold at least this much source: each NVRTC program pays about
# 50 ms of CPU for the prelude and CUDA headers.
_MIN_CHUNK_CHARS = 15_000


def compile_kernels(source: str, arch: str = "sm_90") -> KernelBuild:
    """Cubins for a generated kernels.cu: `artifacts` are cubin paths (load each as a module),
    `symbols` maps each kernel name to (cubin index, function name)."""
    options = nvrtc_options(cubin_arch(source, arch))
    source = source if PRELUDE in source else f'#include "{PRELUDE}"\n{source}'
    return build_kernels(source, root=cache_dir() / "nvrtc-kernels", salt=_salt(options), artifact="kernels.cubin",
                         compiler="nvrtc", min_chunk_chars=_MIN_CHUNK_CHARS,
                         compile_chunk=lambda text, build_dir: _compile_into(text, options, build_dir,
                                                                             "kernels.cubin"))


def _compile(source: str, target: str, tag: str, artifact_name: str) -> bytes:
    text = source if PRELUDE in source else f'#include "{PRELUDE}"\n{source}'
    options = nvrtc_options(target)
    build_dir = cache_dir() / "nvrtc" / f"{safe_tag(tag)}-{_build_key(text, options)[:20]}"
    artifact = build_dir / artifact_name
    if artifact.is_file():
        return artifact.read_bytes()
    return _compile_into(text, options, build_dir, artifact_name)


def _compile_into(text: str, options: list[str], build_dir: Path, artifact_name: str) -> bytes:
    """Compile `text`, leaving kernels.cu, compile.log and the artifact in `build_dir`."""
    source_path = build_dir / _SOURCE_NAME
    atomic_write_bytes(source_path, text.encode())
    program = _check(
        nvrtc.nvrtcCreateProgram(text.encode(), _SOURCE_NAME.encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log = _program_log(program)
        atomic_write_bytes(build_dir / "compile.log", log.encode())
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError("NVRTC", log, text, source_path)
        image = _program_image(program, artifact_name.endswith(".ptx"))
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    atomic_write_bytes(build_dir / artifact_name, image)
    return image


def _out_buffer(size: int) -> bytes:
    """A fresh bytes object for NVRTC to write into. Never `b" " * 1`: CPython hands out one
    shared object for every one-byte bytes value, and NVRTC writing the empty log's NUL into it
    turned every later b" " in the process into b"\0" (NumPy's .npy header padding, for one)."""
    return b" " * max(int(size), 2)


def _program_log(program) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    log = _out_buffer(size)
    _check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
    return log[:size].rstrip(b"\0").decode(errors="replace")


def _program_image(program, ptx: bool) -> bytes:
    get_size, get = (
        (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        if ptx
        else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
    )
    size = _check(get_size(program), get_size.__name__)
    image = _out_buffer(size)
    _check(get(program, image), get.__name__)
    return image[:size]
