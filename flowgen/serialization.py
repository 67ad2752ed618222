"""`flow.save(obj, path)` / `flow.load(path)`: nested state as a directory, never pickle.

A saved ``path`` is a directory holding two files:

* ``tensors.safetensors`` — every tensor leaf, named by where it sits in the
  nesting (``model.0.weight``, ``state.0.momentum_buffer``), so other tools
  can read the weights;
* ``structure.json`` — the nesting. Scalars (int, float, str, bool, None) and
  lists are plain JSON; other nodes are tagged objects::

      {"__tensor__": "model.0.weight", "dtype": "float32", "device": "cpu"}
                                               (optional "parameter": true, "requires_grad": true)
      {"__ndarray__": "key"}                   (a NumPy array leaf)
      {"__dict__": {"lr": 0.1}}                (all keys are strings)
      {"__dict_items__": [[0, ...], ...]}      (other keys: int, float, bool, None)
      {"__tuple__": [...]}

  plus ``format``, ``version``, ``tensors_sha256`` (the SHA-256 of
  tensors.safetensors) and ``structure_sha256``: the SHA-256 of the structure
  document itself without that key, as canonical JSON (sorted keys, no spaces).
  Both are checked on load, so a damaged file is refused instead of read.

Errors: `flow.load` raises `CheckpointError` (a ValueError) for any directory it
cannot read back — a missing, unreadable, truncated, damaged or hand-edited file —
with a message naming the file and the field; `FileNotFoundError` only when
``path`` itself does not exist. For saved graphs (`flow.save(graph, dir)`) many of
these are its subclass `saved_graph.FormatError`.

Saving is atomic: everything is written into ``path + ".tmp-<pid>-<random>"``,
flushed to disk, then swapped with ``path`` in one step (Linux
``renameat2(RENAME_EXCHANGE)``; elsewhere the old directory is renamed aside to
``.old-<pid>-<random>`` first) and the old copy deleted. So ``path`` always holds
a complete save, the old one or the new one, even if the process is killed. A
save killed midway leaves its ``.tmp-``/``.old-`` folder behind; the next
successful save or load of that path deletes every such leftover whose process
is no longer running.

A ``path`` that already is an empty regular file or a single-file save (OneFlow's `flow.save`
writes one file, so its code saves to files such as a `tempfile.NamedTemporaryFile`'s name) is
replaced atomically (`os.replace`) by a single-file save instead (any other file is refused): one safetensors file whose metadata holds
``format``, ``version`` and ``structure`` (the structure document above, as JSON, with a
``tensors_sha256`` computed over the tensors' names, dtypes, shapes and bytes). `flow.load`
reads either form.

`flow.save(obj, path)` on an object with a ``_flowgen_save(path)`` method
(an `nn.Graph`) hands the whole job to that method.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil

import numpy as np
from safetensors import safe_open

from flowgen import dtype as dt
from flowgen.device import as_device
from flowgen.nn.parameter import Parameter
from flowgen.tensor import Tensor

FORMAT = "flowgen.save"
VERSION = 1
STRUCTURE_FILE = "structure.json"
TENSORS_FILE = "tensors.safetensors"
# Deeper nesting than this is refused on save and on load (JSON readers recurse per level).
MAX_DEPTH = 100

__all__ = ["save", "load", "CheckpointError"]


class CheckpointError(ValueError):
    """A flow.save directory that cannot be loaded: a file is missing, unreadable, damaged or
    not what flow.save writes. The message names the file and the field."""


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
        if len(where) > MAX_DEPTH:
            raise ValueError(f"flow.save: the object is nested more than {MAX_DEPTH} levels deep at {_where(where)}")
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


_TAGS = ("__tensor__", "__ndarray__", "__dict__", "__dict_items__", "__tuple__")
_TENSOR_FIELDS = {"__tensor__", "dtype", "device", "parameter", "requires_grad"}
_DTYPES = {d.name: d for d in dt.ALL}


class _Decoder:
    """structure.json -> Python objects. The document may have been edited by hand, so every node
    is checked before use and every refusal names the node's place in the nesting."""

    def __init__(self, arrays: dict, structure_path: str, map_location):
        self.arrays = arrays
        self.structure_path = structure_path
        self.device = as_device(map_location) if map_location is not None else None

    def fail(self, where: list, message: str):
        raise CheckpointError(f"flow.load: {self.structure_path}: the node at {_where(where)} {message}")

    def _array(self, key, where: list) -> np.ndarray:
        if not isinstance(key, str):
            self.fail(where, f"names its tensor with a {type(key).__name__}, not a string")
        if key not in self.arrays:
            self.fail(where, f"refers to tensor {key!r}, which is not in {TENSORS_FILE}")
        return self.arrays[key]

    def decode(self, node, where: list):
        if len(where) > MAX_DEPTH:
            self.fail(where, f"is nested more than {MAX_DEPTH} levels deep")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v, where + [i]) for i, v in enumerate(node)]
        tags = [t for t in _TAGS if t in node] if isinstance(node, dict) else []
        if len(tags) != 1:
            self.fail(where, f"is not a value flow.save writes: {str(node)[:80]}")
        tag = tags[0]
        if tag == "__tensor__":
            return self._tensor(node, where)
        if len(node) != 1:
            self.fail(where, f"has keys other than {tag}: {sorted(node)[:5]}")
        body = node[tag]
        if tag == "__ndarray__":
            return self._array(body, where)
        if tag == "__dict__":
            if not isinstance(body, dict):
                self.fail(where, f"has a {type(body).__name__} as __dict__, not an object")
            return {k: self.decode(v, where + [k]) for k, v in body.items()}
        if not isinstance(body, list):
            self.fail(where, f"has a {type(body).__name__} as {tag}, not a list")
        if tag == "__tuple__":
            return tuple(self.decode(v, where + [i]) for i, v in enumerate(body))
        result = {}
        for i, item in enumerate(body):
            if not (isinstance(item, list) and len(item) == 2):
                self.fail(where, f"has __dict_items__ entry {i} that is not a [key, value] pair")
            key, value = item
            if not (key is None or isinstance(key, (bool, int, float, str))):
                self.fail(where, f"has __dict_items__ entry {i} whose key is a {type(key).__name__}")
            result[key] = self.decode(value, where + [key])
        return result

    def _tensor(self, node: dict, where: list):
        extra = sorted(set(node) - _TENSOR_FIELDS)
        if extra:
            self.fail(where, f"is a tensor with unknown fields {extra[:5]}")
        array = self._array(node["__tensor__"], where)
        name = node.get("dtype", dt.from_numpy(array.dtype).name)
        if not isinstance(name, str) or name not in _DTYPES:
            self.fail(where, f"has dtype {str(name)[:40]!r}, not one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[name]
        if array.dtype != dtype.np_dtype:
            self.fail(where, f"says dtype {dtype.name}, but tensor {node['__tensor__']!r} is stored as {array.dtype}")
        for flag in ("parameter", "requires_grad"):
            if not isinstance(node.get(flag, False), bool):
                self.fail(where, f"has a non-boolean {flag!r}")
        requires_grad = node.get("requires_grad", False)
        if requires_grad and not dtype.is_floating:
            self.fail(where, f"is a {dtype.name} tensor that requires grad; only floating tensors can")
        device = self.device
        if device is None:
            try:
                device = as_device(node.get("device", "cpu"))
            except (TypeError, ValueError) as e:
                self.fail(where, f"has a bad device: {e}")
        if node.get("parameter", False):
            return Parameter(Tensor(array, dtype=dtype, device=device), requires_grad=requires_grad)
        return Tensor(array, dtype=dtype, device=device, requires_grad=requires_grad)


# ------------------------------------------------------------- safetensors
def _safetensors_dtypes() -> dict:
    names = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
             "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64"}
    table = {np.dtype(k): v for k, v in names.items()}
    table[dt.bfloat16.np_dtype] = "BF16"
    return table


