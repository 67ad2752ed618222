"""`flow.save(graph, dir)` / `flow.load(dir)`: a compiled graph as a deployable directory.

`flow.save(graph, dir)` (after the graph has been called once) writes the
traced, optimised IR of the graph's last-used variant together with its state,
so the step can be rebuilt without the Python code that defined it::

    dir/
      graph.json            the IR (format below)
      constants.safetensors numeric attributes of IR nodes (captured constants)
      weights.safetensors   every state value: parameters, buffers, optimizer
                            slots and hyper scalars (lr, ...) with their values
                            for the next step; metadata holds the step counter
                            and how many steps a GradScaler skipped
      signature.json        inputs/outputs (names, shapes, dtypes), training
                            flag, graph name, flowgen version, the
                            data_parallel entry of graph.json if any, and
                            signature_sha256 (its own hash, as graph.json's)

`flow.load(dir)` returns a `SavedGraph`: the IR rebuilt, the weights as NumPy
arrays; `SavedGraph.run(*arrays)` runs one step on the CPU emulator, and
`flowgen build dir` turns it into a standalone program.

graph.json, format version 1
----------------------------
::

    {"format": "flowgen.graph", "version": 1, "flowgen_version": "0.1.0",
     "name": "G_0", "training": true,
     "inputs":  [{"name": "input_0", "shape": [200, 3], "dtype": "float32"}],
     "state":   [{"name": "model.0.weight", "shape": [1, 3], "dtype": "float32",
                  "kind": "param"}],                 # param|buffer|optim|hyper|counter|const
     "nodes":   [{"op": "matmul", "inputs": ["input_0", "t0"],
                  "outputs": [{"name": "t1", "shape": [200, 1], "dtype": "float32"}],
                  "attrs": {...}, "scope": "model.0", "loc": "train.py:42"},
                 {"op": "fused", ..., "attrs": {"kind": "elementwise"},
                  "body": [<nodes, same form>]}],
     "outputs": ["t6"],
     "updates": [["model.0.weight", "t24"]],          # state name <- value name
     "data_parallel": {"world_size": 2, "inputs": ["split", "split"],
                       "outputs": ["mean"]},          # only for a data-parallel graph
     "constants_sha256": "<sha256 of constants.safetensors>",
     "weights_sha256": "<sha256 of weights.safetensors as saved>",
     "graph_sha256": "<sha256 of this document without this key, as canonical JSON>"}

Values are named once, where they are defined (an input, a state entry or a
node output); everywhere else a value is its name. Names are unique in a graph
(a fused node's outputs are the outputs of nodes in its body, named the same).
The state value of a state entry has the entry's name. Attribute values are
JSON with tags where JSON has no type of its own::

    1, 2.5, "tanh", true, null, [..]        int, float, str, bool, None, list
    {"$tuple": [1, 0]}                      tuple
    {"$dtype": "float32"}                   a flowgen dtype
    {"$float": "inf"}                       inf, -inf, nan
    {"$scalar": "float32", "value": 0.5}    a NumPy scalar
    {"$dict": {"k": ...}}                   a dict with string keys
    {"$array": "t8", "dtype": "float32", "shape": [200]}
                                            a NumPy array, stored in
                                            constants.safetensors under that key
                                            (a constant node's value is keyed by
                                            its output's name, other arrays by
                                            "<output name>.<attr>")

A graph compiled with dynamic dimensions (graph.config.dynamic_shapes, flowgen/dims.py) is
saved at every Dim's maximum, with an entry more::

     "dynamic": {"dims": [{"name": "batch", "min": 1, "max": 64}],
                 "uses": [[0, 0, 0]],                 # [Dim, input, axis]: where each is read
                 "renderings": [{"sizes": [2], "graph": {<this document's fields: name,
                                 inputs, state, nodes, outputs, updates>}}, ...],
                 "variants": [{"ones": [0], "graph": {...}, "renderings": [...]}]}

`renderings` are the step at other sizes, fitted with the top-level IR into one program by the
build (codegen/dynamic.py); `variants` the programs for sets of Dims whose minimum is 1 at 1
(`ones`: their places in `dims`), when the kernels of the other sizes do not fit them, each its IR
with the others at their max plus its renderings. Their arrays are in constants.safetensors under
"rendering_<j>/", "variant_<v>/" and "variant_<v>/rendering_<j>/" before the usual key.
signature.json repeats `dims` and `uses`. A step that updates its state (training) may have Dims
on its inputs' first axis only (the built program trains on batches of an input's rows); a
data-parallel graph has none.

Dtype names are flowgen's (float32, bfloat16, int64, bool, ...); attribute arrays and
scalars of other NumPy dtypes use NumPy's spelling ("|u1").

A data-parallel graph (called with `flow.sbp.split(0)` global inputs on several ranks,
flowgen/distributed/data_parallel.py) is saved by `flow.save(graph, dir)` on every rank, as
OneFlow saves global tensors: the ranks check that their graphs and weights are identical
(replicas never drift apart), rank 0 writes the directory, and every rank returns once it is
written. Its IR is one rank's step (the traced per-rank batch, shapes as traced) with its
`all_reduce` nodes; ``data_parallel`` records the world size, each input's layout ("split":
rows split evenly over the ranks, "broadcast": every rank gets the whole) and how each output
becomes the global value, as the graph returns it: "split" (the ranks' rows concatenated),
"sum"/"mean" (a 0-d value added or averaged over the ranks), "global" (combined inside the
graph) or "replicated" (equal on every rank). The standalone program runs it with
`mpiexec -n <world_size>` (templates/program_host.cpp.j2). ZeRO (optimizer state sharded per
rank), pipelines (set_stage) and DistributedDataParallel-wrapped modules (each rank's own
batch) are refused.

A reader must refuse a version it does not know. Later versions may add keys;
version 1 readers ignore keys they do not use.

Loading checks everything it reads: graph.json against its own hash (sorted-key
compact JSON of the document without ``graph_sha256``, see
`serialization.document_sha256`), constants.safetensors and weights.safetensors
against ``constants_sha256`` and ``weights_sha256``, both with the safetensors library, the
weights against the graph's state (names, dtypes, shapes; metadata ``step`` and
``skipped`` decimal integers) and signature.json against the graph. Anything
refused raises `FormatError` (a `serialization.CheckpointError`) naming the file
and the field.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np

from flowgen import dtype as dt
from flowgen import random
from flowgen.codegen.dynamic import DynamicShapeError, fit_programs, fit_variant, with_variants
from flowgen.codegen.program import build_program, count_unfused_kernels, kernels_source
from flowgen.codegen.target import forms_chosen_at
from flowgen.dims import Dim, DimUse, dim_axes, sizes_of, unit_points, unit_subsets, variant_points
from flowgen.distributed.collectives import world
from flowgen.errors import internal_checks
from flowgen.ir.graph import Graph, Node, StateVar, Value
from flowgen.ir.verify import IRError, verify
from flowgen.ops.lowering import Collective
from flowgen.ops.registry import get_op
from flowgen.runtime import program_cache
from flowgen.runtime.executor import CpuBackend, Executor
from flowgen.serialization import (CheckpointError, check_self_hash, document_sha256, file_sha256,
                                   install_graph_loader, read_json_file, read_safetensors_file, with_self_hash,
                                   write_directory_atomically, write_json, write_safetensors)
from flowgen.version import __version__

FORMAT = "flowgen.graph"
VERSION = 1
SIGNATURE_FORMAT = "flowgen.signature"
WEIGHTS_FORMAT = "flowgen.weights"
GRAPH_FILE = "graph.json"
CONSTANTS_FILE = "constants.safetensors"
WEIGHTS_FILE = "weights.safetensors"
SIGNATURE_FILE = "signature.json"
INPUT_LAYOUTS = ("split", "broadcast")
OUTPUT_COMBINES = ("split", "sum", "mean", "global", "replicated")

__all__ = ["SavedGraph", "save_graph", "load_saved_graph", "is_saved_graph"]


def _flowgen_version() -> str:
    return __version__


def _contiguous(array) -> np.ndarray:
    """A C-contiguous array of the same shape (np.ascontiguousarray would turn a 0-d array into 1-d)."""
    return np.require(array, requirements="C")


def _np_dtype_name(np_dtype) -> str:
    """flowgen's name for the dtypes it has (float32, bfloat16, ...), NumPy's ('<u1') otherwise."""
    np_dtype = np.dtype(np_dtype)
    for d in dt.ALL:
        if d.np_dtype == np_dtype:
            return d.name
    return np_dtype.str


def _np_dtype(name: str) -> np.dtype:
    try:
        return dt.get(name).np_dtype
    except TypeError:
        return np.dtype(name)


def _value_json(v) -> dict:
    return {"name": v.name, "shape": [int(d) for d in v.shape], "dtype": v.dtype.name}


# ------------------------------------------------------------------ encoding
class _IREncoder:
    def __init__(self):
        self.arrays: dict = {}
        self.defined: dict = {}   # name -> Value, to check that names identify values

    def define(self, v) -> dict:
        self._claim(v)
        return _value_json(v)

    def ref(self, v) -> str:
        self._claim(v)
        return v.name

    def _claim(self, v):
        other = self.defined.setdefault(v.name, v)
        if other is not v:
            raise ValueError(f"flow.save: the graph has two different values named %{v.name}; "
                             f"graph.json identifies values by name")

    def attr(self, value, key: str):
        if isinstance(value, np.generic):   # before float: np.float64 is a float subclass
            return {"$scalar": _np_dtype_name(value.dtype), "value": self.attr(value.item(), key)}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, dt.DType):
            return {"$dtype": value.name}
        if isinstance(value, np.ndarray):
            if key in self.arrays:
                raise ValueError(f"flow.save: two arrays would be stored as {key!r} in {CONSTANTS_FILE}")
            self.arrays[key] = _contiguous(value)
            return {"$array": key, "dtype": _np_dtype_name(value.dtype), "shape": list(value.shape)}
        if isinstance(value, tuple):
            return {"$tuple": [self.attr(v, f"{key}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.attr(v, f"{key}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"$dict": {k: self.attr(v, f"{key}.{k}") for k, v in value.items()}}
        raise TypeError(f"flow.save: cannot store attribute {key!r} of type {type(value).__name__} in graph.json")

    def node(self, node) -> dict:
        out_name = node.outputs[0].name if node.outputs else "node"
        attrs = {}
        for k, v in node.attrs.items():
            if k == "body":
                continue
            key = out_name if (node.op == "constant" and k == "value") else f"{out_name}.{k}"
            attrs[k] = self.attr(v, key)
        entry = {"op": node.op, "inputs": [self.ref(v) for v in node.inputs]}
        body = node.attrs.get("body") if node.op == "fused" else None
        if body is not None:
            # The body defines the fused node's outputs; the node lists them by name.
            entry["body"] = [self.node(n) for n in body]
            entry["outputs"] = [_value_json(v) for v in node.outputs]
            for v in node.outputs:
                self._claim(v)
        else:
            entry["outputs"] = [self.define(v) for v in node.outputs]
        entry["attrs"] = attrs
        if node.scope:
            entry["scope"] = node.scope
        if node.loc:
            entry["loc"] = node.loc
        return entry


def encode_graph(ir, training: bool) -> tuple:
    """(graph.json dict without the constants hash, {key: array} for constants.safetensors)."""
    enc = _IREncoder()
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "flowgen_version": _flowgen_version(),
        "name": ir.name,
        "training": bool(training),
        "inputs": [enc.define(v) for v in ir.inputs],
        "state": [],
    }
    for s in ir.state:
        if s.value.name != s.name:
            raise ValueError(f"flow.save: state {s.name!r} is held in a value named %{s.value.name}; graph.json "
                             f"names a state value after its state entry")
        entry = dict(enc.define(s.value), kind=s.kind)
        if s.schedule:
            entry["schedule"] = s.schedule   # how a hyper value advances per step (program.cu does it)
            if "note" in s.schedule:         # a schedule the program cannot follow (passes/optimizer.py)
                warnings.warn(f"flow.save: {s.name}: {s.schedule['note']}", stacklevel=3)
        doc["state"].append(entry)
    doc["nodes"] = [enc.node(n) for n in ir.nodes]
    doc["outputs"] = [enc.ref(v) for v in ir.outputs]
    doc["updates"] = [[name, enc.ref(v)] for name, v in ir.updates]
    return doc, enc.arrays


# ------------------------------------------------------------------ decoding
class FormatError(CheckpointError):
    """A saved graph directory that cannot be read (corrupt, or written by another format version)."""


_STATE_KINDS = ("param", "buffer", "optim", "hyper", "counter", "const")
_DTYPE_NAMES = {d.name for d in dt.ALL}


class _IRDecoder:
    """graph.json -> IR. The hash guards against damage; these checks make a well-formed but
    wrong document a FormatError naming the entry too, never a crash."""

    def __init__(self, arrays: dict, source: str):
        self.arrays = arrays
        self.source = source
        self.values: dict = {}

    def fail(self, message: str):
        raise FormatError(f"flow.load: {self.source}: {message}")

    def new_value(self, entry):
        if not isinstance(entry, dict):
            self.fail(f"bad value description {str(entry)[:80]} (not an object)")
        name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype")
        if not isinstance(name, str):
            self.fail(f"bad value description {str(entry)[:80]} (no name)")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            self.fail(f"value %{name[:40]} has a bad shape {str(shape)[:80]}")
        if not isinstance(dtype, str) or dtype not in _DTYPE_NAMES:
            self.fail(f"value %{name[:40]} has an unknown dtype {str(dtype)[:40]!r}")
        if name in self.values:
            self.fail(f"value %{name} is defined twice")
        v = Value(name, tuple(shape), dt.get(dtype))
        self.values[name] = v
        return v

    def ref(self, name):
        if not isinstance(name, str) or name not in self.values:
            self.fail(f"value {str(name)[:80]!r} is used before it is defined")
        return self.values[name]

    def attr(self, node, key: str):
        if node is None or isinstance(node, (bool, str, int, float)):
            return node
        if isinstance(node, list):
            return [self.attr(v, key) for v in node]
        if not isinstance(node, dict) or len(node) == 0:
            self.fail(f"attribute {key!r}: bad value {str(node)[:80]}")
        if "$tuple" in node and isinstance(node["$tuple"], list):
            return tuple(self.attr(v, key) for v in node["$tuple"])
        if "$dtype" in node and isinstance(node["$dtype"], str) and node["$dtype"] in _DTYPE_NAMES:
            return dt.get(node["$dtype"])
        if "$float" in node and node["$float"] in ("inf", "-inf", "nan"):
            return float(node["$float"])
        if "$scalar" in node:
            np_dtype = self.np_dtype(node["$scalar"], key)
            value = self.attr(node.get("value"), key)
            try:
                return np_dtype.type(value)
            except (TypeError, ValueError, OverflowError) as e:
                self.fail(f"attribute {key!r}: bad {np_dtype} scalar {str(value)[:40]} ({e})")
        if "$dict" in node and isinstance(node["$dict"], dict):
            return {k: self.attr(v, key) for k, v in node["$dict"].items()}
        if "$array" in node:
            name = node["$array"]
            array = self.arrays.get(name) if isinstance(name, str) else None
            if array is None:
                self.fail(f"attribute {key!r}: constant {str(name)[:80]!r} is missing from {CONSTANTS_FILE}")
            if self.np_dtype(node.get("dtype"), key) != array.dtype or list(array.shape) != node.get("shape"):
                self.fail(f"constant {name!r} in {CONSTANTS_FILE} is {array.dtype}{list(array.shape)}, "
                          f"graph.json says {str(node.get('dtype'))[:40]}{str(node.get('shape'))[:80]}")
            return array
        self.fail(f"attribute {key!r}: unknown or malformed tag in {str(node)[:80]}")

    def np_dtype(self, name, key: str) -> np.dtype:
        try:
            if isinstance(name, str):
                return _np_dtype(name)
        except (TypeError, ValueError, SyntaxError):   # NumPy parses dtype strings, e.g. "(2,)f4,"
            pass
        self.fail(f"attribute {key!r}: unknown dtype {str(name)[:40]!r}")

    def node(self, entry, where: str):
        if not isinstance(entry, dict) or not isinstance(entry.get("op"), str):
            self.fail(f"{where} is not a node object with an op")
        op = entry["op"]
        if op != "fused":   # fused nodes are made by the fusion pass, not registered ops
            try:
                get_op(op)
            except (KeyError, TypeError) as e:
                self.fail(f"{where}: unknown op {op[:40]!r} ({e})")
        lists = {k: entry.get(k, []) for k in ("inputs", "outputs", "body")}
        for k, v in lists.items():
            if not isinstance(v, list):
                self.fail(f"{where} ({op}): {k} is not a list")
        attrs_entry = entry.get("attrs", {})
        if not isinstance(attrs_entry, dict):
            self.fail(f"{where} ({op}): attrs is not an object")
        scope, loc = entry.get("scope", ""), entry.get("loc", "")
        if not (isinstance(scope, str) and isinstance(loc, str)):
            self.fail(f"{where} ({op}): scope and loc must be strings")
        inputs = [self.ref(n) for n in lists["inputs"]]
        attrs = {k: self.attr(v, k) for k, v in attrs_entry.items()}
        if "body" in entry:
            attrs["body"] = [self.node(n, f"{where}.body[{i}]") for i, n in enumerate(lists["body"])]
            outputs = [self.ref(o.get("name") if isinstance(o, dict) else None) for o in lists["outputs"]]
        else:
            outputs = [self.new_value(o) for o in lists["outputs"]]
        return Node(op, inputs, outputs, attrs, scope, loc)


def check_graph_format(doc, source: str) -> None:
    """Refuse a document that is not a graph.json of the version this flowgen reads."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError(f"flow.load: {source}: {GRAPH_FILE} is not a flowgen graph file")
    if doc.get("version") != VERSION:
        raise FormatError(f"flow.load: {source}: {GRAPH_FILE} has format version {str(doc.get('version'))[:20]}; "
                          f"this flowgen ({_flowgen_version()}) reads version {VERSION}")


