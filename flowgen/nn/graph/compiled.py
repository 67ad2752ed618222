"""Trace + compile one input signature of an nn.Graph, and run it.

`compile_step` is the whole pipeline for one variant; `CompiledGraph.run` keeps
the eager tensors (parameters, buffers, optimizer slots) and the device copies
in sync: a tensor is uploaded when another variant or eager code changed it,
and read back lazily when eager code looks at it.
"""
from __future__ import annotations

import time

import numpy as np

from flowgen import random
from flowgen.codegen.program import build_program, count_unfused_kernels
from flowgen.device import as_device
from flowgen.ir.trace import TraceError, Tracer
from flowgen.nn import module as module_mod
from flowgen.nn.graph.report import meta_repr
from flowgen.ir.graph import NameGen
from flowgen.passes.autodiff import autodiff, next_value_index
from flowgen.passes.optimizer import GraphScaler, HostScalar, lower_optimizers, scaler_state_name
from flowgen.passes.pipeline import default_passes, run_passes
from flowgen.passes.random_streams import bind_random_streams
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

    # --------------------------------------------------------------- running
    def _upload_state(self) -> bool:
        """Copy changed state to the device; True if anything was copied."""
        changed = False
        for value, tensor in self.bindings:
            if getattr(tensor, "_graph_owner", None) is self and self.versions.get(id(tensor)) == tensor._version:
                continue  # the device copy is the newest
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
        for value, tensor in self.bindings:
            tensor._graph_owner = self
            self.versions[id(tensor)] = tensor._version
            tensor._sync_from_device = lambda t, v=value: self._download(t, v)

    def _download(self, tensor, value):
        tensor._data[...] = self.executor.read_value(value).reshape(tensor._data.shape)

    def run(self, args):
        from flowgen.tensor import Tensor

        for a in args:
            if a.device != self.device:
                raise RuntimeError(f"{self.graph_name}: an input is on {a.device} but the graph runs on {self.device}; "
                                   f"move inputs and modules to the same device")
        changed = self._upload_state()
        outputs = self.executor.run([a.numpy_view() for a in args], state_changed=changed)
        self._mark_device_newer()
        self._graph._after_step(skipped=self._read_back_scaler())
        tensors = [Tensor(o, dtype=v.dtype, device=self.device) for o, v in zip(outputs, self.ir.outputs)]
        return self.output_structure(tensors)


def _device_of(graph, args):
    devices = {a.device for a in args}
    for module in graph._modules.values():
        devices.update(p.device for p in module.parameters())
    if len(devices) > 1:
        raise RuntimeError(f"{graph.name}: inputs and parameters are on different devices "
                           f"({', '.join(sorted(map(str, devices)))}); move them with .to(device)")
    return devices.pop() if devices else as_device("cpu")


def _make_backend(device, source: str):
    from flowgen.runtime.executor import CpuBackend, CudaBackend

    if device.type == "cpu":
        return CpuBackend(source)
    from flowgen.runtime import cuda_driver

    if not cuda_driver.available():
        raise cuda_driver.NoCudaDevice("the graph's tensors are on 'cuda'")
    return CudaBackend(source)


def _module_hook(graph, tracer, paths: dict, io: dict):
    def hook(module, forward, args, kwargs):
        path = paths.get(id(module))
        if path is None:
            return forward(*args, **kwargs)
        tracer.scopes.append(path)
        graph._log(1, f"(MODULE:{path}:{type(module).__name__}())")
        inputs = [meta_repr(a, lazy=True) for a in args if hasattr(a, "is_lazy")]
        for k, m in enumerate(inputs):
            graph._log(1, f"(INPUT:_{path}-input_{k}:{m})")
        try:
            out = forward(*args, **kwargs)
        finally:
            tracer.scopes.pop()
        outs = out if isinstance(out, (tuple, list)) else [out]
        outputs = [meta_repr(o, lazy=True) for o in outs if hasattr(o, "is_lazy")]
        for k, m in enumerate(outputs):
            graph._log(1, f"(OUTPUT:_{path}-output_{k}:{m})")
        io[path] = {"inputs": inputs, "outputs": outputs}
        return out
    return hook


