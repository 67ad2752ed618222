"""`flow.nn.Graph`: describe a step in `build()`, call it, get compiled CUDA C++.

The first call with a given input signature traces `build()` into IR, runs the
pass pipeline (autodiff and optimizer lowering for training graphs, clean-ups,
fusion), renders `kernels.cu`, plans memory, compiles for the device the
modules live on (NVRTC for cuda, g++ + emulator for cpu) and runs it. Later
calls with the same signature reuse that compiled variant.
"""
from __future__ import annotations

import collections
import inspect
import itertools
import warnings

from flowgen.nn.graph import lr_log
from flowgen.nn.graph.config import GraphConfig
from flowgen.nn.graph.io import abstract_inputs, flatten_call, signature
from flowgen.nn.graph.proxy import Proxy, ProxyModule
from flowgen.nn.graph.report import format_graph_repr, meta_repr
from flowgen.nn.graph.state_dict import graph_state_dict, load_graph_state_dict
from flowgen.creation import zeros
from flowgen.dims import normalize_spec, shapes_at, sizes_of
from flowgen.nn.graph.compiled import CompiledGraph, compile_dynamic_step, compile_step
from flowgen.nn.module import Module
from flowgen.distributed.data_parallel import data_parallel_of, split_inputs
from flowgen.optim.lr_scheduler import LRScheduler
from flowgen.optim.optimizer import Optimizer
from flowgen.passes.optimizer import group_lr_now
from flowgen.saved_graph import save_graph

def _as_int(step) -> int:
    return int(step.item() if hasattr(step, "item") else step)


_counters: dict = collections.defaultdict(itertools.count)

MAX_CACHED_VARIANTS = 8
# Exact input signatures remembered per dynamic graph (each maps to its variant's key).
MAX_KNOWN_SIZES = 256


