"""`ProxyModule`: how a module assigned to a Graph is wrapped (as OneFlow does).

Attribute reads go to the wrapped module (so `graph.model[0].weight` and
`graph.model.state_dict()` work); `.to(GraphModule)` gives the per-module graph
options (`set_stage`, `activation_checkpointing`).
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
    def __init__(self, module, name: str, graph):
        object.__setattr__(self, "_origin", module)
        object.__setattr__(self, "_graph_module", GraphModule(name))

    def to(self, kind):
        if kind is GraphModule:
            return self._graph_module
        return self._origin.to(kind)

    def __getattr__(self, name):
        return getattr(self._origin, name)

    def __setattr__(self, name, value):
        setattr(self._origin, name, value)

    def __getitem__(self, index):
        return self._origin[index]

    def __call__(self, *args, **kwargs):
        return self._origin(*args, **kwargs)

    def __repr__(self):
        return repr(self._origin)
