"""The standalone program: render `program.cu` from a saved graph and build it (`flowgen build`).

`render_program` turns a `Program` (kernels in launch order, memory plan, constants) into one
C++ file from `templates/program.cu.j2`: the kernels verbatim, the step as straight-line
launches, arena offsets as named constants, strict safetensors/.npy readers and `main()`.
It mirrors `runtime/executor.py` exactly: bind addresses, copy inputs in, launch in order,
copy state updates back, read outputs.

`build` writes an output directory::

    OUT/program.cu              the program (host + device code)
    OUT/<name>                  the binary (<name>: `name`, by default the graph's name)
    OUT/weights.safetensors     the state it starts from
    OUT/manifest.json           inputs/outputs, state, kernels, memory, program.cu's sha256
    OUT/flowgen_*.h, program_constants.inc[, program_cubin.inc]   (everything program.cu includes)
    OUT/graph.json, constants.safetensors, signature.json   (the saved graph, for `inspect`)

A data-parallel graph (saved with its ``data_parallel`` entry, flowgen/saved_graph.py) becomes
a program that runs as ``mpiexec -n <world size>``: each of its ``all_reduce`` nodes is a host
step between the launches (download, ``MPI_Allreduce`` with ``MPI_SUM`` on one packed buffer per
dtype, the division by the world size for "mean", upload: the Python executor's order and
arithmetic, so the numbers are the same), every rank reads the whole input files and uses its
rows, and rank 0 combines the outputs and writes the results. MPI comes from the ``mpich`` wheel:
its ``mpicxx -show`` gives the compile and link flags, added only for such programs (world size
above 1), so one-process programs build without MPI.

Targets: ``cpu`` compiles the device half with g++ against the emulator header as the emulator's
own cached chunk objects (cpu_compiler.compile_kernel_objects: a graph that ran already compiled
them), the host half as a unit of its own (``-DFLOWGEN_HOST_UNIT``: the kernels only declared,
-O0, cached as an object), and links them; ``cuda`` compiles the device half with NVRTC (or nvcc)
to a cubin embedded in the binary and the host half with g++; the host half opens
``libcuda.so.1`` at run time, so building needs no GPU. program.cu's header lists the commands
that build OUT by hand.

``sanitize`` ("address", "undefined" or "address,undefined") builds the host code (on the cpu
target: the kernels too) with g++'s AddressSanitizer and/or UndefinedBehaviorSanitizer, -O0 -g,
every report fatal; for testing the program against hostile files.

Every file lands atomically (written beside its final name, then renamed) with the permissions
a normal file gets under the process umask: 0644 for files and 0755 for the binary under the
usual umask 022, so a service running as another user can read a deployed build.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flowgen import dtype as dt
from flowgen.codegen import library
from flowgen.codegen.hyper_schedule import schedule_lines
from flowgen.codegen.dynamic import host_shapes
from flowgen.codegen.kernel import BufferArg
from flowgen.codegen.manifest import manifest_for
from flowgen.codegen.target import native_cpu_kernels
from flowgen.codegen.templates import get_template
from flowgen.ir.graph import Value
from flowgen.passes.optimizer import scaler_state_name
from flowgen.runtime import cache_bound, cpu_blas
from flowgen.runtime.cpu_compiler import compile_kernel_objects
from flowgen.runtime.toolchain import (MULDEFS, BuildError, CompileError, cache_dir, compiler_version,
                                      copy_file_atomically, host_command, link_command, mpi_flags, nvcc_command,
                                      program_build_commands, program_kernel_optimisation, runtime_cpp_dir, safe_tag)
from flowgen.saved_graph import (CONSTANTS_FILE, GRAPH_FILE, SIGNATURE_FILE, WEIGHTS_FILE, SavedGraph, load_saved_graph,
                                 write_weights)
from flowgen.serialization import with_self_hash, write_file_atomic
from flowgen.version import __version__

SANITIZERS = ("address", "undefined", "address,undefined")
MAX_DIMS = 8
PROGRAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_DTYPE_ENUM = {dt.float32: "f32", dt.float16: "f16", dt.bfloat16: "bf16", dt.float64: "f64",
               dt.int64: "i64", dt.int32: "i32", dt.bool_: "boolean"}


@dataclass
class BuildResult:
    out_dir: Path
    binary: Path
    manifest: dict
    timings: dict = field(default_factory=dict)   # stage -> seconds


def program_name(name: str | None, graph_name: str) -> str:
    """The name of a build's binary, library and header (OUT/<name>, lib<name>.so, <name>.h):
    `name` (`flowgen build --name`), which must be a C identifier, or by default the graph's name
    made safe for a file name."""
    if name is None:
        return safe_tag(graph_name)
    if not isinstance(name, str) or not PROGRAM_NAME.fullmatch(name):
        raise BuildError(f"--name {name!r}: a program's name must be a C identifier (letters, digits and "
                         f"underscores, not starting with a digit), as it names the binary, lib<name>.so and "
                         f"<name>.h")
    if (runtime_cpp_dir() / f"{name}.h").is_file():
        raise BuildError(f"--name {name}: {name}.h (the library's header) is the name of a runtime header that "
                         f"program.cu includes; choose another name")
    return name


# ----------------------------------------------------------------------------- rendering
class _Names:
    """C identifiers from IR names: `model.0.weight` -> `S_model_0_weight`, unique per prefix."""

    def __init__(self):
        self.used: set = set()

    def __call__(self, prefix: str, name: str) -> str:
        base = prefix + re.sub(r"[^0-9A-Za-z_]", "_", name)
        candidate, n = base, 1
        while candidate in self.used:
            candidate, n = f"{base}_{n}", n + 1
        self.used.add(candidate)
        return candidate


def _c_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _scalar_literal(ctype: str, value) -> str:
    if ctype in ("float", "double"):
        v = float(value)
        if np.isnan(v):
            text = "NAN"
        elif np.isinf(v):
            text = "INFINITY" if v > 0 else "-INFINITY"
        else:
            text = repr(v)
        return f"({ctype}){text}" if ctype == "float" else text
    suffix = {"int": "", "unsigned": "u", "long long": "LL", "unsigned long long": "ULL"}
    if ctype not in suffix:
        raise BuildError(f"a kernel takes a scalar argument of type {ctype!r}, which the program renderer "
                         f"does not know")
    return f"{int(value)}{suffix[ctype]}"


def _tensor_spec(name: str, value, kind: str, dims: list | None = None, text: str | None = None) -> str:
    """A TensorSpec initializer (program_host.cpp.j2); `dims`: an input's Dim per axis (1 + its
    index in DIMS, 0 for a fixed size), `text`: the shape as the help shows it ("[batch,20]")."""
    if len(value.shape) > MAX_DIMS:
        raise BuildError(f"{name} has {len(value.shape)} dimensions; the program supports up to {MAX_DIMS}")
    if value.dtype not in _DTYPE_ENUM:
        raise BuildError(f"{name} is {value.dtype.name}; a standalone program reads and writes "
                         f"{', '.join(d.name for d in _DTYPE_ENUM)} tensors (cast it in build())")
    shape = ", ".join(str(int(d)) for d in value.shape)
    dynamic = "" if text is None else f', {{{", ".join(map(str, dims or []))}}}, "{_c_string(text)}"'
    return f'{{"{_c_string(name)}", DType::{_DTYPE_ENUM[value.dtype]}, {len(value.shape)}, {{{shape}}}, ' \
           f'{value.nbytes}, "{kind}"{dynamic}}}'


def _bytes_literal(symbol: str, data: bytes, comment: str) -> str:
    """`data` as a C string literal, 32 bytes (\\xNN each) per line."""
    escaped = "\\x" + data.hex("|").replace("|", "\\x") if data else ""
    lines = [f"static const unsigned char {symbol}[] =  // {comment}"]
    lines += [f'    "{escaped[start:start + 128]}"' for start in range(0, len(escaped), 128)] or ['    ""']
    lines[-1] += ";"
    return "\n".join(lines) + "\n"


def _producers(graph) -> dict:
    return {v: n for n in graph.nodes for v in n.outputs}


def _describe_value(v, producers) -> str:
    node = producers.get(v)
    if node is None:
        return v.type_str
    if node.op == "fused":
        ops = ", ".join(n.op for n in node.body)
        what = f"fused {ops}"
    else:
        what = node.op
    return f"{v.type_str} {what}" + (f" ({node.scope})" if node.scope else "")


def _collective_entry(k, address, world_size: int) -> dict:
    """A host step of the launch list: an all_reduce (inputs i -> outputs i) run with MPI."""
    if k.ops != ["all_reduce"]:
        raise BuildError(f"{k.name}: the standalone program runs all_reduce between ranks, not "
                         f"{', '.join(k.ops)} (ZeRO and pipelines run in Python only)")
    if k.collective["world_size"] != world_size:
        raise BuildError(f"{k.name}: all_reduce over {k.collective['world_size']} ranks in a graph saved for "
                         f"{world_size}")
    buffers = [a.value for a in k.args]
    half = len(buffers) // 2
    tensors = []
    for x, y in zip(buffers[:half], buffers[half:]):
        if x.dtype not in (dt.float32, dt.float64):
            raise BuildError(f"{k.name}: all_reduce of %{x.name} ({x.dtype.name}); the standalone program "
                             f"all-reduces float32 and float64 tensors")
        tensors.append({"src": address(x)[0], "dst": address(y)[0], "nbytes": x.nbytes,
                        "dtype": _DTYPE_ENUM[x.dtype], "comment": f"%{x.name} -> %{y.name} {x.type_str}"})
    return {"collective": True, "name": k.name, "comment": _one_line(k.comment), "tensors": tensors,
            "mean": k.collective["op"] == "mean"}


def _output_spec(i: int, v, combine: str, world_size: int, text: str | None) -> str:
    """The program's view of output i: the global value (a split output: every rank's rows)."""
    if combine == "split":
        v = Value(v.name, (v.shape[0] * world_size, *v.shape[1:]), v.dtype)
    elif combine in ("sum", "mean") and v.dtype not in (dt.float32, dt.float64):
        raise BuildError(f"output_{i} (%{v.name}, {v.dtype.name}) is combined over the ranks by a {combine}; the "
                         f"standalone program adds float32 and float64 outputs")
    return _tensor_spec(f"output_{i}", v, "output", [], text)


class _StepRender:
    """One program's part of program.cu (a build holds one, or one more per set of Dims at 1,
    codegen/dynamic.py with_variants): its arena offsets, constants, prepared values, launches,
    state write-backs and where its outputs are. `names` makes the C names of the whole file."""

    def __init__(self, program, names, state_cname: dict, world_size: int):
        self.program, self.names, self.world_size = program, names, world_size
        ir = program.graph
        self.producers = _producers(ir)
        self.input_index = {v: i for i, v in enumerate(ir.inputs)}
        self.state_index = {s.value: s.name for s in ir.state}
        self.state_cname = state_cname
        self.const_cname = {v: names("C_", v.name) for v in program.constants}
        # Updates the step writes straight into their state buffer (no arena slot, no copy).
        self.state_writes = program.state_writes
        # Prepare kernels read only state the step never writes: they run once, after the weights
        # are loaded, into buffers of their own (persistent values).
        self.persistent_cname = {v: names("P_", v.name) for v in program.persistent_values}
        self.offsets: dict = {}     # base Value -> context entry, in order of first use

    def base_of(self, v):
        while v in self.program.aliases:
            v = self.program.aliases[v]
        return v

    def address(self, v):
        """(C expression for the address of `v`, base Value)."""
        dynamic = self.program.dynamic
        if dynamic is not None and v is dynamic.value:
            return "m.dims", v
        base = self.base_of(v)
        base = self.state_writes.get(base, base)
        if base in self.input_index:
            return f"m.input[{self.input_index[base]}]", base
        if base in self.state_index:
            return f"m.state[{self.state_cname[self.state_index[base]]}]", base
        if base in self.persistent_cname:
            return f"m.persistent[{self.persistent_cname[base]}]", base
        if base in self.const_cname:
            return f"m.constant[{self.const_cname[base]}]", base
        if base not in self.offsets:
            if base not in self.program.plan.offsets:
                raise BuildError(f"%{base.name} has no place in the memory plan")
            self.offsets[base] = {"cname": self.names("OFF_", base.name), "offset": self.program.plan.offsets[base],
                                  "comment": f"%{base.name} {_describe_value(base, self.producers)}, "
                                             f"{base.nbytes} bytes"}
        return f"m.arena + {self.offsets[base]['cname']}", base

    def launch_entry(self, k, dims: list) -> dict:
        """The template's entry for launching `k`; a grid that follows the Dims (`dims`: the
        build's) is computed from the step's sizes, `m.size`."""
        lines, refs = [], []
        for j, arg in enumerate(k.args):
            if isinstance(arg, BufferArg):
                expr, base = self.address(arg.value)
                if self.base_of(arg.value) in self.state_writes:
                    view = f" (written straight into state %{base.name})"
                else:
                    view = "" if base is arg.value else f" (view of %{base.name})"
                lines.append(f"DevPtr a{j} = {expr};  // {arg.ctype} %{arg.value.name} {arg.value.type_str}{view}")
            else:
                lines.append(f"{arg.ctype} a{j} = {_scalar_literal(arg.ctype, arg.literal)};")
            refs.append(f"&a{j}")
        return {
            "collective": False,
            "name": k.name,
            "cname": self.names("K_", k.name),
            "comment": _one_line(k.comment),
            "comment_c": _c_string(_one_line(k.comment)),
            "smem": int(k.smem),
            "grid": ", ".join(str(int(g)) for g in k.grid) if k.dynamic_grid is None else
                    ", ".join(str(g) if isinstance(g, int) else
                              f"unsigned({g.c_expr(_size_names(self.program, dims, 'm.size'))})"
                              for g in k.dynamic_grid),
            "block": ", ".join(str(int(b)) for b in k.block),
            "arg_lines": lines,
            "args_decl": f"void* args[] = {{{', '.join(refs)}}};" if refs else "void** args = nullptr;",
        }

    def context(self, suffix: str, title: str, dims: list, ones: tuple, output_shapes: list) -> dict:
        """The template's entry for this program: `dims`, every Dim of the build; `ones`, the
        places of those it serves at 1; `output_shapes`, OUTPUTS' shapes (the first program's)."""
        program, ir = self.program, self.program.graph
        prepare = [self.launch_entry(k, dims) for k in program.prepare]
        kernels = [self.launch_entry(k, dims) if k.collective is None else _collective_entry(k, self.address,
                                                                                        self.world_size)
                   for k in program.kernels]
        updates = []
        for state_name, v in ir.updates:
            target_value = next(s.value for s in ir.state if s.name == state_name)
            src, base = self.address(v)
            if base is target_value:
                continue   # the step already wrote the state in place
            updates.append({"dst": f"m.state[{self.state_cname[state_name]}]", "src": src, "nbytes": v.nbytes,
                            "comment": f"{state_name} <- %{v.name}"})
        outputs = [{"value": v.name, "address": self.address(v)[0], "local_nbytes": v.nbytes,
                    "sizes": _output_sizes(program, k, dims, output_shapes[k])} for k, v in enumerate(ir.outputs)]
        width = max((len(o["cname"]) + len(str(o["offset"])) for o in self.offsets.values()), default=0)
        dynamic = program.dynamic
        return {
            "suffix": suffix,
            "title": title,
            "ones": list(ones),
            "reads": [] if dynamic is None else [dims.index(d) for d in dynamic.dims],
            "arena_bytes": program.plan.arena_bytes,
            "memory_line": program.plan.describe(),
            "offsets": [dict(o, pad=" " * (width - len(o["cname"]) - len(str(o["offset"]))))
                        for o in self.offsets.values()],
            "prepare": prepare,
            "kernels": kernels,
            "updates": updates,
            "outputs": outputs,
        }

    def constants(self, inc_parts: list) -> list:
        """Its constant tensors' table entries; their bytes go to `inc_parts` (program_constants.inc)."""
        entries = []
        for v, array in self.program.constants.items():
            data = np.asarray(array, v.dtype.np_dtype).reshape(v.shape).tobytes()
            symbol = self.names("CONST_DATA_", v.name)
            comment = f"%{v.name} {_describe_value(v, self.producers)}, {len(data)} bytes"
            inc_parts.append(_bytes_literal(symbol, data, comment))
            entries.append({"name": v.name, "cname": self.const_cname[v], "symbol": symbol, "nbytes": len(data),
                            "comment": comment})
        return entries

    def persistent(self) -> list:
        return [{"name": v.name, "cname": cname, "nbytes": v.nbytes,
                 "comment": f"%{v.name} {_describe_value(v, self.producers)}"} for v, cname in
                self.persistent_cname.items()]


