"""Trace + compile one input signature of an nn.Graph, and run it.

`compile_step` is the whole pipeline for one variant; `CompiledGraph.run` keeps
the eager tensors (parameters, buffers, optimizer slots) and the device copies
in sync: a tensor is uploaded when another variant or eager code changed it,
and read back lazily when eager code looks at it.
"""
from __future__ import annotations

import functools
import os
import re
import time
import warnings
from dataclasses import dataclass

import numpy as np

from flowgen import random
from flowgen import creation
from flowgen import functional as F
from flowgen.amp import StaticGradScaler
from flowgen.codegen.program import build_program, count_unfused_kernels
from flowgen.device import as_device
from flowgen.errors import internal_checks
from flowgen.ir.trace import TraceError, Tracer
from flowgen.nn import module as module_mod
from flowgen.nn.graph.io import flatten, flatten_call, non_tensor_arguments
from flowgen.nn.graph.report import io_lines, module_header, state_lines
from flowgen.ir.graph import NameGen
from flowgen.distributed.collectives import world
from flowgen.distributed import env
from flowgen.distributed.global_tensor import absent, covers_world, graph_storage, holds
from flowgen.distributed.data_parallel import (broadcast_state, combine_outputs, global_outputs,
                                               gradient_reduction, graph_placement, shard_parameter_bindings,
                                               shard_slot_tensors)
from flowgen.distributed.placement import placement as Placement
from flowgen.distributed.sbp import broadcast
from flowgen.distributed.pipeline import pipeline_of, split_stage
from flowgen.passes.autodiff import autodiff, next_value_index
from flowgen.passes.gradient_allreduce import (all_reduce_gradients, divide_ratio_loss_by_global_count,
                                                reduce_traced_gradients)
from flowgen.passes.optimizer import GraphScaler, HostScalar, lower_optimizers, scaler_state_name
from flowgen.passes.pipeline import default_passes, run_passes
from flowgen.passes.random_streams import bind_random_streams
from flowgen.passes.zero import reduce_scatter_traced_gradients, shard_optimizer_state, shards_parameter
from flowgen.runtime.executor import CpuBackend, CudaBackend, Executor
from flowgen.tensor import Tensor
from flowgen.runtime import program_cache
from flowgen.runtime.progress import reporting


