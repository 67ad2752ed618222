"""The program cache: a compiled `Program` (kernels, memory plan, kernels.cu) kept on disk, so a
new process compiling the same graph skips the passes, the memory planner and kernel rendering.

`cached(ir, options, build)` returns `build()`'s result, from the cache when an entry for the
same inputs exists. The key is a SHA-256 over everything that decides the result:

* the IR given (pickled whole: every node, attribute, constant array, scope, state kind and
  hyper-parameter schedule), and the definitions of the ops it uses. Two things are left out,
  as they name where the graph came from rather than what it computes: the graph's instance
  number (`TrainGraph_3` is keyed as `TrainGraph`, the name kernels.cu's header uses) and the
  nodes' user source locations (`train.py:42`: editing a script above its `graph(x)` call, or a
  second graph instance, still hits). The loaded result takes the caller's, see below;
* `options`: the caller's settings (graph config, target, ...), and what codegen reads from the
  environment (`$FLOWGEN_NAIVE_MEMORY`);
* `source_fingerprint()`: the contents of flowgen's Python files, `templates/` and
  `runtime_cpp/`, and the Python, NumPy, ml_dtypes and Jinja2 versions, hashed once per process;
* `_module_state()`: the constants (tile lists, limits, the target block counts) and functions
  of the modules the passes and codegen run in, as they are now, so a process that replaced
  one (a test's monkeypatch) does not share entries with one that did not.

Code goes into the key by name, so it must be code the fingerprint covers: flowgen's, those
libraries' or the standard library's. An IR or op definition that refers to other code (an op
a user defined with `defop`), or anything that does not pickle, makes the graph uncacheable
("off"): it is never keyed by less than its content. `build` must not change the IR it is
given; a build that did is not stored.

An entry is `programs/<key>.pkl` under the build cache: a header line, the key, the SHA-256 of
the payload, then the payload (the pickled result). The IR's values and the graph itself are
pickled as references (`("value", i)`, `("graph",)`) and bound to the caller's objects on
load, so the loaded program shares its values with the caller exactly as a fresh build does
(the executor and the graph's state bindings find buffers by value identity). So are the
graph's name (`("name",)`) and each node's source location (`("loc", i)`, node i of the IR
given): the passes pass them on by reference, and a result holding either inside another
string (by value, where a load could not put the caller's in) is not stored. dtypes are
pickled by name and load as flowgen's dtype objects. Entries are written to a temporary file
and renamed into place; an entry that is truncated, corrupt, for another key or does not
unpickle is counted in `STATS.rejected`, ignored, and rebuilt over.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib
import io
import os
import pickle
import pkgutil
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from flowgen import dtype as dt
from flowgen.codegen.target import choice_key
from flowgen.codegen.templates import templates_dir
from flowgen.ir.graph import Graph, Node
from flowgen.ops.registry import get_op
from flowgen.runtime import cache_bound
from flowgen.runtime.toolchain import atomic_write_bytes, cache_dir, runtime_cpp_dir

_MAGIC = b"flowgen-program-cache 1\n"
_PROTOCOL = 5
# Where the passes and codegen run: their module-level constants and functions are in the key.
_COMPILER_PACKAGES = ("flowgen.ir", "flowgen.ops", "flowgen.passes", "flowgen.schedule", "flowgen.memory",
                      "flowgen.codegen", "flowgen.codegen.kernels")
_COMPILER_MODULES = ("flowgen.nn.graph.compiled", "flowgen.runtime.autotune", "flowgen.saved_graph")
# Code the key may refer to by name: flowgen's (in `source_fingerprint`), the libraries whose
# versions are in it, and the standard library (in `sys.version`).
_COVERED_MODULES = frozenset({"flowgen", "numpy", "ml_dtypes", "jinja2"})


@dataclass
class CacheStats:
    """What this process's lookups found (tests and `graph.compiled.program_cache` read it)."""
    hits: int = 0
    misses: int = 0
    rejected: int = 0    # entries present but corrupt or unreadable (rebuilt)
    stored: int = 0


STATS = CacheStats()


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """SHA-256 of flowgen's own source (Python files, templates, runtime headers, by content)
    and of the versions of the libraries that shape a program."""
    # Imported here, not at the top: Jinja2 takes ~0.15 s to load and `import flowgen` needs only its version here.
    import jinja2

    h = hashlib.sha256()
    roots = [Path(__file__).resolve().parent.parent, templates_dir().resolve(), runtime_cpp_dir().resolve()]
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    for version in (sys.version, np.__version__, ml_dtypes.__version__, jinja2.__version__):
        h.update(version.encode() + b"\0")
    return h.hexdigest()


