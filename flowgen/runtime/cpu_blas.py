"""OpenBLAS for the cpu target's native kernels (codegen/cpu/, runtime_cpp/flowgen_cpu.h): the
`scipy-openblas32` wheel, the build NumPy and SciPy ship (symbols prefixed `scipy_`, 32-bit
integers), found through its own Python package. The emulator library links it with an rpath to
the wheel; `flowgen build`'s program gets a copy beside the binary."""
from __future__ import annotations

from pathlib import Path

from flowgen.runtime.toolchain import copy_file_atomically

NATIVE_INCLUDE = '#include "flowgen_cpu.h"'


def uses_blas(source: str) -> bool:
    """Whether a generated kernels.cu has native kernels (codegen/program.py NATIVE_HEADER)."""
    return NATIVE_INCLUDE in source


def _package():
    try:
        import scipy_openblas32
    except ImportError:
        raise RuntimeError("the cpu target's native kernels link OpenBLAS from the scipy-openblas32 package: "
                           "pip install scipy-openblas32, or set FLOWGEN_CPU_KERNELS=emulator to run every "
                           "kernel on the emulator") from None
    return scipy_openblas32


def library_dir() -> Path:
    return Path(_package().get_lib_dir())


def link_flags() -> list:
    """g++ flags linking OpenBLAS into a library or program of native kernels."""
    lib = library_dir()
    return [f"-L{lib}", f"-l{_package().get_library()}", f"-Wl,-rpath,{lib}"]


def program_link_flags(out: Path, source: str) -> list:
    """g++ flags linking a standalone program (`flowgen build --target cpu`, its program.cu in
    `source`) in `out`: where it has native kernels, OpenBLAS's library is copied beside the
    binary, which finds it there ($ORIGIN), else in the wheel it came from."""
    if not uses_blas(source):
        return []
    name = f"lib{_package().get_library()}.so"
    copy_file_atomically(library_dir() / name, out / name)
    return ["-Wl,-rpath,$ORIGIN", *link_flags()]


def record() -> dict:
    """What a build records about the BLAS it linked (flowgen build's manifest)."""
    package = _package()
    return {"package": "scipy-openblas32", "version": package.__version__,
            "library": str(library_dir() / f"lib{package.get_library()}.so"),
            "config": package.get_openblas_config()}