def decode_graph(doc: dict, arrays: dict, source: str):
    check_graph_format(doc, source)
    dec = _IRDecoder(arrays, source)
    for key, kind in (("name", str), ("inputs", list), ("state", list), ("nodes", list), ("outputs", list),
                      ("updates", list)):
        if not isinstance(doc.get(key), kind):
            dec.fail(f"{GRAPH_FILE}: the {key!r} field is missing or not a {kind.__name__}")
    graph = Graph(doc["name"])
    graph.inputs = [dec.new_value(e) for e in doc["inputs"]]
    for i, e in enumerate(doc["state"]):
        value = dec.new_value(e)
        if e.get("kind") not in _STATE_KINDS:
            dec.fail(f"{GRAPH_FILE}: state[{i}] ({value.name}) has kind {str(e.get('kind'))[:20]!r}, not one of "
                     f"{', '.join(_STATE_KINDS)}")
        schedule = e.get("schedule")
        if schedule is not None and not (isinstance(schedule, dict) and isinstance(schedule.get("kind"), str)):
            dec.fail(f"{GRAPH_FILE}: state[{i}] ({value.name}) has a malformed schedule")
        graph.state.append(StateVar(value.name, value, e["kind"], schedule))
    try:
        graph.nodes = [dec.node(n, f"nodes[{i}]") for i, n in enumerate(doc["nodes"])]
    except RecursionError:
        dec.fail(f"{GRAPH_FILE}: an attribute is nested too deeply")
    graph.outputs = [dec.ref(n) for n in doc["outputs"]]
    for i, update in enumerate(doc["updates"]):
        if not (isinstance(update, list) and len(update) == 2 and isinstance(update[0], str)):
            dec.fail(f"{GRAPH_FILE}: updates[{i}] is not a [state name, value name] pair")
        graph.updates.append((update[0], dec.ref(update[1])))
    try:
        verify(graph)
    except IRError as e:
        dec.fail(f"{GRAPH_FILE} does not describe a valid graph: {e}")
    except Exception as e:  # noqa: BLE001 - verify runs every op's shape inference on the file's attributes
        dec.fail(f"{GRAPH_FILE} does not describe a valid graph: {type(e).__name__}: {e}")
    return graph


