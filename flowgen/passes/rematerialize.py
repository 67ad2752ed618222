"""Rematerialisation: recompute cheap elementwise values in each kernel that reads them.

CSE leaves one node per distinct expression, so a value such as BatchNorm's ``x - mean``
is computed once in the forward pass and read again in the backward pass: the fusion pass
must then write it to memory (an activation-sized buffer kept alive from forward to
backward) and give it a kernel of its own. When such a value is an elementwise function of
*at most one* activation-sized tensor (plus broadcast per-channel vectors and scalars), it is
cheaper to recompute it where it is used: each consumer that can fuse it (an elementwise
consumer of the same size, or a reduction that reads it as its input) gets a private copy
of the chain, and dead-code elimination drops the shared original once nobody reads it.

Pure IR -> IR; run after CSE and before fusion (with fusion off it would only add kernels).
"""
from __future__ import annotations

from flowgen.ir.graph import NameGen, Node, Value
from flowgen.ops.lowering import Elementwise, Reduction
from flowgen.ops.registry import get_op
from flowgen.passes.autodiff import next_value_index
from flowgen.passes.simplify import dce, impure

MAX_CHAIN = 8          # nodes recomputed per consumer, at most
MIN_NUMEL = 1 << 12    # smaller values cost nothing to keep; a copy could cost a launch


def _is_elementwise(node) -> bool:
    return (node.op != "fused" and not impure(node.op) and len(node.outputs) == 1
            and isinstance(get_op(node.op).lowering, Elementwise))


def _copy_scope(original: str, consumer: str) -> str:
    """The module path of the original; marked ``.backward`` when a backward kernel recomputes it."""
    if consumer.endswith("backward") and not original.endswith("backward"):
        return f"{original}.backward" if original else "backward"
    return original


def rematerialize(graph, min_numel: int = MIN_NUMEL):
    """`graph` with each shared cheap value of at least `min_numel` elements recomputed by its
    consumers (0 for a step with dynamic dimensions: the choice may not depend on a size)."""
    producers = graph.producers()
    users = graph.users()
    live_out = graph.live_out()

    # Full-size tensors each cheap elementwise value is computed from (None: not cheap).
    sources: dict = {}
    for node in graph.nodes:
        if not _is_elementwise(node):
            continue
        found = set()
        for u in node.inputs:
            if u.numel < node.output.numel:
                continue                       # a broadcast per-channel vector or scalar
            if u in sources:
                found |= sources[u]                # computed by a cheap chain: its sources count
            else:
                found.add(u)
        if len(found) <= 1:
            sources[node.output] = found

    def shared(v) -> bool:
        return v in sources and v.numel >= min_numel and len(users.get(v, [])) + (v in live_out) > 1

    order = {id(n): i for i, n in enumerate(graph.nodes)}

    def chain(v) -> list:
        """The shared cheap nodes a private copy of `v` needs, in graph order."""
        todo, seen = [v], {}
        while todo:
            w = todo.pop()
            if w in seen:
                continue
            seen[w] = producers[w]
            todo.extend(u for u in producers[w].inputs if shared(u))
        return sorted(seen.values(), key=lambda n: order[id(n)])

    def fuses_into(v, node) -> bool:
        if _is_elementwise(node):
            return v.numel == node.output.numel
        return isinstance(get_op(node.op).lowering, Reduction) and node.inputs[0] is v

    names = NameGen(start=next_value_index(graph))
    nodes = []
    changed = False
    for node in graph.nodes:
        private: dict = {}
        for v in node.inputs:
            if not shared(v) or not fuses_into(v, node) or v in private:
                continue
            needed = chain(v)
            if len(needed) > MAX_CHAIN:
                continue
            for original in needed:
                if original.output in private:
                    continue
                copy = Value(names(), original.output.shape, original.output.dtype)
                nodes.append(Node(original.op, [private.get(u, u) for u in original.inputs], [copy],
                                  dict(original.attrs), _copy_scope(original.scope, node.scope), original.loc))
                private[original.output] = copy
        if private:
            changed = True
            node = Node(node.op, [private.get(v, v) for v in node.inputs], node.outputs, node.attrs, node.scope,
                        node.loc)
        nodes.append(node)
    if not changed:
        return graph
    return dce(graph.copy_with(nodes=nodes))