def _process_options() -> dict:
    """What codegen reads from the process rather than from its arguments."""
    return {"naive_memory_env": os.environ.get("FLOWGEN_NAIVE_MEMORY", ""),
            "cpu_kernels_env": os.environ.get("FLOWGEN_CPU_KERNELS", ""),
            "emulator_check_env": os.environ.get("FLOWGEN_EMULATOR_CHECK", ""),   # no native cpu kernels when on
            "forms_chosen_at": choice_key()}   # a dynamic step's sizes rendered with the maximum's forms


@functools.lru_cache(maxsize=1)
def _compiler_modules() -> tuple:
    """Every module of the packages the passes and codegen run in (all loaded, so the key does
    not depend on which a script happened to import), and the compile glue."""
    names = list(_COMPILER_MODULES)
    for package in _COMPILER_PACKAGES:
        path = importlib.import_module(package).__path__
        names += [f"{package}.{info.name}" for info in pkgutil.iter_modules(path) if not info.ispkg]
    return tuple(importlib.import_module(name) for name in sorted(set(names)))


def _plain(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def _canonical(value):
    """A plain value with its sets in a fixed order (a set of strings iterates in an order that
    changes from process to process)."""
    if isinstance(value, frozenset):
        return "frozenset", tuple(sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, tuple):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((_canonical(k), _canonical(v)) for k, v in value.items())
    return value


def _module_state() -> list:
    """The compiler modules' constants (tile lists, limits, target block counts) and functions
    as they are now: the source fingerprint says what they were written as, this catches a
    process (a test) that replaced one (`monkeypatch.setattr(fusion, "MULTI_MAX_POINTERS", 16)`)."""
    state = []
    for module in _compiler_modules():
        for name, value in vars(module).items():
            if name.startswith("__"):      # __file__, __cached__: where, not what
                continue
            if _plain(value):
                state.append((module.__name__, name, _canonical(value)))
            elif isinstance(value, (types.FunctionType, type)):
                state.append((module.__name__, name, value))   # pickled by name, and only if covered
    return state


class _UnboundString(pickle.PicklingError):
    """The result holds the graph's name or a source location inside a string of its own."""


class _Pickler(pickle.Pickler):
    """dtypes by name; the `external` objects (the caller's IR, its values, its name and source
    locations) by position; refuses any other string that contains the name or is a location."""

    def __init__(self, file, external: dict, name: str, locations: frozenset):
        super().__init__(file, protocol=_PROTOCOL)
        self.external = external    # id(object) -> persistent id
        self.name = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")   # the name as a word of its own
        self.locations = locations

    def persistent_id(self, obj):
        if isinstance(obj, dt.DType):
            return ("dtype", obj.name)
        pid = self.external.get(id(obj))
        if pid is None and type(obj) is str and (obj in self.locations or self.name.search(obj)):
            raise _UnboundString(f"{obj!r} holds the graph's name or a source location")
        return pid


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, graph, values: list, nodes: list):
        super().__init__(file)
        self.graph, self.values, self.nodes = graph, values, nodes

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "dtype":
            return dt.get(rest[0])
        if kind == "graph":
            return self.graph
        if kind == "name":
            return self.graph.name
        if kind == "value":
            return self.values[rest[0]]
        if kind == "loc":
            return self.nodes[rest[0]].loc
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def _nodes(nodes):
    for node in nodes:
        yield node
        yield from _nodes(node.body)


def _values(ir) -> list:
    """Every value of `ir`, once each, in a fixed order."""
    seen, out = set(), []
    candidates = [*ir.inputs, *(s.value for s in ir.state)]
    for node in _nodes(ir.nodes):
        candidates += node.inputs + node.outputs
    candidates += ir.outputs + [v for _, v in ir.updates]
    for v in candidates:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _op_definitions(ir) -> list:
    """Each op `ir` uses, as its name and definition (functions by name, lowerings by value); a
    fused node is no op of its own (its body's ops are listed)."""
    ops = [get_op(name) for name in sorted({node.op for node in _nodes(ir.nodes)} - {"fused"})]
    return [(op.name, op.infer, op.ref, op.grad, op.lowering, op.num_outputs) for op in ops]


def _covered(module: str | None) -> bool:
    top = (module or "").split(".")[0]
    return top in _COVERED_MODULES or top in sys.stdlib_module_names


class _UncoveredCode(pickle.PicklingError):
    """The IR refers to code outside flowgen and the libraries in its fingerprint."""


