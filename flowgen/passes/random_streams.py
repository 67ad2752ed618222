"""Random streams: give a graph's dropout nodes a fresh Philox offset on every call.

While tracing, each dropout call took ``(seed, offset)`` from the global stream,
so the attributes hold trace-time values. This pass adds one ``hyper`` state,
``rng`` (int64[2] = seed, base offset), that the host fills before each call by
drawing as many offsets from the global stream as the graph has dropout calls
(exactly what the eager loop would draw), and rewrites each node's ``offset``
to its index relative to the first call. Kernels then use ``rng[1] + index``.
Forward and backward nodes of one dropout share the index, hence the mask.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.ir.graph import Node, StateVar, Value
from flowgen.passes.optimizer import HostScalar

RNG_STATE = "rng"


def bind_random_streams(graph):
    """Returns (graph, host scalar or None)."""
    offsets = sorted({n.attrs["offset"] for n in graph.nodes if n.op == "dropout"})
    if not offsets:
        return graph, None
    first, count = offsets[0], offsets[-1] - offsets[0] + 1
    nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "offset": n.attrs["offset"] - first, "stream": RNG_STATE},
                  n.scope, n.loc) if n.op == "dropout" else n for n in graph.nodes]
    state = StateVar(RNG_STATE, Value(RNG_STATE, (2,), dt.int64), "hyper",
                     schedule={"kind": "philox_offset", "count": count})

    def draw():
        from flowgen import random

        seed, base = random.next_dropout_seed()
        for _ in range(count - 1):
            random.next_dropout_seed()
        return np.array([seed, base], dtype=np.int64)

    return graph.copy_with(nodes=nodes, state=graph.state + [state]), HostScalar(RNG_STATE, draw)