def _size_names(program, dims: list, vector: str) -> list:
    """The C++ names of `program`'s Dims' sizes, in its order: `vector[j]`, j the Dim's place in the
    build's `dims` (a program for sizes of 1 has fewer Dims than the build)."""
    return [] if program.dynamic is None else [f"{vector}[{dims.index(d)}]" for d in program.dynamic.dims]


def _output_sizes(program, k: int, dims: list, spec_shape) -> list:
    """[(axis, C++ expression of the build's sizes `size[j]`)] for each axis of `program`'s output
    k other than OUTPUTS' `spec_shape`: those that follow the Dims, or a size of 1's program's."""
    fitted = (program.dynamic.output_shapes[k] if program.dynamic is not None
              else list(program.graph.outputs[k].shape))
    names = _size_names(program, dims, "size")
    return [(axis, str(n) if isinstance(n, int) else n.c_expr(names))
            for axis, (n, fixed) in enumerate(zip(fitted, spec_shape)) if not (isinstance(n, int) and n == fixed)]


def render_program(program, *, name: str, training: bool, target: str, arch: str,
                   build_commands: list, data_parallel: dict | None = None) -> tuple:
    """(program.cu text, program_constants.inc text) for `program` (and the programs for sizes of 1
    it holds, codegen/dynamic.py with_variants); `data_parallel` is the saved graph's entry
    (flowgen/saved_graph.py) for a program run by mpiexec, else None."""
    ir = program.graph
    names = _Names()
    state_cname = {s.name: names("S_", s.name) for s in ir.state}
    world_size = data_parallel["world_size"] if data_parallel else 1
    layouts = data_parallel["inputs"] if data_parallel else ["broadcast"] * len(ir.inputs)
    dynamic = program.dynamic
    dims = [] if dynamic is None else dynamic.dims
    input_dims, output_dims = host_shapes(dynamic, ir)
    programs = [((), program)] + ([] if dynamic is None else dynamic.variants)
    for ones, p in programs[1:]:
        if [(s.name, s.value.shape, s.value.dtype) for s in p.graph.state] != \
                [(s.name, s.value.shape, s.value.dtype) for s in ir.state]:
            raise BuildError(f"the program for {', '.join(dims[k].name for k in ones)} = 1 has other state than the "
                             f"one for other sizes")
    renders = [_StepRender(p, names, state_cname, world_size) for _, p in programs]
    output_shapes = [v.shape for v in ir.outputs]
    steps = [r.context("_" + "_".join(f"{dims[k].name}1" for k in ones) if ones else "",
                       " at " + ", ".join(f"{dims[k].name} = 1" for k in ones) if ones else "",
                       dims, ones, output_shapes)
             for r, (ones, _) in zip(renders, programs)]
    inc_parts = [f"// program_constants.inc: the constant tensors of graph {name}, generated by flowgen {__version__} "
                 f"with program.cu.\n"]
    constant_list = [c for r in renders for c in r.constants(inc_parts)]
    combines = data_parallel["outputs"] if data_parallel else ["global"] * len(ir.outputs)
    outputs = [{"spec": _output_spec(i, v, combine, world_size, output_dims[i]), "value": v.name,
                "local_nbytes": v.nbytes, "combine": combine} for i, (v, combine) in enumerate(zip(ir.outputs, combines))]
    index_checks = {}
    for _, p in programs:
        for check in p.index_checks.values():
            parts = check.message_parts()
            if index_checks.setdefault(check.id, parts) != parts:
                raise BuildError(f"index check {check.id} says other things in the programs for different sizes "
                                 f"({index_checks[check.id][0]!r}, {parts[0]!r})")

    def summary(values, label):
        return ", ".join(f"{label(i, v)}: {v.type_str}" for i, v in enumerate(values)) or "none"

    launches = [k for step in steps for k in step["prepare"] + step["kernels"] if not k["collective"]]
    context = {
        "name": name,
        "version": __version__,
        "target": target,
        "arch": arch,
        "training": training,
        "build_commands": build_commands,
        "kernels_source": _device_section(program.source, target, [k["name"] for k in launches]),
        "inputs_summary": summary(ir.inputs, lambda i, v: v.name),
        "outputs_summary": summary(ir.outputs, lambda i, v: f"output_{i} (%{v.name})"),
        "inputs": [{"spec": _tensor_spec(v.name, v, "input", shape and shape[1], shape and shape[0]),
                    "shards": world_size if layout == "split" else 1}
                   for v, layout, shape in zip(ir.inputs, layouts, input_dims)],
        "dims": dims,
        "world_size": world_size,
        "distributed": data_parallel is not None,
        "outputs": outputs,
        "state": [{"spec": _tensor_spec(s.name, s.value, s.kind), "cname": state_cname[s.name]} for s in ir.state],
        "arena_bytes": max(step["arena_bytes"] for step in steps),
        "steps": steps,
        "constants": constant_list,
        "all_kernels": launches,
        "persistent": [p for r in renders for p in r.persistent()],
        "index_checks": [{"id": id_, "before": _c_string(before), "after": _c_string(after)}
                         for id_, (before, after) in index_checks.items()],
        "schedules": schedule_lines(ir),
        "scaler_state": next((j for j, st in enumerate(ir.state) if st.name == scaler_state_name("scale")), -1),
        "tracker_state": next((j for j, st in enumerate(ir.state) if st.name == scaler_state_name("growth_tracker")),
                              -1),
    }
    return get_template("program.cu.j2").render(**context), "\n".join(inc_parts)


