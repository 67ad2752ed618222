"""Run a `Program` step by step: one executor for both backends.

A backend provides memory (`alloc`, `upload`, `download`, `copy`) and `launch`;
this class binds every buffer argument to an address once — graph inputs and
outputs, state (parameters, buffers, optimizer slots, hyper-parameters),
constants and the arena — and then each call is: copy inputs in, launch the
kernels in order, write state updates back, copy outputs out.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from flowgen.codegen.kernel import BufferArg
from flowgen.runtime.toolchain import kernel_params

_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
           "unsigned": ctypes.c_uint, "unsigned long long": ctypes.c_ulonglong}


class CpuBackend:
    """Host memory; kernels from the g++-built emulator library."""

    name = "cpu"

    def __init__(self, source: str):
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
        launcher = self.module._launcher(kernel.name)
        grid = (ctypes.c_uint * 3)(*kernel.grid)
        block = (ctypes.c_uint * 3)(*kernel.block)
        params = kernel_params(args)
        self._keep.append((args, params))
        return lambda: launcher(grid, block, kernel.smem, params)

    def synchronize(self):
        pass


class CudaBackend:
    """Device memory through the CUDA driver; kernels from the NVRTC cubin.

    After the first step the launch sequence (and the state write-back copies) is
    captured into a CUDA graph and replayed, so a step costs one driver call.
    """

    name = "cuda"

    def __init__(self, source: str):
        from flowgen.runtime import cuda_driver, nvrtc

        self.driver = cuda_driver
        self.ctx = cuda_driver.CudaContext.get()
        major, _ = self.ctx.compute_capability()
        if major < 7:
            raise RuntimeError(f"flowgen needs a GPU of compute capability 7.0 or newer; this one is {self.ctx.arch}")
        if "__nv_bfloat16" in source and major < 8:
            raise RuntimeError(f"this graph uses bfloat16, which needs sm_80 or newer; the GPU is {self.ctx.arch}")
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

    def synchronize(self):
        self.ctx.synchronize(self.stream)


class Executor:
    def __init__(self, program, backend):
        self.program = program
        self.backend = backend
        graph = program.graph
        self.address: dict = {}
        self.calls = 0
        self.graph_exec = None     # CUDA graph of one step, captured on the second call
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
        self.launches = [backend.prepare(k, [self._arg(a) for a in k.args]) for k in program.kernels]
        self.prepare_launches = [backend.prepare(k, [self._arg(a) for a in k.args]) for k in program.prepare]
        # State updates: the new value is copied over the state buffer at the end of the step.
        state = graph.state_by_name()
        self.updates = [(self.address[state[name].value], self.resolve(v), v.nbytes)
                        for name, v in graph.updates if self.resolve(v) != self.address[state[name].value]]

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
        self.backend.download(out, self.resolve(value))
        return out

    def _step(self):
        for launch in self.launches:
            launch()
        for dst, src, nbytes in self.updates:
            self.backend.copy(dst, src, nbytes)

    def run(self, inputs, state_changed: bool = True):
        """One step: `inputs` are contiguous arrays matching the graph inputs. Prepare kernels
        (they read only state the graph never writes) run when `state_changed`."""
        for v, array in zip(self.program.graph.inputs, inputs):
            self.backend.upload(self.address[v], array)
        if state_changed:
            for launch in self.prepare_launches:
                launch()
        if self.backend.name == "cuda" and self.calls >= 1 and os.environ.get("FLOWGEN_DEBUG_SYNC") != "1":
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
        self.backend.synchronize()
        return [self.read_value(v) for v in self.program.graph.outputs]
