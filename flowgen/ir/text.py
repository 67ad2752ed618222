"""Text form of the IR: one line per node, diffable in tests.

    graph LinearTrainGraph_0(%input_0: f32[20,3], %input_1: f32[20])
      state %model.0.weight: f32[1,3] param
      %t0: f32[3,1] = permute(%model.0.weight) {dims=(1, 0)}        # model.0
      ...
      return %t7
      update %model.0.weight <- %t12
"""
from __future__ import annotations

import numpy as np


def format_attr(value) -> str:
    if isinstance(value, np.ndarray):
        if value.size <= 4:
            return np.array2string(value, separator=", ")
        return f"<{value.dtype}{list(value.shape)}>"
    if isinstance(value, list) and value and hasattr(value[0], "op"):
        return f"<{len(value)} nodes>"
    return repr(value)


def format_node(node, indent: str = "  ") -> list:
    outs = ", ".join(f"%{v.name}: {v.type_str}" for v in node.outputs)
    args = ", ".join(f"%{v.name}" for v in node.inputs)
    attrs = {k: v for k, v in node.attrs.items() if k != "body"}
    attr_text = " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in sorted(attrs.items())) + "}" if attrs else ""
    line = f"{indent}{outs} = {node.op}({args}){attr_text}"
    if node.scope:
        line = f"{line:<72}  # {node.scope}"
    lines = [line]
    for inner in node.body:
        lines.extend(format_node(inner, indent + "    | "))
    return lines


def format_graph(graph) -> str:
    params = ", ".join(f"%{v.name}: {v.type_str}" for v in graph.inputs)
    lines = [f"graph {graph.name}({params})"]
    for s in graph.state:
        lines.append(f"  state %{s.value.name}: {s.value.type_str} {s.kind}")
    for node in graph.nodes:
        lines.extend(format_node(node))
    lines.append("  return " + ", ".join(f"%{v.name}" for v in graph.outputs))
    for name, v in graph.updates:
        lines.append(f"  update %{name} <- %{v.name}")
    return "\n".join(lines)