# ------------------------------------------------------------------ the object
class SavedGraph:
    """A graph loaded from a `flow.save(graph, dir)` directory: IR, weights, signature.

    `run(*arrays)` runs one step with the Python executor on the CPU emulator
    (training graphs update `weights`); `flowgen build dir` compiles the same IR
    into a standalone program.
    """

    def __init__(self, ir, weights: dict, signature: dict, step: int = 0, path: str | None = None,
                 skipped: int = 0, data_parallel: dict | None = None, dynamic=None):
        self.ir = ir
        self.weights = weights          # state name -> ndarray, in ir.state order
        self.signature = signature
        self.step = int(step)           # steps the graph had run when it was saved (+ runs since)
        self.skipped = int(skipped)     # how many of them a GradScaler skipped
        self.path = path
        self.data_parallel = data_parallel   # graph.json's data_parallel entry (module doc), or None
        self.dynamic = dynamic               # SavedDynamic: the dynamic dimensions (module doc), or None
        self._programs: dict = {}   # (target, arch, native) -> Program
        self._executors: dict = {}   # id(Program) -> its Executor (one per program of a dynamic graph)

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def training(self) -> bool:
        return bool(self.signature.get("training", False))

    @property
    def inputs(self) -> list:
        return self.signature["inputs"]

    @property
    def outputs(self) -> list:
        return self.signature["outputs"]

    def program(self, target: str = "cuda", arch: str = None, native: bool = None):
        """The `Program` (kernels, memory plan, kernels.cu) rendered from the IR for `target`
        ("cuda" or "cpu": tile shapes and reduction splits differ) and, for "cuda", the GPU
        architecture `arch` ("sm_90": Hopper's warpgroup MMA; None: any sm_80 or newer); for
        "cpu", `native` False keeps every kernel on the emulator (None: `$FLOWGEN_CPU_KERNELS`,
        codegen/program.py build_program)."""
        key = (target, arch, native)
        if key not in self._programs:
            options = ({"target": target} | ({"arch": arch} if arch else {})
                       | ({"native": native} if native is not None else {}))

            def program_of(ir):
                program, _ = program_cache.cached(ir, options, functools.partial(_build_program, ir, target, arch,
                                                                                 native))
                return program

            with internal_checks(self.name, lambda: f"codegen for {target}"):
                program = program_of(self.ir)
                if self.dynamic is not None:
                    d = self.dynamic
                    try:
                        with forms_chosen_at(program.graph):
                            renderings = [(sizes, program_of(ir)) for sizes, ir in d.renderings]
                            variants = [(ones, program_of(base), [(sizes, program_of(ir)) for sizes, ir in others])
                                        for ones, base, others in d.variants]
                        program = fit_programs(program, renderings, d.dims, d.uses, kernels_source)
                        program = with_variants(program, [
                            (ones, fit_variant(base, others, d.dims, d.uses, ones, kernels_source))
                            for ones, base, others in variants], kernels_source)
                    except DynamicShapeError as e:
                        raise DynamicShapeError(f"{self.name}: for the {target} target: {e}") from None
                self._programs[key] = program
        return self._programs[key]

    def _check_inputs(self, arrays) -> tuple:
        """(the arrays as the step reads them, {Dim: its size in them}: empty for fixed shapes)."""
        if len(arrays) != len(self.ir.inputs):
            raise TypeError(f"{self.name}: run() takes {len(self.ir.inputs)} input arrays, got {len(arrays)}")
        result = []
        dynamic = {} if self.dynamic is None else dim_axes(self.dynamic.uses)
        arrays = [np.asarray(a.numpy() if hasattr(a, "numpy") else a) for a in arrays]
        for i, (a, v) in enumerate(zip(arrays, self.ir.inputs)):
            if a.ndim != len(v.shape) or any(n != m for axis, (n, m) in enumerate(zip(a.shape, v.shape))
                                             if (i, axis) not in dynamic):
                expected = ", ".join(dynamic[i, axis].name if (i, axis) in dynamic else str(m)
                                     for axis, m in enumerate(v.shape))
                raise ValueError(f"{self.name}: input {i} ({v.name}) has shape {tuple(a.shape)}, expected "
                                 f"({expected})")
            if a.dtype != v.dtype.np_dtype:
                convert = "ml_dtypes.bfloat16" if v.dtype.name == "bfloat16" else f"np.{np.dtype(v.dtype.np_dtype).name}"
                raise ValueError(f"{self.name}: input {i} ({v.name}) has dtype {a.dtype}, expected {v.dtype.name}; "
                                 f"convert it with x.astype({convert})")
            result.append(_contiguous(a))
        sizes = sizes_of(self.dynamic.uses, [a.shape for a in result], self.name,
                         [v.name for v in self.ir.inputs]) if dynamic else {}
        return result, sizes

    def run(self, *arrays) -> list:
        """One step on the CPU emulator; returns the outputs as NumPy arrays.

        Every call uses the saved hyper values (lr, bias corrections, dropout offset): it is the
        saved step, replayed; the built program advances them from step to step. An input index
        out of range raises IndexError after the step, as a graph call does.
        """
        inputs, sizes = self._check_inputs(arrays)
        program = self.program("cpu")
        if self.dynamic is not None:   # the program for the Dims at 1, if they have one
            ones = tuple(k for k, d in enumerate(self.dynamic.dims) if sizes[d] == 1)
            program = dict(program.dynamic.variants).get(ones, program)
        if id(program) not in self._executors:
            self._executors[id(program)] = Executor(program, CpuBackend(program.source))
        ex = self._executors[id(program)]
        for s in program.graph.state:
            ex.write_state(s.value, self.weights[s.name])
        outputs = ex.run(inputs)
        if self.training:
            for s in program.graph.state:
                self.weights[s.name] = ex.read_value(s.value)
        self.step += 1
        ex.raise_index_error()
        return outputs

    def __repr__(self) -> str:
        def sig(items):
            return ", ".join(f"{e['name']}: {e['dtype']}{list(e['shape'])}" for e in items)

        kind = "training" if self.training else "inference"
        return (f"SavedGraph({self.name}, {kind}, inputs=({sig(self.inputs)}), outputs=({sig(self.outputs)}), "
                f"{len(self.weights)} state tensors, path={self.path!r})")


