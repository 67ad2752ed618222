"""Eager autograd: a tape of `GradNode`s and reverse-mode accumulation.

Gradient formulas are not here: each op's `grad` in its definition computes
them with flowgen ops, which is what lets the graph autodiff pass reuse them.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

_state = threading.local()

from flowgen import mixed_precision  # noqa: E402
from flowgen.ops.registry import GradContext, apply, install_eager_runtime  # noqa: E402
from flowgen.device import CPU  # noqa: E402
from flowgen.tensor import Tensor, as_tensor_like, c_array  # noqa: E402
from flowgen.distributed import global_tensor  # noqa: E402
from flowgen.distributed.sbp import broadcast  # noqa: E402


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def _grad_mode(enabled: bool):
    previous = is_grad_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


class no_grad(contextlib.ContextDecorator):  # noqa: N801 - PyTorch spelling
    def __enter__(self):
        self._cm = _grad_mode(False)
        self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


class enable_grad(no_grad):  # noqa: N801
    def __enter__(self):
        self._cm = _grad_mode(True)
        self._cm.__enter__()


class GradNode:
    """One recorded op: enough to call its gradient function later."""

    __slots__ = ("op", "ctx", "inputs", "versions", "output_index", "name")

    def __init__(self, op, ctx, inputs):
        self.op = op
        self.ctx = ctx
        self.inputs = inputs
        self.versions = tuple(t._version for t in inputs)   # backward() refuses inputs written since
        self.name = f"{op.name}_backward"


def rebase_history(target, new):
    """Autograd side of an in-place write of `new` (computed from `target`) into `target`
    (`F.relu(x, inplace=True)`, `x.copy_(y)`): `target` takes `new`'s history, and the nodes that
    read target's old value (its producer, and the ops computing `new`) read a stand-in holding it.
    Other ops that read the old value are refused at backward() (GradNode.versions)."""
    if target.requires_grad and target.grad_fn is None:
        raise RuntimeError("a leaf tensor that requires grad is being used in an in-place operation; "
                           "write into it under flow.no_grad(), or use the out-of-place form")
    old = Tensor._wrap(target.numpy_view().copy(), target.dtype, target.device)
    old.requires_grad, old.grad_fn, old._version = target.requires_grad, target.grad_fn, target._version
    if old.grad_fn is not None:
        old.grad_fn.ctx.outputs = tuple(old if o is target else o for o in old.grad_fn.ctx.outputs)
    # The ops computing `new` were recorded after `target` was made: walk only those.
    stack, seen = [new], set()
    while stack:
        node = stack.pop().grad_fn
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if any(i is target for i in node.inputs):
            node.inputs = tuple(old if i is target else i for i in node.inputs)
            node.ctx.inputs = tuple(old if i is target else i for i in node.ctx.inputs)
        stack.extend(i for i in node.inputs if i is not old and i._serial > target._serial)
    node = new.grad_fn
    node.ctx.outputs = tuple(target if o is new else o for o in node.ctx.outputs)
    target.grad_fn, target.requires_grad = node, True


def zero_grads(params, set_to_none: bool = True) -> None:
    """`zero_grad()` of modules and optimizers: drop each gradient, or give it a fresh zero
    buffer (never zero in place: eager gradients may share one buffer)."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad = Tensor(np.zeros(p.grad.shape, p.grad.dtype.np_dtype), dtype=p.grad.dtype,
                            device=p.grad.device)


def wrap_outputs(op, inputs, attrs, result, metas=None):
    """Turn the NumPy result(s) of `op` into tensors and record them on the tape.

    `metas` is what ``op.infer`` returned for these inputs (computed again when omitted).
    """
    if metas is None:
        metas = op.infer(*(t.meta for t in inputs), **attrs)
    multi = type(metas) is tuple
    if not multi:
        metas, results = (metas,), (result,)
    else:
        results = result
    device = inputs[0].device if inputs else CPU
    outs = []
    for meta, arr in zip(metas, results):
        if type(arr) is not np.ndarray:
            arr = np.asarray(arr)
        np_dtype = meta.dtype.np_dtype
        if arr.dtype != np_dtype:
            arr = arr.astype(np_dtype)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        outs.append(Tensor._wrap(arr, meta.dtype, device))
    record(op, inputs, attrs, outs)
    return tuple(outs) if multi else outs[0]


