"""Clean-up passes: dead-code elimination, common-subexpression elimination, folding, composing
permutes."""
from __future__ import annotations

import numpy as np

from flowgen.ops.registry import REGISTRY, get_op


def impure(op_name: str) -> bool:
    """Ops whose result must not be shared or precomputed: they draw random numbers per call, or
    act beyond their result (a pipeline's send and recv)."""
    op = REGISTRY.get(op_name)   # None for "fused"
    return op is not None and (op.extra["random"] or op.extra["side_effect"])


def dce(graph):
    """Drop nodes whose outputs nobody needs."""
    needed = set(graph.live_out())
    kept = []
    for node in reversed(graph.nodes):
        if any(v in needed for v in node.outputs):
            kept.append(node)
            needed.update(node.inputs)
    return graph.copy_with(nodes=list(reversed(kept)))


def _attr_key(value):
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _attr_key(v)) for k, v in value.items()))
    return (type(value).__name__, repr(value))


def _reading(node, replace: dict):
    """`node` reading, for each input `replace` maps, the value it maps to."""
    inputs = [replace.get(v, v) for v in node.inputs]
    return node if inputs == node.inputs else type(node)(node.op, inputs, node.outputs, node.attrs, node.scope,
                                                         node.loc)


def cse(graph):
    """Merge nodes that compute the same op on the same inputs with the same attributes."""
    replace: dict = {}
    seen: dict = {}
    nodes = []
    for node in graph.nodes:
        node = _reading(node, replace)
        key = None
        if not impure(node.op):
            key = (node.op, tuple(id(v) for v in node.inputs), _attr_key(node.attrs))
        if key is not None and key in seen:
            for old, new in zip(node.outputs, seen[key].outputs):
                replace[old] = new
            continue
        if key is not None:
            seen[key] = node
        nodes.append(node)
    outputs = [replace.get(v, v) for v in graph.outputs]
    updates = [(n, replace.get(v, v)) for n, v in graph.updates]
    return graph.copy_with(nodes=nodes, outputs=outputs, updates=updates)


def fold_constants(graph):
    """Evaluate nodes whose inputs are all constants.

    Only when the result is no bigger than its largest input: folding a broadcast
    (ones expanded to the batch) would turn a literal the kernels inline into an
    array in memory.
    """
    producers = graph.producers()
    nodes = []
    for node in graph.nodes:
        if (node.op != "constant" and not impure(node.op) and node.inputs
                and all(producers.get(v) is not None and producers[v].op == "constant" for v in node.inputs)
                and len(node.outputs) == 1
                and node.output.numel <= max([1] + [v.numel for v in node.inputs])):
            value = get_op(node.op).ref(*(producers[v].attrs["value"] for v in node.inputs), **node.attrs)
            value = np.asarray(value).astype(node.output.dtype.np_dtype).reshape(node.output.shape)
            node = type(node)("constant", [], node.outputs, {"value": value}, node.scope, node.loc)
            producers[node.output] = node
        nodes.append(node)
    return graph.copy_with(nodes=nodes)


def compose_permutes(graph):
    """A permute of a permute reads the first one's input: permute(permute(x, p), q) is
    permute(x, (p[q[0]], p[q[1]], ...)), and x itself where that is the identity. A Linear's weight
    transposed for the forward GEMM and transposed back for its input gradient's GEMM then leaves one
    transpose, read in place by the forward GEMM (passes/fusion.py), instead of a copy kernel every
    step. A result the step returns or writes to state stays a node of its own (so no output or
    update is renamed)."""
    live_out = set(graph.live_out())
    producers: dict = {}
    replace: dict = {}
    nodes = []
    for node in graph.nodes:
        node = _reading(node, replace)
        inner = producers.get(node.inputs[0]) if node.op == "permute" else None
        if inner is not None and inner.op == "permute":
            dims = tuple(inner.attrs["dims"][d] for d in node.attrs["dims"])
            if dims == tuple(range(len(dims))) and node.output not in live_out:
                replace[node.output] = inner.inputs[0]
                continue
            node = type(node)("permute", [inner.inputs[0]], node.outputs, {**node.attrs, "dims": dims},
                              node.scope, node.loc)
        for v in node.outputs:
            producers[v] = node
        nodes.append(node)
    return graph.copy_with(nodes=nodes)
