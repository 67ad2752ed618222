"""`flowgen build --lib`: a graph as a shared library with a plain-C API.

Beside the standalone program, `build(..., lib=True)` (codegen/aot.py) calls `build_library`,
which writes::

    OUT/<name>.h           the C API (templates/library.h.j2): flowgen_create, flowgen_run,
                           flowgen_last_error, flowgen_destroy and the signature functions
    OUT/library.cpp        its implementation (templates/library.cpp.j2), which includes
                           program.cu with FLOWGEN_LIBRARY defined (no command line, no main())
    OUT/library.map        the linker version script: only the C API is exported
    OUT/lib<name>.so       the library, which finds OUT/weights.safetensors beside itself

On the cpu target the library links the kernels' cached emulator objects (the ones the
program links) with library.cpp's host unit; on the cuda target it is one g++ unit holding the
embedded cubin and opening ``libcuda.so.1`` at run time, so it builds without a GPU or the CUDA
headers. Native cpu kernels call OpenBLAS, which the library links (a copy in OUT, found through
$ORIGIN), so a C program links the library alone. `flow.load_compiled(OUT)`
(flowgen/deploy/loader.py) loads it through ctypes.

Inference graphs only: a library runs the same step on shared weights from any number of
threads, so a graph that writes its state (a training step, BatchNorm in train mode) or
advances it (random ops) is refused by `refusal`.

The C API's contract (workspaces, threads, errors, dynamic dimensions): docs/embedding.md.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import flowgen
from flowgen.codegen.dynamic import host_shapes
from flowgen.codegen.templates import get_template
from flowgen.runtime import cache_bound, cpu_blas
from flowgen.runtime.cpu_compiler import compiler_version
from flowgen.runtime.toolchain import CompileError, cache_dir, copy_file_atomically, safe_tag
from flowgen.serialization import write_file_atomic

# What the library exports (library.map); the rest of it (kernels, tables) stays local, so
# two libraries loaded into one process never bind to each other's symbols.
API_FUNCTIONS = ("flowgen_api_version", "flowgen_graph_name", "flowgen_target", "flowgen_num_inputs",
                 "flowgen_num_outputs", "flowgen_input_info", "flowgen_output_info", "flowgen_create",
                 "flowgen_run", "flowgen_last_error", "flowgen_last_error_code", "flowgen_destroy")

_SERIAL_CUDA = ("its kernels run on one CUDA stream and record an out-of-range index in the module's one "
                "index-error record")
_SERIAL_INDEX_CHECKS = ("the graph checks indices read from its inputs, and its kernels record an out-of-range "
                        "index in the library's one index-error record, which each call reads and clears")


def library_files(name: str) -> dict:
    """The manifest entries of a library build named `name` (aot.program_name: `--name`, or the
    graph's name): {"library": "lib<name>.so", "header": "<name>.h"}."""
    tag = safe_tag(name)
    return {"library": f"lib{tag}.so", "header": f"{tag}.h"}


def refusal(saved) -> str | None:
    """Why `saved` (a SavedGraph) cannot become a library, or None when it can."""
    if saved.training:
        return (f"graph {saved.name} is a training step (it updates its parameters and optimizer state every "
                f"call); a library runs inference graphs on weights shared by every call. Build an inference "
                f"graph of the trained model for --lib, or run the training program (`flowgen run --steps`)")
    if saved.data_parallel:
        return (f"graph {saved.name} was saved on {saved.data_parallel['world_size']} ranks (data parallel); a "
                f"library runs one-process graphs")
    ir = saved.ir
    if ir.updates:
        names = ", ".join(name for name, _ in ir.updates[:4]) + (", ..." if len(ir.updates) > 4 else "")
        return (f"graph {saved.name} writes its state every call ({names}); a library shares its state between "
                f"calls and threads. Call model.eval() before tracing (BatchNorm in train mode updates its "
                f"running statistics)")
    for s in ir.state:
        kind = (s.schedule or {}).get("kind", "constant")
        if kind == "philox_offset":
            return (f"graph {saved.name} draws random numbers ({s.name}: the stream of its random ops advances "
                    f"every call); a library runs the same step on shared state. Call model.eval() before tracing "
                    f"(Dropout in train mode draws), or pass the noise in as an input")
        if kind != "constant":
            return (f"graph {saved.name} advances its state every call ({s.name}: {kind}); a library runs the same "
                    f"step on shared state")
    return None


def _tensor_lines(specs, texts) -> list:
    """The header's lines for inputs or outputs; `texts`: each one's shape text with its Dims
    (codegen/dynamic.py host_shapes), None for a fixed shape."""
    return [{"name": t["name"], "dtype": t["dtype"], "shape": text or "[" + ", ".join(map(str, t["shape"])) + "]"}
            for t, text in zip(specs, texts)]


def _host_flags(optimise: list) -> list:
    return ["g++", "-std=c++17", *optimise, "-fPIC"]


def _commands(target: str, library: str, host_object: str, optimise: list, sanitizers: list, kernel_objects: list,
              symbol_script: list, libraries: list) -> dict:
    """The g++ commands of the library, run in OUT: {"host": ..., "link": ...} on the cpu target,
    {"library": ...} on the cuda target. `library`, `host_object`: the files they write;
    `kernel_objects`: the program's kernel objects (cpu); `symbol_script`: [] or the linker
    script that names the kernels' entries back (cached objects name them by their body's hash);
    `libraries`: what the kernels link (OpenBLAS for native cpu kernels)."""
    # Only the C API is exported, and the library's own calls bind to its own definitions (-Bsymbolic):
    # a process may hold several models' libraries, whose API functions share their names.
    exports = ["-Wl,--version-script=library.map", "-Wl,-Bsymbolic", "-ldl"]
    if target == "cuda":
        return {"library": [*_host_flags(optimise), "-shared", "-I.", "-x", "c++", "library.cpp", *sanitizers,
                            *exports, "-o", library]}
    return {"host": [*_host_flags(optimise), "-DFLOWGEN_EMULATOR", "-DFLOWGEN_HOST_UNIT", "-I.", "-c", "-x", "c++",
                     "library.cpp", "-o", host_object],
            "link": ["g++", "-shared", "-fopenmp", *sanitizers, host_object, *kernel_objects, *symbol_script,
                     "-Wl,-z,muldefs", *libraries, *exports, "-o", library]}


def _run(command: list, cwd: Path, source: Path) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        log = " ".join(command) + "\n" + result.stdout + result.stderr
        raise CompileError(command[0], log, source.read_text(), source)


def _cache_key(commands: dict, out: Path, extra: str) -> str:
    """The library's cache key: its commands, the compiler, `extra` and every file they read."""
    digest = hashlib.sha256("\0".join([*(" ".join(c) for c in commands.values()), compiler_version(),
                                       extra]).encode())
    for path in sorted(p for p in out.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".inc", ".map")):
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def build_library(program, saved, out: Path, *, name: str, target: str, optimise: list, sanitizers: list,
                  kernels=None) -> tuple:
    """Render and compile the library of `saved` (its `program`, as program.cu was rendered) into
    `out`, which already holds program.cu and the files it includes; `name` names the library and
    its header (lib<name>.so, <name>.h). `optimise`: the host code's
    g++ optimisation flags (a sanitized build's sanitizer flags); `sanitizers`: the link's
    -fsanitize flags; `kernels`: on the cpu target, cpu_compiler.compile_kernel_objects' build
    of the program's kernels. Returns (manifest entries, one line for the build log, cache hit)."""
    files = library_files(name)
    inputs, outputs = host_shapes(program.dynamic, program.graph)
    serial_reason = _SERIAL_CUDA if target == "cuda" else (_SERIAL_INDEX_CHECKS if program.index_checks else "")
    # Native cpu kernels call OpenBLAS: the library links it (a copy beside it in OUT, found through
    # $ORIGIN), so a C program linking the library needs nothing more.
    libraries = cpu_blas.program_link_flags(out, program.source) if target == "cpu" else []
    # As built by hand in OUT: the kernels compiled from program.cu (its header says how).
    shown = _commands(target, files["library"], "library_host.o", optimise, sanitizers,
                      ["program_kernels.o"] if target == "cpu" else [], [], libraries)
    context = {
        "name": saved.name,
        "version": flowgen.__version__,
        "target": target,
        "library": files["library"],
        "header": files["header"],
        "guard": re.sub(r"[^0-9A-Za-z]", "_", safe_tag(name)).upper(),
        "inputs": _tensor_lines(saved.inputs, [shape and shape[0] for shape in inputs]),
        "outputs": _tensor_lines(saved.outputs, outputs),
        "dims": [] if program.dynamic is None else program.dynamic.dims,
        "serial_reason": serial_reason,
        "index_checks": bool(program.index_checks),
        "build_commands": [f"{what + ':':<8} {' '.join(command)}" for what, command in shown.items()],
    }
    _write(out / files["header"], get_template("library.h.j2").render(**context))
    _write(out / "library.cpp", get_template("library.cpp.j2").render(**context))
    _write(out / "library.map", "{\n  global:\n" + "".join(f"    {name};\n" for name in API_FUNCTIONS)
           + "  local: *;\n};\n")

    kernel_objects = [str(p) for p in kernels.artifacts] if kernels is not None else []
    # The cached kernel objects name each entry by its body's hash; a linker script names them back.
    symbol_map = "".join(f"flowgen_launch_{name} = flowgen_launch_{symbol};\n"
                         for name, (_, symbol) in sorted(kernels.symbols.items()) if name != symbol) if kernels else ""
    key_commands = _commands(target, files["library"], "library_host.o", optimise, sanitizers, kernel_objects, [],
                             libraries)
    cached = cache_dir() / "library" / _cache_key(key_commands, out, symbol_map) / files["library"]
    hit = cached.is_file()
    if hit:
        cache_bound.used(cached.parent)
    else:
        build_dir = cached.parent
        build_dir.mkdir(parents=True, exist_ok=True)
        partial = build_dir / f".{files['library']}.{os.getpid()}"
        if target == "cpu":
            _write(build_dir / "kernel_symbols.ld", symbol_map)
            host_object = str(build_dir / f".library_host.{os.getpid()}.o")
            commands = _commands(target, str(partial), host_object, optimise, sanitizers, kernel_objects,
                                 [str(build_dir / "kernel_symbols.ld")], libraries)
            _run(commands["host"], out, out / "library.cpp")
            _run(commands["link"], out, out / "library.cpp")
            Path(host_object).unlink()
        else:
            library_command = _commands(target, str(partial), "", optimise, sanitizers, [], [], [])["library"]
            _run(library_command, out, out / "library.cpp")
        os.replace(partial, cached)
    copy_file_atomically(cached, out / files["library"])
    line = f"{files['library']} + {files['header']} (C API" + (f"; calls run one at a time: {serial_reason}"
                                                                if serial_reason else "; calls run concurrently") + ")"
    return files, line, hit


def _write(path: Path, text: str) -> None:
    data = text.encode()
    write_file_atomic(path, lambda f: f.write(data))
