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
