"""Trace + compile one input signature of an nn.Graph, and run it.

`compile_step` is the whole pipeline for one variant: trace build() into a step
(trace_step.py), run the pass list over it (passes/pipeline.py: the step's stages, then
the IR passes), build the program (kernels and memory plan) and its executor.
`CompiledGraph.run` keeps the eager tensors (parameters, buffers, optimizer slots) and
the device copies in sync: a tensor is uploaded when another variant or eager code
changed it, and read back lazily when eager code looks at it.
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import numpy as np

from flowgen.codegen.dynamic import DynamicShapeError, fit_programs
from flowgen.codegen.program import build_program, count_unfused_kernels, kernels_source
from flowgen.codegen.target import forms_chosen_at
from flowgen.distributed import env
from flowgen.distributed.data_parallel import broadcast_state, global_outputs, graph_placement
from flowgen.distributed.global_tensor import absent, holds
from flowgen.distributed.pipeline import pipeline_of
from flowgen.distributed.placement import placement as Placement
from flowgen.distributed.sbp import broadcast
from flowgen.dims import sample_points, shapes_at
from flowgen.creation import zeros
from flowgen.errors import internal_checks
from flowgen.nn.graph.backend import cuda_arch, make_backend_once
from flowgen.nn.graph.io import flatten_call
from flowgen.nn.graph.trace_step import device_of, trace_step, zero_settings
from flowgen.passes.pipeline import ir_passes_start, run_passes, step_passes
from flowgen.runtime import program_cache
from flowgen.runtime.executor import Executor
from flowgen.runtime.toolchain import CompileError
from flowgen.runtime.progress import reporting
from flowgen.tensor import Tensor


class CompiledGraph:
    """What `graph.compiled` shows: the IR, the sources, launches and memory."""

    def __init__(self, graph, step, settings, program, executor, timings):
        self.graph_name = graph.name
        self._graph = graph
        self.ir = step.ir
        self.program = program
        self.executor = executor
        self.device = settings.device
        self.bindings = list(step.bindings)             # [(state Value, eager Tensor)]
        self.host_scalars = list(step.host_scalars)     # [(state Value, HostScalar)]
        self.output_structure = step.structure
        self.timings = timings
        self.versions: dict = {}
        # GraphScaler when a GradScaler scales the loss
        self.scaler = settings.scaler if step.grads is not None else None
        self.checks = list(step.checks)                 # run before every call (a traced optimizer's fixed options)
        self.data_parallel = settings.data_parallel     # DataParallel when gradients are reduced over ranks
        self.output_combine = step.output_combine       # per output, how a data-parallel step makes it global
        self.output_placements = None       # per output, the placement it is global on (None: outputs are local)
        self.runs_here = True               # False on a rank outside the placement of a graph on some ranks
        self.sharded_slots = list(step.sharded_slots)   # ShardedSlot: slots (stage 3: parameters too) ZeRO split
        self.pipeline = step.stage_program              # StageProgram: this rank's stage of a set_stage pipeline
        self.program_cache = "off"          # "hit" (passes and codegen loaded), "miss" (built, stored) or "off"
        self.render_at = None               # dynamic dimensions: sizes -> the step's Program at those sizes

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


def compile_step(graph, args: tuple, kwargs: dict, data_parallel=None, input_placements: tuple = ()):
    """Trace `graph.build(*args, **kwargs)` (tensors anywhere in them become graph inputs,
    other values are constants of this variant) and compile it. The tensors are this rank's
    local ones; `data_parallel` (flowgen/distributed/data_parallel.py) makes the step reduce its
    gradients over the ranks; `input_placements` gives each flat input's placement when it was a
    global tensor (data_parallel.split_inputs). One progress line covers all stages; an internal
    check failing in any of them is reported as a FlowgenInternalError naming the graph
    (flowgen/errors.py)."""
    with _compiling(graph) as progress:
        return _compile_step(graph, args, kwargs, data_parallel, input_placements, progress)


@contextmanager
def _compiling(graph):
    """The progress line of one compile (its stages' names) and what surrounds every compile: the
    program cache's collector paused, internal checks reported as errors naming the graph."""
    with reporting(graph.name) as progress, program_cache.collector_paused(), \
            internal_checks(graph.name, lambda: progress.stage_name):
        yield progress


def _compile_step(graph, args: tuple, kwargs: dict, data_parallel, input_placements, progress):
    built = _build_program(graph, args, kwargs, data_parallel, input_placements, progress)
    return _compiled(graph, built, built.program, data_parallel, input_placements)


class _Built:
    """A traced, optimized and rendered step: what a CompiledGraph is made from."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _build_program(graph, args: tuple, kwargs: dict, data_parallel, input_placements, progress) -> _Built:
    """Trace, the passes and codegen: the step's IR and Program (no compiler runs yet)."""
    cls = type(graph).__name__
    inputs, rebuild_call = flatten_call(args, kwargs, graph.name)
    device = device_of(graph, inputs)
    zero = zero_settings(graph, data_parallel)
    pipeline = pipeline_of(graph, data_parallel, input_placements)
    placement = graph_placement(graph, input_placements, data_parallel, pipeline is not None)
    if data_parallel is not None:
        broadcast_state(graph)
    timings = {}
    start = time.perf_counter()
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start building graph.")
    progress.stage("trace")
    step, settings = trace_step(graph, inputs, rebuild_call, args, kwargs, device, data_parallel, zero, pipeline)
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end building graph.")
    timings["trace"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) building graph Done! Cost time: {timings['trace']:.2f}s.")

    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start compiling plan and init graph runtime.")
    start = time.perf_counter()
    progress.stage("passes")
    checkpointed = [path for path, options in graph._module_configs.items() if options.activation_checkpointing]
    passes = step_passes(settings, graph.config, checkpointed)
    split = ir_passes_start(passes)   # the IR passes, which the program cache may skip, follow the step's stages
    log = graph._log if graph._debug_level >= 1 else None
    # Structure and updates here (the stages' nodes are mostly typed by the Tracer that emits them);
    # types too after the IR passes, where a mistyped node a stage made fails as "the IR given".
    step, _ = run_passes(step, passes[:split], log=log, check_types=False)

    def ir_passes_and_codegen():
        """(optimized IR, Program): the IR passes, then kernels and memory plan."""
        optimized, _ = run_passes(step, passes[split:], log=log)
        if optimized.stage_program is not None:
            optimized.stage_program.check_transfer_order(optimized.ir)
        timings["passes"] = time.perf_counter() - start
        progress.stage("codegen")
        return _codegen(graph, optimized.ir, settings.device, timings)

    options = _program_cache_options(graph, settings.device, data_parallel, step.stage_program)
    if options is None:
        (ir, program), cache_status = ir_passes_and_codegen(), "off"
    else:
        (ir, program), cache_status = program_cache.cached(step.ir, options, ir_passes_and_codegen)
    if cache_status == "hit":
        timings["program cache"] = time.perf_counter() - start
    return _Built(step=step, settings=settings, ir=ir, program=program, timings=timings, cache_status=cache_status,
                  placement=placement, pipeline=pipeline)


def _compiled(graph, built: _Built, program, data_parallel, input_placements) -> CompiledGraph:
    """The CompiledGraph running `program` (built's, or one fitted from several builds)."""
    cls = type(graph).__name__
    graph._log(1, program.plan.describe())
    start = time.perf_counter()
    executor = Executor(program, make_backend_once(built.settings.device, program.source, data_parallel))
    built.timings["compile"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end compiling plan and init graph rumtime.")
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) compiling plan and init graph runtime Done! Cost time: "
                  f"{sum(t for k, t in built.timings.items() if k != 'trace'):.2f}s.")
    compiled = CompiledGraph(graph, built.step.with_ir(built.ir), built.settings, program, executor, built.timings)
    compiled.program_cache = built.cache_status
    compiled.runs_here = built.placement is None or holds(built.placement)
    compiled.output_placements = _output_placements(len(built.ir.outputs), input_placements, built.placement,
                                                    built.pipeline, built.step.stage_program)
    return compiled