SAFETENSORS_DTYPES = _safetensors_dtypes()


def write_safetensors(arrays: dict, file, metadata: dict) -> None:
    """Write `arrays` ({name: ndarray}) and `metadata` ({str: str}) to the open binary `file` in the
    safetensors format, the same bytes for the same input in every process (the safetensors
    library writes its metadata in hash order). Tensors are laid out by decreasing element size,
    then name, as the library does, so every tensor starts aligned to its element size."""
    prepared = []
    for name, array in arrays.items():
        array = np.require(array, requirements="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"safetensors has no dtype for {name!r} of NumPy dtype {array.dtype}")
        prepared.append((name, array))
    prepared.sort(key=lambda item: (-item[1].dtype.itemsize, item[0]))
    header = {"__metadata__": {k: metadata[k] for k in sorted(metadata)}} if metadata else {}
    offset = 0
    for name, array in prepared:
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype], "shape": [int(d) for d in array.shape],
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned
    file.write(len(text).to_bytes(8, "little"))
    file.write(text)
    for _, array in prepared:
        if array.nbytes:
            file.write(array.reshape(-1).view(np.uint8))


def write_file_atomic(path, write, mode: int = 0o666) -> None:
    """Create or replace the file `path`: `write(f)` fills a new file beside it (opened for binary
    writing), which is flushed to disk and renamed over `path`, so a reader sees the old file or
    the whole new one. The file gets `mode` less the process umask, like any file the process
    creates (typically 0644, or 0755 for mode 0o777)."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


# -------------------------------------------------------------------- save
def save(obj, path, dynamic_shapes=None) -> None:
    """Save nested dicts/lists/tuples of tensors and Python scalars to the directory `path` (atomically).
    An nn.Graph saves its compiled step (flowgen/saved_graph.py); `dynamic_shapes`, one entry per
    input of its build() ({axis: flow.Dim} or None, as torch.export), saves it with dynamic dimensions."""
    hook = getattr(obj, "_flowgen_save", None)
    if callable(hook) and not isinstance(obj, (dict, list, tuple, Tensor)):
        return hook(path) if dynamic_shapes is None else hook(path, dynamic_shapes=dynamic_shapes)
    if dynamic_shapes is not None:
        raise TypeError(f"flow.save: dynamic_shapes= applies to an nn.Graph (its compiled step), not to a "
                        f"{type(obj).__name__}")
    encoder = _Encoder()
    root = encoder.encode(obj, [])

    if os.path.isfile(path) and not os.path.islink(path):
        if os.path.getsize(path) and not _is_save_file(path):
            raise FileExistsError(f"flow.save: {path} is a file that flow.save did not write (not empty, no "
                                  f"{FORMAT!r} metadata); refusing to replace it")
        _save_single_file(encoder, root, os.fspath(path))
        return

    def write(tmp: str) -> None:
        tensors_path = os.path.join(tmp, TENSORS_FILE)
        _write_tensors(encoder.arrays, tensors_path)
        doc = {"format": FORMAT, "version": VERSION, "tensors_sha256": file_sha256(tensors_path), "root": root}
        write_json(with_self_hash(doc, "structure_sha256"), os.path.join(tmp, STRUCTURE_FILE), allow_nan=True)

    write_directory_atomically(path, write)


def _save_single_file(encoder, root, path: str) -> None:
    """The single-file form (see the module docstring), written beside `path` and renamed over it."""
    doc = {"format": FORMAT, "version": VERSION, "tensors_sha256": arrays_sha256(encoder.arrays), "root": root}
    structure = json.dumps(with_self_hash(doc, "structure_sha256"), allow_nan=True)
    metadata = {"format": FORMAT, "version": str(VERSION), "structure": structure}
    write_file_atomic(path, lambda f: write_safetensors(encoder.arrays, f, metadata))


def _is_save_file(path) -> bool:
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # noqa: BLE001 - any file safetensors cannot open is not a single-file save
        return False


def arrays_sha256(arrays: dict) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode("utf-8"))
        digest.update(array.reshape(-1).view(np.uint8).tobytes())
    return digest.hexdigest()


def document_sha256(doc: dict) -> str:
    """SHA-256 of a JSON document as canonical JSON (sorted keys, no spaces): the same for the
    document as written and as read back."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def with_self_hash(doc: dict, key: str) -> dict:
    """`doc` plus `key`: the document_sha256 of `doc`, so that the file covers itself."""
    return dict(doc, **{key: document_sha256(doc)})


