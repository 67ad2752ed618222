"""manifest.json of a `flowgen build` directory: what was built (graph, target, compiler, the
program's hash), its inputs, outputs and state, the kernels in launch order with their launch
shapes, the memory plan and how long each build stage took. codegen/aot.py writes it."""
from __future__ import annotations

from flowgen.runtime import cpu_blas
from flowgen.version import __version__

MANIFEST_FORMAT = "flowgen.manifest"
MANIFEST_VERSION = 1


def manifest_for(saved, program, *, target: str, arch: str, compiler: str, name: str, binary: str,
                 program_sha256: str, timings: dict, cpu_kernels: str | None = None,
                 sanitize: str | None = None) -> dict:
    """The manifest of a build. `name`: the program's name (binary, library, header; `--name`);
    `cpu_kernels`: on the cpu target "native" (native kernels where codegen/cpu/ has them) or
    "emulator" (every kernel the CUDA source on the emulator), None on the cuda target."""
    ir = program.graph
    native_kernels = [k.name for k in getattr(program, "prepare", []) + program.kernels if k.native]

    def kernel_json(k):
        return {"name": k.name, "comment": k.comment, "ops": list(k.ops), "grid": list(k.grid),
                "block": list(k.block), "smem": int(k.smem)}

    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "flowgen_version": __version__,
        "graph": saved.name,
        "name": name,
        "binary": binary,
        "target": target,
        "cpu_kernels": cpu_kernels if target == "cpu" else None,
        "arch": arch if target == "cuda" else None,
        "compiler": compiler if target == "cuda" else "g++",
        "sanitize": sanitize,
        "native_kernels": len(native_kernels),
        "blas": cpu_blas.record() if native_kernels else None,
        "training": saved.training,
        "world_size": saved.data_parallel["world_size"] if saved.data_parallel else 1,
        "data_parallel": saved.data_parallel,
        "program_sha256": program_sha256,
        "inputs": saved.signature["inputs"],      # a dynamic dimension at its max
        "outputs": saved.signature["outputs"],
        "dynamic": saved.signature.get("dynamic"),   # the Dims and the input axes that give them, or None
        "size_one_programs": [{"dims_at_1": [program.dynamic.dims[k].name for k in ones],
                               "launches_per_step": p.num_launches, "arena_bytes": p.plan.arena_bytes}
                              for ones, p in (program.dynamic.variants if program.dynamic is not None else [])],
        "state": [{"name": s.name, "shape": list(s.value.shape), "dtype": s.value.dtype.name, "kind": s.kind}
                  for s in ir.state],
        "step": saved.step,
        "prepare_kernels": [kernel_json(k) for k in getattr(program, "prepare", [])],
        "kernels": [kernel_json(k) for k in program.kernels],
        "launches_per_step": program.num_launches,
        "kernels_before_fusion": program.kernels_before_fusion,
        "memory": {"arena_bytes": program.plan.arena_bytes, "lower_bound_bytes": program.plan.lower_bound_bytes,
                   "naive_bytes": program.plan.naive_bytes, "buffers": program.plan.n_buffers,
                   "summary": program.plan.describe()},
        "build_seconds": {k: round(v, 3) for k, v in timings.items()},
    }
