"""Activation checkpointing: recompute a module's activations in the backward pass.

For every module marked with
``graph.model.block.to(nn.graph.GraphModule).activation_checkpointing = True``,
the values it computes inside are not kept alive until the backward pass: its
forward nodes are cloned right before the first backward node that needs them,
and backward nodes read the clones. The module's inputs (the segment boundary)
stay alive; everything inside is recomputed, one segment at a time as the
backward pass reaches it. Peak memory drops; the cost is running those modules
forward twice.
"""
from __future__ import annotations

from flowgen.ir.graph import Node, Value


def _in_scope(scope: str, prefix: str) -> bool:
    return scope == prefix or scope.startswith(prefix + ".")


def _segment_clones(segment, needed):
    """Clones of the segment's nodes that (transitively) produce `needed`, and old->new names."""
    produced = {v for n in segment for v in n.outputs}
    keep = set(needed)
    for n in reversed(segment):
        if any(v in keep for v in n.outputs):
            keep.update(v for v in n.inputs if v in produced)
    clones, rename = [], {}
    for n in segment:
        if not any(v in keep for v in n.outputs):
            continue
        outs = [Value(f"{v.name}_re", v.shape, v.dtype) for v in n.outputs]
        rename.update(zip(n.outputs, outs))
        clones.append(Node(n.op, [rename.get(v, v) for v in n.inputs], outs, dict(n.attrs),
                           f"{n.scope}.recompute", n.loc))
    return clones, rename


def checkpoint_activations(graph, scopes):
    """`scopes`: module paths to recompute. Runs after CSE (which would merge the clones back)."""
    # The autodiff pass names its nodes "<module>.backward"; everything before the first is forward.
    forward_count = next((i for i, n in enumerate(graph.nodes) if n.scope.endswith("backward")), None)
    outermost = [s for s in scopes if not any(s != o and _in_scope(s, o) for o in scopes)]
    if not outermost or forward_count is None:
        return graph
    forward, backward = graph.nodes[:forward_count], graph.nodes[forward_count:]
    inserts: dict = {}     # backward index -> clones to run just before it
    rename: dict = {}
    for prefix in outermost:
        segment = [n for n in forward if _in_scope(n.scope, prefix) and n.op != "constant"]
        produced = {v for n in segment for v in n.outputs}
        needed = {v for n in backward for v in n.inputs if v in produced}
        if not needed:
            continue
        clones, names = _segment_clones(segment, needed)
        rename.update(names)
        first_use = next(i for i, n in enumerate(backward) if any(v in needed for v in n.inputs))
        inserts.setdefault(first_use, []).extend(clones)
    nodes = list(forward)
    for i, n in enumerate(backward):
        nodes.extend(inserts.get(i, []))
        nodes.append(Node(n.op, [rename.get(v, v) for v in n.inputs], n.outputs, n.attrs, n.scope, n.loc))
    return graph.copy_with(nodes=nodes)
