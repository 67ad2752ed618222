"""`flow.load_compiled(OUT)`: a library built by `flowgen build --lib` as a Python callable.

It opens OUT/lib<name>.so with ctypes (no compiler, no IR: only the library and its weights),
reads the signature from the library itself and calls ``flowgen_run`` with the caller's
arrays. The outputs come back as NumPy arrays the caller owns (copied out of the model's
per-thread output buffers before the call returns), so they stay valid however the model is
used afterwards.

Threads: ctypes releases the GIL for the call, and the library gives every concurrent call
activation memory of its own (codegen/library.py), so one loaded model serves several threads
at once on shared weights. A model built for the cuda target runs one call at a time
(its header says why).
"""
from __future__ import annotations

import ctypes
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowgen import dtype as dt

API_VERSION = 1
MAX_DIMS = 8

# The C API's dtype codes (flowgen_tensor.dtype) in enum order, and its memory kinds.
_DTYPES = (dt.float32, dt.float16, dt.bfloat16, dt.float64, dt.int64, dt.int32, dt.bool_)
_CODE_OF = {d.np_dtype: code for code, d in enumerate(_DTYPES)}
HOST, CUDA_DEVICE = 0, 1
_ERRORS = {1: ValueError, 2: IndexError, 3: RuntimeError, 4: MemoryError}


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("memory", ctypes.c_int)]


class _TensorInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("min_shape", ctypes.c_int64 * MAX_DIMS),
                ("max_shape", ctypes.c_int64 * MAX_DIMS)]


@dataclass(frozen=True)
class TensorInfo:
    """An input or output of a compiled model. `shape` holds None for a dynamic dimension, whose
    allowed sizes are `min_shape[d]` to `max_shape[d]` (for a fixed one both are its size)."""
    name: str
    dtype: np.dtype
    shape: tuple
    min_shape: tuple
    max_shape: tuple

    def __repr__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype.name}[{dims}]"


def _declare(lib) -> None:
    """Argument and result types of the C API (flowgen_tensor_info and flowgen_tensor as above)."""
    model = ctypes.c_void_p
    for name, restype, argtypes in (
            ("flowgen_api_version", ctypes.c_int, []),
            ("flowgen_graph_name", ctypes.c_char_p, []),
            ("flowgen_target", ctypes.c_char_p, []),
            ("flowgen_num_inputs", ctypes.c_int, []),
            ("flowgen_num_outputs", ctypes.c_int, []),
            ("flowgen_input_info", ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_TensorInfo)]),
            ("flowgen_output_info", ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_TensorInfo)]),
            ("flowgen_create", model, [ctypes.c_char_p]),
            ("flowgen_run", ctypes.c_int, [model, ctypes.POINTER(_Tensor), ctypes.c_int, ctypes.POINTER(_Tensor),
                                           ctypes.c_int]),
            ("flowgen_last_error", ctypes.c_char_p, []),
            ("flowgen_last_error_code", ctypes.c_int, []),
            ("flowgen_destroy", None, [model])):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def _signature(lib, count: int, describe) -> list:
    result = []
    for i in range(count):
        info = _TensorInfo()
        if describe(i, ctypes.byref(info)) != 0:
            raise RuntimeError(lib.flowgen_last_error().decode(errors="replace"))
        dims = range(info.ndim)
        result.append(TensorInfo(info.name.decode(), _DTYPES[info.dtype].np_dtype,
                                 tuple(None if info.shape[d] < 0 else int(info.shape[d]) for d in dims),
                                 tuple(int(info.min_shape[d]) for d in dims),
                                 tuple(int(info.max_shape[d]) for d in dims)))
    return result