def _device_section(source: str, target: str, kernel_names: list) -> str:
    """The device half of program.cu: kernels.cu verbatim. A cpu program compiles it as a unit
    of its own (-DFLOWGEN_DEVICE_PASS), so the host unit (-DFLOWGEN_HOST_UNIT) sees instead
    what the host code uses of it: the index-error record and each kernel's emulator entry."""
    kernels = source.rstrip("\n")
    if target != "cpu":
        return kernels
    entries = [f'extern "C" void flowgen_launch_{name}(const unsigned*, const unsigned*, size_t, void**);'
               for name in dict.fromkeys(kernel_names)]
    return "\n".join([
        "#if defined(FLOWGEN_HOST_UNIT)",
        "// The host unit: the kernels (below, in the #else branch) are compiled on their own and linked in.",
        "#include <cstddef>",
        "struct FlowgenIndexError {  // as flowgen_cuda_prelude.h declares it",
        "  unsigned long long check;",
        "  long long value;",
        "};",
        'extern "C" FlowgenIndexError flowgen_index_error;',
        *entries,
        "#else",
        kernels,
        "#endif  // FLOWGEN_HOST_UNIT",
    ])


# ----------------------------------------------------------------------------- building
def _cubin_inc(cubin: bytes, arch: str) -> str:
    return (f"// program_cubin.inc: the device half of program.cu compiled for {arch} ({len(cubin)} bytes).\n"
            + _bytes_literal("FLOWGEN_CUBIN", cubin, f"cubin for {arch}"))


