"""Run a `Program` step by step: one executor for both backends.

A backend provides memory (`alloc`, `upload`, `download`, `copy`) and `launch`;
this class binds every buffer argument to an address once — graph inputs and
outputs, state (parameters, buffers, optimizer slots, hyper-parameters),
constants and the arena — and then each call is: copy inputs in, launch the
kernels in order, write state updates back, copy outputs out.

Index errors: kernels that read a tensor as indices report an out-of-range one into the
module's error record (`flowgen_index_error`, runtime_cpp/flowgen_cuda_prelude.h) instead of
using it. `run` reads the record (16 bytes) after every step and keeps what it found;
`raise_index_error` then clears it and raises IndexError naming the op, the module path, the
value and the valid range. The step itself has completed by then: its outputs are computed
and its state updates applied, with each out-of-range index treated as missing (a gathered
value or cross-entropy row of 0, a scattered value dropped).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from flowgen.codegen.kernel import BufferArg
from flowgen.ops.registry import get_op
from flowgen.runtime.toolchain import kernel_params

_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
           "unsigned": ctypes.c_uint, "unsigned long long": ctypes.c_ulonglong}


class CpuBackend:
    """Host memory; kernels from the g++-built emulator library."""

    name = "cpu"

    def __init__(self, source: str):
        # Imported here, not at the top: the g++ build machinery (~0.1 s) loads when a CPU program is first built.
        from flowgen.runtime.cpu_compiler import CpuModule, build_kernel_library

        library, self.build = build_kernel_library(source)
        self.module = CpuModule(library, {name: symbol for name, (_, symbol) in self.build.symbols.items()})
        self._keep = []

    def alloc(self, nbytes: int):
        buf = np.zeros(max(nbytes, 1), np.uint8)
        self._keep.append(buf)
        return buf.ctypes.data

    def upload(self, address: int, array: np.ndarray):
        ctypes.memmove(address, np.ascontiguousarray(array).ctypes.data, array.nbytes)

    def download(self, array: np.ndarray, address: int):
        ctypes.memmove(array.ctypes.data, address, array.nbytes)

    def copy(self, dst: int, src: int, nbytes: int):
        ctypes.memmove(dst, src, nbytes)

    def prepare(self, kernel, args):
        launcher = self.module.launcher(kernel.name, f"launched as {kernel.name} ({kernel.comment})")
        grid = (ctypes.c_uint * 3)(*kernel.grid)
        block = (ctypes.c_uint * 3)(*kernel.block)
        params = kernel_params(args)
        self._keep.append((args, params))
        return lambda: launcher(grid, block, kernel.smem, params)

    def global_address(self, name: str) -> int:
        return self.module.global_address(name)

    def synchronize(self):
        pass


class CudaBackend:
    """Device memory through the CUDA driver; kernels from the NVRTC cubin.

    After the first step the launch sequence (and the state write-back copies) is
    captured into a CUDA graph and replayed, so a step costs one driver call.
    """

    name = "cuda"

    def __init__(self, source: str):
        # Imported here, not at the top: cuda-python's driver and NVRTC bindings take ~0.3 s to load.
        from flowgen.runtime import cuda_driver, nvrtc

        self.driver = cuda_driver
        self.ctx = cuda_driver.CudaContext.get()
        major, _ = self.ctx.compute_capability()
        if major < 7:
            raise RuntimeError(f"flowgen needs a GPU of compute capability 7.0 or newer; this one is {self.ctx.arch}")
        if "__nv_bfloat16" in source and major < 8:
            raise RuntimeError(f"this graph uses bfloat16, which needs sm_80 or newer; the GPU is {self.ctx.arch}")
        if "mma_m16n8k" in source and major < 8:
            raise RuntimeError(f"this graph runs GEMMs on tensor cores (mma.sync, cp.async), which needs sm_80 or "
                               f"newer; the GPU is {self.ctx.arch}")
        if "wgmma_m64n" in source and self.ctx.arch != "sm_90":
            raise RuntimeError(f"this graph's GEMMs were rendered for sm_90 (warpgroup MMA); the GPU is {self.ctx.arch}")
        self.build = nvrtc.compile_kernels(source, self.ctx.arch)
        self.modules = [cuda_driver.CudaModule(path.read_bytes()) for path in self.build.artifacts]
        self.stream = self.ctx.create_stream()
        self.allocations = []
        self._keep = []

    def alloc(self, nbytes: int):
        ptr = self.ctx.alloc(nbytes)
        self.ctx.memset(ptr, 0, max(nbytes, 1))
        self.allocations.append(ptr)
        return ptr

    def upload(self, address: int, array: np.ndarray):
        self.ctx.memcpy_htod(address, array)

    def download(self, array: np.ndarray, address: int):
        self.ctx.synchronize(self.stream)
        self.ctx.memcpy_dtoh(array, address)

    def copy(self, dst: int, src: int, nbytes: int):
        from cuda.bindings import driver as cu

        self.driver.check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def prepare(self, kernel, args):
        index, symbol = self.build.symbols[kernel.name]
        module = self.modules[index]
        function = module.function(symbol)
        self._keep.append(args)   # the ctypes values must outlive every launch
        return lambda: module.launch(function, kernel.grid, kernel.block, kernel.smem, args,
                                     self.stream, name_for_errors=f"{kernel.name} ({kernel.comment})")

    def global_address(self, name: str) -> int:
        return self.module.global_address(name)

    def synchronize(self):
        self.ctx.synchronize(self.stream)


# The error record's layout: {check (0: none, else the IndexCheck id), bad index value}.
_INDEX_ERROR_RECORD = np.dtype([("check", np.uint64), ("value", np.int64)])


class Executor:
    def __init__(self, program, backend):
        self.program = program
        self.backend = backend
        graph = program.graph
        self.address: dict = {}
        self.calls = 0
        self.graph_exec = None     # CUDA graph of one step, captured on the second call
        self.index_checks = program.index_checks
        self.index_error = np.zeros((), _INDEX_ERROR_RECORD)   # the record as the last step left it
        self.index_error_address = backend.global_address("flowgen_index_error") if self.index_checks else None
        self.arena = backend.alloc(program.plan.arena_bytes)
        for v in graph.inputs:
            self.address[v] = backend.alloc(v.nbytes)
        for s in graph.state:
            self.address[s.value] = backend.alloc(s.value.nbytes)
        for v in program.persistent_values:
            self.address[v] = backend.alloc(v.nbytes)
        for value, state_value in program.state_writes.items():
            self.address[value] = self.address[state_value]
        for v, array in program.constants.items():
            self.address[v] = backend.alloc(v.nbytes)
            backend.upload(self.address[v], np.asarray(array, v.dtype.np_dtype).reshape(v.shape))
        self.launches = [self._host_collective(k) if k.collective is not None
                         else backend.prepare(k, [self._arg(a) for a in k.args]) for k in program.kernels]
        # Host collectives (data parallelism) cannot be captured into a CUDA graph.
        self.capturable = all(k.collective is None for k in program.kernels)
        self.prepare_launches = [backend.prepare(k, [self._arg(a) for a in k.args]) for k in program.prepare]
        # State updates: the new value is copied over the state buffer at the end of the step.
        state = graph.state_by_name()
        self.updates = [(self.address[state[name].value], self.resolve(v), v.nbytes)
                        for name, v in graph.updates if self.resolve(v) != self.address[state[name].value]]

    def _host_collective(self, kernel):
        """A collective between two launches: its inputs come to the host, the op's reference
        exchanges them with the other ranks (MPI), the results go back to the output buffers."""
        reference = get_op(kernel.ops[0]).ref
        inputs = [a.value for a in kernel.args if a.ctype.startswith("const")]
        outputs = [a.value for a in kernel.args if not a.ctype.startswith("const")]

        def step():
            results = reference(*(self.read_value(v) for v in inputs), **kernel.collective)
            for v, r in zip(outputs, results if len(outputs) > 1 else (results,)):
                self.backend.upload(self.resolve(v), np.ascontiguousarray(r, v.dtype.np_dtype))
        return step

    def resolve(self, value) -> int:
        while value in self.program.aliases:
            value = self.program.aliases[value]
        if value in self.address:
            return self.address[value]
        return self.arena + self.program.plan.offsets[value]

    def _arg(self, arg):
        if isinstance(arg, BufferArg):
            return ctypes.c_void_p(self.resolve(arg.value))
        return _CTYPES[arg.ctype](arg.literal)

    def write_state(self, state_value, array: np.ndarray):
        self.backend.upload(self.address[state_value], np.asarray(array, state_value.dtype.np_dtype))

    def read_value(self, value) -> np.ndarray:
        out = np.empty(value.shape, value.dtype.np_dtype)
        if out.size == 0:   # nothing to read, and no kernel may have given it a place in the arena
            return out
        self.backend.download(out, self.resolve(value))
        return out

    def _step(self):
        for launch in self.launches:
            launch()
        for dst, src, nbytes in self.updates:
            self.backend.copy(dst, src, nbytes)

    def launch_step(self):
        """Launch one step's kernels and state write-backs on the device buffers as they are: no
        inputs copied in, no synchronisation, no outputs read (`run` does those around it;
        benchmarks time this alone, between events on `backend.stream`). On CUDA the second
        step is captured into a CUDA graph and later steps replay it."""
        if (self.backend.name == "cuda" and self.calls >= 1 and self.capturable
                and os.environ.get("FLOWGEN_DEBUG_SYNC") != "1"):
            if self.graph_exec is None:
                ctx, stream = self.backend.ctx, self.backend.stream
                ctx.synchronize(stream)
                ctx.begin_capture(stream)
                self._step()
                self.graph_exec = ctx.end_capture(stream)
            self.backend.ctx.launch_graph(self.graph_exec, self.backend.stream)
        else:
            self._step()
        self.calls += 1

    def run(self, inputs, state_changed: bool = True):
        """One step: `inputs` are contiguous arrays matching the graph inputs. Prepare kernels
        (they read only state the graph never writes) run when `state_changed`."""
        for v, array in zip(self.program.graph.inputs, inputs):
            self.backend.upload(self.address[v], array)
        if state_changed:
            for launch in self.prepare_launches:
                launch()
        self.launch_step()
        self.backend.synchronize()
        if self.index_error_address is not None:
            self.backend.download(self.index_error, self.index_error_address)
        return [self.read_value(v) for v in self.program.graph.outputs]

    def raise_index_error(self):
        """If the last step read an out-of-range index: clear the record, raise IndexError."""
        check_id, value = int(self.index_error["check"]), int(self.index_error["value"])
        if check_id == 0:
            return
        self.index_error = np.zeros((), _INDEX_ERROR_RECORD)
        self.backend.upload(self.index_error_address, self.index_error)
        raise IndexError(self.index_checks[check_id].message(value))