# ------------------------------------------------------------------ saving
def _build_program(ir, target: str, arch: str = None, native: bool = None):
    program = build_program(ir, target=target, arch=arch, native=native)
    program.kernels_before_fusion = count_unfused_kernels(ir)
    return program


def _state_values(compiled) -> dict:
    """Current value of every state entry: eager tensors for bound state, the host's value for hyper
    scalars (what the next step would use), the device copy for anything else."""
    bound = {id(v): t for v, t in compiled.bindings}
    hyper = {id(v): h for v, h in compiled.host_scalars}
    result = {}
    for s in compiled.ir.state:
        np_dtype = s.value.dtype.np_dtype
        if id(s.value) in bound:
            array = np.array(bound[id(s.value)].numpy(), dtype=np_dtype)
        elif id(s.value) in hyper:
            # Saving must not consume the dropout stream: the saved offset is the one the
            # graph's next call will draw.
            with random.preserved_dropout_stream():
                array = np.asarray(hyper[id(s.value)].compute(), dtype=np_dtype)
        else:
            array = compiled.executor.read_value(s.value)
        result[s.name] = _contiguous(array.reshape(s.value.shape))
    return result


def signature_of(ir, training: bool, graph_name: str, data_parallel: dict | None = None,
                 dynamic: dict | None = None) -> dict:
    outputs = [dict(_value_json(v), name=f"output_{i}", value=v.name) for i, v in enumerate(ir.outputs)]
    extra = ({} if data_parallel is None else {"data_parallel": data_parallel}) | \
        ({} if dynamic is None else {"dynamic": dynamic})
    return {
        "format": SIGNATURE_FORMAT,
        "version": VERSION,
        "graph": graph_name,
        "flowgen_version": _flowgen_version(),
        "training": bool(training),
        "inputs": [_value_json(v) for v in ir.inputs],
        "outputs": outputs,
        "state": [dict(_value_json(s.value), kind=s.kind) for s in ir.state],
        **extra,
    }


