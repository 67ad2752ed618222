"""Autodiff: append the backward pass of a traced forward graph.

Walks the forward nodes in reverse and calls each op's `grad` — the same
function eager autograd calls — on lazy tensors bound to IR values, so the
gradient formulas are written once. Returns the new graph and the gradient
value of each requested state variable.
"""
from __future__ import annotations

import numpy as np

from flowgen.ir.graph import NameGen, Value
from flowgen.ir.trace import Tracer
from flowgen.ops.registry import GradContext, apply, get_op


def _needs_grad(graph, wrt: set) -> set:
    """Values that depend on some state in `wrt` (forward reachability)."""
    live = {s.value for s in graph.state if s.name in wrt}
    for node in graph.nodes:
        if get_op(node.op).grad is not None and any(v in live for v in node.inputs):
            live.update(v for v in node.outputs if v.dtype.is_floating)
    return live


def _reaches(graph, root) -> set:
    """Values the root depends on (backward reachability)."""
    needed = {root}
    for node in reversed(graph.nodes):
        if any(v in needed for v in node.outputs):
            needed.update(node.inputs)
    return needed


def autodiff(graph, loss, wrt: list, device=None, loss_scale: float = 1.0, first_index: int | None = None):
    """Returns (graph with backward nodes appended, {state name: grad Value}).

    The new values are named t<first_index>, ... (default: after the graph's own); a graph the
    caller inserts the backward into the middle of gives the first index free in the whole.

    `loss_scale` seeds the backward pass with d(loss)/d(loss) = scale (a GradScaler's loss
    scaling, which keeps float16 gradients from underflowing): a number, or the Value of the
    scale held as graph state; the optimizer pass divides it out.
    """
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph) if first_index is None else first_index)
    wrt_set = set(wrt)
    differentiable = _needs_grad(graph, wrt_set) & _reaches(graph, loss)

    grads: dict = {}
    with tracer:
        tracer.scopes.append("loss.backward")
        if isinstance(loss_scale, Value):   # a GradScaler's scale, state of the graph
            ones = tracer.emit("constant", [], {"value": np.ones(loss.shape, loss.dtype.np_dtype)}).output
            scale = tracer.lazy(loss_scale)
            grads[loss] = tracer.lazy(ones) * (scale if loss_scale.dtype == loss.dtype else scale.to(loss.dtype))
        else:
            seed = tracer.emit("constant", [], {"value": np.full(loss.shape, loss_scale, loss.dtype.np_dtype)}).output
            grads[loss] = tracer.lazy(seed)
        tracer.scopes.pop()
        for node in reversed(graph.nodes):
            outs = [grads.get(v) for v in node.outputs]
            if all(g is None for g in outs) or not any(v in differentiable for v in node.inputs):
                continue
            op = get_op(node.op)
            ctx = GradContext(tuple(tracer.lazy(v) for v in node.inputs),
                              tuple(tracer.lazy(v) for v in node.outputs), node.attrs)
            tracer.scopes.append(f"{node.scope}.backward" if node.scope else "backward")
            in_grads = op.grad(ctx, *outs)
            tracer.scopes.pop()
            in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
            for v, g in zip(node.inputs, in_grads):
                if g is None or v not in differentiable:
                    continue
                if g.dtype != v.dtype:   # a gradient has its input's dtype (mixed precision; PyTorch's engine)
                    g = apply("cast", g, dtype=v.dtype)
                prev = grads.get(v)
                if prev is None:
                    grads[v] = g
                else:
                    tracer.scopes.append(f"{node.scope}.backward" if node.scope else "backward")
                    grads[v] = prev + g
                    tracer.scopes.pop()

    by_state = {s.value: s.name for s in graph.state}
    result = {by_state[v]: g._value for v, g in grads.items() if v in by_state and by_state[v] in wrt_set}
    return out, result


def next_value_index(graph) -> int:
    """First unused number for fresh `tN` names."""
    best = -1
    for node in graph.nodes:
        for v in node.outputs:
            if v.name[1:].isdigit():
                best = max(best, int(v.name[1:]))
    return best + 1
