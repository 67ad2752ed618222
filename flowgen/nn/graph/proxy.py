"""`Proxy` / `ProxyModule`: how a module assigned to a Graph is wrapped (as OneFlow does).

Attribute reads go to the wrapped module (so `graph.model[0].weight` and
`graph.model.state_dict()` work); submodules come back wrapped too, by attribute, index or
key (Sequential, ModuleList, ModuleDict), so `graph.model.blocks["a"].to(GraphModule)` gives
the per-module graph options (`activation_checkpointing`, `set_stage`) of that exact module
path (`.config` too, OneFlow 0.8's spelling, unless the module has a `config` of its own), and
`.to(flow.nn.Module)` the module itself. Inside build() the same holds from within a module: its
forward runs on its proxy (`ProxyModule.__call__`), so a submodule seen from a forward is a proxy
too, all the way down.
"""
from __future__ import annotations

import types

from flowgen.distributed import env
from flowgen.nn.graph.config import warn_single_device
from flowgen.nn.module import Module


class GraphModule:
    """The graph's view of one module: its name in the graph and its options."""

    def __init__(self, name_prefix: str, name: str):
        self._name_prefix = name_prefix
        self._name = name
        self._stage_id = None
        self._stage_placement = None
        self.activation_checkpointing = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def name_prefix(self) -> str:
        return self._name_prefix

    @property
    def type(self) -> str:
        return "MODULE"

    @property
    def stage_id(self):
        return self._stage_id

    @property
    def stage_placement(self):
        return self._stage_placement

    def set_stage(self, stage_id: int = None, placement=None):
        """Pipeline stage of this module, run on `placement`'s one rank (distributed/pipeline.py).
        A process started alone has no pipeline: it warns and only records it."""
        if env.get_world_size() == 1:
            warn_single_device("set_stage")
        self._stage_id = stage_id
        self._stage_placement = placement


class Proxy:
    """What `graph.<attribute>` holds for a module: `.to(GraphModule)` its graph options,
    `.to(flow.nn.Module)` the original."""

    def to(self, *args, **kwargs):
        if len(args) == 1 and args[0] is GraphModule:
            return self._proxy_configs.setdefault(self._proxy_path, GraphModule(*self._proxy_split_path()))
        if len(args) == 1 and args[0] is Module:
            return self._proxy_origin
        return self._proxy_origin.to(*args, **kwargs)

    def _proxy_split_path(self) -> tuple:
        prefix, _, name = self._proxy_path.rpartition(".")
        return (prefix + "." if prefix else ""), name


class ProxyModule(Proxy):
    """A module as the graph sees it. Calling it runs the module (its hooks, the graph's module scope)
    with `forward` bound to the proxy, as OneFlow does: inside forward, and inside the methods the
    module's own class defines (rebound to the proxy too), `self` is this proxy, so `self.layer` is the
    submodule's proxy, `self.to(nn.graph.GraphModule)` the module's graph options and `isinstance(self,
    nn.graph.Proxy)` holds. flowgen's own methods (`parameters()`, `state_dict()`, a layer's helpers)
    run on the module itself. The proxy's own attributes are named `_proxy_*`, out of a module's way."""

    def __init__(self, module, path: str, configs: dict):
        object.__setattr__(self, "_proxy_origin", module)
        object.__setattr__(self, "_proxy_path", path)
        object.__setattr__(self, "_proxy_configs", configs)   # path -> GraphModule, shared by the graph
        object.__setattr__(self, "_proxy_children", {})       # child name -> its ProxyModule (stable identity)

    @property
    def __class__(self):
        """The wrapped module's class, so `isinstance(graph.model.fc, nn.Linear)` holds in build() as in
        OneFlow; `isinstance(graph.model, Proxy)` holds too (Python checks the real type first)."""
        return type(self._proxy_origin)

    def _proxy_wrap(self, value):
        """A child module comes back wrapped under its own name (`-1` of a list is its last index), the
        same proxy every time; a method the module's class defines comes back bound to the proxy."""
        origin = self._proxy_origin
        if isinstance(value, Module):
            for name, child in origin._modules.items():
                if child is value:
                    cached = self._proxy_children.get(name)
                    if cached is None or cached._proxy_origin is not value:
                        cached = ProxyModule(value, f"{self._proxy_path}.{name}", self._proxy_configs)
                        self._proxy_children[name] = cached
                    return cached
            return value
        if isinstance(value, types.MethodType) and value.__self__ is origin and _user_defined(value.__func__):
            return types.MethodType(value.__func__, self)
        return value

    def __getattr__(self, name):
        if name.startswith("__") or name.startswith("_proxy_"):
            raise AttributeError(name)   # not yet set (copy/pickle build the object empty)
        if name == "config" and not hasattr(self._proxy_origin, "config"):
            # OneFlow 0.8's spelling of the graph options, which its pipeline tutorial uses:
            # graph.model.stage0.config.set_stage(0, P0); a module's own `config` attribute wins.
            return self.to(GraphModule)
        return self._proxy_wrap(getattr(self._proxy_origin, name))

    def __setattr__(self, name, value):
        setattr(self._proxy_origin, name, value)

    def __delattr__(self, name):
        delattr(self._proxy_origin, name)

    def __getitem__(self, index):
        return self._proxy_wrap(self._proxy_origin[index])

    def __len__(self):
        return len(self._proxy_origin)

    def __bool__(self):
        return bool(self._proxy_origin)   # `if self.downsample:` in a forward: a module without len() is true

    def __iter__(self):
        return (self._proxy_wrap(m) for m in self._proxy_origin)

    def __call__(self, *args, **kwargs):
        origin = self._proxy_origin
        forward = origin.forward
        if isinstance(forward, types.MethodType) and forward.__self__ is origin:
            forward = types.MethodType(forward.__func__, self)   # flowgen's layers too: every forward sees its proxy
        return origin._call_forward(forward, args, kwargs)

    def __repr__(self):
        return repr(self._proxy_origin)


def _user_defined(function) -> bool:
    """Whether `function` is a user's code rather than flowgen's (nn.Module's API, a layer's helpers)."""
    return not getattr(function, "__module__", "").startswith("flowgen.")