def write_weights(weights: dict, file, graph_name: str, step: int, skipped: int = 0) -> None:
    """weights.safetensors, to the open binary `file`: tensors in state order; metadata names the
    graph, the step counter and how many of those steps a GradScaler skipped (they do not count
    for Adam or SGD momentum). The same state gives the same bytes in every process."""
    write_safetensors({k: _contiguous(v) for k, v in weights.items()}, file,
                      {"format": WEIGHTS_FORMAT, "graph": graph_name, "step": str(int(step)),
                       "skipped": str(int(skipped))})


def is_saved_graph(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), GRAPH_FILE))


def save_graph(graph, path) -> None:
    """`flow.save(graph, path)`: write graph.json, constants, weights and signature atomically. For a
    data-parallel graph every rank calls it and rank 0 writes (module doc); a graph whose tensors
    are all on some of the ranks is written by those (the others hold nothing of it)."""
    if graph._last is None:
        raise RuntimeError(f"flow.save: {graph.name} has not been called yet; call it once with example inputs "
                           f"so that it is traced and compiled, then save it")
    compiled = graph.compiled
    if graph.config.dynamic is not None and compiled.program.dynamic is None:
        # The last call had every Dim at 1 (a variant of fixed shapes): the dynamic variant saves.
        dynamic = [v for v in graph._variants.values() if v.program.dynamic is not None]
        if not dynamic:
            raise ValueError(f"flow.save: {graph.name} declares dynamic_shapes, but has run only with every Dim at 1 "
                             f"(compiled for those shapes alone); call it once with sizes above 1, then save it")
        compiled = dynamic[-1]
    if not compiled.runs_here:     # a graph on some of the ranks: they save it, this rank holds none of it
        return
    data_parallel = data_parallel_entry(graph.name, compiled)
    doc, arrays = encode_graph(compiled.ir, graph.training)
    if data_parallel is not None:
        doc["data_parallel"] = data_parallel
    if compiled.program.dynamic is not None and data_parallel is not None:
        raise NotImplementedError(f"flow.save: {graph.name} is data parallel and has dynamic dimensions; the "
                                  f"standalone program splits each batch over its ranks at one size: save it "
                                  f"compiled for fixed shapes (graph.config.dynamic_shapes(None))")
    dynamic = _dynamic_entry(graph.name, compiled, graph.training)
    if dynamic is not None:
        doc["dynamic"], renderings_arrays = dynamic
        arrays.update(renderings_arrays)
    weights = _state_values(compiled)
    signature = signature_of(compiled.ir, graph.training, graph.name, data_parallel,
                             None if dynamic is None else _dims_only(dynamic[0]))

    def write(tmp: str) -> None:
        constants_path = os.path.join(tmp, CONSTANTS_FILE)
        with open(constants_path, "wb") as f:
            write_safetensors(arrays, f, {"format": "flowgen.constants"})
        weights_path = os.path.join(tmp, WEIGHTS_FILE)
        with open(weights_path, "wb") as f:
            write_weights(weights, f, graph.name, graph._counter["calls"], graph._counter.get("skipped", 0))
        doc["constants_sha256"] = file_sha256(constants_path)
        doc["weights_sha256"] = file_sha256(weights_path)
        write_json(with_self_hash(doc, "graph_sha256"), os.path.join(tmp, GRAPH_FILE))
        write_json(with_self_hash(signature, "signature_sha256"), os.path.join(tmp, SIGNATURE_FILE))

    if data_parallel is None:
        write_directory_atomically(path, write)
    else:
        _write_on_rank_0(graph.name, path, write, doc, weights)


