"""`flow.save(obj, path)` / `flow.load(path)`: nested state as a directory, never pickle.

A saved ``path`` is a directory holding two files:

* ``tensors.safetensors`` — every tensor leaf, named by where it sits in the
  nesting (``model.0.weight``, ``state.0.momentum_buffer``), so other tools
  can read the weights;
* ``structure.json`` — the nesting. Scalars (int, float, str, bool, None) and
  lists are plain JSON; other nodes are tagged objects::

      {"__tensor__": "model.0.weight", "dtype": "float32", "device": "cpu"}
      {"__ndarray__": "key"}                   (a NumPy array leaf)
      {"__dict__": {"lr": 0.1}}                (all keys are strings)
      {"__dict_items__": [[0, ...], ...]}      (other keys: int, float, bool, None)
      {"__tuple__": [...]}

  plus ``format``, ``version`` and ``tensors_sha256`` (checked on load, so a
  damaged file is refused instead of read).

Saving is atomic: everything is written into ``path + ".tmp-<random>"`` and
renamed over ``path`` at the end (an old save is first renamed aside, then
deleted), so an interrupted save leaves the previous one intact.

`flow.save(obj, path)` on an object with a ``_flowgen_save(path)`` method
(an `nn.Graph`) hands the whole job to that method.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil

import numpy as np

from flowgen import dtype as dt
from flowgen.device import as_device
from flowgen.tensor import Tensor

FORMAT = "flowgen.save"
VERSION = 1
STRUCTURE_FILE = "structure.json"
TENSORS_FILE = "tensors.safetensors"

__all__ = ["save", "load"]


# ---------------------------------------------------------------- encoding
class _Encoder:
    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def _key(self, where: list) -> str:
        base = ".".join(str(p) for p in where) or "tensor"
        key, n = base, 1
        while key in self.arrays:
            key, n = f"{base}#{n}", n + 1
        return key

    def _store(self, array: np.ndarray, where: list) -> str:
        key = self._key(where)
        self.arrays[key] = array if array.flags.c_contiguous else np.array(array, order="C")
        return key

    def encode(self, obj, where: list):
        from flowgen.nn.parameter import Parameter

        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj
        if isinstance(obj, Tensor):
            if obj.is_lazy:
                raise TypeError(f"flow.save: the tensor at {_where(where)} is a lazy graph tensor; save the values "
                                f"returned by the graph instead")
            node = {"__tensor__": self._store(obj.numpy_view(), where), "dtype": obj.dtype.name,
                    "device": str(obj.device)}
            if isinstance(obj, Parameter):
                node["parameter"] = True
            if obj.requires_grad and obj.is_leaf:
                node["requires_grad"] = True
            return node
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in "OUSV" and obj.dtype != dt.bfloat16.np_dtype:
                raise TypeError(f"flow.save: cannot save a NumPy array of dtype {obj.dtype} at {_where(where)}")
            return {"__ndarray__": self._store(obj, where)}
        if isinstance(obj, np.bool_):
            return bool(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, dict):
            for key in obj:
                if not (key is None or isinstance(key, (str, bool, int, float))):
                    raise TypeError(f"flow.save: dict keys must be str, int, float, bool or None; found a "
                                    f"{type(key).__name__} key at {_where(where)}")
            if all(isinstance(k, str) for k in obj):
                return {"__dict__": {k: self.encode(v, where + [k]) for k, v in obj.items()}}
            return {"__dict_items__": [[k, self.encode(v, where + [k])] for k, v in obj.items()]}
        if isinstance(obj, list):
            return [self.encode(v, where + [i]) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, where + [i]) for i, v in enumerate(obj)]}
        raise TypeError(f"flow.save: cannot save an object of type {type(obj).__name__} at {_where(where)}; "
                        f"supported: tensors, NumPy arrays, dicts, lists, tuples, int, float, str, bool, None "
                        f"(save a module through its state_dict())")


def _where(where: list) -> str:
    return "the top level" if not where else "'" + ".".join(str(p) for p in where) + "'"


class _Decoder:
    def __init__(self, arrays: dict, source: str, map_location):
        self.arrays = arrays
        self.source = source
        self.device = as_device(map_location) if map_location is not None else None

    def _array(self, key) -> np.ndarray:
        if key not in self.arrays:
            raise ValueError(f"flow.load: {self.source} is corrupt: structure.json refers to tensor {key!r}, which "
                             f"is not in {TENSORS_FILE}")
        return self.arrays[key]

    def decode(self, node):
        from flowgen.nn.parameter import Parameter

        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or len({"__tensor__", "__ndarray__", "__dict__", "__dict_items__",
                                              "__tuple__"} & node.keys()) != 1:
            raise ValueError(f"flow.load: {self.source} is corrupt: unexpected node {str(node)[:80]} in "
                             f"structure.json")
        if "__tensor__" in node:
            array = self._array(node["__tensor__"])
            dtype = dt.get(node.get("dtype", dt.from_numpy(array.dtype).name))
            if array.dtype != dtype.np_dtype:
                raise ValueError(f"flow.load: {self.source} is corrupt: tensor {node['__tensor__']!r} is stored as "
                                 f"{array.dtype}, structure.json says {dtype.name}")
            device = self.device or node.get("device", "cpu")
            requires_grad = bool(node.get("requires_grad", False))
            if node.get("parameter"):
                t = Parameter(Tensor(array, dtype=dtype, device=device), requires_grad=requires_grad)
            else:
                t = Tensor(array, dtype=dtype, device=device, requires_grad=requires_grad)
            return t
        if "__ndarray__" in node:
            return self._array(node["__ndarray__"])
        if "__dict__" in node:
            return {k: self.decode(v) for k, v in node["__dict__"].items()}
        if "__dict_items__" in node:
            return {k: self.decode(v) for k, v in node["__dict_items__"]}
        return tuple(self.decode(v) for v in node["__tuple__"])


# -------------------------------------------------------------------- save
def save(obj, path) -> None:
    """Save nested dicts/lists/tuples of tensors and Python scalars to the directory `path` (atomically)."""
    hook = getattr(obj, "_flowgen_save", None)
    if callable(hook) and not isinstance(obj, (dict, list, tuple, Tensor)):
        return hook(path)
    encoder = _Encoder()
    root = encoder.encode(obj, [])

    def write(tmp: str) -> None:
        tensors_path = os.path.join(tmp, TENSORS_FILE)
        _write_tensors(encoder.arrays, tensors_path)
        write_json({"format": FORMAT, "version": VERSION, "tensors_sha256": file_sha256(tensors_path),
                    "root": root},
                   os.path.join(tmp, STRUCTURE_FILE), allow_nan=True)

    write_directory_atomically(path, write)


def write_directory_atomically(path, write) -> None:
    """Write a flow.save directory at `path`: `write(tmp)` fills a fresh temporary directory
    beside it, which then replaces `path`. An interrupted save leaves the old directory intact."""
    path = os.path.abspath(os.fspath(path))
    _check_replaceable(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"flow.save: the parent directory {parent} does not exist")
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        write(tmp)
        _replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(obj, filename: str, allow_nan: bool = False) -> None:
    """JSON written and fsynced (strict by default; state dicts may hold inf/nan scalars)."""
    with open(filename, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=allow_nan)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(arrays: dict, filename: str) -> None:
    from safetensors.numpy import save_file

    save_file(arrays, filename, metadata={"format": FORMAT})
    with open(filename, "rb+") as f:
        os.fsync(f.fileno())


def file_sha256(filename: str) -> str:
    digest = hashlib.sha256()
    with open(filename, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Files that mark a directory as written by flow.save (a state dict, or a saved graph).
SAVE_MARKERS = (STRUCTURE_FILE, "graph.json")


def _is_save_directory(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, marker)) for marker in SAVE_MARKERS)


def _check_replaceable(path: str) -> None:
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise FileExistsError(f"flow.save: {path} exists and is not a directory; flow.save writes a directory "
                              f"there, so remove it or choose another path")
    if os.listdir(path) and not _is_save_directory(path):
        raise FileExistsError(f"flow.save: {path} is a non-empty directory that is not a flow.save directory "
                              f"(no {' or '.join(SAVE_MARKERS)}); refusing to replace it")


def _replace_directory(new: str, path: str) -> None:
    """Put directory `new` at `path`; an old directory there is renamed aside first, then deleted."""
    if not os.path.lexists(path):
        os.rename(new, path)
    else:
        old = f"{path}.old-{secrets.token_hex(4)}"
        os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_directory(os.path.dirname(path))


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -------------------------------------------------------------------- load
def load(path, map_location=None):
    """Load what `flow.save` wrote at `path`; tensors get `map_location`'s device label if given."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        leftovers = sorted(p for p in os.listdir(os.path.dirname(path)) if p.startswith(os.path.basename(path) +
                                                                                        ".old-")) \
            if os.path.isdir(os.path.dirname(path)) else []
        hint = (f" (an interrupted save left the previous version at {leftovers[-1]}; rename it to "
                f"{os.path.basename(path)} to use it)") if leftovers else ""
        raise FileNotFoundError(f"flow.load: {path} does not exist{hint}")
    if not os.path.isdir(path):
        raise ValueError(f"flow.load: {path} is a file; flow.save writes a directory containing {STRUCTURE_FILE} "
                         f"and {TENSORS_FILE}")
    if os.path.isfile(os.path.join(path, "graph.json")):   # flow.save(graph, dir): a deployable graph
        from flowgen.saved_graph import load_saved_graph

        return load_saved_graph(path)
    structure_path = os.path.join(path, STRUCTURE_FILE)
    tensors_path = os.path.join(path, TENSORS_FILE)
    if not os.path.isfile(structure_path):
        raise FileNotFoundError(f"flow.load: {path} is not a flow.save directory: {STRUCTURE_FILE} is missing")
    try:
        with open(structure_path, encoding="utf-8") as f:
            structure = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"flow.load: {structure_path} is corrupt (not valid JSON: {e})") from None
    if not isinstance(structure, dict) or structure.get("format") != FORMAT or "root" not in structure:
        raise ValueError(f"flow.load: {structure_path} is not a flow.save structure file")
    if structure.get("version") != VERSION:
        raise ValueError(f"flow.load: {path} was written by format version {structure.get('version')}; this "
                         f"flowgen reads version {VERSION}")
    if not os.path.isfile(tensors_path):
        raise FileNotFoundError(f"flow.load: {path} is incomplete: {TENSORS_FILE} is missing")
    expected = structure.get("tensors_sha256")
    if expected is not None and file_sha256(tensors_path) != expected:
        raise ValueError(f"flow.load: {tensors_path} is corrupt: its SHA-256 does not match the one recorded in "
                         f"{STRUCTURE_FILE} (truncated or modified after saving)")
    arrays = _read_tensors(tensors_path)
    return _Decoder(arrays, path, map_location).decode(structure["root"])


def _read_tensors(filename: str) -> dict:
    from safetensors.numpy import load_file

    try:
        arrays = load_file(filename)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad headers
        raise ValueError(f"flow.load: {filename} is corrupt ({type(e).__name__}: {e})") from None
    return {k: v if v.flags.writeable else v.copy() for k, v in arrays.items()}

