"""Trace `graph.build(...)` into a `Step` (passes/step.py) and the `StepSettings` its stages read.

The tracer records build()'s ops on lazy tensors (ir/trace.py), the graph's parameters and
buffers as state, and each micro-batch of gradient accumulation in turn. A `loss.backward()` is
recorded for the autodiff pass (passes/step_stages.py), which differentiates it where its
micro-batch ends, unless build() reads the gradients (gradient clipping): then the backward is
appended right there, and in a data-parallel graph the gradients are reduced over the ranks
there too, so build() clips the global-batch gradients.
"""
from __future__ import annotations

import warnings

from flowgen import creation
from flowgen import functional as F
from flowgen import random
from flowgen.amp import StaticGradScaler
from flowgen.device import as_device
from flowgen.distributed import env
from flowgen.distributed.collectives import world
from flowgen.distributed.data_parallel import gradient_reduction
from flowgen.distributed.global_tensor import graph_storage
from flowgen.ir.graph import NameGen
from flowgen.ir.trace import TraceError, Tracer
from flowgen.nn import module as module_mod
from flowgen.nn.graph.io import flatten, non_tensor_arguments
from flowgen.nn.graph.report import io_lines, module_header, state_lines
from flowgen.passes.autodiff import next_value_index
from flowgen.passes.gradient_allreduce import divide_ratio_loss_by_global_count, reduce_traced_gradients
from flowgen.passes.optimizer import GraphScaler, HostScalar, scaler_state_name
from flowgen.passes.step import Backward, Step, StepSettings, ZeroSettings
from flowgen.passes.step_stages import backward_of, on_some_ranks
from flowgen.passes.zero import reduce_scatter_traced_gradients


def trace_step(graph, inputs: list, rebuild_call, args: tuple, kwargs: dict, device, data_parallel, zero,
               pipeline) -> tuple:
    """(Step, StepSettings) of build() called on the flat `inputs` (`rebuild_call` puts them back
    into build()'s arguments `args`, `kwargs`); `device` None: the device of what build() makes."""
    cls = type(graph).__name__
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
    grads, backward = None, []
    reduced_in_build = False   # data parallel: build() read the gradients, so they were all-reduced there

    def pending_roots(in_build: bool) -> tuple:
        """The roots of the backward() calls not yet differentiated (checked, and for a data-parallel
        ratio loss made the rank's share of the global-batch loss); the tracer forgets them."""
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
        _check_trained_parameters(graph, tracer)
        roots = tuple(tracer.backward_roots)
        tracer.backward_roots.clear()
        return roots

    def differentiate(in_build: bool) -> dict:
        """The tracer's hook for build() reading the gradients: the backward appended now."""
        nonlocal reduced_in_build
        roots = pending_roots(in_build)
        tracer.graph, grads = backward_of(tracer.graph, roots, wrt, tracer.device or as_device("cpu"), scale,
                                          tracer.new_name.counter)
        tracer.new_name = NameGen(start=next_value_index(tracer.graph))
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
                if tracer.backward_roots and tracer.grads is None:   # the autodiff pass differentiates it here
                    backward.append(Backward(pending_roots(False), len(tracer.graph.nodes)))
                micro_grads = tracer.take_step_gradients()   # those build() read (and a backward() after that)
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
    bindings = tuple((tracer.state_of[id(t)].value, graph_storage(t, tracer.state_of[id(t)].name))
                     for t in tracer.state_tensors)
    placed = frozenset(tracer.state_of[id(t)].name for t in tracer.state_tensors if on_some_ranks(t))
    step = Step(tracer.graph, structure, bindings=bindings, host_scalars=tuple(host_scalars), placed=placed,
                backward=tuple(backward), micro_ends=tuple(micro_ends), grads=grads,
                gradients_reduced=reduced_in_build, losses=tuple(tracer.losses),
                gradient_pieces=dict(tracer.gradient_pieces))
    settings = StepSettings(graph.name, device, tuple(wrt), scale, graph._optimizers, param_name, graph._counter,
                            grad_unscale=1.0 / (static_scale * steps), scaler=scaler, data_parallel=data_parallel,
                            zero=zero, zero_store=graph._zero_slots, pipeline=pipeline)
    return step, settings


def device_of(graph, args):
    """The device of the graph's inputs and parameters; None when it has neither (the tracer then
    takes the device of the tensors build() makes)."""
    devices = {a.device for a in args}
    for module in graph._modules.values():
        devices.update(p.device for p in module.parameters())
    if len(devices) > 1:
        raise RuntimeError(f"{graph.name}: inputs and parameters are on different devices "
                           f"({', '.join(sorted(map(str, devices)))}); move them with .to(device)")
    return devices.pop() if devices else None


def _check_trained_parameters(graph, tracer) -> None:
    """A backward() needs an optimizer, and the parameters it trains inside the graph's modules."""
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


def _micro_batch(graph, lazy_args, j: int, steps: int) -> list:
    out = []
    for k, a in enumerate(lazy_args):
        if not a.shape or a.shape[0] % steps:
            raise TraceError(f"{graph.name}: gradient accumulation over {steps} steps splits every input along "
                             f"dim 0, but input {k} has shape {tuple(a.shape)}")
        size = a.shape[0] // steps
        out.append(F.narrow(a, 0, j * size, size))
    return out


def zero_settings(graph, data_parallel):
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
