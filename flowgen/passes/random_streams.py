"""Random streams: give a graph's random nodes a fresh Philox offset on every call.

Random nodes are the ops defined with ``random=True`` (dropout and the random ops of
`flowgen/ops/random_ops.py`: uniform, normal, integer samples). While tracing, each
random call took ``(seed, offset)`` from the global stream, so the attributes hold
trace-time values. This pass adds one ``hyper`` state, ``rng`` (int64[2] = seed, base
offset), that the host fills before each call by drawing as many offsets from the global
stream as the graph has random calls (exactly what the eager loop would draw), and
rewrites each node's ``offset`` to its index relative to the first call. Kernels then use
``rng[1] + index``. Forward and backward nodes of one dropout share the index, hence the mask.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen import random
from flowgen.ir.graph import Node, StateVar, Value
from flowgen.ops.registry import get_op
from flowgen.passes.optimizer import HostScalar

RNG_STATE = "rng"


def bind_random_streams(graph):
    """Returns (graph, host scalar or None)."""
    is_random = {n.op: get_op(n.op).extra.get("random", False) for n in graph.nodes}
    offsets = sorted({n.attrs["offset"] for n in graph.nodes if is_random[n.op]})
    if not offsets:
        return graph, None
    first, count = offsets[0], offsets[-1] - offsets[0] + 1
    nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "offset": n.attrs["offset"] - first, "stream": RNG_STATE},
                  n.scope, n.loc) if is_random[n.op] else n for n in graph.nodes]
    state = StateVar(RNG_STATE, Value(RNG_STATE, (2,), dt.int64), "hyper",
                     schedule={"kind": "philox_offset", "count": count})

    def draw():
        seed, base = random.next_dropout_seed()
        for _ in range(count - 1):
            random.next_dropout_seed()
        return np.array([seed, base], dtype=np.uint64).view(np.int64)   # seed: a uint64 bit pattern

    return graph.copy_with(nodes=nodes, state=graph.state + [state]), HostScalar(RNG_STATE, draw)
