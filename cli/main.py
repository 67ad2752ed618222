"""`flowgen`: build, run and inspect graphs saved with `flow.save(graph, dir)`.

    flowgen build SAVED_DIR|MODEL.pt2|MODEL.onnx -o BUILD_DIR [--target cpu|cuda|emulator] [--arch sm_90]
                  [--compiler nvrtc|nvcc] [--sanitize address|undefined|address,undefined] [--lib] [--name NAME]
    flowgen run BUILD_DIR INPUT.npy... -o RESULTS_DIR [--steps N] [--nproc N]
    flowgen inspect SAVED_DIR|BUILD_DIR|MODEL.pt2|MODEL.onnx [--source] [--ir] [--memory]
    flowgen bench BUILD_DIR INPUT.npy... [--steps N] [--json FILE]

SAVED_DIR is what `flow.save(graph, dir)` wrote, BUILD_DIR what `flowgen build` wrote (the
program), RESULTS_DIR where `flowgen run` writes outputs and trained weights. MODEL.pt2 is a
program written by `torch.export.save` (imported with flow.from_torch; needs torch), MODEL.onnx an
ONNX model (needs the onnx package): each is imported and saved as a graph first
(flowgen/frontends/model_files.py).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import contextlib

import click

# `--sanitize`'s choices, spelled here so that `--help` does not import the compiler; the same
# tuple as flowgen.codegen.aot.SANITIZERS (tests/test_cli.py checks), which `build` validates again.
SANITIZERS = ("address", "undefined", "address,undefined")


def _flowgen():
    """The flowgen package with the compiler modules the commands use, imported on first use.

    The one place this module imports flowgen, and only for start-up time: `import flowgen` loads
    NumPy, Jinja2 and every op (about half a second), which `flowgen --help` and `--version` do not
    need. It is not a way around an import cycle; a command calls this when it starts its work.
    """
    import flowgen.codegen.aot
    import flowgen.frontends.model_files
    import flowgen.runtime.toolchain
    import flowgen.saved_graph
    import flowgen.serialization

    return flowgen


def _fail(message: str):
    raise click.ClickException(message)


def _load(path: str):
    flowgen = _flowgen()
    is_saved_graph, load_saved_graph = flowgen.saved_graph.is_saved_graph, flowgen.saved_graph.load_saved_graph
    CheckpointError = flowgen.serialization.CheckpointError

    if not is_saved_graph(path):
        _fail(f"{path} is not a saved graph: it has no graph.json (write one with flow.save(graph, dir) after "
              f"calling the graph once)")
    try:
        return load_saved_graph(path)
    except CheckpointError as e:
        _fail(str(e))


@contextlib.contextmanager
def _saved_graph_dir(path: str):
    """`path` if it is a directory, else the model file `path` (.pt2, .onnx) imported and saved as a
    graph in a temporary directory, for as long as the command runs."""
    if Path(path).is_dir():
        yield path
        return
    model_files = _flowgen().frontends.model_files
    if Path(path).suffix not in model_files.MODEL_FILE_SUFFIXES:
        _fail(f"{path} is neither a saved graph directory nor a model file flowgen imports "
              f"({', '.join(model_files.MODEL_FILE_SUFFIXES)})")
    with tempfile.TemporaryDirectory(prefix="flowgen-import-") as directory:
        try:
            model_files.save_model_file(path, directory)
        except ImportError as e:
            _fail(f"{path}: {e} (.pt2 files need torch, .onnx files the onnx package: pip install 'flowgen[onnx]')")
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            _fail(f"{path}: {e}")
        yield directory


def _read_manifest(out: str) -> dict:
    path = Path(out) / "manifest.json"
    if not path.is_file():
        _fail(f"{out} is not a flowgen build directory: manifest.json is missing (run `flowgen build` first)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(f"{path} is corrupt: {e}")


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, the same as `flowgen.__version__`),
    read from its metadata so that `--version` does not import flowgen; a source checkout that
    was never installed falls back to importing it."""
    try:
        return importlib.metadata.version("flowgen")
    except importlib.metadata.PackageNotFoundError:
        return _flowgen().__version__