class CompiledGraph:
    """What `graph.compiled` shows: the IR, the sources, launches and memory."""

    def __init__(self, graph, ir, program, executor, device, bindings, host_scalars, output_structure, timings):
        self.graph_name = graph.name
        self._graph = graph
        self.ir = ir
        self.program = program
        self.executor = executor
        self.device = device
        self.bindings = bindings            # [(state Value, eager Tensor)]
        self.host_scalars = host_scalars    # [(state Value, HostScalar)]
        self.output_structure = output_structure
        self.timings = timings
        self.versions: dict = {}
        self.scaler = None                  # GraphScaler when a GradScaler scales the loss
        self.checks: list = []              # run before every call (a traced optimizer's fixed options)
        self.data_parallel = None           # DataParallel when gradients are reduced over ranks
        self.output_combine = None          # per output, how a data-parallel step makes it global
        self.output_placements = None       # per output, the placement it is global on (None: outputs are local)
        self.runs_here = True               # False on a rank outside the placement of a graph on some ranks
        self.sharded_slots = []             # ShardedSlot: optimizer slots (stage 3: parameters too) ZeRO split
        self.pipeline = None                # StageProgram: this rank's stage of a set_stage pipeline
        self.program_cache = "off"          # "hit" (passes and codegen loaded), "miss" (built, stored) or "off"

    @property
    def sources(self) -> dict:
        return {"kernels.cu": self.program.source}

    @property
    def num_launches(self) -> int:
        return self.program.num_launches

    @property
    def kernels_before_fusion(self) -> int:
        return self.program.kernels_before_fusion

    @property
    def memory(self):
        return self.program.plan

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer slots this rank keeps on the device (a shard of each under ZeRO)."""
        return sum(s.value.nbytes for s in self.ir.state if s.kind == "optim")

    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank keeps on the device as state (a shard of each under ZeRO
        stage 3; the full copies it gathers during a step are temporaries of the memory plan)."""
        return sum(s.value.nbytes for s in self.ir.state if s.kind == "param")

    # --------------------------------------------------------------- running
    def _upload_state(self) -> bool:
        """Copy changed state to the device; True if anything was copied."""
        changed = False
        for value, tensor in self.bindings:
            if (getattr(tensor, "_graph_owner", None) is self and self.versions.get(id(tensor)) == tensor._version
                    and not tensor._storage_shared):
                continue  # the device copy is the newest (an array from .numpy() may have been written)
            self.executor.write_state(value, tensor.numpy_view())
            changed = True
        for value, scalar in self.host_scalars:
            self.executor.write_state(value, np.asarray(scalar.compute(), value.dtype.np_dtype))
        return changed

    def _read_back_scaler(self) -> bool:
        """After a step with a GradScaler: its new scale and growth tracker go back to the Python
        object; True if the step was skipped (an inf/NaN gradient backs the scale off)."""
        if self.scaler is None:
            return False
        scaler = self._graph._grad_scaler
        old = scaler.get_scale()
        scaler._scale = float(self.executor.read_value(self.scaler.scale))
        scaler._growth_tracker = int(self.executor.read_value(self.scaler.tracker))
        # a skip resets the tracker without growing the scale (it backs off, or stays inf)
        return scaler._growth_tracker == 0 and not scaler._scale > old

    def _mark_device_newer(self):
        """After a call: eager reads of bound tensors download the graph's copy, lazily, except
        for tensors whose storage `.numpy()` handed out: their arrays are refreshed now."""
        for value, tensor in self.bindings:
            tensor._graph_owner = self
            self.versions[id(tensor)] = tensor._version
            if tensor._storage_shared:
                self._download(tensor, value)
                tensor._sync_from_device = None
            else:
                tensor._sync_from_device = lambda t, v=value: self._download(t, v)
        for slot in self.sharded_slots:     # other graphs reading `full` upload it (gathered) first
            slot.full._graph_owner = self
            slot.full._sync_from_device = slot.gather

    def _download(self, tensor, value):
        tensor._data[...] = self.executor.read_value(value).reshape(tensor._data.shape)

    def run(self, args):
        """One call with the flat input tensors (io.flatten of the call's arguments)."""
        for a in args:
            if a.device != self.device:
                raise RuntimeError(f"{self.graph_name}: an input is on {a.device} but the graph runs on {self.device}; "
                                   f"move inputs and modules to the same device")
        if not self.runs_here:   # a graph on some of the ranks: this one runs nothing, its outputs have no component
            self._graph._after_step()
            return self.output_structure([absent(v.dtype, p, broadcast, v.shape)
                                          for v, p in zip(self.ir.outputs, self.output_placements)])
        for check in self.checks:
            check()
        for slot in self.sharded_slots:
            slot.cut_again_if_written()
        changed = self._upload_state()
        outputs = self.executor.run([a.numpy_view() for a in args], state_changed=changed)
        self._mark_device_newer()
        if self.pipeline is not None:
            self.pipeline.after_step(self)
        self._graph._after_step(skipped=self._read_back_scaler())
        # Raised after the bookkeeping: the step (and its state updates) happened, see executor.py.
        self.executor.raise_index_error()
        tensors = [Tensor(o, dtype=v.dtype, device=self.device) for o, v in zip(outputs, self.ir.outputs)]
        if self.output_placements is not None:
            tensors = global_outputs(tensors, self.output_placements, self.output_combine)
        return self.output_structure(tensors)


def _device_of(graph, args):
    """The device of the graph's inputs and parameters; None when it has neither (the tracer then
    takes the device of the tensors build() makes)."""
    devices = {a.device for a in args}
    for module in graph._modules.values():
        devices.update(p.device for p in module.parameters())
    if len(devices) > 1:
        raise RuntimeError(f"{graph.name}: inputs and parameters are on different devices "
                           f"({', '.join(sorted(map(str, devices)))}); move them with .to(device)")
    return devices.pop() if devices else None


