"""`flow.nn.Graph`: describe a step in `build()`, call it, get compiled CUDA C++.

The first call with a given input signature traces `build()` into IR, runs the
pass pipeline (autodiff and optimizer lowering for training graphs, clean-ups,
fusion), renders `kernels.cu`, plans memory, compiles for the device the
modules live on (NVRTC for cuda, g++ + emulator for cpu) and runs it. Later
calls with the same signature reuse that compiled variant.
"""
from __future__ import annotations

import collections
import itertools
from flowgen.nn.graph.config import GraphConfig
from flowgen.nn.graph.proxy import ProxyModule
from flowgen.nn.graph.report import format_graph_repr, meta_repr
from flowgen.nn.graph.compiled import CompiledGraph, compile_step

def _as_int(step) -> int:
    return int(step.item() if hasattr(step, "item") else step)


_counters: dict = collections.defaultdict(itertools.count)

MAX_CACHED_VARIANTS = 8


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
        object.__setattr__(self, "_io", None)
        object.__setattr__(self, "_counter", {"calls": 0})

    # ---------------------------------------------------------------- set-up
    def __setattr__(self, name, value):
        from flowgen.nn.module import Module

        if not hasattr(self, "_modules"):
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting attributes")
        if isinstance(value, Module):
            self._modules[name] = value
            object.__setattr__(self, name, ProxyModule(value, name, self._module_configs))
            return
        if type(value).__module__.startswith("flowgen.optim") and hasattr(value, "param_groups"):
            raise AttributeError(f"'{name}' is an optimizer: register it with self.add_optimizer({name}) "
                                 f"instead of assigning it as an attribute of the graph")
        object.__setattr__(self, name, value)

    def add_optimizer(self, optimizer, *, lr_sch=None):
        self._optimizers.append((optimizer, lr_sch))
        self.config.training = True

    def set_grad_scaler(self, grad_scaler=None):
        object.__setattr__(self, "_grad_scaler", grad_scaler)

    def build(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must override build(); see flow.nn.Graph's docstring")

    @property
    def name(self) -> str:
        return self._name

    @property
    def training(self) -> bool:
        return self.config.training

    def debug(self, v_level: int = 0, *, ranks=None, max_py_stack_depth: int = 2, only_user_py_stack=True):
        """Print build/compile stages: 0 stages, 1 + modules, 2 + ops and IR per pass, 3 + locations."""
        object.__setattr__(self, "_debug_level", int(v_level))

    def _log(self, level: int, text: str):
        if self._debug_level >= level:
            print(text, flush=True)

    # ------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        from flowgen.tensor import Tensor

        if kwargs:
            raise TypeError(f"{self._name}: keyword arguments to a graph call are not supported "
                            f"({', '.join(kwargs)}); pass tensors positionally")
        for i, a in enumerate(args):
            if not isinstance(a, Tensor):
                raise TypeError(f"{self._name}: argument {i} of build() is a {type(a).__name__}, but graph inputs "
                                f"must be flowgen tensors (wrap it with flow.tensor(...) or make it an attribute)")
        key = tuple((tuple(a.shape), a.dtype, a.device) for a in args)
        variant = self._variants.get(key)
        if variant is None:
            if self._variants:
                self._log(0, f"(GRAPH:{self._name}) new input signature "
                             f"{[meta_repr(a, lazy=False) for a in args]}: tracing and compiling a new variant "
                             f"({len(self._variants) + 1} cached)")
            variant = compile_step(self, args)
            self._variants[key] = variant
            if len(self._variants) > MAX_CACHED_VARIANTS:
                self._variants.popitem(last=False)
        else:
            self._variants.move_to_end(key)
        object.__setattr__(self, "_last", variant)
        return variant.run(args)

    @property
    def compiled(self) -> CompiledGraph:
        if self._last is None:
            raise RuntimeError(f"{self._name} has not been called yet; call it once to compile it")
        return self._last

    # ----------------------------------------------------------- state dicts
    def state_dict(self) -> dict:
        """Model parameters and buffers, optimizer and LR-scheduler state, and the step counter."""
        result = {}
        for name, module in self._modules.items():
            for k, v in module.state_dict().items():
                result[f"{name}.{k}"] = v
        for i, (opt, sch) in enumerate(self._optimizers):
            result[f"_optimizer{i}"] = opt.state_dict()
            if sch is not None:
                result[f"_lr_scheduler{i}"] = sch.state_dict()
        result["_step"] = self._counter["calls"]
        return result

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        for name, module in self._modules.items():
            prefix = f"{name}."
            module.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)},
                                   strict=strict)
        for i, (opt, sch) in enumerate(self._optimizers):
            if f"_optimizer{i}" in state_dict:
                opt.load_state_dict(state_dict[f"_optimizer{i}"])
            if sch is not None and f"_lr_scheduler{i}" in state_dict:
                sch.load_state_dict(state_dict[f"_lr_scheduler{i}"])
        self._counter["calls"] = int(state_dict.get("_step", self._counter["calls"]))
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

    def _flowgen_save(self, path):
        """`flow.save(graph, path)`: the compiled IR, state and signature for deployment (flowgen/saved_graph.py)."""
        from flowgen.saved_graph import save_graph

        save_graph(self, path)

    def _after_step(self, skipped: bool = False):
        """Host bookkeeping after a step: counters, Adam step counts, LR schedules. A step a
        GradScaler skipped (inf/NaN gradients) does not count for Adam's bias corrections."""
        self._counter["calls"] += 1
        if skipped:
            self._counter["skipped"] = self._counter.get("skipped", 0) + 1
        if not self.config.training:
            return
        for opt, sch in self._optimizers:
            if type(opt).__name__ in ("Adam", "AdamW") and not skipped:
                for group in opt.param_groups:
                    for p in group["params"]:
                        st = opt.state.setdefault(p, {})
                        st["step"] = _as_int(st.get("step", 0)) + 1
            if sch is not None:
                sch.step()

    def __repr__(self) -> str:
        return format_graph_repr(self)
