"""Build a kernels.cu kernel by kernel: each distinct kernel body compiled once, in parallel
chunks, and cached on disk by content.

A generated kernels.cu is a preamble (`#include "flowgen_cuda_prelude.h"`) followed by one unit
per kernel: comment lines, the `extern "C" __global__` function and its `FLOWGEN_EMU_KERNEL`
line. Kernels of different module paths often have the same body under different names (every
BatchNorm + ReLU of a given shape, say), so a body is identified by its text with the kernel's
name abstracted and comment lines dropped, plus the compiler's `salt` (version, options,
headers) — never by the graph or instance name. Bodies found in the cache are reused; the others
are grouped into chunks, one compiler call per chunk, run `jobs()` at a time.

Cache layout, under one compiler's `root` (e.g. `<cache>/nvrtc-kernels`):

    kernels/<body key>      "<chunk id> <symbol>": where that body was compiled
    chunks/<chunk id>/      what the compiler saw (source.cu for g++, kernels.cu for NVRTC;
                            kernels renamed <first name>_<key prefix>), compile.log, and the
                            artifact (cubin or object file)
    sources/<source key>    JSON: a whole kernels.cu's build (its chunks, every kernel's symbol,
                            the counts), so the same source again is one file read instead of
                            splitting it and hashing each body; used while its chunks' artifacts
                            are all there, rebuilt from the body entries when not

Every file is written to a temporary name and renamed into place, and an index entry is
written only after its chunk's artifact exists, so concurrent processes at worst compile the
same body twice.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flowgen.runtime import cache_bound
from flowgen.runtime.progress import reporting
from flowgen.runtime.toolchain import atomic_write_bytes

_KERNEL_START = re.compile(r'^extern "C" __global__ ')
_KERNEL_END = re.compile(r"^FLOWGEN_EMU_KERNEL\((\w+)\s*,")
_NAME_PLACEHOLDER = "FLOWGEN_KERNEL_NAME"
_WORD = re.compile(r"\w")
_KEY_CHARS = 32
_SYMBOL_KEY_CHARS = 10


def jobs() -> int:
    """Compiler calls run at once: `$FLOWGEN_COMPILE_JOBS`, else the CPU cores this process may use."""
    if os.environ.get("FLOWGEN_COMPILE_JOBS"):
        return max(1, int(os.environ["FLOWGEN_COMPILE_JOBS"]))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@dataclass(frozen=True)
class KernelUnit:
    name: str
    text: str   # comment lines, the __global__ function and its FLOWGEN_EMU_KERNEL line

    def body(self) -> str:
        """The text that decides what gets compiled: comment lines dropped, the name abstracted."""
        code = "\n".join(line for line in self.text.splitlines() if not line.lstrip().startswith("//"))
        return _replace_identifier(code, self.name, _NAME_PLACEHOLDER)

    def renamed(self, symbol: str) -> str:
        return _replace_identifier(self.text, self.name, symbol)


def _replace_identifier(text: str, name: str, replacement: str) -> str:
    """`re.sub(rf"\\b{name}\\b", replacement, text)` for a name of word characters, without
    compiling a pattern per kernel name: each occurrence, left to right, is replaced where no
    word character touches it on either side."""
    out, start, find_from = [], 0, 0
    while (at := text.find(name, find_from)) >= 0:
        end = at + len(name)
        if (at == 0 or not _WORD.match(text, at - 1)) and (end == len(text) or not _WORD.match(text, end)):
            out += [text[start:at], replacement]
            start = find_from = end
        else:
            find_from = at + 1
    out.append(text[start:])
    return "".join(out)


def _split_preamble(lines: list) -> tuple[str, int]:
    """(the preprocessor lines before the first kernel, the index of the line after the last)."""
    first = next((i for i, line in enumerate(lines) if _KERNEL_START.match(line)), len(lines))
    directives = [i for i in range(first) if lines[i].startswith("#")]
    return "".join(lines[i] for i in directives), directives[-1] + 1 if directives else 0


def preamble_of(source: str) -> str:
    """The preprocessor lines of a generated kernels.cu, or of a chunk of it, before its first
    kernel: what every chunk of that source starts with."""
    return _split_preamble(source.splitlines(keepends=True))[0]


def split_kernels(source: str) -> tuple[str, list[KernelUnit]]:
    """(preamble, kernels) of a generated kernels.cu. The preamble is its preprocessor lines
    before the first kernel (comments dropped: they name the graph)."""
    lines = source.splitlines(keepends=True)
    preamble, body_start = _split_preamble(lines)
    units, pending = [], []
    for line in lines[body_start:]:
        pending.append(line)
        end = _KERNEL_END.match(line)
        if end:
            units.append(KernelUnit(end.group(1), "".join(pending).strip("\n") + "\n"))
            pending = []
    rest = "".join(pending).strip()
    if rest:
        if not units:
            raise ValueError("kernels.cu has code but no kernel ending in a FLOWGEN_EMU_KERNEL(name, ...) line")
        last = units.pop()
        units.append(KernelUnit(last.name, last.text + "".join(pending)))
    return preamble, units


@dataclass
class BuildStats:
    """What one build did; `compiled` counts distinct bodies handed to the compiler."""
    kernels: int = 0     # kernels in the source
    distinct: int = 0    # distinct bodies among them
    cached: int = 0      # distinct bodies found in the cache
    compiled: int = 0    # distinct bodies compiled now
    chunks: int = 0      # compiler calls made

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class KernelBuild:
    artifacts: list            # Path of each chunk artifact the kernels live in
    symbols: dict              # kernel name -> (index into artifacts, symbol in that artifact)
    stats: BuildStats = field(default_factory=BuildStats)


@dataclass
class _Body:
    key: str
    unit: KernelUnit           # the first kernel with this body (its comments go into source.cu)
    symbol: str = ""
    chunk: str = ""            # chunk id once found or compiled


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _chunks(bodies: list, count: int) -> list:
    """`bodies` in `count` groups of similar source size (largest first onto the lightest)."""
    groups = [[] for _ in range(count)]
    sizes = [0] * count
    for body in sorted(bodies, key=lambda b: (-len(b.unit.text), b.key)):
        i = sizes.index(min(sizes))
        groups[i].append(body)
        sizes[i] += len(body.unit.text)
    return [g for g in groups if g]


def build_kernels(source: str, *, root: Path, salt: str, artifact: str, compiler: str,
                  compile_chunk: Callable[[str, Path], None], min_chunk_chars: int) -> KernelBuild:
    """Compile the kernels of `source` through the cache under `root`.

    `compile_chunk(text, chunk_dir)` compiles one chunk's source (the preamble, then its
    kernels) into `chunk_dir / artifact` (raising CompileError on failure); `salt` holds
    everything besides the source that changes its output. Chunks hold at least
    `min_chunk_chars` of source each (a compiler call has a fixed cost: headers, start-up), at
    most two per job.
    """
    source_key = _digest(salt, source)[:_KEY_CHARS]
    known = _lookup_source(root, source_key, artifact)
    if known is not None:
        cache_bound.used(root / "sources" / source_key)
        for path in known.artifacts:
            cache_bound.used(path.parent)
        return known
    build = _build_bodies(source, root, salt, artifact, compiler, compile_chunk, min_chunk_chars)
    chunks = [path.parent.name for path in build.artifacts]
    record = {"chunks": chunks, "symbols": build.symbols, "kernels": build.stats.kernels,
              "distinct": build.stats.distinct}
    atomic_write_bytes(root / "sources" / source_key, json.dumps(record).encode())
    cache_bound.wrote()
    return build


def _lookup_source(root: Path, source_key: str, artifact: str) -> KernelBuild | None:
    """The recorded build of a whole source whose artifacts are all still there, else None."""
    try:
        record = json.loads((root / "sources" / source_key).read_bytes())
        artifacts = [root / "chunks" / chunk / artifact for chunk in record["chunks"]]
        symbols = {name: (index, symbol) for name, (index, symbol) in record["symbols"].items()}
        stats = BuildStats(kernels=record["kernels"], distinct=record["distinct"], cached=record["distinct"])
    except (OSError, ValueError, KeyError, TypeError):   # absent, or not a record we wrote: build
        return None
    whole = all(0 <= index < len(artifacts) for index, _ in symbols.values())
    return KernelBuild(artifacts, symbols, stats) if whole and all(p.is_file() for p in artifacts) else None


def _build_bodies(source: str, root: Path, salt: str, artifact: str, compiler: str, compile_chunk,
                  min_chunk_chars: int) -> KernelBuild:
    """`build_kernels` body by body: the cached ones found, the others compiled in chunks."""
    preamble, units = split_kernels(source)
    bodies: dict[str, _Body] = {}
    kernel_keys = {}
    for unit in units:
        key = _digest(salt, preamble, unit.body())[:_KEY_CHARS]
        kernel_keys[unit.name] = key
        bodies.setdefault(key, _Body(key, unit))
    stats = BuildStats(kernels=len(units), distinct=len(bodies))
    missing = []
    for body in bodies.values():
        found = _lookup(root, body.key, artifact)
        if found:
            body.chunk, body.symbol = found
        else:
            body.symbol = f"{body.unit.name}_{body.key[:_SYMBOL_KEY_CHARS]}"
            missing.append(body)
    stats.cached = len(bodies) - len(missing)
    stats.compiled = len(missing)
    if missing:
        total_chars = sum(len(b.unit.text) for b in missing)
        count = max(1, min(len(missing), 2 * jobs(), total_chars // max(1, min_chunk_chars)))
        groups = _chunks(missing, count)
        stats.chunks = len(groups)
        with reporting("compile") as progress:
            progress.stage(f"{compiler} kernels", total=len(missing))
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(jobs(), len(groups))) as pool:
                futures = {pool.submit(_compile_group, group, preamble, salt, root, artifact, compile_chunk): group
                           for group in groups}
                for future in concurrent.futures.as_completed(futures):
                    future.result()
                    progress.advance(len(futures[future]))
    chunk_ids = list(dict.fromkeys(b.chunk for b in bodies.values()))
    index = {c: i for i, c in enumerate(chunk_ids)}
    symbols = {name: (index[bodies[key].chunk], bodies[key].symbol) for name, key in kernel_keys.items()}
    return KernelBuild([root / "chunks" / c / artifact for c in chunk_ids], symbols, stats)


def _lookup(root: Path, key: str, artifact: str):
    """(chunk id, symbol) of a cached body whose artifact is still there, else None."""
    try:
        chunk, symbol = (root / "kernels" / key).read_text().split()
    except (OSError, ValueError):
        return None
    if not (root / "chunks" / chunk / artifact).is_file():
        return None
    cache_bound.used(root / "kernels" / key)
    cache_bound.used(root / "chunks" / chunk)
    return chunk, symbol


def _compile_group(group: list, preamble: str, salt: str, root: Path, artifact: str, compile_chunk) -> None:
    text = preamble + "\n" + "\n".join(b.unit.renamed(b.symbol) for b in group)
    chunk = _digest(salt, text)[:_KEY_CHARS]
    chunk_dir = root / "chunks" / chunk
    if not (chunk_dir / artifact).is_file():
        compile_chunk(text, chunk_dir)
    for body in group:
        body.chunk = chunk
        atomic_write_bytes(root / "kernels" / body.key, f"{chunk} {body.symbol}\n".encode())