def _make_backend(device, source: str):
    if device.type == "cpu":
        return CpuBackend(source)
    # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load and CPU graphs never use them.
    from flowgen.runtime import cuda_driver

    if not cuda_driver.available():
        if os.environ.get("FLOWGEN_EMULATE_CUDA") == "1":  # the CUDA program, run by the CPU emulator
            return CpuBackend(source)
        raise cuda_driver.NoCudaDevice("the graph's tensors are on 'cuda'")
    return CudaBackend(source)


def _make_backend_once(device, source: str, data_parallel):
    """Ranks of a data-parallel graph compile the same source: rank 0 builds it into the
    cache while the others wait, then they load it from there."""
    if data_parallel is None or data_parallel.world_size == 1:
        return _make_backend(device, source)
    comm = world()
    backend = _make_backend(device, source) if comm.rank == 0 else None
    comm.barrier()
    return backend if backend is not None else _make_backend(device, source)


def _module_hook(graph, tracer, paths: dict, io: dict):
    def hook(module, forward, args, kwargs):
        path = paths.get(id(module))
        if path is None:
            warnings.warn(f"{module_header(module)} is called in a nn.Graph, but not registered into a nn.Graph; "
                          f"its parameters and buffers, if any, are read as constants (assign it as an attribute "
                          f"of the graph or of a registered module)", UserWarning, stacklevel=3)
            return forward(*args, **kwargs)
        tracer.scopes.append(path)
        graph._log(1, f"(MODULE:{path}:{module_header(module)})")
        inputs = io_lines("INPUT", path, args, kwargs)
        for line in inputs + state_lines(module, path):
            graph._log(1, line)
        try:
            out = forward(*args, **kwargs)
        finally:
            tracer.scopes.pop()
        outputs = io_lines("OUTPUT", path, out if type(out) in (tuple, list) else (out,), {})
        for line in outputs:
            graph._log(1, line)
        io[path] = {"inputs": inputs, "outputs": outputs}
        return out
    return hook


def _conv_tiles(graph, ir, device) -> dict:
    """Measured conv tile choices when the graph asks for the search (on a GPU only)."""
    if not graph.config.cudnn_conv_heuristic_search_algo:
        return {}
    if device.type != "cuda":   # (_program_cache_options warned, cached program or not)
        return {}
    # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load and CPU graphs never use them.
    from flowgen.runtime import cuda_driver

    if not cuda_driver.available():
        return {}   # the backend reports the missing GPU
    # Imported here, not at the top: autotune loads the kernel families (~0.2 s), kept out of `import flowgen`.
    from flowgen.runtime.autotune import tune_convs

    return tune_convs(ir, log=graph._log)


def _with_measured_conv_tiles(graph, ir, device):
    """The IR with the measured tiles as conv attributes (saved graphs and programs keep them)."""
    # Imported here, not at the top: autotune loads the kernel families (~0.2 s), kept out of `import flowgen`.
    from flowgen.runtime.autotune import with_conv_tiles

    return with_conv_tiles(ir, _conv_tiles(graph, ir, device))


def _micro_batch(graph, lazy_args, j: int, steps: int) -> list:
    out = []
    for k, a in enumerate(lazy_args):
        if not a.shape or a.shape[0] % steps:
            raise TraceError(f"{graph.name}: gradient accumulation over {steps} steps splits every input along "
                             f"dim 0, but input {k} has shape {tuple(a.shape)}")
        size = a.shape[0] // steps
        out.append(F.narrow(a, 0, j * size, size))
    return out


