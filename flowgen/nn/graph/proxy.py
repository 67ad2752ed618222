"""`ProxyModule`: how a module assigned to a Graph is wrapped (as OneFlow does).

Attribute reads go to the wrapped module (so `graph.model[0].weight` and
`graph.model.state_dict()` work); submodules come back wrapped too, so
`graph.model.features[3].to(GraphModule)` gives the per-module graph options
(`set_stage`, `activation_checkpointing`) of that exact module path.
"""
from __future__ import annotations


class GraphModule:
    def __init__(self, name: str):
        self.name = name
        self.stage_id = None
        self.placement = None
        self.activation_checkpointing = False

    def set_stage(self, stage_id: int, placement=None):
        self.stage_id = stage_id
        self.placement = placement


class ProxyModule:
    def __init__(self, module, name: str, configs: dict):
        object.__setattr__(self, "_origin", module)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_configs", configs)   # path -> GraphModule, shared by the graph

    def _wrap(self, value, key):
        from flowgen.nn.module import Module

        if isinstance(value, Module):
            return ProxyModule(value, f"{self._name}.{key}", self._configs)
        return value

    def to(self, kind):
        if kind is GraphModule:
            return self._configs.setdefault(self._name, GraphModule(self._name))
        return self._origin.to(kind)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_origin", "_name", "_configs"):
            raise AttributeError(name)   # not yet set (copy/pickle build the object empty)
        return self._wrap(getattr(self._origin, name), name)

    def __setattr__(self, name, value):
        setattr(self._origin, name, value)

    def __getitem__(self, index):
        item = self._origin[index]
        return self._wrap(item, index) if isinstance(index, int) else item

    def __len__(self):
        return len(self._origin)

    def __iter__(self):
        return (self._wrap(m, i) for i, m in enumerate(self._origin))

    def __call__(self, *args, **kwargs):
        return self._origin(*args, **kwargs)

    def __repr__(self):
        return repr(self._origin)