def _print_version(ctx, param, value):
    """`--version`, as click.version_option prints it, but with the version looked up only when asked."""
    if value and not ctx.resilient_parsing:
        click.echo(f"flowgen, version {_version()}", color=ctx.color)
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
def cli():
    """flowgen: an ahead-of-time compiler for neural networks that emits readable CUDA C++.

    Save a graph with `flow.save(graph, SAVED_DIR)` after calling it once, then build it into a
    standalone program, run it, or look inside.
    """


@cli.command()
@click.argument("saved_dir", metavar="SAVED_DIR|MODEL.pt2|MODEL.onnx", type=click.Path(exists=True))
@click.option("-o", "--out", "out_dir", metavar="BUILD_DIR", required=True, type=click.Path(file_okay=False),
              help="Where the program goes: program.cu, the binary, weights.safetensors, manifest.json.")
@click.option("--target", type=click.Choice(["cpu", "cuda", "emulator"]), default="cuda", show_default=True,
              help="cuda: GPU binary (builds without a GPU); cpu: runs anywhere, GEMMs and convs through OpenBLAS, "
                   "the other kernels on the CPU emulator; emulator: every kernel the CUDA source on the emulator.")
@click.option("--arch", default="sm_90", show_default=True,
              help="GPU architecture the program is rendered and compiled for (cuda target); sm_90 uses Hopper's "
                   "warpgroup MMA (an sm_90a cubin), others mma.sync.")
@click.option("--compiler", type=click.Choice(["nvrtc", "nvcc"]), default="nvrtc", show_default=True,
              help="Device compiler for the cuda target; nvcc must be on PATH.")
@click.option("--sanitize", type=click.Choice(SANITIZERS), default=None,
              help="Build with g++'s AddressSanitizer and/or UndefinedBehaviorSanitizer (-O0 -g, every report "
                   "fatal): for testing the program against hostile input files.")
@click.option("--lib", is_flag=True,
              help="Also build BUILD_DIR/lib<name>.so and <name>.h: the graph as a shared library with a C API "
                   "(inference graphs; load it from Python with flow.load_compiled(BUILD_DIR)).")
@click.option("--name", metavar="NAME", default=None,
              help="The program's name, a C identifier: the binary BUILD_DIR/<name>, and with --lib lib<name>.so "
                   "and <name>.h (default: the graph's name, e.g. InferGraph_0).")
def build(saved_dir, out_dir, target, arch, compiler, sanitize, lib, name):
    """Build the standalone program for the graph saved in SAVED_DIR (by `flow.save(graph, dir)`), or
    an inference program for the model in MODEL.pt2 (by `torch.export.save`; for its example inputs'
    shapes) or MODEL.onnx (for its static input shapes).

    Renders BUILD_DIR/program.cu (kernels + host code), compiles it to BUILD_DIR/<name> (--name, by
    default the graph's name), and writes BUILD_DIR/weights.safetensors and BUILD_DIR/manifest.json.
    With --lib, also the shared library BUILD_DIR/lib<name>.so and its C header BUILD_DIR/<name>.h.
    """
    start = time.perf_counter()
    with _saved_graph_dir(saved_dir) as directory:
        _build(saved_dir, directory, out_dir, target, arch, compiler, sanitize, lib, name, start)


def _build(source, saved_dir, out_dir, target, arch, compiler, sanitize, lib, name, start):
    flowgen = _flowgen()
    BuildError, build_program = flowgen.codegen.aot.BuildError, flowgen.codegen.aot.build
    CompileError = flowgen.runtime.toolchain.CompileError
    saved = _load(saved_dir)
    kind = "training" if saved.training else "inference"
    click.echo(f"flowgen build: {saved.name} ({kind}) -> {out_dir} [target {target}"
               f"{', ' + arch + ' via ' + compiler if target == 'cuda' else ''}]", err=True)
    click.echo(f"  {'load':<22} {time.perf_counter() - start:7.2f} s   {source}", err=True)
    try:
        result = build_program(saved, out_dir, target=target, arch=arch, compiler=compiler, sanitize=sanitize,
                               lib=lib, name=name, log=lambda line: click.echo(line, err=True))
    except (BuildError, CompileError, ValueError) as e:
        _fail(str(e))
    built = result.binary if not lib else f"{result.binary} and {result.out_dir / result.manifest['library']}"
    click.echo(f"built {built} in {time.perf_counter() - start:.2f} s", err=True)


