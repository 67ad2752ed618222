"""Data types: one object per dtype, carrying its NumPy and C++ spellings.

bfloat16 is stored faithfully through ml_dtypes (a well-kept NumPy extension
type), so eager tensors, safetensors files and kernels agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str            # "float32"
    np_dtype: np.dtype   # storage type in eager mode
    ctype: str           # C++ type in generated kernels
    short: str           # "f32", used in the IR text form
    is_floating: bool

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    def __repr__(self) -> str:
        return f"flowgen.{self.name}"


float32 = DType("float32", np.dtype(np.float32), "float", "f32", True)
float16 = DType("float16", np.dtype(np.float16), "__half", "f16", True)
bfloat16 = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", "bf16", True)
float64 = DType("float64", np.dtype(np.float64), "double", "f64", True)
int64 = DType("int64", np.dtype(np.int64), "long long", "i64", False)
int32 = DType("int32", np.dtype(np.int32), "int", "i32", False)
int16 = DType("int16", np.dtype(np.int16), "short", "i16", False)
int8 = DType("int8", np.dtype(np.int8), "signed char", "i8", False)
uint8 = DType("uint8", np.dtype(np.uint8), "unsigned char", "u8", False)
bool_ = DType("bool", np.dtype(np.bool_), "bool", "bool", False)

ALL = (float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool_)
_BY_NP = {d.np_dtype: d for d in ALL}
_BY_NAME = {d.name: d for d in ALL} | {"float": float32, "half": float16, "double": float64, "long": int64,
                                       "int": int32, "short": int16, "char": int8}

# Rank used for type promotion between tensors (bool < ints < floats).
_RANK = {bool_: 0, uint8: 1, int8: 1, int16: 2, int32: 3, int64: 4, float16: 5, bfloat16: 5, float32: 6, float64: 7}


def from_numpy(np_dtype) -> DType:
    np_dtype = np.dtype(np_dtype)
    if np_dtype in _BY_NP:
        return _BY_NP[np_dtype]
    if np_dtype.kind == "f":
        return float32
    if np_dtype.kind in "iu":
        return int64
    raise TypeError(f"flowgen has no dtype for NumPy dtype {np_dtype}")


def get(dtype) -> DType:
    """Accept a DType, a NumPy dtype, a Python type or a name."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        if dtype.startswith("flowgen."):
            dtype = dtype[len("flowgen."):]
        if dtype in _BY_NAME:
            return _BY_NAME[dtype]
        raise TypeError(f"unknown dtype {dtype!r}")
    if dtype is float:
        return float32
    if dtype is int:
        return int64
    if dtype is bool:
        return bool_
    return from_numpy(dtype)


def promote(a: DType, b: DType) -> DType:
    if a == b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    if {a, b} == {int8, uint8}:  # as PyTorch: the smallest type holding both ranges
        return int16
    return a if _RANK[a] >= _RANK[b] else b


def default_for_scalar(value) -> DType:
    if isinstance(value, bool):
        return bool_
    if isinstance(value, int):
        return int64
    return float32