def _differentiate(graph, tracer, wrt, device, scale) -> dict:
    """Append the backward pass of the loss just traced; the tracer continues after it."""
    if not graph._optimizers:
        raise TraceError(f"{graph.name}: loss.backward() was called in build() but no optimizer was added; "
                         f"call self.add_optimizer(optimizer) in __init__")
    optimized = {id(p): p for opt, _ in graph._optimizers for g in opt.param_groups for p in g["params"]}
    for tensor in [entry[0] for entry in tracer.constants.values()] + tracer.free_tensors:
        if id(tensor) in optimized and tensor.requires_grad:
            raise TraceError(f"{graph.name}: build() used a parameter of shape {tuple(tensor.shape)} that the "
                             f"optimizer trains but that belongs to no module of this graph, so the graph "
                             f"would treat it as a constant; assign the module that owns it in __init__ "
                             f"(self.model = model)")
    roots = list(tracer.backward_roots)
    tracer.backward_roots.clear()
    root = roots[0]
    for other in roots[1:]:   # several backward() calls: their gradients add up, as in eager mode
        root = (tracer.lazy(root) + tracer.lazy(other))._value
    ir, grads = autodiff(tracer.graph, root, wrt, device, loss_scale=scale)
    tracer.graph, tracer.new_name = ir, NameGen(start=next_value_index(ir))
    return grads


def compile_step(graph, args: tuple, kwargs: dict, data_parallel=None, input_placements: tuple = ()):
    """Trace `graph.build(*args, **kwargs)` (tensors anywhere in them become graph inputs,
    other values are constants of this variant) and compile it. The tensors are this rank's
    local ones; `data_parallel` (flowgen/distributed/data_parallel.py) makes the step reduce its
    gradients over the ranks; `input_placements` gives each flat input's placement when it was a
    global tensor (data_parallel.split_inputs). One progress line covers all stages; an internal
    check failing in any of them is reported as a FlowgenInternalError naming the graph
    (flowgen/errors.py)."""
    with reporting(graph.name) as progress, program_cache.collector_paused(), \
            internal_checks(graph.name, lambda: progress.stage_name):
        return _compile_step(graph, args, kwargs, data_parallel, input_placements, progress)