def record(op, inputs, attrs, outs) -> None:
    """Put `op` applied to `inputs` giving `outs` on the tape, when a gradient is wanted."""
    if op.grad is not None and getattr(_state, "enabled", True):
        for t in inputs:
            if t.requires_grad:
                node = GradNode(op, GradContext(tuple(inputs), tuple(outs), attrs), tuple(inputs))
                for o in outs:
                    if o._dtype.is_floating:
                        o.requires_grad = True
                        o.grad_fn = node
                break


def _topological_order(root):
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t.grad_fn is not None:
            for i in t.grad_fn.inputs:
                if i.requires_grad and id(i) not in seen:
                    stack.append((i, False))
    return list(reversed(order))


def _accumulate_global_grad(t, g) -> None:
    """Add the global gradient `g` into `t.grad`, laid out as `t` is (OneFlow boxes the gradient to
    the leaf's sbp: a partial_sum gradient of a broadcast parameter is all-reduced)."""
    g = g.to_global(t.placement, t.sbp)
    if t.grad is not None:
        g = t.grad + g
    t.grad = global_tensor.component_copy(g, t.dtype)
    for hook in t._post_accumulate_grad_hooks:
        hook(t)


def backward(root, gradient=None):
    if not root.requires_grad:
        raise RuntimeError("backward(): the tensor does not require grad and has no grad_fn")
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError(f"backward(): grad can be implicitly created only for scalar outputs; "
                               f"this tensor has shape {tuple(root.shape)}, pass gradient=")
        gradient = Tensor(np.ones(root.shape, root.dtype.np_dtype), device=root.device)
        if root.is_global:   # a logical 1 on every rank (a partial_sum root too: d(sum)/d(part) = 1)
            gradient = gradient.to_global(root.placement, broadcast)
    elif not isinstance(gradient, Tensor):
        gradient = Tensor(gradient, dtype=root.dtype)
    if tuple(gradient.shape) != tuple(root.shape):
        raise RuntimeError(f"backward(): gradient shape {tuple(gradient.shape)} does not match "
                           f"tensor shape {tuple(root.shape)}")
    grads = {id(root): gradient}
    # inf/NaN gradients are values (a GradScaler's overflowing step makes them on purpose): no warnings
    # Autocast off: the gradient formulas run in the dtypes autocast chose for the forward (PyTorch).
    with no_grad(), mixed_precision.disabled(), np.errstate(over="ignore", invalid="ignore"):
        for t in _topological_order(root):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            if t.is_global and (t.grad_fn is None or t._retains_grad):
                _accumulate_global_grad(t, g)
            elif t.grad_fn is None or t._retains_grad:
                # A fresh buffer: g may be shared with another tensor's gradient (add passes g through).
                total = g.numpy_view() if t.grad is None else t.grad.numpy_view() + g.numpy_view()
                t.grad = Tensor(c_array(total, t.dtype.np_dtype).copy() if t.grad is None else total,
                                dtype=t.dtype, device=t.device)
                for hook in t._post_accumulate_grad_hooks:
                    hook(t)
            node = t.grad_fn
            if node is None:
                continue
            # Multi-output nodes: pass zeros for the outputs that got no gradient.
            gouts = [g if o is t else None for o in node.ctx.outputs]
            in_grads = node.op.grad(node.ctx, *gouts) if len(gouts) > 1 else node.op.grad(node.ctx, g)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            for inp, ig, version in zip(node.inputs, in_grads, node.versions):
                if ig is None or not inp.requires_grad:
                    continue
                if inp._version != version and inp.grad_fn is not None:
                    raise RuntimeError(f"backward(): an input of {node.op.name} was modified by an in-place "
                                       f"operation after {node.op.name} used it; use the out-of-place form "
                                       f"(inplace=False) or clone() before writing")
                if tuple(ig.shape) != tuple(inp.shape):
                    raise RuntimeError(f"gradient of {node.op.name} has shape {tuple(ig.shape)} "
                                       f"for an input of shape {tuple(inp.shape)}")
                if ig.dtype != inp.dtype:   # a gradient has its input's dtype (mixed precision; PyTorch's engine)
                    ig = apply("cast", ig, dtype=inp.dtype)
                prev = grads.get(id(inp))
                grads[id(inp)] = ig if prev is None else prev + ig


install_eager_runtime(Tensor, as_tensor_like, wrap_outputs)