class _KeyPickler(pickle.Pickler):
    """Pickles the key's inputs: dtypes by name, code (functions, classes) by name, and only
    flowgen's own and the fingerprinted libraries' code, whose content `source_fingerprint`
    covers. (Called for every object that is not a number, string or repeat, so it is brief.)"""

    def __init__(self, file):
        super().__init__(file, protocol=_PROTOCOL)
        self.covered_types: set = set()

    def reducer_override(self, obj):
        cls = type(obj)
        if cls in self.covered_types:
            return NotImplemented
        if cls is dt.DType:
            return dt.get, (obj.name,)
        if isinstance(obj, Node):     # its fields but the source location
            fields = vars(obj).copy()
            del fields["loc"]
            return tuple, ((cls.__qualname__, fields),)
        if isinstance(obj, Graph):    # its fields, with the class's name for the instance's
            fields = {**vars(obj), "name": _graph_class_name(obj.name)}
            return tuple, ((cls.__qualname__, fields),)
        code = isinstance(obj, type) or callable(obj)
        module = getattr(obj, "__module__", None) if code else cls.__module__
        if not _covered(module):
            raise _UncoveredCode(f"{obj!r} comes from {module}")
        if isinstance(obj, types.FunctionType):
            # Closures too (an op's infer made by a factory when flowgen is imported): what they
            # capture is set by the source, which the fingerprint covers.
            return str, (f"{module}:{obj.__qualname__}",)
        if not code:
            self.covered_types.add(cls)
        return NotImplemented


def _graph_class_name(name: str) -> str:
    """`TrainGraph` of the instance name `TrainGraph_3` (nn.Graph names instances so)."""
    return name.rsplit("_", 1)[0]


def _key_pickle(ir, options: dict) -> bytes | None:
    buf = io.BytesIO()
    try:
        _KeyPickler(buf).dump((ir, _op_definitions(ir), options, _process_options(), _module_state()))
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return buf.getvalue()


def _key(data: bytes) -> str:
    return hashlib.sha256(source_fingerprint().encode() + b"\0" + data).hexdigest()


def _entry(k: str) -> Path:
    return cache_dir() / "programs" / f"{k}.pkl"


def _external(ir) -> dict:
    """The caller's objects a result refers to, by position: the graph, its name, its values,
    its nodes' source locations (the empty string is shared by every empty string: not one)."""
    external = {id(v): ("value", i) for i, v in enumerate(_values(ir))}
    for i, node in enumerate(_nodes(ir.nodes)):
        if node.loc:
            external.setdefault(id(node.loc), ("loc", i))
    return {**external, id(ir): ("graph",), id(ir.name): ("name",)}


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off meanwhile. Loading an entry, or tracing and compiling a
    graph, makes tens of thousands of objects that mostly stay alive: the collector, which runs
    every few hundred new objects, would walk them again and again and find little to free (a
    third of a load's time, a sixth of a warm compile's). It runs again afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(k: str, ir):
    """The cached result for key `k`, None if there is no valid entry."""
    try:
        data = _entry(k).read_bytes()
    except OSError:
        return None
    header = _MAGIC + f"{k}\n".encode()
    digest_end = len(header) + 65
    try:
        if not data.startswith(header) or data[digest_end - 1:digest_end] != b"\n":
            raise ValueError("bad header")
        payload = data[digest_end:]
        if hashlib.sha256(payload).hexdigest().encode() != data[len(header):digest_end - 1]:
            raise ValueError("payload digest mismatch")
        with collector_paused():
            return _Unpickler(io.BytesIO(payload), ir, _values(ir), list(_nodes(ir.nodes))).load()
    except Exception:   # any damage to an entry means: rebuild it, never trust it
        STATS.rejected += 1
        return None


def _store(k: str, ir, result) -> None:
    buf = io.BytesIO()
    try:
        locations = frozenset(node.loc for node in _nodes(ir.nodes) if node.loc)
        _Pickler(buf, _external(ir), ir.name, locations).dump(result)
    except (pickle.PicklingError, TypeError, AttributeError):
        return   # a result that does not pickle is simply not kept
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    atomic_write_bytes(_entry(k), _MAGIC + f"{k}\n{digest}\n".encode() + payload)
    STATS.stored += 1
    cache_bound.wrote()


def cached(ir, options: dict, build: Callable[[], object]) -> tuple:
    """(`build()`'s result, "hit" | "miss" | "off"): from the cache when it holds an entry for
    `ir` and `options`; otherwise built, and stored when the IR is cacheable ("off": it is not)."""
    before = _key_pickle(ir, options)
    if before is None:
        return build(), "off"
    k = _key(before)
    result = _load(k, ir)
    if result is not None:
        STATS.hits += 1
        cache_bound.used(_entry(k))
        return result, "hit"
    STATS.misses += 1
    result = build()
    if _key_pickle(ir, options) == before:    # the build left its input as it was
        _store(k, ir, result)
    return result, "miss"