class CompiledModel:
    """A model built by `flowgen build --lib`. Call it with one array per input (NumPy arrays, or
    objects with ``__dlpack__`` on the CPU; on a cuda build also objects with
    ``__cuda_array_interface__``, read on the device); it returns a NumPy array, or a tuple of
    them for several outputs, owned by the caller. `inputs` and `outputs` describe the signature.
    Calls may come from several threads at once; `close()` (or leaving a ``with`` block) frees
    the model once no call is running."""

    def __init__(self, library: Path, weights: Path | None):
        self.library = Path(library)
        self._lib = ctypes.CDLL(str(self.library))
        _declare(self._lib)
        version = self._lib.flowgen_api_version()
        if version != API_VERSION:
            raise RuntimeError(f"{self.library} has C API version {version}; this flowgen loads version "
                               f"{API_VERSION} (rebuild it with this flowgen's `flowgen build --lib`)")
        self.name = self._lib.flowgen_graph_name().decode()
        self.target = self._lib.flowgen_target().decode()
        self.inputs = _signature(self._lib, self._lib.flowgen_num_inputs(), self._lib.flowgen_input_info)
        self.outputs = _signature(self._lib, self._lib.flowgen_num_outputs(), self._lib.flowgen_output_info)
        self._handle = self._lib.flowgen_create(None if weights is None else str(weights).encode())
        if not self._handle:   # a bad weights file: ValueError; no usable GPU: RuntimeError
            raise self._error(self._lib.flowgen_last_error_code())
        self._scratch = threading.local()   # per thread: the flowgen_tensor arrays of a call

    def __repr__(self) -> str:
        return (f"CompiledModel({self.name}, {self.target}; inputs: {', '.join(map(str, self.inputs))}; "
                f"outputs: {', '.join(map(str, self.outputs))})")

    def _tensors(self):
        scratch = self._scratch
        if not hasattr(scratch, "inputs"):
            scratch.inputs = (_Tensor * max(len(self.inputs), 1))()
            scratch.outputs = (_Tensor * max(len(self.outputs), 1))()
        return scratch.inputs, scratch.outputs

    def _fill(self, slot: _Tensor, i: int, value):
        """Describe input i in `slot`; returns the object that owns the memory (kept alive by the caller)."""
        if isinstance(value, np.ndarray):
            array = value
        elif hasattr(value, "__cuda_array_interface__"):
            return self._fill_device(slot, i, value)
        elif hasattr(value, "__dlpack__"):
            try:
                array = np.from_dlpack(value)
            except (BufferError, RuntimeError, TypeError) as e:
                raise ValueError(f"input {i} ({self.inputs[i].name}): NumPy cannot read this {type(value).__name__} "
                                 f"through DLPack ({e}); pass host memory") from None
        else:
            raise TypeError(f"input {i} ({self.inputs[i].name}) is a {type(value).__name__}; pass a NumPy array "
                            f"(or an object with __dlpack__) of {self.inputs[i]}")
        code = _CODE_OF.get(array.dtype)
        if code is None:
            raise ValueError(f"input {i} ({self.inputs[i].name}): dtype {array.dtype}, expected "
                             f"{self.inputs[i].dtype.name}; convert it with .astype(np.{self.inputs[i].dtype.name})")
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        slot.data, slot.dtype, slot.ndim, slot.memory = array.ctypes.data, code, array.ndim, HOST
        slot.shape[:min(array.ndim, MAX_DIMS)] = array.shape[:MAX_DIMS]
        return array

    def _fill_device(self, slot: _Tensor, i: int, value):
        interface = value.__cuda_array_interface__
        what = f"input {i} ({self.inputs[i].name})"
        if self.target != "cuda":
            raise ValueError(f"{what} is in CUDA device memory (__cuda_array_interface__), but {self.library.name} "
                             f"was built for the {self.target} target; pass host memory (a NumPy array)")
        dtype = np.dtype(interface["typestr"])
        shape = tuple(interface["shape"])
        if interface.get("strides") not in (None, tuple(np.empty(shape, dtype).strides)):
            raise ValueError(f"{what}: device tensor with strides {interface['strides']}; pass a C-contiguous one")
        if dtype not in _CODE_OF:
            raise ValueError(f"{what}: dtype {dtype}, expected {self.inputs[i].dtype.name}")
        slot.data, slot.dtype, slot.ndim, slot.memory = interface["data"][0], _CODE_OF[dtype], len(shape), CUDA_DEVICE
        slot.shape[:min(len(shape), MAX_DIMS)] = shape[:MAX_DIMS]
        return value

    def __call__(self, *arrays):
        if not self._handle:
            raise ValueError(f"{self.name}: the model is closed")
        if len(arrays) != len(self.inputs):
            raise TypeError(f"{self.name} takes {len(self.inputs)} input(s) ({', '.join(map(str, self.inputs))}), "
                            f"got {len(arrays)}")
        inputs, outputs = self._tensors()
        owners = [self._fill(inputs[i], i, a) for i, a in enumerate(arrays)]
        for slot in outputs:
            slot.memory = HOST
        code = self._lib.flowgen_run(self._handle, inputs, len(self.inputs), outputs, len(self.outputs))
        del owners   # the library copied the inputs
        if code != 0:
            raise self._error(code)
        results = []
        for i in range(len(self.outputs)):
            slot = outputs[i]
            result = np.empty(tuple(slot.shape[:slot.ndim]), _DTYPES[slot.dtype].np_dtype)
            if result.nbytes:
                ctypes.memmove(result.ctypes.data, slot.data, result.nbytes)
            results.append(result)
        return results[0] if len(results) == 1 else tuple(results)

    def _error(self, code: int) -> Exception:
        """The exception for a failed call's code, with the library's message."""
        return _ERRORS.get(code, RuntimeError)(self._lib.flowgen_last_error().decode(errors="replace"))

    def close(self) -> None:
        """Free the model (its device memory and buffers); no call may be running."""
        if self._handle:
            handle, self._handle = self._handle, None
            self._lib.flowgen_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None):
            self.close()


def load_compiled(path, weights=None) -> CompiledModel:
    """The model `flowgen build --lib` wrote to the build directory `path`, ready to call.
    `weights`: a weights.safetensors to use instead of the build's (the same names, dtypes and
    shapes)."""
    out = Path(path)
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{out} is not a flowgen build directory: manifest.json is missing (build one with "
                                f"`flowgen build SAVED_DIR -o {out} --lib`)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{manifest_path} is corrupt: {e}") from None
    if "library" not in manifest:
        raise ValueError(f"{out} holds a program built without --lib (manifest.json names no library); rebuild it "
                         f"with `flowgen build SAVED_DIR -o {out} --lib`")
    if manifest.get("sanitize"):
        raise ValueError(f"{out} was built with --sanitize {manifest['sanitize']}: its library loads only into a "
                         f"program linked with -fsanitize={manifest['sanitize']}; rebuild it without --sanitize "
                         f"for Python")
    library = out / manifest["library"]
    if not library.is_file():
        raise FileNotFoundError(f"{library} is missing; rebuild with `flowgen build --lib`")
    return CompiledModel(library.resolve(), None if weights is None else Path(weights))