def _host_build_key(command: list, out: Path) -> str:
    """A host build's cache key: its command, the compiler and every file it reads (program.cu,
    the .inc files it includes, the runtime headers) -- not the graph's or binary's name."""
    digest = hashlib.sha256("\0".join([*command, compiler_version()]).encode())
    for path in sorted(p for p in out.iterdir() if p.suffix in (".cu", ".h", ".inc")):
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def _write(path: Path, data) -> None:
    data = data.encode() if isinstance(data, str) else data
    write_file_atomic(path, lambda f: f.write(data))


def _run_compiler(command: list, cwd: Path, what: str, source_text: str) -> None:
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError(f"{what}: {command[0]} was not found on PATH") from None
    log = " ".join(command) + "\n" + result.stdout + result.stderr
    _write(cwd / f"{what.replace(' ', '_')}.log", log)
    if result.returncode != 0:
        raise CompileError(command[0], log, source_text, cwd / "program.cu")


def _build_cuda_host(out: Path, binary: str, sanitize: str | None, mpi: list, text: str) -> bool:
    """Compile the cuda program's host code (program.cu with the embedded cubin) into OUT/binary
    through `<cache>/host/<key>/program`; True when the cache had it."""
    partial = f".{binary}.partial"
    cached = cache_dir() / "host" / _host_build_key(host_command("cuda", "program", sanitize, mpi), out) / "program"
    hit = cached.is_file()
    if hit:
        cache_bound.used(cached.parent)
        copy_file_atomically(cached, out / partial)
    else:
        _run_compiler(host_command("cuda", partial, sanitize, mpi), out, "compile host code", text)
        copy_file_atomically(out / partial, cached)
    os.replace(out / partial, out / binary)
    return hit