@dataclass
class SavedDynamic:
    """graph.json's `dynamic` entry, decoded: the Dims, where each is read ({Dim: [DimUse]}), the
    step's IR at other sizes than the maxima ([(sizes, IR)]), which a build fits into one program
    for its target (codegen/dynamic.py), and the programs for sizes of 1 that do not fit it."""

    dims: list
    uses: dict
    renderings: list
    variants: list      # [(places of the Dims at 1, IR at the others' max, [(sizes, IR)])]


def _dynamic_entry(graph_name: str, compiled, training: bool) -> tuple | None:
    """(graph.json's `dynamic` entry, its renderings' constant arrays) for a variant compiled with
    dynamic dimensions, None for fixed shapes. A Dim whose minimum is 1 is rendered at 1 too: if
    the kernels fitted for the other sizes fit it, the build has one program; if not, one more
    program for each set of such Dims at 1 (`variants`), as the Python graph compiles them. A step
    that updates its state (training) takes its Dims on the inputs' first axis only: the standalone
    program splits each input's rows into batches of the Dim's maximum, the last one smaller."""
    dynamic = compiled.program.dynamic
    if dynamic is None:
        return None
    dims, uses = dynamic.dims, dynamic.uses
    off_batch = [(d, use) for d in dims for use in uses[d] if use.axis != 0]
    if compiled.ir.updates and off_batch:
        d, use = off_batch[0]
        raise NotImplementedError(f"flow.save: {graph_name} updates its state (a training step, or BatchNorm's running "
                                  f"statistics) and its {d!r} is axis {use.axis} of input {use.input}; the standalone "
                                  f"program runs such a step over batches of an input's rows, so its Dims must be "
                                  f"the inputs' first axis (it runs so in Python)")
    renderings = list(dynamic.renderings)
    at_one = [(sizes, compiled.render_at(sizes)) for sizes in unit_points(dims)]
    variants = []
    if at_one:
        try:
            fit_programs(dynamic.base, renderings + at_one, dims, uses, kernels_source)
            renderings += at_one
        except DynamicShapeError:   # a size of 1 compiles to other kernels: programs of their own
            for ones in unit_subsets(dims):
                base_sizes, points = variant_points(dims, ones)
                base = compiled.render_at(base_sizes)
                others = [(sizes, compiled.render_at(sizes)) for sizes in points]
                at = ", ".join(f"{dims[k].name}=1" for k in ones)
                try:
                    fit_variant(base, others, dims, uses, ones, kernels_source)
                except DynamicShapeError as e:
                    raise DynamicShapeError(f"flow.save: {graph_name}: the program for {at}: {e}") from None
                variants.append((ones, base, others))
    entry = {"dims": [{"name": d.name, "min": d.min, "max": d.max} for d in dims],
             "uses": [[k, use.input, use.axis] for k, d in enumerate(dims) for use in uses[d]],
             "renderings": [], "variants": []}
    arrays = {}

    def encoded(program, prefix):
        doc, graph_arrays = encode_graph(program.graph, training)
        arrays.update({f"{prefix}{key}": array for key, array in graph_arrays.items()})
        return {k: v for k, v in doc.items() if k not in _HEADER}

    def rendering_list(items, prefix):
        return [{"sizes": list(sizes), "graph": encoded(program, f"{prefix}rendering_{j}/")}
                for j, (sizes, program) in enumerate(items)]

    entry["renderings"] = rendering_list(renderings, "")
    for v, (ones, base, others) in enumerate(variants):
        entry["variants"].append({"ones": list(ones), "graph": encoded(base, f"variant_{v}/"),
                                  "renderings": rendering_list(others, f"variant_{v}/")})
    return entry, arrays


_HEADER = ("format", "version", "flowgen_version")


def _dims_only(entry: dict) -> dict:
    """signature.json's `dynamic` entry: graph.json's without the renderings."""
    return {"dims": entry["dims"], "uses": entry["uses"]}


