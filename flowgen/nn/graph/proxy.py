"""`Proxy` / `ProxyModule`: how a module assigned to a Graph is wrapped (as OneFlow does).

Attribute reads go to the wrapped module (so `graph.model[0].weight` and
`graph.model.state_dict()` work); submodules come back wrapped too, by attribute, index or
key (Sequential, ModuleList, ModuleDict), so `graph.model.blocks["a"].to(GraphModule)` gives
the per-module graph options (`activation_checkpointing`, `set_stage`) of that exact module
path (`.config` too, OneFlow 0.8's spelling, unless the module has a `config` of its own), and
`.to(flow.nn.Module)` the module itself.
"""
from __future__ import annotations

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
            return self._configs.setdefault(self._path, GraphModule(*self._split_path()))
        if len(args) == 1 and args[0] is Module:
            return self._origin
        return self._origin.to(*args, **kwargs)

    def _split_path(self) -> tuple:
        prefix, _, name = self._path.rpartition(".")
        return (prefix + "." if prefix else ""), name


class ProxyModule(Proxy):
    def __init__(self, module, path: str, configs: dict):
        object.__setattr__(self, "_origin", module)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_configs", configs)   # path -> GraphModule, shared by the graph

    @property
    def __class__(self):
        """The wrapped module's class, so `isinstance(graph.model.fc, nn.Linear)` holds in build() as in
        OneFlow; `isinstance(graph.model, Proxy)` holds too (Python checks the real type first)."""
        return type(self._origin)

    def _wrap(self, value):
        """A child module comes back wrapped under its own name (`-1` of a list is its last index)."""
        for name, child in self._origin._modules.items():
            if child is value:
                return ProxyModule(value, f"{self._path}.{name}", self._configs)
        return value

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_origin", "_path", "_configs"):
            raise AttributeError(name)   # not yet set (copy/pickle build the object empty)
        if name == "config" and not hasattr(self._origin, "config"):
            # OneFlow 0.8's spelling of the graph options, which its pipeline tutorial uses:
            # graph.model.stage0.config.set_stage(0, P0); a module's own `config` attribute wins.
            return self.to(GraphModule)
        return self._wrap(getattr(self._origin, name))

    def __setattr__(self, name, value):
        setattr(self._origin, name, value)

    def __getitem__(self, index):
        return self._wrap(self._origin[index])

    def __len__(self):
        return len(self._origin)

    def __iter__(self):
        return (self._wrap(m) for m in self._origin)

    def __call__(self, *args, **kwargs):
        return self._origin(*args, **kwargs)

    def __repr__(self):
        return repr(self._origin)