def _build_cpu_host(out: Path, binary: str, sanitize: str | None, mpi: list, text: str, kernels) -> bool:
    """Compile the cpu program's host unit into `<cache>/host/<key>/program_host.o` and link it
    with the kernel objects (`kernels`: cpu_compiler.compile_kernel_objects) into OUT/binary;
    the linked program is cached too. True when both were in the cache."""
    host_object = cache_dir() / "host" / _host_build_key(host_command("cpu", "program_host.o", sanitize, mpi),
                                                         out) / "program_host.o"
    hit = host_object.is_file()
    if hit:
        cache_bound.used(host_object.parent)
    else:
        host_object.parent.mkdir(parents=True, exist_ok=True)
        partial_object = host_object.parent / f".program_host.{os.getpid()}.o"
        _run_compiler(host_command("cpu", str(partial_object), sanitize, mpi), out, "compile host code", text)
        os.replace(partial_object, host_object)
    # The kernel objects name each kernel's entry by its body's hash (shared between graphs, and
    # with the emulator's libraries); a linker script defines the program's names as those.
    symbol_map = "".join(f"flowgen_launch_{name} = flowgen_launch_{symbol};\n"
                         for name, (_, symbol) in sorted(kernels.symbols.items()) if name != symbol)
    objects = [str(host_object), *map(str, kernels.artifacts)]
    link_flags = [MULDEFS, *cpu_blas.program_link_flags(out, text)]
    key = hashlib.sha256("\0".join([*link_command("program", [*objects, "kernel_symbols.ld", *link_flags],
                                                   sanitize, mpi), compiler_version(), symbol_map]).encode())
    link_dir = cache_dir() / "host" / key.hexdigest()[:32]
    if (link_dir / "program").is_file():
        cache_bound.used(link_dir)
    else:
        hit = False
        link_dir.mkdir(parents=True, exist_ok=True)
        _write(link_dir / "kernel_symbols.ld", symbol_map)
        partial = link_dir / f".program.{os.getpid()}"
        command = link_command(str(partial), [*objects, str(link_dir / "kernel_symbols.ld"), *link_flags], sanitize,
                               mpi)
        _run_compiler(command, out, "link", text)
        os.replace(partial, link_dir / "program")
    partial = f".{binary}.partial"
    copy_file_atomically(link_dir / "program", out / partial)
    os.replace(out / partial, out / binary)
    return hit