def _decoded_dynamic(entry, arrays: dict, ir, filename: str, source: str) -> SavedDynamic | None:
    """graph.json's `dynamic` entry (module doc), checked against the graph and decoded."""
    if entry is None:
        return None

    def bad(why: str):
        raise FormatError(f"flow.load: {filename}: the 'dynamic' field {why}")

    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), list) for k in ("dims", "uses", "renderings")):
        bad("must be an object with the lists dims, uses and renderings")
    dims = []
    for d in entry["dims"]:
        try:
            dims.append(Dim(d["name"], min=d["min"], max=d["max"]))
        except (TypeError, KeyError, ValueError) as e:
            bad(f"has a bad Dim {str(d)[:80]}: {e}")
    if not dims or len({d.name for d in dims}) != len(dims):
        bad("must name one or more Dims, each once")
    uses: dict = {d: [] for d in dims}
    for use in entry["uses"]:
        if not (isinstance(use, list) and len(use) == 3 and all(type(n) is int for n in use)
                and 0 <= use[0] < len(dims) and 0 <= use[1] < len(ir.inputs)
                and 0 <= use[2] < len(ir.inputs[use[1]].shape)):
            bad(f"has a bad use {str(use)[:40]} (a [Dim, input, axis] triple in range)")
        dim = dims[use[0]]
        if ir.inputs[use[1]].shape[use[2]] != dim.max:
            bad(f"ties axis {use[2]} of input {use[1]} ({ir.inputs[use[1]].shape[use[2]]}) to {dim}, whose max it "
                f"must be")
        uses[dim].append(DimUse(use[1], use[2]))
    if not all(uses.values()):
        bad("has a Dim no input uses")

    def graph_at(doc, prefix: str):
        own = {k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix) and "/" not in k[len(prefix):]}
        return decode_graph(dict(doc, format=FORMAT, version=VERSION), own, source)

    def decoded_renderings(items, prefix: str, where: str, ones=None) -> list:
        renderings = []
        for j, r in enumerate(items if isinstance(items, list) else [None]):
            sizes = r.get("sizes") if isinstance(r, dict) else None
            if not (isinstance(sizes, list) and len(sizes) == len(dims) and all(type(n) is int for n in sizes)
                    and all(d.min <= n <= d.max and (ones is None or (n == 1) == (k in ones))
                            for k, (d, n) in enumerate(zip(dims, sizes))) and isinstance(r.get("graph"), dict)):
                bad(f"has a bad rendering {j}{where} (sizes in the Dims' ranges, 1 where the program says, and a graph)")
            renderings.append((sizes, graph_at(r["graph"], f"{prefix}rendering_{j}/")))
        return renderings

    renderings = decoded_renderings(entry["renderings"], "", "")
    variants = []
    for v, variant in enumerate(entry.get("variants", [])):
        ones = variant.get("ones") if isinstance(variant, dict) else None
        if not (isinstance(ones, list) and ones and all(type(k) is int and 0 <= k < len(dims) and dims[k].min == 1
                                                         for k in ones) and isinstance(variant.get("graph"), dict)):
            bad(f"has a bad variant {v} (the places of Dims with min 1, and a graph)")
        ones = tuple(ones)
        variants.append((ones, graph_at(variant["graph"], f"variant_{v}/"),
                         decoded_renderings(variant.get("renderings"), f"variant_{v}/", f" of variant {v}", ones)))
    return SavedDynamic(dims, uses, renderings, variants)


def data_parallel_entry(graph_name: str, compiled) -> dict | None:
    """graph.json's `data_parallel` entry of a compiled variant (module doc), None when it is not
    data parallel; raises for the data-parallel graphs a standalone program cannot run."""
    dp = compiled.data_parallel
    if dp is None:
        return None
    where = f"flow.save({graph_name}, ...)"
    if dp.contract != "global":
        raise NotImplementedError(f"{where}: the graph's module is wrapped in DistributedDataParallel, so each "
                                  f"rank passes a batch of its own; the standalone program shards one file per "
                                  f"input over the ranks, as a graph called with flow.sbp.split(0) global inputs "
                                  f"does: call the graph with global inputs (x.to_global(placement, "
                                  f"flow.sbp.split(0))) and save that")
    # every collective but an all_reduce (the one a standalone program runs: codegen/aot.py) leaves
    # each rank part of the state: ZeRO's reduce_scatter / all_gather, a pipeline's send / recv
    lowerings = [(n.op, get_op(n.op).lowering) for n in compiled.ir.nodes if n.op != "fused"]   # not a registry op
    sharded = [op for op, lowering in lowerings if isinstance(lowering, Collective) and lowering.kind != "all_reduce"]
    if compiled.sharded_slots or sharded:
        raise NotImplementedError(f"{where}: the graph shards its optimizer state or parameters over the ranks "
                                  f"(enable_zero: {', '.join(sorted(set(sharded)))}); the standalone program "
                                  f"holds the whole state on every rank: save the graph without enable_zero, or "
                                  f"save graph.state_dict() instead")
    local = [k for k, layout in enumerate(compiled.input_layouts) if layout not in INPUT_LAYOUTS]
    if local:
        raise NotImplementedError(f"{where}: input(s) {', '.join(map(str, local))} of the data-parallel graph are "
                                  f"local tensors (each rank its own value); the standalone program reads one "
                                  f"file per input on every rank: pass them as global tensors, flow.sbp.split(0) "
                                  f"or flow.sbp.broadcast")
    return {"world_size": dp.world_size, "inputs": list(compiled.input_layouts),
            "outputs": ["split" if how is None else how for how in compiled.output_combine]}


def _write_on_rank_0(graph_name: str, path, write, doc: dict, weights: dict) -> None:
    """flow.save of a data-parallel graph, called on every rank: the ranks' graphs and weights must
    be identical (checked by hash); rank 0 writes, and every rank returns once it has written (or
    raises if it failed)."""
    digest = hashlib.sha256(document_sha256(doc).encode())
    for name, array in weights.items():
        digest.update(name.encode() + b"\0" + _contiguous(array).tobytes())
    comm = world()
    digests = comm.all_gather(np.frombuffer(digest.digest(), np.uint8))
    differing = [r for r, d in enumerate(digests) if not np.array_equal(d, digests[0])]
    if differing:
        raise RuntimeError(f"flow.save({graph_name}, ...): the graph or weights of rank(s) "
                           f"{', '.join(map(str, differing))} differ from rank 0's; the replicas of a data-parallel "
                           f"graph must be identical to be saved once")
    error = None
    if comm.rank == 0:
        try:
            write_directory_atomically(path, write)
        except Exception as exc:   # noqa: BLE001 - re-raised below, after telling the other ranks
            error = exc
    failed = comm.all_gather(np.array(error is not None))
    if error is not None:
        raise error
    if bool(failed[0]):
        raise RuntimeError(f"flow.save({graph_name}, {path}): rank 0 could not write the directory (its error "
                           f"says why)")