def _compile_step(graph, args: tuple, kwargs: dict, data_parallel, input_placements, progress):
    cls = type(graph).__name__
    inputs, rebuild_call = flatten_call(args, kwargs, graph.name)
    device = _device_of(graph, inputs)
    zero = _zero_settings(graph, data_parallel)
    pipeline = pipeline_of(graph, data_parallel, input_placements)
    placement = graph_placement(graph, input_placements, data_parallel, pipeline is not None)
    if data_parallel is not None:
        broadcast_state(graph)
    timings = {}
    start = time.perf_counter()
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start building graph.")
    progress.stage("trace")
    tracer = Tracer(graph.name, device, log=graph._log if graph._debug_level >= 2 else None,
                    autocast=graph.config.amp_dtype if graph.config.amp else None, capture_free_tensors=True)
    param_name, paths = {}, {}
    for mname, module in graph._modules.items():
        for path, sub in module.named_modules(prefix=mname):
            paths.setdefault(id(sub), path)
        for pname, p in module.named_parameters(prefix=mname):
            if id(p) not in param_name:
                tracer.add_state(pname, p, "param")
                param_name[id(p)] = pname
        for bname, b in module.named_buffers(prefix=mname):
            if b is not None and id(b) not in tracer.state_of:
                tracer.add_state(bname, b, "buffer")
    io: dict = {}
    wrt = [param_name[id(p)] for opt, _ in graph._optimizers for g in opt.param_groups for p in g["params"]
           if id(p) in param_name and p.requires_grad]
    host_scalars = []
    scaler = _add_grad_scaler(graph, tracer, host_scalars)
    static_scale = _static_scale(graph)
    scale = scaler.scale if scaler is not None else static_scale
    if scaler is not None and zero is not None:
        raise NotImplementedError(f"{graph.name}: enable_zero(stage={zero.stage}) with a GradScaler: the sharded "
                                  f"update cannot skip an overflowing step yet; use a StaticGradScaler or no scaler")
    steps = graph.config.gradient_accumulation_steps
    grads, sharded_slots = None, []

    reduced_in_build = False   # data parallel: build() read the gradients, so they were all-reduced there

    def differentiate(in_build: bool) -> dict:
        nonlocal reduced_in_build
        if in_build and (steps > 1 or scale != 1.0):   # build() would see scaled or partial gradients
            raise TraceError(f"{graph.name}: reading gradients inside build() (gradient clipping) with a "
                             f"GradScaler or gradient accumulation is not supported yet; give the optimizer's "
                             f"parameter groups clip_grad_max_norm and clip_grad_norm_type instead (they clip the "
                             f"unscaled, accumulated gradients inside the step)")
        if data_parallel is not None and (len(tracer.backward_roots) > 1 or tracer.grads is not None):
            raise NotImplementedError(f"{graph.name}: a data-parallel graph whose build() calls backward() more "
                                      f"than once before the optimizer step is not supported yet (each loss would "
                                      f"need its own reduction over the ranks); add the losses and call backward() "
                                      f"once")
        if data_parallel is not None and data_parallel.contract == "global":
            divide_ratio_loss_by_global_count(tracer, data_parallel.world_size)
        grads = _differentiate(graph, tracer, wrt, tracer.device or as_device("cpu"), scale)
        if in_build and data_parallel is not None:     # clip the gradients reduced over the ranks
            reduction = gradient_reduction(graph.name, tracer.graph, tracer.losses, data_parallel)
            pieces = {} if zero is None or zero.stage == 1 else reduce_scatter_traced_gradients(
                tracer, grads, world().rank, data_parallel.world_size, zero.shard_min_size,
                data_parallel.bucket_size, reduction.gradient_op)
            whole = {n: g for n, g in grads.items() if n not in pieces}
            grads = {**reduce_traced_gradients(tracer, whole, reduction, data_parallel), **pieces}
            reduced_in_build = True
        return grads

    tracer.differentiate = differentiate
    previous_hook = module_mod.set_module_call_hook(_module_hook(graph, tracer, paths, io))
    try:
        with tracer, random.preserved_dropout_stream():
            lazy_inputs = [tracer.add_input(a, i) for i, a in enumerate(inputs)]
            graph._log(1, f"(GRAPH:{graph.name}:{cls}) start building forward graph.")
            graph_inputs = io_lines("INPUT", graph.name, args, kwargs)
            for line in graph_inputs:
                graph._log(1, line)
            micro_outputs, micro_ends = [], []   # micro-batch j's nodes end before micro_ends[j]
            for j in range(steps):
                lazy_args, lazy_kwargs = rebuild_call(
                    lazy_inputs if steps == 1 else _micro_batch(graph, lazy_inputs, j, steps))
                try:
                    result = graph.build(*lazy_args, **lazy_kwargs)
                except (TypeError, AttributeError) as exc:
                    python_values = non_tensor_arguments(args, kwargs)
                    if not python_values:
                        raise
                    raise TypeError(f"{graph.name}: build() failed ({exc}); {', '.join(python_values)}: values "
                                    f"other than tensors reach build() as they are (OneFlow does the same); "
                                    f"wrap data with flow.tensor(...) to make it a graph input") from exc
                flat, structure = flatten(result, f"{graph.name}: the output of build()")
                micro_outputs.append(flat)
                # Differentiate this micro-batch now (if build() has not), so its activations die before the next.
                micro_grads = tracer.take_step_gradients()
                if micro_grads is not None:
                    grads = micro_grads if grads is None else {
                        n: (tracer.lazy(grads[n]) + tracer.lazy(g))._value for n, g in micro_grads.items()}
                micro_ends.append(len(tracer.graph.nodes))
            if steps > 1:   # per-micro-batch outputs stacked along a new leading dim
                flat = [F.stack([m[i] for m in micro_outputs]) for i in range(len(micro_outputs[0]))]
            tracer.graph.outputs = [tracer.value_of(t) for t in flat]
    finally:
        module_mod.set_module_call_hook(previous_hook)
    io[""] = {"inputs": graph_inputs, "outputs": io_lines("OUTPUT", graph.name, (structure(flat),), {})}
    for line in io[""]["outputs"]:
        graph._log(1, line)
    graph._log(1, f"(GRAPH:{graph.name}:{cls}) end building forward graph.")
    object.__setattr__(graph, "_io", io)
    device = tracer.device or as_device("cpu")
    ir = tracer.graph
    bindings = [(tracer.state_of[id(t)].value, graph_storage(t, tracer.state_of[id(t)].name))
                for t in tracer.state_tensors]
    placed = {tracer.state_of[id(t)].name for t in tracer.state_tensors if _on_some_ranks(t)}
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end building graph.")
    timings["trace"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) building graph Done! Cost time: {timings['trace']:.2f}s.")

    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start compiling plan and init graph runtime.")
    start = time.perf_counter()
    progress.stage("passes")
    if grads is not None and data_parallel is not None:
        # ZeRO-2 and 3 reduce-scatter the gradients of the parameters they shard (passes/zero.py).
        reduced_here = grads if zero is None or zero.stage == 1 else {
            n: g for n, g in grads.items()
            if not shards_parameter(g.numel, data_parallel.world_size, zero.shard_min_size)}
        reduction = gradient_reduction(graph.name, ir, tracer.losses, data_parallel)
        if not reduced_in_build:
            ir, reduced = all_reduce_gradients(ir, reduced_here, device, data_parallel.world_size, reduction,
                                               data_parallel.bucket_size)
            grads = {**grads, **reduced}
    output_combine = None
    if data_parallel is not None and data_parallel.contract == "global":
        emitter = Tracer(graph.name, device)
        emitter.graph, emitter.new_name = ir, NameGen(start=next_value_index(ir))
        emitter.scopes.append("data_parallel.outputs")
        ir, output_combine = combine_outputs(ir, emitter.emit, data_parallel.world_size)
    checks = []
    if grads is not None:
        # Gradients are averaged over micro-batches and the loss scale divided out.
        ir, host, slots, checks = lower_optimizers(ir, grads, graph._optimizers, param_name, device,
                                                   graph._counter, grad_unscale=1.0 / (static_scale * steps),
                                                   scaler=scaler)
        if zero is not None:
            ir, shards = shard_optimizer_state(ir, world().rank, data_parallel.world_size, zero.shard_min_size,
                                               device, data_parallel.bucket_size, zero.stage, reduction.gradient_op,
                                               {grads[n]: piece for n, (piece, _) in tracer.gradient_pieces.items()})
            slots, sharded_slots = shard_slot_tensors(graph._zero_slots, slots, shards)
            bindings, sharded_params = shard_parameter_bindings(graph._zero_slots, bindings, ir.state_by_name(),
                                                                shards)
            sharded_slots += sharded_params
        state = ir.state_by_name()
        bindings += [(state[s.state_name].value, graph_storage(s.tensor, s.state_name)) for s in slots]
        placed |= {s.state_name for s in slots if _on_some_ranks(s.tensor)}
        host_scalars += [(state[h.name].value, h) for h in host]
    stage_program = None
    if pipeline is not None:
        _refuse_sync_batch_norm(graph.name, ir)
        stage_program = split_stage(graph.name, ir, pipeline, micro_ends)
        bindings, host_scalars = stage_program.keep_bindings(ir, bindings, host_scalars, placed)
        ir, structure = stage_program.ir, stage_program.user_structure(structure)
    ir, rng = bind_random_streams(ir)
    if rng is not None:
        host_scalars.append((ir.state_by_name()[rng.name].value, rng))
    checkpointed = [path for path, options in graph._module_configs.items() if options.activation_checkpointing]
    options = _program_cache_options(graph, device, data_parallel, stage_program)
    passes_and_codegen = functools.partial(_passes_and_codegen, graph, ir, device, checkpointed, progress,
                                           timings, start, stage_program)
    if options is None:
        (ir, program), cache_status = passes_and_codegen(), "off"
    else:
        (ir, program), cache_status = program_cache.cached(ir, options, passes_and_codegen)
    if cache_status == "hit":
        timings["program cache"] = time.perf_counter() - start
    graph._log(1, program.plan.describe())
    start = time.perf_counter()
    executor_backend = _make_backend_once(device, program.source, data_parallel)
    executor = Executor(program, executor_backend)
    timings["compile"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end compiling plan and init graph rumtime.")
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) compiling plan and init graph runtime Done! Cost time: "
                  f"{sum(t for k, t in timings.items() if k != 'trace'):.2f}s.")
    compiled = CompiledGraph(graph, ir, program, executor, device, bindings, host_scalars, structure, timings)
    compiled.program_cache = cache_status
    compiled.scaler = scaler if grads is not None else None
    compiled.checks = checks
    compiled.data_parallel = data_parallel
    compiled.output_combine = output_combine
    compiled.sharded_slots = sharded_slots
    compiled.pipeline = stage_program
    compiled.runs_here = placement is None or holds(placement)
    compiled.output_placements = _output_placements(len(ir.outputs), input_placements, placement, pipeline,
                                                    stage_program)
    return compiled


