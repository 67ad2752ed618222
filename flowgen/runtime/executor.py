"""Run a `Program` step by step: one executor for both backends.

A backend provides memory (`alloc`, `upload`, `download`, `copy`) and `launch`;
this class binds every buffer argument to an address once — graph inputs and
outputs, state (parameters, buffers, optimizer slots, hyper-parameters),
constants and the arena — and then each call is: copy inputs in, launch the
kernels in order, write state updates back, copy outputs out.

Index errors: kernels that read a tensor as indices report an out-of-range one into the
module's error record (`flowgen_index_error`; one per cubin on CUDA, runtime_cpp/flowgen_cuda_prelude.h) instead of
using it. `run` reads the record (16 bytes) after every step and keeps what it found;
`raise_index_error` then clears it and raises IndexError naming the op, the module path, the
value and the valid range. The step itself has completed by then: its outputs are computed
and its state updates applied, with each out-of-range index treated as missing (a gathered
value or cross-entropy row of 0, a scattered value dropped).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import numpy as np

from flowgen.codegen.kernel import BufferArg
from flowgen.ops.registry import get_op
from flowgen.runtime import tensor_core_check
from flowgen.runtime.toolchain import kernel_params

_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
           "unsigned": ctypes.c_uint, "unsigned long long": ctypes.c_ulonglong}


class CpuBackend:
    """Host memory; kernels from the g++-built emulator library."""

    name = "cpu"

    def __init__(self, source: str):
        self.module, self.build = self._load(source)
        self._keep = []
        self._buffers = {}   # address -> the array holding it

    @staticmethod
    def _load(source: str):
        """(CpuModule, build) of a generated kernels.cu."""
        # Imported here, not at the top: the g++ build machinery (~0.1 s) loads when a CPU program is first built.
        from flowgen.runtime.cpu_compiler import CpuModule, build_kernel_library

        library, build = build_kernel_library(source)
        return CpuModule(library, {name: symbol for name, (_, symbol) in build.symbols.items()}), build

    def alloc(self, nbytes: int):
        buf = np.zeros(max(nbytes, 1), np.uint8)
        self._buffers[buf.ctypes.data] = buf
        return buf.ctypes.data

    def free(self, address: int):
        del self._buffers[address]

    def upload(self, address: int, array: np.ndarray):
        ctypes.memmove(address, np.ascontiguousarray(array).ctypes.data, array.nbytes)

    def download(self, array: np.ndarray, address: int):
        ctypes.memmove(array.ctypes.data, address, array.nbytes)

    def copy(self, dst: int, src: int, nbytes: int):
        ctypes.memmove(dst, src, nbytes)

    def prepare(self, kernel, args, module=None):
        """The launch of `kernel` with `args` (of this backend's program, or of `module` from
        `load_kernels`)."""
        launcher = (module or self.module).launcher(kernel.name, f"launched as {kernel.name} ({kernel.comment})")
        grid = (ctypes.c_uint * 3)(*kernel.grid)
        block = (ctypes.c_uint * 3)(*kernel.block)
        params = self._params(args)
        return lambda: launcher(grid, block, kernel.smem, params)

    def prepare_sequence(self, kernels, args):
        """One call launching the program's `kernels` (with their `args`) in order, or None where
        each launch must be its own call (the checking emulator reports after every launch)."""
        return self.module.launch_sequence([(k.name, k.grid, k.block, k.smem, self._params(a))
                                            for k, a in zip(kernels, args)])

    def _params(self, args):
        params = kernel_params(args)
        self._keep.append((args, params))
        return params

    def load_kernels(self, source: str):
        """Kernels besides the program's (a generated kernels.cu), for `prepare(..., module=)`."""
        return self._load(source)[0]

    def global_addresses(self, name: str) -> list:
        """The address of `name` in the one linked library (every chunk shares it)."""
        return [self.module.global_address(name)]

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

        self.driver, self.nvrtc = cuda_driver, nvrtc
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
        self.build, self.modules = self._load(source)
        self.stream = self.ctx.create_stream()
        self.allocations = []
        self._keep = []

    def _load(self, source: str):
        """(build, modules) of a generated kernels.cu compiled for this GPU."""
        build = self.nvrtc.compile_kernels(source, self.ctx.arch)
        return build, [self.driver.CudaModule(path.read_bytes()) for path in build.artifacts]

    def alloc(self, nbytes: int):
        ptr = self.ctx.alloc(nbytes)
        self.ctx.memset(ptr, 0, max(nbytes, 1))
        self.allocations.append(ptr)
        return ptr

    def free(self, address: int):
        self.ctx.synchronize(self.stream)
        self.ctx.free(address)
        self.allocations.remove(address)

    def upload(self, address: int, array: np.ndarray):
        self.ctx.memcpy_htod(address, array)

    def download(self, array: np.ndarray, address: int):
        self.ctx.synchronize(self.stream)
        self.ctx.memcpy_dtoh(array, address)

    def copy(self, dst: int, src: int, nbytes: int):
        from cuda.bindings import driver as cu

        self.driver.check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def prepare(self, kernel, args, module=None):
        """The launch of `kernel` with `args` (of this backend's program, or of `module` from
        `load_kernels`)."""
        build, modules = module or (self.build, self.modules)
        index, symbol = build.symbols[kernel.name]
        module = modules[index]
        function = module.function(symbol)
        self._keep.append(args)   # the ctypes values must outlive every launch
        return lambda: module.launch(function, kernel.grid, kernel.block, kernel.smem, args,
                                     self.stream, name_for_errors=f"{kernel.name} ({kernel.comment})")

    def load_kernels(self, source: str):
        """Kernels besides the program's (a generated kernels.cu), for `prepare(..., module=)`."""
        return self._load(source)

    def global_addresses(self, name: str) -> list:
        """The address of `name` in every module: NVRTC compiles the kernels in chunks, one cubin
        each, and each cubin holds its own copy of a `__device__` variable of the prelude."""
        return [module.global_address(name) for module in self.modules]

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
        # The first step's check of the tensor-core kernels against SIMT ones (runtime/tensor_core_check.py):
        # its report, and buffers of SIMT kernels that replaced wrong tensor-core ones
        self.tensor_core_check = None
        self.tensor_core_fallback_buffers = []
        self.index_checks = program.index_checks
        self.index_error = np.zeros((), _INDEX_ERROR_RECORD)   # the record as the last step left it
        # One record per loaded module (the CUDA backend loads one cubin per NVRTC chunk).
        self.index_error_addresses = backend.global_addresses("flowgen_index_error") if self.index_checks else []
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
        # Dynamic dimensions (codegen/dynamic.py): the sizes of this call, which the kernels read.
        self.dynamic = program.dynamic
        if self.dynamic is not None:
            self.address[self.dynamic.value] = backend.alloc(self.dynamic.value.nbytes)
        self.kernel_args = [[self._arg(a) for a in k.args] for k in program.kernels]
        self.launches, self.sequence = self._prepare(program.kernels)
        # Kernels whose launch grid follows the dynamic dimensions (Kernel.dynamic_grid): the grids
        # the launches above were prepared with, and those prepared for other grids (with their
        # captured CUDA graphs), which a call at other sizes swaps in.
        self.dynamic_grids = [(i, k.dynamic_grid) for i, k in enumerate(program.kernels) if k.dynamic_grid]
        self.grid_key = tuple(tuple(int(g) for g in program.kernels[i].grid) for i, _ in self.dynamic_grids)
        self.prepared_grids = {}
        # Host collectives (data parallelism) cannot be captured into a CUDA graph.
        self.capturable = all(k.collective is None for k in program.kernels)
        self.prepare_launches = [backend.prepare(k, [self._arg(a) for a in k.args]) for k in program.prepare]
        # State updates: the new value is copied over the state buffer at the end of the step.
        state = graph.state_by_name()
        self.updates = [(self.address[state[name].value], self.resolve(v), v.nbytes)
                        for name, v in graph.updates if self.resolve(v) != self.address[state[name].value]]

    def _prepare(self, kernels) -> tuple:
        """(launches, sequence) of `kernels` (the program's, with their grids as given)."""
        launches = [self._host_collective(k) if k.collective is not None else self.backend.prepare(k, a)
                    for k, a in zip(kernels, self.kernel_args)]
        # On the CPU the whole step is one call into the library where no launch needs Python.
        sequence = (self.backend.prepare_sequence(kernels, self.kernel_args)
                    if self.backend.name == "cpu" and all(k.collective is None for k in kernels) else None)
        return launches, sequence

    def _use_grids(self, sizes) -> None:
        """Launches with the grids the dynamic dimensions' `sizes` give (prepared once per grid)."""
        key = tuple(tuple(g if isinstance(g, int) else g.at(sizes) for g in grid) for _, grid in self.dynamic_grids)
        if key == self.grid_key:
            return
        self.prepared_grids[self.grid_key] = (self.launches, self.sequence, self.graph_exec)
        if key in self.prepared_grids:
            self.launches, self.sequence, self.graph_exec = self.prepared_grids.pop(key)
        else:
            kernels = list(self.program.kernels)
            for (i, _), grid in zip(self.dynamic_grids, key):
                kernels[i] = replace(kernels[i], grid=grid)
            (self.launches, self.sequence), self.graph_exec = self._prepare(kernels), None
        self.grid_key = key

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

    def read_value(self, value, shape=None) -> np.ndarray:
        """`value`'s contents (its first elements in `shape`, for a size given at run time)."""
        out = np.empty(value.shape if shape is None else shape, value.dtype.np_dtype)
        if out.size == 0:   # nothing to read, and no kernel may have given it a place in the arena
            return out
        self.backend.download(out, self.resolve(value))
        return out

    def _step(self):
        if self.sequence is not None:
            self.sequence()
        else:
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
        sizes = None
        if self.dynamic is not None:   # the inputs' sizes were checked against the Dims (flowgen/dims.py)
            by_dim = {dim: int(inputs[uses[0].input].shape[uses[0].axis]) for dim, uses in self.dynamic.uses.items()}
            sizes = self.dynamic.sizes(by_dim)
            self.backend.upload(self.address[self.dynamic.value], sizes)
            if self.dynamic_grids:
                self._use_grids(sizes)
        if state_changed:
            for launch in self.prepare_launches:
                launch()
        if self.calls == 0 and tensor_core_check.wanted(self.backend, self.program):
            self.tensor_core_check = tensor_core_check.first_step(self)
        else:
            self.launch_step()
        self.backend.synchronize()
        for address in self.index_error_addresses:   # the first module whose kernels found a bad index
            self.backend.download(self.index_error, address)
            if self.index_error["check"]:
                break
        if sizes is not None:
            return [self.read_value(v, self.dynamic.output_shape(k, sizes))
                    for k, v in enumerate(self.program.graph.outputs)]
        return [self.read_value(v) for v in self.program.graph.outputs]

    def raise_index_error(self):
        """If the last step read an out-of-range index: clear the record, raise IndexError."""
        check_id, value = int(self.index_error["check"]), int(self.index_error["value"])
        if check_id == 0:
            return
        self.index_error = np.zeros((), _INDEX_ERROR_RECORD)
        for address in self.index_error_addresses:
            self.backend.upload(address, self.index_error)
        raise IndexError(self.index_checks[check_id].message(value))
