"""Scheduling pass: put the (fused) nodes in the order the kernels will launch.

The default keeps the traced order (already valid; the scheduler checks it). With
`config.enable_straighten_algorithm(True)` the memory-aware order of
`flowgen.schedule.order.straighten` is used instead.
"""
from __future__ import annotations

from flowgen.schedule.order import order_kernels


def schedule(graph, straighten: bool = False):
    producer = graph.producers()

    def deps(node):
        return [producer[v] for v in node.inputs if v in producer]

    def size_of(node):
        return sum(v.nbytes for v in node.outputs)

    order = order_kernels(list(graph.nodes), deps, size_of=size_of, straighten_algorithm=straighten)
    return graph.copy_with(nodes=order)


def hoist(graph, movable):
    """Move every node for which `movable(node)` holds to just after the last producer of its
    inputs (keeping the order among nodes placed at the same point).

    Used for views (free) and optimizer updates: placed early, they let the update join the
    kernel that reduces its gradient, and free gradients as soon as the backward pass made them.
    """
    position: dict = {}
    placed: dict = {}
    kept = []
    for node in graph.nodes:
        if movable(node):
            after = max((position.get(v, -1) for v in node.inputs), default=-1)
            placed.setdefault(after, []).append(node)
            for v in node.outputs:
                position[v] = after
        else:
            kept.append(node)
            for v in node.outputs:
                position[v] = len(kept) - 1
    # Nodes hoisted behind a kept node k go right after it; chains of hoisted nodes stay in order.
    result = list(placed.get(-1, []))
    for k, node in enumerate(kept):
        result.append(node)
        result.extend(placed.get(k, []))
    return graph.copy_with(nodes=result)