def _on_some_ranks(tensor) -> bool:
    """A global tensor on a placement of some of the ranks (a pipeline stage's, OneFlow's way)."""
    return tensor.is_global and not covers_world(tensor.placement)


def _output_placements(num_outputs: int, input_placements: tuple, placement, pipeline, stage_program):
    """Per output, the placement it comes back global on; None when every output is local (no
    input was global and the graph runs on every rank). A graph on some of the ranks returns them
    on its placement; a pipeline each on the placement of the stage that made it (OneFlow returns
    the loss on the last stage's), one made on every rank on all of them."""
    given = [p for p in input_placements if p is not None]
    if placement is not None:
        return [placement] * num_outputs
    if not given:
        return None
    if pipeline is None:    # data parallel, or inputs on every rank
        return [given[-1]] * num_outputs
    everywhere = Placement(given[0].type, range(env.get_world_size()))
    return [everywhere if stage is None else pipeline.placements[stage] for stage in stage_program.output_stages]


def _passes_and_codegen(graph, ir, device, checkpointed, progress, timings, start, stage_program) -> tuple:
    """(optimized IR, Program) of the traced step: the pass pipeline, then kernels and memory plan."""
    passes = default_passes(graph.config, checkpointed)
    ir, _ = run_passes(ir, passes, log=graph._log if graph._debug_level >= 1 else None)
    if stage_program is not None:
        stage_program.check_transfer_order(ir)
    timings["passes"] = time.perf_counter() - start
    start = time.perf_counter()
    progress.stage("codegen")
    ir = _with_measured_conv_tiles(graph, ir, device)
    program = build_program(ir, naive_memory=graph.config.naive_memory, target=device.type,
                            compress_memory=graph.config.compress_memory, allow_tf32=graph.config.tf32,
                            arch=_cuda_arch(device))
    program.kernels_before_fusion = count_unfused_kernels(ir)
    timings["codegen"] = time.perf_counter() - start
    return ir, program


