"""Scheduling pass: put the (fused) nodes in the order the kernels will launch.

The default keeps the traced order (already valid; the scheduler checks it). With
`config.enable_straighten_algorithm(True)` the memory-aware order of
`flowgen.schedule.order.straighten` is used instead.
"""
from __future__ import annotations

from flowgen.ops.lowering import Collective
from flowgen.ops.registry import get_op
from flowgen.schedule.order import order_kernels


def schedule(graph, straighten: bool = False):
    """Collectives (all-reduce, send, recv) keep their relative order: every rank must reach them
    in the order the others expect (a recv moved before a send could wait forever)."""
    producer = graph.producers()
    collectives = [n for n in graph.nodes if n.op != "fused" and isinstance(get_op(n.op).lowering, Collective)]
    previous = {id(b): a for a, b in zip(collectives, collectives[1:])}

    def deps(node):
        before = [previous[id(node)]] if id(node) in previous else []
        return [producer[v] for v in node.inputs if v in producer] + before

    def size_of(node):
        return sum(v.nbytes for v in node.outputs)

    order = order_kernels(list(graph.nodes), deps, size_of=size_of, straighten_algorithm=straighten)
    return graph.copy_with(nodes=order)


def hoist(graph, movable):
    """Move every node for which `movable(node)` holds to just after the last producer of its
    inputs (keeping the order among nodes placed at the same point). A movable node that reads
    no computed value (a momentum buffer times the momentum, a reshape of a parameter) goes
    just before its first consumer instead of to the top, so it lands next to the kernel it feeds.

    Used for views (free) and optimizer updates: placed early, they let the update join the
    kernel that reduces its gradient, and free gradients as soon as the backward pass made them.
    """
    position: dict = {}
    placed: dict = {}
    kept = []
    pending: dict = {}        # output Value -> its deferred node (reads only state/inputs/constants)

    def release(node, slot):
        """Place the deferred producers of `node`'s inputs in `slot`, in their original order."""
        for v in node.inputs:
            producer = pending.pop(v, None)
            if producer is not None:
                for w in producer.outputs:
                    pending.pop(w, None)
                release(producer, slot)
                placed.setdefault(slot, []).append(producer)
                for w in producer.outputs:
                    position[w] = slot

    for node in graph.nodes:
        if movable(node):
            if all(v not in position for v in node.inputs):
                for v in node.outputs:
                    pending[v] = node
                continue
            after = max((position.get(v, -1) for v in node.inputs), default=-1)
            release(node, after)
            placed.setdefault(after, []).append(node)
            for v in node.outputs:
                position[v] = after
        else:
            release(node, len(kept) - 1)
            kept.append(node)
            for v in node.outputs:
                position[v] = len(kept) - 1
    # never read inside the graph (graph outputs, updates): at the end, in graph order
    leftover = {id(node): node for node in pending.values()}
    placed.setdefault(len(kept) - 1, []).extend(node for node in graph.nodes if id(node) in leftover)
    # Nodes hoisted behind a kept node k go right after it; chains of hoisted nodes stay in order.
    result = list(placed.get(-1, []))
    for k, node in enumerate(kept):
        result.append(node)
        result.extend(placed.get(k, []))
    return graph.copy_with(nodes=result)
