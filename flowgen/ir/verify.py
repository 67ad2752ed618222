"""The IR verifier: structural checks run after every pass in tests and debug mode."""
from __future__ import annotations

from flowgen.ops.registry import TensorMeta, get_op, semantic_attrs


class IRError(AssertionError):
    pass


def _check_nodes(nodes, defined: set, where: str, check_types: bool) -> None:
    for node in nodes:
        for v in node.inputs:
            if v not in defined:
                raise IRError(f"{where}: {node.op} ({node.scope or 'graph'}) reads %{v.name} before it is defined")
        if node.op == "fused":
            inner = set(defined)
            _check_nodes(node.body, inner, f"{where}/fused", check_types)
            missing = [v for v in node.outputs if v not in inner]
            if missing:
                raise IRError(f"{where}: fused node outputs {missing} are not produced by its body")
        elif check_types:
            metas = get_op(node.op).infer(*(TensorMeta(v.shape, v.dtype) for v in node.inputs),
                                          **semantic_attrs(node.attrs))
            metas = metas if isinstance(metas, tuple) else (metas,)
            for v, m in zip(node.outputs, metas):
                if tuple(v.shape) != tuple(m.shape) or v.dtype != m.dtype:
                    raise IRError(f"{where}: %{v.name} of {node.op} is typed {v.type_str} but the op infers {m}")
        for v in node.outputs:
            if v in defined:
                raise IRError(f"{where}: %{v.name} is defined twice")
            defined.add(v)


def verify(graph, check_types: bool = True) -> None:
    defined = set(graph.inputs) | {s.value for s in graph.state}
    names = [v.name for v in defined]
    if len(names) != len(set(names)):
        raise IRError(f"{graph.name}: duplicate input/state names")
    _check_nodes(graph.nodes, defined, graph.name, check_types)
    for v in graph.outputs:
        if v not in defined:
            raise IRError(f"{graph.name}: output %{v.name} is never defined")
    state = graph.state_by_name()
    for name, v in graph.updates:
        if name not in state:
            raise IRError(f"{graph.name}: update of unknown state {name!r}")
        target = state[name].value
        if v not in defined or tuple(v.shape) != tuple(target.shape) or v.dtype != target.dtype:
            raise IRError(f"{graph.name}: update {name} <- %{v.name} ({v.type_str}) does not match {target.type_str}")
