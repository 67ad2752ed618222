"""A thin wrapper over `cuda.bindings.driver`: the process-wide CUDA context, device memory,
streams, CUDA graphs, and modules (cubin or PTX) whose kernels are launched like
cuLaunchKernel does, with a list of ctypes arguments.

Every driver call goes through `check`, so a failure names the call (and, for launches, the
kernel). With FLOWGEN_DEBUG_SYNC=1 each launch is followed by a synchronisation, so an
asynchronous fault is reported against the kernel that caused it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Sequence

import numpy as np
from cuda.bindings import driver as cu

from flowgen.runtime.toolchain import kernel_params

_SUCCESS = cu.CUresult.CUDA_SUCCESS
# Above this much dynamic shared memory a kernel must opt in (cuFuncSetAttribute).
_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


class CudaError(RuntimeError):
    """A CUDA driver call failed."""

    def __init__(self, message: str, code: cu.CUresult):
        super().__init__(message)
        self.code = code


class NoCudaDevice(RuntimeError):
    """No CUDA driver or no GPU: the caller should fall back to the CPU emulator."""

    def __init__(self, reason: str):
        super().__init__(
            f"No CUDA driver/GPU was found ({reason}). "
            'Use device="cpu" to run on the CPU emulator instead, or set FLOWGEN_EMULATE_CUDA=1 to run '
            "'cuda' graphs' CUDA programs on the emulator (for CI without a GPU)."
        )


def _describe(code: cu.CUresult) -> str:
    status, name = cu.cuGetErrorName(code)
    if status != _SUCCESS:
        return f"CUresult {int(code)}"
    _, text = cu.cuGetErrorString(code)
    return f"{name.decode()}: {text.decode()}"


def check(result: Any, what: str) -> Any:
    """Unwrap what a `cuda.bindings.driver` call returned: a CUresult alone or a tuple of a
    CUresult and the outputs. Raises CudaError naming `what` unless it succeeded; returns
    None, the single output, or a tuple of outputs."""
    code, *values = result if isinstance(result, tuple) else (result,)
    if code != _SUCCESS:
        raise CudaError(f"{what} failed: {_describe(code)}", code)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _init_driver() -> None:
    try:
        (code,) = cu.cuInit(0)
    except Exception as exc:  # the driver library itself is missing or cannot be loaded
        raise NoCudaDevice(f"the CUDA driver library could not be loaded: {exc}") from exc
    if code != _SUCCESS:
        raise NoCudaDevice(f"cuInit failed with {_describe(code)}")
    if check(cu.cuDeviceGetCount(), "cuDeviceGetCount") == 0:
        raise NoCudaDevice("the driver reports no CUDA device")


def available() -> bool:
    """Whether a CUDA driver and at least one GPU are usable. Never raises."""
    try:
        _init_driver()
        return True
    except Exception:
        return False


class CudaContext:
    """The primary context of device 0, shared by the whole process: use `CudaContext.get()`,
    which also makes the context current on the calling thread."""

    _instance: CudaContext | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        _init_driver()
        self.device = check(cu.cuDeviceGet(0), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._bound = threading.local()

    @classmethod
    def get(cls) -> CudaContext:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
        instance = cls._instance
        if not getattr(instance._bound, "current", False):
            check(cu.cuCtxSetCurrent(instance.context), "cuCtxSetCurrent")
            instance._bound.current = True
        return instance

    def compute_capability(self) -> tuple[int, int]:
        attribute = cu.CUdevice_attribute
        major = check(
            cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
            "cuDeviceGetAttribute",
        )
        minor = check(
            cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
            "cuDeviceGetAttribute",
        )
        return major, minor

    @property
    def name(self) -> str:
        """The GPU's name, e.g. "NVIDIA H100 80GB HBM3"."""
        raw = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    @property
    def multiprocessor_count(self) -> int:
        attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return int(check(cu.cuDeviceGetAttribute(attribute, self.device), "cuDeviceGetAttribute"))

    @property
    def arch(self) -> str:
        """The real architecture to compile for, e.g. "sm_90"."""
        major, minor = self.compute_capability()
        return f"sm_{major}{minor}"

    def driver_version(self) -> tuple[int, int]:
        version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        return version // 1000, version % 1000 // 10

    # Memory. Device pointers are plain ints (wrap them in ctypes.c_void_p for launches).
    def alloc(self, nbytes: int) -> int:
        return int(check(cu.cuMemAlloc(max(int(nbytes), 1)), "cuMemAlloc"))

    def free(self, dptr: int) -> None:
        check(cu.cuMemFree(dptr), "cuMemFree")

    def memcpy_htod(self, dptr: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        check(cu.cuMemcpyHtoD(dptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")

    def memcpy_dtoh(self, array: np.ndarray, dptr: int) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("memcpy_dtoh needs a C-contiguous destination array")
        check(cu.cuMemcpyDtoH(array.ctypes.data, dptr, array.nbytes), "cuMemcpyDtoH")

    def memset(self, dptr: int, byte: int, nbytes: int) -> None:
        check(cu.cuMemsetD8(dptr, byte, nbytes), "cuMemsetD8")

    # Streams.
    def create_stream(self) -> cu.CUstream:
        # A blocking stream orders itself after the synchronous copies below, which run on
        # the legacy default stream.
        return check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_DEFAULT), "cuStreamCreate")

    def destroy_stream(self, stream: cu.CUstream) -> None:
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")

    def synchronize(self, stream: cu.CUstream | None = None) -> None:
        """Wait for `stream`, or for all work in the context when no stream is given."""
        if stream is None:
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        else:
            check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    # CUDA graphs: record the launches issued on a stream once, replay them with one call.
    def begin_capture(self, stream: cu.CUstream) -> None:
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")

    def end_capture(self, stream: cu.CUstream) -> cu.CUgraphExec:
        graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:  # the executable graph does not need the template it was built from
            check(cu.cuGraphDestroy(graph), "cuGraphDestroy")

    def launch_graph(self, graph_exec: cu.CUgraphExec, stream: cu.CUstream) -> None:
        check(cu.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")

    def destroy_graph(self, graph_exec: cu.CUgraphExec) -> None:
        check(cu.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")

    def load_module(self, image: bytes) -> CudaModule:
        return CudaModule(image)


def _is_capturing(stream: cu.CUstream | None) -> bool:
    if stream is None:
        return False
    status = check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class CudaModule:
    """Kernels loaded from a cubin or (NUL-terminated) PTX image."""

    def __init__(self, image: bytes):
        self.context = CudaContext.get()
        self.handle = check(cu.cuModuleLoadData(image), "cuModuleLoadData")
        self._functions: dict[str, cu.CUfunction] = {}
        self._smem_opt_in: dict[int, int] = {}  # function handle -> bytes allowed

    def function(self, name: str) -> cu.CUfunction:
        if name not in self._functions:
            self._functions[name] = check(
                cu.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})"
            )
        return self._functions[name]

    def global_address(self, name: str) -> int:
        """Device address of the module's `extern "C" __device__` variable `name`."""
        dptr, _ = check(cu.cuModuleGetGlobal(self.handle, name.encode()), f"cuModuleGetGlobal({name})")
        return int(dptr)

    def _allow_dynamic_smem(self, func: cu.CUfunction, smem: int, name: str) -> None:
        key = int(func)
        if smem > max(_DEFAULT_DYNAMIC_SMEM_LIMIT, self._smem_opt_in.get(key, 0)):
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(func, attribute, smem), f"cuFuncSetAttribute({name})")
            self._smem_opt_in[key] = smem

    def launch(
        self,
        func: str | cu.CUfunction,
        grid: Sequence[int],
        block: Sequence[int],
        smem: int,
        args: Sequence[ctypes._SimpleCData],
        stream: cu.CUstream | None = None,
        name_for_errors: str | None = None,
    ) -> None:
        """Launch kernel `func` (a name or a handle from `function`) on `stream` (None: the
        legacy default stream). `args` are ctypes values in parameter order: c_void_p for
        device pointers, c_int, c_float, ... With FLOWGEN_DEBUG_SYNC=1 the stream is then
        synchronised (unless it is being captured) so that a fault is reported against
        `name_for_errors` instead of surfacing at some later call."""
        name = name_for_errors or (func if isinstance(func, str) else "kernel")
        function = self.function(func) if isinstance(func, str) else func
        self._allow_dynamic_smem(function, smem, name)
        params = kernel_params(args)
        gx, gy, gz = (int(v) for v in grid)
        bx, by, bz = (int(v) for v in block)
        check(
            cu.cuLaunchKernel(
                function, gx, gy, gz, bx, by, bz, smem,
                stream if stream is not None else 0,
                ctypes.addressof(params) if args else 0,
                0,
            ),
            f"launching kernel {name}",
        )
        if os.environ.get("FLOWGEN_DEBUG_SYNC") == "1" and not _is_capturing(stream):
            try:
                self.context.synchronize(stream)
            except CudaError as exc:
                raise CudaError(f"kernel {name} failed: {exc}", exc.code) from exc

    def close(self) -> None:
        check(cu.cuModuleUnload(self.handle), "cuModuleUnload")
        self._functions.clear()