def _output_structure(result):
    """Flatten build()'s return value (tensors in nested tuples/lists/dicts); return the
    flat tensors and a function that rebuilds the structure from output tensors."""
    from flowgen.tensor import Tensor

    flat = []

    def walk(obj):
        if isinstance(obj, Tensor):
            flat.append(obj)
            index = len(flat) - 1
            return lambda ts: ts[index]
        if isinstance(obj, (tuple, list)):
            parts = [walk(o) for o in obj]
            kind = type(obj) if type(obj) in (tuple, list) else tuple
            return lambda ts: kind(p(ts) for p in parts)
        if isinstance(obj, dict):
            parts = {k: walk(v) for k, v in obj.items()}
            return lambda ts: {k: p(ts) for k, p in parts.items()}
        if obj is None:
            return lambda ts: None
        raise TraceError(f"build() must return tensors (possibly in tuples, lists or dicts) or None; "
                         f"it returned a {type(obj).__name__}")

    return flat, walk(result)


def _conv_tiles(graph, ir, device) -> dict:
    """Measured conv tile choices when the graph asks for the search (on a GPU only)."""
    if not graph.config.cudnn_conv_heuristic_search_algo or device.type != "cuda":
        return {}
    from flowgen.runtime import cuda_driver

    if not cuda_driver.available():
        return {}   # the backend reports the missing GPU
    from flowgen.runtime.autotune import tune_convs

    return tune_convs(ir, log=graph._log)


def _with_measured_conv_tiles(graph, ir, device):
    """The IR with the measured tiles as conv attributes (saved graphs and programs keep them)."""
    from flowgen.runtime.autotune import with_conv_tiles

    return with_conv_tiles(ir, _conv_tiles(graph, ir, device))


def _micro_batch(graph, lazy_args, j: int, steps: int) -> list:
    from flowgen import functional as F

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
    for tensor, _value in tracer.constants.values():
        if id(tensor) in optimized and tensor.requires_grad:
            raise TraceError(f"{graph.name}: build() used a parameter of shape {tuple(tensor.shape)} that the "
                             f"optimizer trains but that belongs to no module of this graph, so the graph "
                             f"would treat it as a constant; assign the module that owns it in __init__ "
                             f"(self.model = model)")
    root = tracer.backward_roots.pop()
    tracer.backward_roots.clear()
    ir, grads = autodiff(tracer.graph, root, wrt, device, loss_scale=scale)
    tracer.graph, tracer.new_name = ir, NameGen(start=next_value_index(ir))
    return grads


def compile_step(graph, args):
    """Trace, optimise, generate and build one variant; one progress line covers all stages."""
    with reporting(graph.name) as progress:
        return _compile_step(graph, args, progress)