# ------------------------------------------------------------------ loading
def check_weights(ir, weights: dict, source: str) -> None:
    """The weights must hold exactly the graph's state, with its shapes and dtypes."""
    expected = {s.name: s.value for s in ir.state}
    missing = [n for n in expected if n not in weights]
    extra = [n for n in weights if n not in expected]
    if missing:
        raise FormatError(f"{source}: missing tensor(s) {', '.join(missing)}")
    if extra:
        raise FormatError(f"{source}: unexpected tensor(s) {', '.join(extra)} (not state of graph {ir.name})")
    for name, v in expected.items():
        a = weights[name]
        if a.dtype != v.dtype.np_dtype:
            raise FormatError(f"{source}: tensor {name!r} has dtype {a.dtype}, expected {v.dtype.name}")
        if tuple(a.shape) != tuple(v.shape):
            raise FormatError(f"{source}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(v.shape)}")


def _metadata_count(metadata: dict, key: str, filename: str) -> int:
    text = metadata.get(key, "0")
    if not (text.isascii() and text.isdigit() and len(text) < 16):
        raise FormatError(f"flow.load: {filename}: metadata {key!r} is {text[:40]!r}, not a step count")
    return int(text)


def _check_signature(signature, ir, training: bool, data_parallel, dynamic, filename: str) -> None:
    """signature.json must describe the graph it sits beside."""
    if not isinstance(signature, dict) or signature.get("format") != SIGNATURE_FORMAT:
        raise FormatError(f"flow.load: {filename} is not a flowgen signature file")
    if not isinstance(signature.get("graph"), str):
        raise FormatError(f"flow.load: {filename}: the 'graph' field is missing or not a string")
    expected = signature_of(ir, training, signature["graph"], data_parallel, dynamic)
    for key in ("version", "training", "inputs", "outputs", "state", "data_parallel", "dynamic"):
        if signature.get(key) != expected.get(key):
            raise FormatError(f"flow.load: {filename}: the {key!r} field does not match {GRAPH_FILE} "
                              f"(found {str(signature.get(key))[:80]}, expected {str(expected.get(key))[:80]})")


def load_saved_graph(path) -> SavedGraph:
    path = os.path.abspath(os.fspath(path))
    graph_path = os.path.join(path, GRAPH_FILE)
    doc = read_json_file(graph_path)
    check_graph_format(doc, path)
    check_self_hash(doc, "graph_sha256", graph_path)
    constants_path = os.path.join(path, CONSTANTS_FILE)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    arrays, _ = read_safetensors_file(constants_path)
    weights_raw, metadata = read_safetensors_file(weights_path)
    for filename, key in ((constants_path, "constants_sha256"), (weights_path, "weights_sha256")):
        if file_sha256(filename) != doc.get(key):
            raise FormatError(f"flow.load: {filename} is corrupt: its SHA-256 does not match the {key} field of "
                              f"{GRAPH_FILE} (modified or damaged after saving)")
    main_arrays = {k: a for k, a in arrays.items() if "/" not in k}   # not a rendering's (dynamic entry)
    ir = decode_graph(doc, main_arrays, path)
    data_parallel = _checked_data_parallel(doc.get("data_parallel"), ir, graph_path)
    dynamic = _decoded_dynamic(doc.get("dynamic"), arrays, ir, graph_path, path)
    if dynamic is not None and data_parallel is not None:
        raise FormatError(f"flow.load: {graph_path}: dynamic dimensions in a data-parallel graph")
    if dynamic is not None and ir.updates and any(use.axis for uses in dynamic.uses.values() for use in uses):
        raise FormatError(f"flow.load: {graph_path}: dynamic dimensions off the inputs' first axis in a step that "
                          f"updates its state")
    check_weights(ir, weights_raw, weights_path)
    weights = {s.name: weights_raw[s.name] for s in ir.state}
    step = _metadata_count(metadata, "step", weights_path)
    skipped = _metadata_count(metadata, "skipped", weights_path)
    signature_path = os.path.join(path, SIGNATURE_FILE)
    signature = read_json_file(signature_path)
    _check_signature(signature, ir, bool(doc.get("training")), data_parallel,
                     None if dynamic is None else _dims_only(doc["dynamic"]), signature_path)
    check_self_hash(signature, "signature_sha256", signature_path)
    return SavedGraph(ir, weights, signature, step=step, path=path, skipped=skipped, data_parallel=data_parallel,
                      dynamic=dynamic)


def _checked_data_parallel(entry, ir, filename: str) -> dict | None:
    """graph.json's data_parallel entry (module doc), checked against the graph."""
    if entry is None:
        return None

    def bad(why: str):
        raise FormatError(f"flow.load: {filename}: the 'data_parallel' field {why}")

    if not isinstance(entry, dict):
        bad("is not an object")
    size, inputs, outputs = entry.get("world_size"), entry.get("inputs"), entry.get("outputs")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        bad(f"has world_size {str(size)[:20]}, not a positive integer")
    if not (isinstance(inputs, list) and len(inputs) == len(ir.inputs) and all(i in INPUT_LAYOUTS for i in inputs)):
        bad(f"must give one of {', '.join(INPUT_LAYOUTS)} per graph input ({len(ir.inputs)})")
    if not (isinstance(outputs, list) and len(outputs) == len(ir.outputs)
            and all(o in OUTPUT_COMBINES for o in outputs)):
        bad(f"must give one of {', '.join(OUTPUT_COMBINES)} per graph output ({len(ir.outputs)})")
    if any(layout == "split" and not v.shape for layout, v in zip(inputs, ir.inputs)):
        bad("splits a 0-d input")
    if any((how == "split") != bool(v.shape) for how, v in zip(outputs, ir.outputs)):
        bad("must split exactly the outputs that are not 0-d")
    return {"world_size": size, "inputs": inputs, "outputs": outputs}


install_graph_loader(load_saved_graph)