def check_self_hash(doc: dict, key: str, filename: str) -> None:
    """Refuse a document read from `filename` whose `key` is not the SHA-256 of the rest."""
    expected = doc.get(key)
    if not isinstance(expected, str):
        raise CheckpointError(f"flow.load: {filename}: the {key} field is missing (the file is damaged, or was not "
                              f"written by flow.save)")
    if document_sha256({k: v for k, v in doc.items() if k != key}) != expected:
        raise CheckpointError(f"flow.load: {filename} is corrupt: its contents do not match its {key} field "
                              f"(modified or damaged after saving)")


_LEFTOVER = re.compile(r"\.(?:tmp|old)-(?:(\d+)-)?[0-9a-f]{8}$")


def write_directory_atomically(path, write) -> None:
    """Write a flow.save directory at `path`: `write(tmp)` fills a fresh temporary directory
    beside it, which is flushed to disk and then swapped in. `path` holds the old directory or
    the complete new one at every moment; leftovers of earlier interrupted saves are deleted."""
    path = os.path.abspath(os.fspath(path))
    _check_replaceable(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"flow.save: the parent directory {parent} does not exist")
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        write(tmp)
        _fsync_tree(tmp)
        _replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_leftovers(path)


def remove_leftovers(path: str) -> list:
    """Delete the `.tmp-`/`.old-` folders that interrupted saves of `path` left beside it, except
    those of a process still running (a save in progress). Returns the names deleted."""
    parent, base = os.path.split(path)
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(base):
            continue
        match = _LEFTOVER.fullmatch(name[len(base):])
        if match is None or (match.group(1) and _process_running(int(match.group(1)))):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    return removed