def _compile_step(graph, args, progress):
    cls = type(graph).__name__
    device = _device_of(graph, args)
    timings = {}
    start = time.perf_counter()
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start building graph.")
    progress.stage("trace")
    tracer = Tracer(graph.name, device, log=graph._log if graph._debug_level >= 2 else None,
                    autocast=graph.config.amp)
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
    steps = graph.config.gradient_accumulation_steps
    grads = None
    previous_hook = module_mod.set_module_call_hook(_module_hook(graph, tracer, paths, io))
    try:
        with tracer, random.preserved_dropout_stream():
            lazy_args = [tracer.add_input(a, i) for i, a in enumerate(args)]
            for k, a in enumerate(args):
                graph._log(1, f"(INPUT:_{graph.name}-input_{k}:{meta_repr(a, lazy=False)})")
            micro_outputs = []
            for j in range(steps):
                result = graph.build(*(lazy_args if steps == 1 else _micro_batch(graph, lazy_args, j, steps)))
                flat, structure = _output_structure(result)
                micro_outputs.append(flat)
                if tracer.backward_roots:
                    # Differentiate this micro-batch now, so its activations die before the next one.
                    micro_grads = _differentiate(graph, tracer, wrt, device, scale)
                    grads = micro_grads if grads is None else {
                        n: (tracer.lazy(grads[n]) + tracer.lazy(g))._value for n, g in micro_grads.items()}
            if steps > 1:   # per-micro-batch outputs stacked along a new leading dim
                from flowgen import functional as F

                flat = [F.stack([m[i] for m in micro_outputs]) for i in range(len(micro_outputs[0]))]
            tracer.graph.outputs = [tracer.value_of(t) for t in flat]
    finally:
        module_mod.set_module_call_hook(previous_hook)
    io[""] = {"inputs": [meta_repr(a, lazy=False) for a in args],
              "outputs": [meta_repr(t, lazy=True) for t in flat]}
    object.__setattr__(graph, "_io", io)
    ir = tracer.graph
    bindings = [(tracer.state_of[id(t)].value, t) for t in tracer.state_tensors]
    timings["trace"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end building graph, {timings['trace']:.2f} s.")

    graph._log(0, f"(GRAPH:{graph.name}:{cls}) start compiling plan and init graph runtime.")
    start = time.perf_counter()
    progress.stage("passes")
    if grads is not None:
        # Gradients are averaged over micro-batches and the loss scale divided out.
        ir, host, slots = lower_optimizers(ir, grads, graph._optimizers, param_name, device, graph._counter,
                                           grad_unscale=1.0 / (static_scale * steps), scaler=scaler)
        state = ir.state_by_name()
        bindings += [(state[s.state_name].value, s.tensor) for s in slots]
        host_scalars += [(state[h.name].value, h) for h in host]
    ir, rng = bind_random_streams(ir)
    if rng is not None:
        host_scalars.append((ir.state_by_name()[rng.name].value, rng))
    checkpointed = [path for path, options in graph._module_configs.items() if options.activation_checkpointing]
    passes = default_passes(graph.config, checkpointed)
    ir, pass_times = run_passes(ir, passes, log=graph._log if graph._debug_level >= 1 else None)
    timings["passes"] = time.perf_counter() - start
    start = time.perf_counter()
    progress.stage("codegen")
    ir = _with_measured_conv_tiles(graph, ir, device)
    program = build_program(ir, naive_memory=graph.config.naive_memory, target=device.type)
    program.kernels_before_fusion = count_unfused_kernels(ir)
    timings["codegen"] = time.perf_counter() - start
    graph._log(1, program.plan.describe())
    start = time.perf_counter()
    executor_backend = _make_backend(device, program.source)
    from flowgen.runtime.executor import Executor

    executor = Executor(program, executor_backend)
    timings["compile"] = time.perf_counter() - start
    graph._log(0, f"(GRAPH:{graph.name}:{cls}) end compiling plan and init graph rumtime, "
                  f"{sum(timings.values()):.2f} s (" + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()) + ").")
    compiled = CompiledGraph(graph, ir, program, executor, device, bindings, host_scalars, structure, timings)
    compiled.scaler = scaler if grads is not None else None
    return compiled


def _static_scale(graph) -> float:
    """A StaticGradScaler's fixed scale (baked into the step), else 1."""
    from flowgen.amp import StaticGradScaler

    scaler = graph._grad_scaler
    return float(scaler.get_scale()) if isinstance(scaler, StaticGradScaler) else 1.0


def _add_grad_scaler(graph, tracer, host_scalars: list):
    """The graph's (dynamic) GradScaler as state: its scale seeds the backward pass; the
    optimizer pass adds the inf check, the skip and the growth/backoff rule (passes/optimizer.py)."""
    from flowgen import creation
    from flowgen.amp import StaticGradScaler

    scaler = graph._grad_scaler
    if scaler is None or not scaler.is_enabled() or isinstance(scaler, StaticGradScaler):
        return None
    values = {}
    for what, read in (("scale", lambda: scaler.get_scale()), ("growth_tracker", lambda: scaler._growth_tracker)):
        name = scaler_state_name(what)
        var = tracer.add_state(name, creation.tensor(float(read()), dtype="float32"), "hyper")
        tracer.state_tensors.pop()    # written by the host before each call, read back after it
        host_scalars.append((var.value, HostScalar(name, read)))
        values[what] = var.value
    return GraphScaler(values["scale"], values["growth_tracker"], scaler.get_growth_factor(),
                       scaler.get_backoff_factor(), scaler.get_growth_interval())
