"""Run an IR graph on the NumPy references — the executor every pass is checked against."""
from __future__ import annotations

import numpy as np

from flowgen.ops.registry import get_op, semantic_attrs


def run_nodes(nodes, env: dict) -> None:
    """Evaluate `nodes` in order, reading and writing `env` (Value -> ndarray)."""
    for node in nodes:
        if node.op == "fused":
            run_nodes(node.body, env)
            continue
        op = get_op(node.op)
        result = op.ref(*(env[v] for v in node.inputs), **semantic_attrs(node.attrs))
        results = result if len(node.outputs) > 1 else (result,)
        for v, r in zip(node.outputs, results):
            env[v] = np.asarray(r).astype(v.dtype.np_dtype, copy=False).reshape(v.shape)


def interpret(graph, inputs, state: dict):
    """Returns (outputs, updated state) for one step; `state` maps state name -> array."""
    env = dict(zip(graph.inputs, (np.asarray(x) for x in inputs)))
    for s in graph.state:
        env[s.value] = np.asarray(state[s.name])
    run_nodes(graph.nodes, env)
    outputs = [env[v] for v in graph.outputs]
    new_state = dict(state)
    for name, v in graph.updates:
        new_state[name] = env[v]
    return outputs, new_state