def _process_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def write_json(obj, filename: str, allow_nan: bool = False) -> None:
    """JSON written and fsynced (strict by default; state dicts may hold inf/nan scalars)."""
    with open(filename, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=allow_nan)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(arrays: dict, filename: str) -> None:
    with open(filename, "wb") as f:
        write_safetensors(arrays, f, {"format": FORMAT})
        f.flush()
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


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the directories `a` and `b` in one step (Linux renameat2); False where the system or
    the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def _replace_directory(new: str, path: str) -> None:
    """Put directory `new` at `path`. An old directory there is swapped out in one step where the
    system can (else renamed aside first, then `new` renamed in), then deleted."""
    if not os.path.lexists(path):
        os.rename(new, path)
    elif _exchange(new, path):
        shutil.rmtree(new, ignore_errors=True)   # `new` now holds the old save
    else:
        old = f"{path}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_directory(os.path.dirname(path))


def _fsync_tree(directory: str) -> None:
    """Flush every file under `directory`, and the directory, to disk."""
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                os.fsync(f.fileno())
    _fsync_directory(directory)


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
    """Load what `flow.save` wrote at `path`; tensors get `map_location`'s device label if given.
    Raises CheckpointError for a damaged directory, FileNotFoundError if `path` does not exist."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        leftovers = sorted(p for p in os.listdir(os.path.dirname(path)) if p.startswith(os.path.basename(path) +
                                                                                        ".old-")) \
            if os.path.isdir(os.path.dirname(path)) else []
        hint = (f" (an interrupted save left the previous version at {leftovers[-1]}; rename it to "
                f"{os.path.basename(path)} to use it)") if leftovers else ""
        raise FileNotFoundError(f"flow.load: {path} does not exist{hint}")
    if not os.path.isdir(path):
        return _load_single_file(path, map_location)
    if os.path.lexists(os.path.join(path, "graph.json")):   # flow.save(graph, dir): a deployable graph
        result = _graph_loader(path)
    else:
        result = _load_state(path, map_location)
    remove_leftovers(path)
    return result


_graph_loader = None   # reads a flow.save(graph, dir) directory: installed by flowgen/saved_graph.py


def install_graph_loader(loader) -> None:
    """flowgen/saved_graph.py, when it loads (it builds on this module): `loader(path)` reads a
    deployable graph's directory for `load`."""
    global _graph_loader
    _graph_loader = loader


