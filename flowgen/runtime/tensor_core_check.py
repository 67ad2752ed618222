"""A safety net for GPUs nobody here has tried: the first time a program's tensor-core kernels
(mma.sync or warpgroup MMA: GEMMs, implicit-GEMM convs, tiled attention) run on a GPU, each is
checked once against the SIMT kernels of the same node on the same data.

On the executor's first step, for every group of tensor-core kernels (a kernel, plus the ones
reading its scratch: a split-k combine, attention's dK/dV after dQ) whose verdict is not cached:
the node's SIMT kernels (the program's graph rendered with `rendering_for(tensor_cores=False)`)
run first, into buffers of their own, reading the same inputs; then the program's kernels run as
usual; then what both wrote is compared (||tensor cores - SIMT|| / ||SIMT|| per value, under the
precision's limit; non-finite values must match). The verdict is cached under
`$FLOWGEN_CACHE/tensor-core-check/`, keyed by the GPU (name, architecture, driver) and the
kernels' bodies and launch shapes, so later calls and processes do not pay again. A mismatch
warns, naming the kernel, the value and the error; the SIMT kernels' results replace the wrong
ones for the rest of that step, and the executor runs the SIMT kernels in the tensor-core
kernels' place from then on (a cached mismatch: from the first step).

FLOWGEN_TENSOR_CORE_CHECK: "1" (default) checks on GPUs, "0" turns the check off, "always" checks
on the CPU emulator too (tests: a tensor-core result can be made wrong there). What the first
call checked, found and cost is `executor.tensor_core_check` (None when nothing was checked).
A step with dynamic dimensions is not checked (`wanted`).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from flowgen.codegen.kernel import BufferArg
from flowgen.codegen.program import KERNELS_HEADER, render_kernels
from flowgen.codegen.target import rendering_for
from flowgen.runtime.kernel_cache import KernelUnit
from flowgen.runtime.toolchain import atomic_write_bytes, cache_dir

ENVIRONMENT_VARIABLE = "FLOWGEN_TENSOR_CORE_CHECK"
# How a kernel's comment names its tensor-core precision and instructions ("bf16 wgmma").
TENSOR_CORE_KERNEL = re.compile(r"\b(bf16|f16|tf32) (mma\.sync|wgmma)\b")
# ||tensor cores - SIMT|| / ||SIMT|| that passes: both sum exact products in fp32 (in other orders),
# TF32 rounds its inputs to 10 bits first; a 16-bit output may round to a neighbouring value.
KIND_LIMIT = {"tf32": 5e-3, "bf16": 1e-3, "f16": 1e-3}
OUTPUT_LIMIT = {"bfloat16": 1e-2, "float16": 2e-3}
_CHUNK = 1 << 22   # elements compared at a time (float64 copies of a chunk, not of a whole activation)


def mode() -> str:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "1")
    if value not in ("0", "1", "always"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: expected 1 (check on GPUs, the default), 0 (off) "
                         f"or always (the CPU emulator too)")
    return value


def wanted(backend, program) -> bool:
    """Whether an executor of `program` on `backend` checks its tensor-core kernels on its first
    step. Not a step with dynamic dimensions: its SIMT kernels would be rendered at the maximum
    sizes (codegen/dynamic.py fits the program's kernels, not the references), so they would
    compute another problem than the call's."""
    if program.dynamic is not None:
        return False
    return mode() == "always" or (mode() == "1" and backend.name == "cuda")


@dataclass
class Group:
    """Tensor-core kernels of one node, by their positions in the program's launch order, and the
    graph values they write."""
    indices: list
    kernels: list
    outputs: list
    kind: str
    reference: list = field(default_factory=list)   # the node's SIMT kernels


def _written(kernel) -> list:
    return [a.value for a in kernel.args if isinstance(a, BufferArg) and not a.ctype.startswith("const")]


def _read(kernel) -> list:
    return [a.value for a in kernel.args if isinstance(a, BufferArg) and a.ctype.startswith("const")]


def _with_scratch_readers(kernels: list, first: int, produced: set) -> list:
    """`first` and the kernels after it that read scratch (values no graph node produces) written
    by those before: the whole job of one node."""
    indices, scratch = [first], {v for v in _written(kernels[first]) if v not in produced}
    for j in range(first + 1, len(kernels)):
        if scratch & set(_read(kernels[j])):
            indices.append(j)
            scratch |= {v for v in _written(kernels[j]) if v not in produced}
    return indices


def tensor_core_groups(program) -> list:
    produced = set(program.graph.producers())
    kernels, groups, claimed = program.kernels, [], set()
    for i, kernel in enumerate(kernels):
        found = TENSOR_CORE_KERNEL.search(kernel.comment)
        if i in claimed or kernel.collective is not None or not found:
            continue
        indices = _with_scratch_readers(kernels, i, produced)
        claimed.update(indices)
        outputs = list(dict.fromkeys(v for j in indices for v in _written(kernels[j]) if v in produced))
        groups.append(Group(indices, [kernels[j] for j in indices], outputs, found.group(1)))
    return groups


def _attach_references(program, groups: list) -> dict:
    """Each group's SIMT kernels: those of the graph rendered without tensor cores that write its
    values, with the kernels making the scratch they read. Returns that rendering's constants."""
    with rendering_for("cuda", tensor_cores=False):
        simt, _, constants = render_kernels(program.graph)
    produced = set(program.graph.producers())
    writers = {v: j for j, k in enumerate(simt) for v in _written(k) if v not in produced}
    for group in groups:
        chosen = {j for j, k in enumerate(simt) if set(_written(k)) & set(group.outputs)}
        pending = list(chosen)
        while pending:
            for v in _read(simt[pending.pop()]):
                if v in writers and writers[v] not in chosen:
                    chosen.add(writers[v])
                    pending.append(writers[v])
        group.reference = [simt[j] for j in sorted(chosen)]
    return constants


def _device(backend) -> str:
    if backend.name != "cuda":
        return "cpu emulator"
    major, minor = backend.ctx.driver_version()
    return f"{backend.ctx.name} {backend.ctx.arch} driver {major}.{minor}"


def _cache_path(backend, group: Group):
    digest = hashlib.sha256(_device(backend).encode())
    for k in group.kernels:
        digest.update(KernelUnit(k.name, k.source).body().encode())
        digest.update(repr((k.grid, k.block, k.smem)).encode())
    return cache_dir() / "tensor-core-check" / f"{digest.hexdigest()[:32]}.json"


def _cached_verdict(backend, group: Group):
    try:
        return json.loads(_cache_path(backend, group).read_text())
    except (OSError, ValueError):
        return None


def compare(got: np.ndarray, want: np.ndarray, limit: float) -> dict:
    """||got - want|| / ||want|| over the finite elements, in float32 chunks (tensor-core outputs are
    float32 or 16-bit; gigabytes of activations compare in seconds); non-finite elements must match."""
    got, want = got.reshape(-1), want.reshape(-1)
    diff = norm = 0.0
    worst, worst_at, nonfinite_mismatch = 0.0, None, None
    for start in range(0, got.size, _CHUNK):
        g = got[start:start + _CHUNK].astype(np.float32)
        w = want[start:start + _CHUNK].astype(np.float32)
        finite = np.isfinite(g) & np.isfinite(w)
        if not finite.all():
            same = (g == w) | (np.isnan(g) & np.isnan(w))
            if nonfinite_mismatch is None and not same[~finite].all():
                nonfinite_mismatch = start + int(np.argmax(~finite & ~same))
            g, w = np.where(finite, g, 0), np.where(finite, w, 0)
        d = g - w
        diff += float(np.dot(d, d))
        norm += float(np.dot(w, w))
        if d.size and np.abs(d).max() > worst:
            worst, worst_at = float(np.abs(d).max()), start + int(np.argmax(np.abs(d)))
    relative = float(np.sqrt(diff / norm)) if norm > 0 else (0.0 if diff == 0 else float("inf"))
    result = {"ok": relative <= limit and nonfinite_mismatch is None, "relative_error": relative, "limit": limit,
              "max_abs_error": worst, "max_error_at": worst_at}
    if nonfinite_mismatch is not None:
        result["nonfinite_mismatch_at"] = nonfinite_mismatch
    return result


class _Reference:
    """The SIMT kernels of every checked group, compiled once, bound to the executor's buffers."""

    def __init__(self, executor, groups: list, constants: dict):
        self.executor, self.constants, self.uploaded = executor, constants, {}
        kernels = list({k.name: k for g in groups for k in g.reference}.values())
        source = KERNELS_HEADER.format(name="tensor-core check") + "\n".join(k.source for k in kernels)
        self.module = executor.backend.load_kernels(source)

    def address(self, value, private: dict) -> int:
        """Where a SIMT kernel's argument lives: in `private`, in the program's buffers, or (a
        constant only this rendering reads as a buffer) uploaded here once."""
        if value in private:
            return private[value]
        try:
            return self.executor.resolve(value)
        except KeyError:
            if value not in self.constants:
                raise
        if value not in self.uploaded:
            backend = self.executor.backend
            self.uploaded[value] = backend.alloc(value.nbytes)
            backend.upload(self.uploaded[value], np.asarray(self.constants[value], value.dtype.np_dtype)
                           .reshape(value.shape))
            self.executor.tensor_core_fallback_buffers.append(self.uploaded[value])
        return self.uploaded[value]

    def bind(self, group: Group, private: dict) -> list:
        """Launches of the group's SIMT kernels: values in `private` at those addresses, the rest
        at the program's."""
        ex = self.executor
        launches = []
        for k in group.reference:
            args = [ctypes.c_void_p(self.address(a.value, private)) if isinstance(a, BufferArg) else ex._arg(a)
                    for a in k.args]
            launches.append(ex.backend.prepare(k, args, module=self.module))
        return launches


def _scratch(group: Group, produced: set) -> list:
    """What the group's SIMT kernels write besides graph values: split-k partials, attention's D."""
    return list(dict.fromkeys(v for k in group.reference for v in _written(k) if v not in produced))


def first_step(executor) -> dict | None:
    """The executor's first step with its tensor-core kernels checked (the module docstring);
    the report, or None when the program has none."""
    start = time.perf_counter()
    program, backend = executor.program, executor.backend
    groups = tensor_core_groups(program)
    if not groups:
        executor.launch_step()
        return None
    verdicts = {id(g): _cached_verdict(backend, g) for g in groups}
    report = {"device": _device(backend), "groups": len(groups), "kernels": sum(len(g.indices) for g in groups),
              "cached": sum(v is not None for v in verdicts.values()), "checked": [], "mismatches": []}
    needing_simt = [g for g in groups if verdicts[id(g)] is None or not verdicts[id(g)]["ok"]]
    reference = None
    if needing_simt:
        reference = _Reference(executor, needing_simt, _attach_references(program, needing_simt))
    report["prepare_s"] = round(time.perf_counter() - start, 3)
    produced = set(program.graph.producers())
    for g in groups:
        if verdicts[id(g)] is not None and not verdicts[id(g)]["ok"]:
            _fall_back(executor, reference, g, produced, verdicts[id(g)], cached=True)
            report["mismatches"].append(dict(verdicts[id(g)], cached=True))
    first_of = {g.indices[0]: g for g in groups if verdicts[id(g)] is None}
    last_of = {g.indices[-1]: g for g in first_of.values()}
    temporaries = {}
    for i, launch in enumerate(executor.launches):
        if i in first_of:   # the SIMT kernels first, on the inputs as they are, into buffers of their own
            g = first_of[i]
            private = {v: backend.alloc(v.nbytes) for v in g.outputs + _scratch(g, produced)}
            for simt_launch in reference.bind(g, private):
                simt_launch()
            temporaries[id(g)] = private
        launch()
        if i in last_of:
            g = last_of[i]
            private = temporaries.pop(id(g))
            verdict = _judge(executor, g, private)
            report["checked"].append(verdict)
            path = _cache_path(backend, g)
            atomic_write_bytes(path, json.dumps(verdict).encode())
            if not verdict["ok"]:   # this step continues with the SIMT results, later ones with its kernels
                for v in g.outputs:
                    backend.copy(executor.resolve(v), private[v], v.nbytes)
                _fall_back(executor, reference, g, produced, verdict, cached=False)
                report["mismatches"].append(verdict)
            for address in private.values():
                backend.free(address)
    for dst, src, nbytes in executor.updates:
        backend.copy(dst, src, nbytes)
    executor.calls += 1
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def _judge(executor, group: Group, private: dict) -> dict:
    verdict = {"kernels": [k.name for k in group.kernels], "what": group.kernels[0].comment,
               "simt_kernels": [k.name for k in group.reference], "values": {}}
    for v in group.outputs:
        got = executor.read_value(v)
        want = np.empty(v.shape, v.dtype.np_dtype)
        executor.backend.download(want, private[v])
        limit = max(KIND_LIMIT[group.kind], OUTPUT_LIMIT.get(v.dtype.name, 0.0))
        verdict["values"][v.name] = compare(got, want, limit)
    verdict["ok"] = all(r["ok"] for r in verdict["values"].values())
    return verdict


def _fall_back(executor, reference, group: Group, produced: set, verdict: dict, cached: bool) -> None:
    """From now on the group's SIMT kernels run in its tensor-core kernels' place (their scratch in
    buffers of their own), and a warning says why."""
    scratch = {v: executor.backend.alloc(v.nbytes) for v in _scratch(group, produced)}
    executor.tensor_core_fallback_buffers.extend(scratch.values())
    launches = reference.bind(group, scratch)

    def run_simt():
        for launch in launches:
            launch()

    executor.launches[group.indices[0]] = run_simt
    for j in group.indices[1:]:
        executor.launches[j] = _nothing
    worst = max(verdict["values"].items(), key=lambda item: item[1]["relative_error"])
    warnings.warn(
        f"tensor-core kernel {group.kernels[0].name} ({group.kernels[0].comment}) disagrees with the SIMT "
        f"kernel of the same op on this GPU ({_device(executor.backend)}){' (cached verdict)' if cached else ''}: "
        f"{worst[0]} off by {worst[1]['relative_error']:.3g} relative (limit {worst[1]['limit']:.3g}), largest "
        f"error {worst[1]['max_abs_error']:.3g} at element {worst[1]['max_error_at']}; the graph runs the SIMT "
        f"kernel instead ({ENVIRONMENT_VARIABLE}=0 turns the check off)", RuntimeWarning, stacklevel=4)


def _nothing():
    pass