def build(source, out_dir, *, target: str = "cuda", arch: str = "sm_90", compiler: str = "nvrtc",
          sanitize: str | None = None, lib: bool = False, name: str | None = None, log=None) -> BuildResult:
    """Build the program for a saved graph (`source`: a `flow.save(graph, dir)` directory or a
    `SavedGraph`) into `out_dir`; `sanitize` is None or one of SANITIZERS; `lib`: also the shared
    library with the C API (codegen/library.py); `name`: the binary's, library's and header's
    name (a C identifier; default: the graph's name, `program_name`). `log(text)` receives one
    line per finished stage."""
    log = log or (lambda text: None)
    if target not in ("cpu", "cuda", "emulator"):
        raise BuildError(f"unknown target {target!r}; use cpu, cuda or emulator")
    if compiler not in ("nvrtc", "nvcc"):
        raise BuildError(f"unknown device compiler {compiler!r}; use nvrtc or nvcc")
    if sanitize is not None and sanitize not in SANITIZERS:
        raise BuildError(f"unknown sanitizer {sanitize!r}; use one of {', '.join(SANITIZERS)}")
    if target == "cuda" and compiler == "nvcc" and shutil.which("nvcc") is None:
        raise BuildError("--compiler nvcc: nvcc is not on PATH (install the CUDA toolkit, or use the default "
                         "--compiler nvrtc, which needs only the pip wheels)")
    timings: dict = {}
    total = time.perf_counter()

    def begin(key: str) -> float:
        log(f"  {key:<22} ...")
        return time.perf_counter()

    def stage(key: str, text: str, start: float):
        timings[key] = time.perf_counter() - start
        log(f"  {key:<22} {timings[key]:7.2f} s   {text}")

    start = time.perf_counter()
    saved = source if isinstance(source, SavedGraph) else load_saved_graph(source)
    binary = program_name(name, saved.name)
    # A cpu program's kernels: native where codegen/cpu/ has them, or every kernel the CUDA source on
    # the emulator ("emulator": --target emulator, or $FLOWGEN_CPU_KERNELS=emulator), decided once
    # here and recorded in the manifest, so that `flowgen inspect` describes what was built.
    if target == "emulator":
        cpu_kernels, target = "emulator", "cpu"
    else:
        cpu_kernels = ("native" if native_cpu_kernels() else "emulator") if target == "cpu" else None
    refusal = library.refusal(saved) if lib else None
    if refusal:
        raise BuildError(f"--lib: {refusal}")
    # A 'cuda' program is rendered for the GPU `arch` names: on sm_90 its bf16/fp16 (and tf32)
    # GEMMs and convs use warpgroup MMA, and its device code compiles for sm_90a.
    program = saved.program(target, arch=arch if target == "cuda" else None,
                            native=None if cpu_kernels is None else cpu_kernels == "native")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    world_size = saved.data_parallel["world_size"] if saved.data_parallel else 1
    mpi = mpi_flags() if world_size > 1 else []
    if target == "cuda":
        # Imported here, not at the top: cuda-python's NVRTC bindings load only when a build targets CUDA.
        from flowgen.runtime import nvrtc

        device_arch = nvrtc.cubin_arch(program.source, arch)   # sm_90a for warpgroup MMA
    libraries = tuple(cpu_blas.link_flags()) if target == "cpu" and cpu_blas.uses_blas(program.source) else ()
    commands = program_build_commands(target, binary, sanitize, mpi, compiler,
                                      device_arch if target == "cuda" else arch, libraries)
    text, constants_inc = render_program(program, name=saved.name, training=saved.training, target=target,
                                         arch=device_arch if target == "cuda" else arch, build_commands=commands,
                                         data_parallel=saved.data_parallel)
    runtime = runtime_cpp_dir()
    for header in sorted(runtime.glob("*.h")):   # the kernels' headers, so OUT builds on its own
        _write(out / header.name, header.read_bytes())
    _write(out / "program.cu", text)
    _write(out / "program_constants.inc", constants_inc)
    if saved.path is not None and Path(saved.path).resolve() != out:
        for name in (CONSTANTS_FILE, SIGNATURE_FILE):
            _write(out / name, (Path(saved.path) / name).read_bytes())
    stage("render", f"program.cu: {text.count(chr(10))} lines, {len(program.kernels)} kernels, "
                    f"arena {program.plan.arena_bytes} bytes", start)

    if target == "cuda":
        start = begin("compile device code")
        if compiler == "nvrtc":
            # The device half of program.cu is kernels.cu verbatim; compiling that (not program.cu,
            # whose host half names the graph) lets every graph instance share the cached cubin.
            cubin = nvrtc.compile_cuda(program.source, arch, "aot")
        else:
            _run_compiler(nvcc_command(device_arch), out, "compile device code", text)
            cubin = (out / "program.cubin").read_bytes()
        _write(out / "program_cubin.inc", _cubin_inc(cubin, device_arch))
        stage("compile device code", f"{compiler} -> {device_arch} cubin, {len(cubin)} bytes, embedded", start)
        start = begin("compile host code")
        hit = _build_cuda_host(out, binary, sanitize, mpi, text)
        what = "g++ (driver API via dlopen)" + (f", MPI for {world_size} ranks" if mpi else "")
    else:
        start = begin("compile device code")
        kernels = compile_kernel_objects(program.source, program_kernel_optimisation(sanitize))
        counts = kernels.stats
        stage("compile device code", f"g++ + emulator: {counts.kernels} kernels, {counts.distinct} distinct: "
                                     f"{counts.cached} cached, {counts.compiled} compiled in {counts.chunks} "
                                     f"chunk(s)", start)
        start = begin("compile host code")
        hit = _build_cpu_host(out, binary, sanitize, mpi, text, kernels)
        what = "g++ host unit, linked with the kernels" + (f", MPI for {world_size} ranks" if mpi else "")
    stage("compile host code", f"{what} -> {out / binary}" + (f" [-fsanitize={sanitize}]" if sanitize else "")
          + (" (cached)" if hit else ""), start)
    if lib:
        start = begin("build library")
        library_entries, what, hit = library.build_library(
            program, saved, out, name=binary, target=target, optimise=program_kernel_optimisation(sanitize) or ["-O1"],
            sanitizers=[f"-fsanitize={sanitize}"] if sanitize else [], kernels=kernels if target == "cpu" else None)
        stage("build library", what + (" (cached)" if hit else ""), start)

    start = time.perf_counter()
    weights = io.BytesIO()
    write_weights(saved.weights, weights, saved.name, saved.step, saved.skipped)
    _write(out / WEIGHTS_FILE, weights.getvalue())
    if saved.path is not None:
        # OUT is a saved graph too (`flowgen inspect OUT`): graph.json records the weights' hash,
        # and SavedGraph.run may have changed them since saving.
        doc = json.loads((Path(saved.path) / GRAPH_FILE).read_text())
        doc.pop("graph_sha256")
        doc["weights_sha256"] = hashlib.sha256(weights.getvalue()).hexdigest()
        _write(out / GRAPH_FILE, json.dumps(with_self_hash(doc, "graph_sha256"), indent=1) + "\n")
    nbytes = sum(a.nbytes for a in saved.weights.values())
    stage("write weights", f"{WEIGHTS_FILE}: {len(saved.weights)} tensors, {nbytes} bytes", start)
    timings["total"] = time.perf_counter() - total

    manifest = manifest_for(saved, program, target=target, cpu_kernels=cpu_kernels, arch=arch, compiler=compiler,
                            name=binary, binary=binary,
                            program_sha256=hashlib.sha256(text.encode()).hexdigest(), timings=timings,
                            sanitize=sanitize)
    if lib:
        manifest.update(library_entries)
    _write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return BuildResult(out, out / binary, manifest, timings)