def read_json_file(filename: str, allow_nan: bool = False):
    """A JSON file of a flow.save directory; CheckpointError if it is missing, unreadable or not JSON."""
    def refuse_constant(name):
        raise ValueError(f"{name} is not allowed here")

    try:
        with open(filename, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"flow.load: {os.path.dirname(filename)} is incomplete: {os.path.basename(filename)} "
                              f"is missing") from None
    except OSError as e:
        raise CheckpointError(f"flow.load: cannot read {filename}: {e.strerror or e}") from None
    try:
        return json.loads(data.decode("utf-8"), parse_constant=None if allow_nan else refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"flow.load: {filename} is corrupt (not valid JSON: {e})") from None
    except RecursionError:
        raise CheckpointError(f"flow.load: {filename} is corrupt (JSON nested too deeply)") from None


def _load_state(path: str, map_location):
    structure_path = os.path.join(path, STRUCTURE_FILE)
    tensors_path = os.path.join(path, TENSORS_FILE)
    structure = read_json_file(structure_path, allow_nan=True)
    if not isinstance(structure, dict) or structure.get("format") != FORMAT or "root" not in structure:
        raise CheckpointError(f"flow.load: {structure_path} is not a flow.save structure file (no format "
                              f"{FORMAT!r} and root)")
    if structure.get("version") != VERSION:
        raise CheckpointError(f"flow.load: {structure_path} has format version {str(structure.get('version'))[:20]}; "
                              f"this flowgen reads version {VERSION}")
    check_self_hash(structure, "structure_sha256", structure_path)
    expected = structure.get("tensors_sha256")
    if not isinstance(expected, str):
        raise CheckpointError(f"flow.load: {structure_path}: the tensors_sha256 field is missing")
    if not os.path.isfile(tensors_path):
        raise CheckpointError(f"flow.load: {path} is incomplete: {TENSORS_FILE} is missing")
    try:
        actual = file_sha256(tensors_path)
    except OSError as e:
        raise CheckpointError(f"flow.load: cannot read {tensors_path}: {e.strerror or e}") from None
    if actual != expected:
        raise CheckpointError(f"flow.load: {tensors_path} is corrupt: its SHA-256 does not match the tensors_sha256 "
                              f"recorded in {STRUCTURE_FILE} (truncated or modified after saving)")
    arrays = read_safetensors_file(tensors_path)[0]
    return _Decoder(arrays, structure_path, map_location).decode(structure["root"], [])


def _load_single_file(path: str, map_location):
    arrays, metadata = read_safetensors_file(path)
    if metadata.get("format") != FORMAT or "structure" not in metadata:
        raise CheckpointError(f"flow.load: {path} is a file but not a flow.save file (its safetensors metadata "
                              f"has no format {FORMAT!r} and structure)")
    if metadata.get("version") != str(VERSION):
        raise CheckpointError(f"flow.load: {path} has format version {str(metadata.get('version'))[:20]}; "
                              f"this flowgen reads version {VERSION}")
    try:
        structure = json.loads(metadata["structure"])
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"flow.load: {path} is corrupt (its structure metadata is not valid JSON: {e})") from None
    if not isinstance(structure, dict) or "root" not in structure:
        raise CheckpointError(f"flow.load: {path}: the structure metadata has no root")
    check_self_hash(structure, "structure_sha256", path)
    if structure.get("tensors_sha256") != arrays_sha256(arrays):
        raise CheckpointError(f"flow.load: {path} is corrupt: its tensors do not match the tensors_sha256 recorded "
                              f"in its structure (modified after saving)")
    return _Decoder(arrays, path, map_location).decode(structure["root"], [])


def read_safetensors_file(filename: str) -> tuple:
    """({name: writable ndarray}, metadata) of a safetensors file, read by the safetensors library
    (which checks the header, the dtypes, the shapes and that the tensors tile the data exactly);
    CheckpointError naming the file for anything it refuses."""
    if not os.path.isfile(filename):
        raise CheckpointError(f"flow.load: {os.path.dirname(filename)} is incomplete: {os.path.basename(filename)} "
                              f"is missing")
    try:
        arrays = {}
        with safe_open(filename, framework="numpy") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                arrays[key] = np.array(f.get_tensor(key))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
        raise CheckpointError(f"flow.load: {filename} is corrupt ({type(e).__name__}: {e})") from None
    return arrays, metadata