def _program_cache_options(graph, device, data_parallel, stage_program) -> dict | None:
    """What besides the traced IR decides the compiled program (runtime/program_cache.py), or
    None where it is not cached: conv tiles timed on the GPU (a CPU graph has none to time),
    data-parallel graphs (whose ranks already share rank 0's build through the kernel cache),
    pipeline stages (each rank's own part, checked against its transfer plan), and
    graph.debug(1) or above, which logs each pass as it runs."""
    if graph.config.cudnn_conv_heuristic_search_algo and device.type != "cuda":   # every compile, cached or not
        warnings.warn(f"{graph.name}: enable_cudnn_conv_heuristic_search_algo has no effect on the {device.type} "
                      f"device: conv tile shapes are timed on a GPU only", UserWarning, stacklevel=5)
    conv_search = graph.config.cudnn_conv_heuristic_search_algo and device.type == "cuda"
    if data_parallel is not None or stage_program is not None or conv_search or graph._debug_level >= 1:
        return None
    return {"config": vars(graph.config), "module_configs": graph._module_configs, "target": device.type,
            "arch": _cuda_arch(device)}


def _cuda_arch(device):
    """The GPU architecture a 'cuda' graph's program is rendered for (codegen/target.py): the
    GPU's; with no GPU under FLOWGEN_EMULATE_CUDA=1, FLOWGEN_EMULATE_CUDA_ARCH (e.g. sm_90, to run
    the Hopper kernels on the emulator), else None (any sm_80 or newer)."""
    if device.type != "cuda":
        return None
    # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load and CPU graphs never use them.
    from flowgen.runtime import cuda_driver

    if cuda_driver.available():
        return cuda_driver.CudaContext.get().arch
    arch = os.environ.get("FLOWGEN_EMULATE_CUDA_ARCH") or None
    if arch is not None and not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"FLOWGEN_EMULATE_CUDA_ARCH={arch!r}: expected a GPU architecture such as sm_90")
    return arch