@cli.command()
@click.argument("out_dir", metavar="BUILD_DIR", type=click.Path(exists=True, file_okay=False))
@click.argument("inputs", metavar="INPUT.npy...", nargs=-1, type=click.Path())
@click.option("-o", "--out", "result_dir", metavar="RESULTS_DIR", required=True, type=click.Path(file_okay=False),
              help="Where results go: output_<i>.npy; for training also weights.safetensors and losses.npy.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training: number of steps (default: one per input batch).")
@click.option("--weights", type=click.Path(dir_okay=False), default=None,
              help="State to start from (default: BUILD_DIR/weights.safetensors).")
@click.option("--log-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="Training: print the loss every K steps.")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Ranks to start with mpiexec (default: the world size the graph was saved with; 1 runs the "
                   "program directly).")
def run(out_dir, inputs, result_dir, steps, weights, log_every, nproc):
    """Run the program `flowgen build` wrote to BUILD_DIR on the given .npy inputs (one per
    graph input, in order), writing the results to RESULTS_DIR.

    Inference graphs write each output as RESULTS_DIR/output_<i>.npy. Training graphs run --steps
    steps; an input whose first dimension is k times the traced one holds k batches, used in
    order and wrapping. The loss is printed as the steps run, and the updated weights and
    optimizer state are written to RESULTS_DIR/weights.safetensors. Momentum first steps, Adam's
    bias corrections, dropout offsets and closed-form LR schedules advance per step as in
    Python (LambdaLR/SequentialLR keep the saved learning rate); a GradScaler skips steps whose
    gradients overflow and backs off or grows its scale.

    A data-parallel graph's program runs as `mpiexec -n N` (N: the world size it was saved with):
    every rank reads the whole input files and takes its rows of each batch; rank 0 prints and
    writes the results.
    """
    manifest = _read_manifest(out_dir)
    binary = Path(out_dir) / manifest["binary"]
    if not binary.is_file():
        _fail(f"{binary} is missing; rebuild with `flowgen build`")
    command = _launcher(manifest.get("world_size", 1), nproc)
    command += [str(binary), "--weights", weights or str(Path(out_dir) / "weights.safetensors")]
    for path in inputs:
        command += ["--input", path]
    command += ["--out", result_dir, "--log-every", str(log_every)]
    if steps is not None:
        command += ["--steps", str(steps)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        click.echo(line, nl=False)
    code = proc.wait()
    if code < 0:
        _fail(f"{binary.name} was killed by signal {-code}")
    if code != 0:
        sys.exit(code)


def _launcher(world_size: int, nproc: int | None) -> list:
    """The command prefix that starts the program: nothing for one process, else `mpiexec -n N`
    (the mpiexec next to this Python, as `pip install mpich` puts it, or the first on PATH)."""
    nproc = world_size if nproc is None else nproc
    if nproc != world_size:
        _fail(f"--nproc {nproc}: the program was built for a graph saved on {world_size} rank(s); it runs on "
              f"exactly that many (save the graph from a run on {nproc} ranks to get a program for them)")
    if nproc == 1:
        return []
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    mpiexec = shutil.which("mpiexec", path=search)
    if mpiexec is None:
        _fail(f"--nproc {nproc}: no mpiexec next to {sys.executable} or on PATH; install MPI with "
              f"`pip install mpich`")
    return [mpiexec, "-n", str(nproc)]


@cli.command()
@click.argument("out_dir", metavar="BUILD_DIR", type=click.Path(exists=True, file_okay=False))
@click.argument("inputs", metavar="INPUT.npy...", nargs=-1, type=click.Path())
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps to time in one run of the program (inference: the same step repeated).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the result as JSON to this file (atomically).")
def bench(out_dir, inputs, steps, json_path):
    """Time the program built in BUILD_DIR: one process runs --steps steps on the given inputs and
    reports its own clock (file I/O and start-up excluded), so the number is the step time."""
    manifest = _read_manifest(out_dir)
    binary = Path(out_dir) / manifest["binary"]
    if not binary.is_file():
        _fail(f"{binary} is missing; rebuild with `flowgen build`")
    with tempfile.TemporaryDirectory(prefix="flowgen-bench-") as results:
        command = _launcher(manifest.get("world_size", 1), None)   # a data-parallel program: all its ranks
        command += [str(binary), "--weights", str(Path(out_dir) / "weights.safetensors")]
        for path in inputs:
            command += ["--input", path]
        command += ["--out", results, "--steps", str(steps), "--log-every", str(steps)]
        proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        click.echo(proc.stderr, err=True, nl=False)
        sys.exit(proc.returncode if proc.returncode > 0 else 1)
    found = re.search(r"(\d+) step\(s\) on (.+) in ([0-9.]+) s", proc.stderr)
    if not found:
        _fail(f"{binary.name} did not report its timing:\n{proc.stderr}")
    seconds = float(found.group(3))
    result = {"graph": manifest.get("graph", binary.name), "device": found.group(2), "steps": steps,
              "seconds": seconds, "ms_per_step": seconds / steps * 1e3, "target": manifest.get("target"),
              "cpu_kernels": _cpu_kernels(manifest) if manifest.get("target") == "cpu" else None}
    click.echo(f"{'graph':<24}{'device':<28}{'steps':>8}{'total s':>10}{'ms/step':>10}")
    click.echo(f"{result['graph']:<24}{result['device'][:27]:<28}{steps:>8}{seconds:>10.3f}"
               f"{result['ms_per_step']:>10.3f}")
    if json_path:
        data = json.dumps(result, indent=2).encode()
        _flowgen().serialization.write_file_atomic(json_path, lambda f: f.write(data))
        click.echo(f"wrote {json_path}")


def _format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _io_lines(entries) -> list:
    return [f"    {e['name']}: {e['dtype']}{list(e['shape'])}" for e in entries]


@cli.command()
@click.argument("path", metavar="SAVED_DIR|BUILD_DIR|MODEL.pt2|MODEL.onnx", type=click.Path(exists=True))
@click.option("--source", is_flag=True, help="Print the generated source (program.cu of a build, else kernels.cu).")
@click.option("--ir", is_flag=True, help="Print the optimised IR.")
@click.option("--memory", is_flag=True, help="Print the arena layout: every intermediate value's offset and lifetime.")
def inspect(path, source, ir, memory):
    """Summarise a saved graph (SAVED_DIR), a build (BUILD_DIR) or a model file (MODEL.pt2 or
    MODEL.onnx, as it would be built): inputs/outputs, kernels and what each fuses, launches per step, arena size against its
    lower bound."""
    with _saved_graph_dir(path) as directory:
        _inspect(directory, source, ir, memory)


def _cpu_kernels(manifest: dict) -> str:
    """What a cpu build's kernels are, "native" or "emulator", as its manifest records it; a manifest
    written before flowgen recorded it had native kernels exactly when it counted some."""
    return manifest.get("cpu_kernels") or ("native" if manifest.get("native_kernels") else "emulator")


def _built_program(saved, manifest: dict):
    """The program a build compiled, rendered again as the manifest says it was: for its target, its
    GPU architecture and (cpu) its kernels, whatever $FLOWGEN_CPU_KERNELS says now."""
    if manifest["target"] == "cpu":
        return saved.program("cpu", native=_cpu_kernels(manifest) == "native")
    return saved.program(manifest["target"], arch=manifest.get("arch"))


def _inspect(path, source, ir, memory):
    manifest = None
    if (Path(path) / "manifest.json").is_file():
        manifest = _read_manifest(path)
    saved = _load(path)
    # a build's program as it was rendered, else the any-sm_80 one
    program = _built_program(saved, manifest) if manifest else saved.program("cuda")
    plan = program.plan
    kind = "training" if saved.training else "inference"
    lines = [f"graph {saved.name} ({kind}, saved at step {saved.step})"]
    if manifest:
        if manifest["target"] == "cpu":
            how = (f"{manifest['compiler']}, every kernel the CUDA source on the emulator"
                   if _cpu_kernels(manifest) == "emulator"
                   else f"{manifest['compiler']}, native kernels where flowgen has them")
            built_for = f"cpu ({how})"
        else:
            arch = f" {manifest['arch']}" if manifest.get("arch") else ""
            built_for = f"{manifest['target']}{arch} ({manifest['compiler']})"
        lines.append(f"  build: {manifest['binary']} for {built_for}, flowgen {manifest['flowgen_version']}, "
                     f"program.cu sha256 {manifest['program_sha256'][:16]}...")
        built_kernels = [k["name"] for k in manifest.get("prepare_kernels", []) + manifest.get("kernels", [])]
        if built_kernels != [k.name for k in getattr(program, "prepare", []) + program.kernels]:
            lines.append(f"  note: this flowgen ({_version()}) renders the graph into other kernels than the build "
                         f"did (flowgen {manifest['flowgen_version']}); the kernels and memory below are this "
                         f"version's, program.cu (--source) is what was built")
    lines.append("  inputs:")
    lines += _io_lines(saved.inputs)
    lines.append("  outputs:")
    lines += _io_lines(saved.outputs)
    if saved.dynamic is not None:   # the shapes above are at the Dims' maxima
        d = saved.dynamic
        lines.append("  dynamic dimensions: " + ", ".join(
            f"{dim.name} {dim.min}..{dim.max} (" + ", ".join(f"input {u.input} axis {u.axis}" for u in d.uses[dim]) + ")"
            for dim in d.dims) + (f"; {len(d.variants)} more program(s) for sizes of 1" if d.variants else ""))
    state_bytes = sum(a.nbytes for a in saved.weights.values())
    kinds: dict = {}
    for s in saved.ir.state:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    lines.append(f"  state: {len(saved.ir.state)} tensors, {_format_bytes(state_bytes)} "
                 f"({', '.join(f'{n} {k}' for k, n in kinds.items())})")
    lines.append(f"  launches per step: {program.num_launches} (one kernel per op would be "
                 f"{program.kernels_before_fusion})")
    lines.append(f"  memory: arena {_format_bytes(plan.arena_bytes)}, lower bound {_format_bytes(plan.lower_bound_bytes)}"
                 f", naive {_format_bytes(plan.naive_bytes)} ({plan.n_buffers} buffers)")
    def kernel_lines(kernels):
        for i, k in enumerate(kernels):
            fuses = f"  [fuses {len(k.ops)} ops: {', '.join(k.ops)}]" if len(k.ops) > 1 else ""
            lines.append(f"    {i:>3} {k.name}: {k.comment}{fuses}")

    prepare = getattr(program, "prepare", [])
    if prepare:
        lines.append("  prepare kernels (run once: they read only state the step never writes):")
        kernel_lines(prepare)
    lines.append("  kernels:")
    kernel_lines(program.kernels)
    click.echo("\n".join(lines))
    if memory:
        click.echo("\narena layout (offset, bytes, live from step to step, value):")
        rows = sorted(plan.offsets.items(), key=lambda kv: (kv[1], plan.lifetimes.get(kv[0], (0, 0))))
        for value, offset in rows:
            first, last = plan.lifetimes.get(value, ("?", "?"))
            alias = f" -> %{program.aliases[value].name}" if value in program.aliases else ""
            click.echo(f"  {offset:>10} {value.nbytes:>10}  [{first}, {last}]  %{value.name} {value.type_str}{alias}")
    if ir:
        click.echo("\n" + str(saved.ir))
    if source:
        program_cu = Path(path) / "program.cu"
        click.echo("\n" + (program_cu.read_text() if manifest and program_cu.is_file() else program.source))


def main(argv=None):
    """Console entry point (`flowgen = flowgen_cli.main:main`: a top-level package, because importing
    anything under `flowgen.` first runs flowgen/__init__.py, which loads all of flowgen)."""
    cli.main(args=argv, prog_name="flowgen")


if __name__ == "__main__":
    main()