def compile_dynamic_step(graph, args: tuple, kwargs: dict, uses: dict):
    """compile_step for a graph with dynamic dimensions (flowgen/dims.py): rendered with every
    Dim at its max and at the sample sizes, fitted into one Program whose kernels read the sizes
    at run time (codegen/dynamic.py). A training step too: its state and updates do not follow the
    batch, a mean's count does (a whole number, fitted like the integer sizes)."""
    inputs, rebuild_call = flatten_call(args, kwargs, graph.name)
    dims = list(uses)

    def at(sizes):
        """The call's inputs with each Dim's axes at `sizes` (zeros: tracing reads no values)."""
        shapes = shapes_at([t.shape for t in inputs], uses, dict(zip(dims, sizes)))
        return rebuild_call([t if tuple(t.shape) == shape else zeros(shape, dtype=t.dtype, device=t.device)
                             for t, shape in zip(inputs, shapes)])

    points = sample_points(dims)
    with _compiling(graph) as progress:
        base = _build_program(graph, *at([d.max for d in dims]), None, (), progress)
        with forms_chosen_at(base.program.graph):
            renderings = [(p, _build_at(graph, dims, p, at(p), progress)) for p in points]
        program = fit_programs(base.program, renderings, dims, uses, kernels_source)
        try:
            compiled = _compiled(graph, base, program, None, ())
        except CompileError as error:   # a fitted size where the compiler needs a constant (an array's)
            raise DynamicShapeError(f"{graph.name}: dynamic_shapes: the kernels fitted for "
                                    f"{', '.join(map(repr, dims))} do not compile: {error}") from error

    def render_at(sizes):
        """The step's Program with the Dims at `sizes` (flow.save renders a size of 1 with it)."""
        with _compiling(graph) as progress, forms_chosen_at(base.program.graph):
            return _build_at(graph, dims, sizes, at(sizes), progress)

    compiled.render_at = render_at
    return compiled


def _build_at(graph, dims, sizes, call, progress):
    """The Program of the step traced at `sizes` of the Dims; a step that does not trace at a size
    the Dims allow raises its error with the sizes named."""
    try:
        return _build_program(graph, *call, None, (), progress).program
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        at = ", ".join(f"{d.name}={s}" for d, s in zip(dims, sizes))
        raise type(exc)(f"{graph.name}: dynamic_shapes: the step does not trace at {at}, which "
                        f"{', '.join(map(repr, dims))} allows: {exc}") from exc


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


def _codegen(graph, ir, device, timings) -> tuple:
    """(IR with the measured conv tiles, Program): kernels and memory plan of the optimized IR."""
    start = time.perf_counter()
    ir = _with_measured_conv_tiles(graph, ir, device)
    program = build_program(ir, naive_memory=graph.config.naive_memory, target=device.type,
                            compress_memory=graph.config.compress_memory, allow_tf32=graph.config.tf32,
                            arch=cuda_arch(device))
    program.kernels_before_fusion = count_unfused_kernels(ir)
    timings["codegen"] = time.perf_counter() - start
    return ir, program


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
            "arch": cuda_arch(device)}