def _refuse_sync_batch_norm(graph_name, ir):
    synced = [n.scope for n in ir.nodes if n.op == "sync_batch_norm_affine"]
    if synced:
        raise NotImplementedError(f"{graph_name}: SyncBatchNorm ({synced[0]}) in a pipelined graph: it reduces its "
                                  f"statistics over every rank, but each rank runs one stage on the whole batch; "
                                  f"use BatchNorm")




@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    shard_min_size: int


def _zero_settings(graph, data_parallel):
    """How the graph shards its optimizer (ZeroSettings), or None. On one rank enable_zero has
    nothing to split; on several, what flowgen cannot do raises."""
    world_size, config = env.get_world_size(), graph.config
    if not config.zero or world_size == 1:
        return None
    if data_parallel is None:
        raise NotImplementedError(f"{graph.name}: enable_zero on {world_size} ranks needs a data-parallel graph "
                                  f"(inputs split by flow.sbp.split(0), or a DistributedDataParallel module)")
    return ZeroSettings(config.zero_stage, config.zero_shard_min_size)


def _static_scale(graph) -> float:
    """A StaticGradScaler's fixed scale (baked into the step), else 1."""
    scaler = graph._grad_scaler
    return float(scaler.get_scale()) if isinstance(scaler, StaticGradScaler) else 1.0


def _add_grad_scaler(graph, tracer, host_scalars: list):
    """The graph's (dynamic) GradScaler as state: its scale seeds the backward pass; the
    optimizer pass adds the inf check, the skip and the growth/backoff rule (passes/optimizer.py)."""
    scaler = graph._grad_scaler
    if scaler is None or not scaler.is_enabled() or isinstance(scaler, StaticGradScaler):
        return None
    if len(graph._optimizers) > 1:
        # PyTorch's GradScaler skips each optimizer whose own gradients overflow; the graph's step
        # skips as one, so the two would diverge: refuse instead of training differently.
        raise NotImplementedError(f"{graph.name}: a dynamic GradScaler with {len(graph._optimizers)} optimizers; "
                                  f"PyTorch skips only the optimizers whose gradients hold inf/NaN, which a graph "
                                  f"cannot do yet; use one optimizer (with parameter groups) or a StaticGradScaler")
    values = {}
    for what, read in (("scale", lambda: scaler.get_scale()), ("growth_tracker", lambda: scaler._growth_tracker)):
        name = scaler_state_name(what)
        var = tracer.add_state(name, creation.tensor(float(read()), dtype="float32"), "hyper")
        tracer.state_tensors.pop()    # written by the host before each call, read back after it
        host_scalars.append((var.value, HostScalar(name, read)))
        values[what] = var.value
    return GraphScaler(values["scale"], values["growth_tracker"], scaler.get_growth_factor(),
                       scaler.get_backoff_factor(), scaler.get_growth_interval())