class Graph:
    def __init__(self):
        cls = type(self).__name__
        object.__setattr__(self, "_name", f"{cls}_{next(_counters[cls])}")
        object.__setattr__(self, "config", GraphConfig())
        object.__setattr__(self, "_modules", collections.OrderedDict())
        object.__setattr__(self, "_module_configs", {})   # module path -> GraphModule options
        object.__setattr__(self, "_optimizers", [])
        object.__setattr__(self, "_grad_scaler", None)
        object.__setattr__(self, "_debug_level", -1)
        object.__setattr__(self, "_variants", collections.OrderedDict())
        object.__setattr__(self, "_last", None)
        object.__setattr__(self, "_dynamic_spec", (None, None, None))   # (config.dynamic, ranks, its uses)
        # A call's exact signature -> its dynamic variant's key (config.dynamic, {signature: key}):
        # a size seen before skips the checks and the abstract key (_variant_for).
        object.__setattr__(self, "_dynamic_keys", (None, collections.OrderedDict()))
        object.__setattr__(self, "_io", None)
        object.__setattr__(self, "_counter", {"calls": 0})
        object.__setattr__(self, "_zero_slots", {})   # state name -> ShardedSlot (ZeRO, passes/zero.py)

    # ---------------------------------------------------------------- set-up
    def __setattr__(self, name, value):
        if not hasattr(self, "_modules"):
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting attributes")
        if isinstance(value, Proxy):
            value = value.to(Module)   # another graph's module: wrap the module itself
        if isinstance(value, Module):
            self._modules[name] = value
            object.__setattr__(self, name, ProxyModule(value, name, self._module_configs))
            return
        if isinstance(value, Optimizer):   # flowgen's or a user-written one
            raise AttributeError(f"'{name}' is an optimizer: register it with self.add_optimizer({name}) "
                                 f"instead of assigning it as an attribute of the graph")
        object.__setattr__(self, name, value)

    def add_optimizer(self, optimizer, *, lr_sch=None):
        """Train with `optimizer` in every call (OneFlow's contract): the step clips the gradients of
        groups that set `clip_grad_max_norm`, updates the parameters and advances `lr_sch`. The graph
        advances its own copy of the schedule (call t uses the LR at epoch `lr_sch.last_epoch + t`) and
        never steps the `lr_sch` object; without `lr_sch`, each call uses the groups' current `lr`."""
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__}.add_optimizer: {type(optimizer).__name__} is not a "
                            f"flow.optim.Optimizer")
        if lr_sch is not None:
            if not isinstance(lr_sch, LRScheduler):
                raise TypeError(f"{type(self).__name__}.add_optimizer: lr_sch is a {type(lr_sch).__name__}, not a "
                                f"flow.optim.lr_scheduler scheduler")
            if lr_sch.optimizer is not optimizer:
                raise ValueError(f"{type(self).__name__}.add_optimizer: lr_sch {type(lr_sch).__name__} schedules "
                                 f"another optimizer than the {type(optimizer).__name__} it is added with")
            lr_sch.check_graph_replay()
        self._optimizers.append((optimizer, lr_sch))
        self.config.training = True

    def set_grad_scaler(self, grad_scaler=None):
        object.__setattr__(self, "_grad_scaler", grad_scaler)

    def build(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must override build(); see flow.nn.Graph's docstring")

    @staticmethod
    def trace(func):
        """`@flow.nn.Graph.trace` on a function: a graph whose build() calls it (OneFlow's quick way to
        run a function compiled; modules it calls are not registered, so their parameters are constants)."""
        if not inspect.isfunction(func):
            raise TypeError(f"nn.Graph.trace takes a function, got {type(func).__name__}")
        cls = type(f"{func.__name__}_graph", (Graph,), {"build": lambda self, *args, **kwargs: func(*args, **kwargs)})
        return cls()

    @property
    def name(self) -> str:
        return self._name

    @property
    def training(self) -> bool:
        return self.config.training

    def debug(self, v_level: int = 0, *, ranks=None, max_py_stack_depth: int = 2, only_user_py_stack=True):
        """Print what the next compile does: -1 nothing, 0 the stages with their times, 1 + each module
        (constructor arguments, INPUT/PARAMETER/BUFFER/OUTPUT lines, as OneFlow prints them) and each
        pass, 2 + each op and the IR after each pass, 3 + each op's source location.

        `ranks`: a graph runs in this one process, rank 0; a list without 0 (or -1, all ranks)
        prints nothing, as on OneFlow's rank 0. flowgen records one location per op (the innermost
        frame of user code), so `max_py_stack_depth` and `only_user_py_stack` other than their
        defaults warn that they cannot change it."""
        if not -1 <= int(v_level) <= 3:
            raise ValueError(f"debug: v_level must be in [-1, 3], got {v_level}")
        if max_py_stack_depth != 2 or not only_user_py_stack:
            warnings.warn("debug: flowgen records one source location per op (the innermost user frame); "
                          "max_py_stack_depth and only_user_py_stack cannot change it", UserWarning, stacklevel=2)
        rank_list = [0] if ranks is None else [ranks] if isinstance(ranks, int) else list(ranks)
        level = int(v_level) if (0 in rank_list or -1 in rank_list) else -1
        object.__setattr__(self, "_debug_level", level)

    def _log(self, level: int, text: str):
        if self._debug_level >= level:
            print(text, flush=True)

    # ------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        """Run build(*args, **kwargs) compiled. Tensors may sit in nested tuples, lists and dicts;
        None, bool, int, float and str values pass through (a new value compiles a new variant).
        Global tensors split along dim 0 make the call data parallel (distributed/data_parallel.py):
        the graph runs on this rank's parts."""
        variant, inputs = self._variant_for(args, kwargs)
        return variant.run(inputs)

    def _compile(self, *args, **kwargs):
        """OneFlow's `graph._compile(*args)`: trace and compile the variant for these inputs without
        running a step (parameters and optimizer state stay as they are); a later call with inputs of
        the same signature runs it. Compiling a signature already compiled does nothing."""
        self._variant_for(args, kwargs)

    @property
    def _is_compiled(self) -> bool:
        """OneFlow's flag: whether a call or `_compile` has compiled a variant yet."""
        return bool(self._variants)

    def _variant_for(self, args, kwargs):
        """The compiled variant for these inputs' signature (compiled now if new) and the flat inputs."""
        inputs, rebuild_call = flatten_call(args, kwargs, self._name)
        layouts = [a.sbp[0].kind if a.is_global else "local" for a in inputs]
        inputs, placements, split = split_inputs(self, inputs)
        args, kwargs = rebuild_call(inputs)
        exact = (signature((args, kwargs)), placements)
        spec, known = self._dynamic_keys
        if spec is not self.config.dynamic:   # declared again: the sizes seen before say nothing
            known = collections.OrderedDict()
            object.__setattr__(self, "_dynamic_keys", (self.config.dynamic, known))
        key = exact if self.config.dynamic is None else known.get(exact)
        variant = None if key is None else self._variants.get(key)
        if variant is None:
            uses = self._dynamic_uses(inputs, placements)
            key = exact if uses is None else (signature(rebuild_call(abstract_inputs(inputs, uses))), placements)
            if uses == {}:   # every Dim at 1: the exact variant
                uses = None
            if self.config.dynamic is not None:   # checked: these exact shapes map to this key from now on
                known[exact] = key
                if len(known) > MAX_KNOWN_SIZES:
                    known.popitem(last=False)
            variant = self._variants.get(key)
        if variant is None:
            if self._variants:
                self._log(0, f"(GRAPH:{self._name}) new input signature "
                             f"{[meta_repr(a, lazy=False) for a in inputs]}: tracing and compiling a new variant "
                             f"({len(self._variants) + 1} cached)")
            if uses is not None:
                variant = compile_dynamic_step(self, args, kwargs, uses)
            else:
                variant = compile_step(self, args, kwargs, data_parallel_of(self, split), placements)
            variant.input_layouts = layouts     # "split" | "broadcast" | "local" per input (flow.save reads it)
            # the call's structure and inputs, for flow.save(..., dynamic_shapes=) to trace it again
            variant.example = (rebuild_call, [(tuple(t.shape), t.dtype, t.device) for t in inputs])
            self._variants[key] = variant
            if len(self._variants) > MAX_CACHED_VARIANTS:
                self._variants.popitem(last=False)
        else:
            self._variants.move_to_end(key)
        object.__setattr__(self, "_last", variant)
        return variant, inputs

    def _dynamic_uses(self, inputs, placements):
        """{Dim: [DimUse]} of config.dynamic_shapes for these flat inputs, their sizes checked
        (flowgen/dims.py), less the Dims these inputs have at 1: a size of 1 gets variants of its
        own, since the compiler's special cases for it are not always shortcuts (a slice
        `x[1:2]` is one row from a batch of 2 up, none of a batch of 1). None without dynamic
        dimensions; {} when every Dim is at 1."""
        if self.config.dynamic is None:
            return None
        if any(p is not None for p in placements):
            raise NotImplementedError(f"{self._name}: dynamic_shapes with global (distributed) inputs is not "
                                      f"supported yet")
        ranks = tuple(len(t.shape) for t in inputs)
        spec, checked_ranks, uses = self._dynamic_spec
        if spec is not self.config.dynamic or checked_ranks != ranks:   # checked once per spec and ranks
            uses = normalize_spec(self.config.dynamic, len(inputs), ranks, self._name)
            object.__setattr__(self, "_dynamic_spec", (self.config.dynamic, ranks, uses))
        sizes = sizes_of(uses, [t.shape for t in inputs], self._name)
        return {dim: places for dim, places in uses.items() if sizes[dim] != 1}

    @property
    def compiled(self) -> CompiledGraph:
        if self._last is None:
            raise RuntimeError(f"{self._name} has not been called yet; call it once to compile it")
        return self._last

    # ----------------------------------------------------------- state dicts
    def state_dict(self) -> dict:
        """The graph's whole state in OneFlow's layout (flowgen/nn/graph/state_dict.py): each module's
        state_dict under its name, optimizer slots as "<parameter path>-<slot>" tensors
        ("linear.weight-momentum"), "System-Train-TrainStep", and under "System-..." keys what a
        bit-identical resume needs beyond that: optimizer groups and step counts, LR-scheduler state,
        skipped steps, and the random state (`flow.get_rng_state()`)."""
        return graph_state_dict(self)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load what `state_dict()` returned, or the flat layout of earlier flowgen versions. With
        strict=True, a key this graph does not have, or one of its keys missing, is an error naming it."""
        load_graph_state_dict(self, state_dict, strict)
        # Parameters, buffers and optimizer slots were loaded in place (each gets a new version,
        # uploaded before the next call), so compiled variants stay. A variant bound to a slot
        # the optimizer replaced (the checkpoint had none, or another shape) is dropped.
        live = {id(t) for t in self._state_tensors()}
        for key, variant in list(self._variants.items()):
            if any(id(tensor) not in live for _, tensor in variant.bindings):
                del self._variants[key]
        if self._last is not None and not any(v is self._last for v in self._variants.values()):
            object.__setattr__(self, "_last", None)

    def _state_tensors(self):
        """Every tensor a compiled variant may be bound to: parameters, buffers, optimizer slots."""
        for module in self._modules.values():
            yield from module.parameters()
            yield from (b for b in module.buffers() if b is not None)
        for opt, _ in self._optimizers:
            for slots in opt.state.values():
                yield from (v for v in slots.values() if hasattr(v, "_version"))

    def _flowgen_save(self, path, dynamic_shapes=None):
        """`flow.save(graph, path)`: the compiled IR, state and signature for deployment (flowgen/saved_graph.py).
        A data-parallel graph is saved by every rank together (rank 0 writes; see saved_graph.py).
        `dynamic_shapes` (as graph.config.dynamic_shapes, torch.export's spec): the last call's step
        compiled with those dynamic dimensions is saved; the graph's own config is left as it was."""
        if self._last is not None and self._last.pipeline is not None:
            raise NotImplementedError(f"flow.save({self._name}, ...): the graph is a pipeline (set_stage): each rank "
                                      f"runs one stage; standalone programs run on one process only, so save the "
                                      f"graph of a one-process run, or save graph.state_dict() instead")
        if dynamic_shapes is None:
            save_graph(self, path)
            return
        if self._last is None:
            raise RuntimeError(f"flow.save: {self._name} has not been called yet; call it once with example inputs, "
                               f"then save it with dynamic_shapes")
        rebuild_call, examples = self._last.example
        uses = normalize_spec(dynamic_shapes, len(examples), [len(shape) for shape, _, _ in examples], self._name)
        shapes = shapes_at([shape for shape, _, _ in examples], uses, {dim: dim.max for dim in uses})
        inputs = [zeros(shape, dtype=dtype, device=device)   # tracing reads no values
                  for shape, (_, dtype, device) in zip(shapes, examples)]
        before = self.config.dynamic
        self.config.dynamic_shapes(dynamic_shapes)
        try:
            self._variant_for(*rebuild_call(inputs))
            save_graph(self, path)
        finally:
            self.config.dynamic = before

    def _after_step(self, skipped: bool = False):
        """Host bookkeeping after a step: counters and the optimizers' step counts (`counts_steps`). A
        step a GradScaler skipped (inf/NaN gradients) does not count for Adam's bias corrections."""
        if self._optimizers and self.config.training and lr_log.enabled():
            optimizer, scheduler = self._optimizers[0]
            lr = group_lr_now(optimizer.param_groups[0], 0, scheduler, self._counter)
            lr_log.record(self._counter["calls"], float(lr), first=self._counter["calls"] == 0)
        self._counter["calls"] += 1
        if skipped:
            self._counter["skipped"] = self._counter.get("skipped", 0) + 1
        if not self.config.training:
            return
        for opt, _sch in self._optimizers:   # the graph advances its schedule itself (add_optimizer)
            if opt.counts_steps and not skipped:
                for group in opt.param_groups:
                    for p in group["params"]:
                        st = opt.state.setdefault(p, {})
                        st["step"] = _as_int(st.get("step", 0)) + 1

    def __repr__(self) -> str:
        return format_graph_repr(self)
