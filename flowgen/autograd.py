"""Eager autograd: a tape of `GradNode`s and reverse-mode accumulation.

Gradient formulas are not here: each op's `grad` in its definition computes
them with flowgen ops, which is what lets the graph autodiff pass reuse them.

In-place writes (`inplace=True` flags, `copy_`, `add_`, `relu_`, `__setitem__`, a write through a
view) rebase the tensor's history onto the new value and keep a stand-in with the old value and
history (`rebase_history`): the ops computing the new value read it, and the gradients of earlier
readers reach it (`as_read`, PyTorch's edges). An input written after an op read it is handed to
the op's gradient formula as `_Overwritten`, whose values raise PyTorch's error, so only a
gradient that needs the old value fails (per-node versions); a second `backward()` through ops
whose gradient reads saved values needs `retain_graph=True`. The whole story, views included:
docs/views_and_inplace.md.
"""
from __future__ import annotations

import contextlib
import itertools
import threading

import numpy as np

_state = threading.local()

from flowgen import mixed_precision  # noqa: E402
from flowgen.ops.registry import GradContext, apply, install_eager_runtime  # noqa: E402
from flowgen.device import CPU  # noqa: E402
from flowgen.tensor import Tensor, as_tensor_like, c_array, global_tensors  # noqa: E402
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

    __slots__ = ("op", "ctx", "inputs", "versions", "name", "freed")

    def __init__(self, op, ctx, inputs):
        self.op = op
        self.ctx = ctx
        self.inputs = inputs
        # (own, shared) write counts of each input when the op read it: an input written in place
        # since is routed to the value it had then (`as_read`) and its values are refused to the
        # gradient formula (`_Overwritten`)
        self.versions = tuple((t._version, version_of(t)) for t in inputs)
        self.name = f"{op.name}_backward"
        self.freed = 0   # the backward() call, if any, that went through it without retain_graph


def version_of(tensor) -> int:
    """A tensor's write count; for a view, plus its root's writes since the view last matched it
    (a view shares its base's counter in PyTorch: a write to either is a write to both). Reading a
    stale view recomputes it (bumping its own count), and a write through a view leaves it
    matching its root, so the ops that read it after its own write stay valid."""
    view = tensor._view
    return tensor._version if view is None else tensor._version + view.root._version - view.root_version


def as_read(tensor, own_version: int):
    """The tensor holding the value and autograd history `tensor` had at write count
    `own_version`: itself, or the stand-in `rebase_history` kept when a later in-place write gave
    it another history (PyTorch's edges point at the producer an op saw, not at the tensor's
    current one: `y = h + p; h.mul_(q)` sends y's gradient to h's old producer)."""
    if tensor._version != own_version:
        for version, old in tensor._earlier_values:
            if version >= own_version:
                return old
    return tensor


class _Overwritten(Tensor):
    """Stands in for an op's input that an in-place op wrote after the op read it, while the op's
    gradient formula runs: shape, dtype and requires_grad are the input's, but reading its values
    raises PyTorch's error. So only the gradients that need the old value fail, as PyTorch's saved
    tensors do (`y = h * 2; h.mul_(3)` is fine, `y = h * h; h.mul_(3)` is not)."""

    def __init__(self, tensor, op_name: str):
        super().__init__(None, device=tensor.device, requires_grad=tensor.requires_grad)
        self._data = np.broadcast_to(np.zeros((), tensor.dtype.np_dtype), tuple(tensor.shape))
        self._dtype = tensor.dtype
        self._op_name = op_name

    def numpy_view(self):
        raise RuntimeError(f"backward(): an input of {self._op_name} was modified by an in-place operation after "
                           f"{self._op_name} used it; use the out-of-place form (inplace=False) or clone() before "
                           f"writing")


def rebase_history(target, new, walk_all: bool = False):
    """Autograd side of an in-place write of `new` into `target` (`F.relu(x, inplace=True)`,
    `x.copy_(y)`, `x.fill_(0)`): `target` takes the history of a copy of `new` (broadcast and cast
    to target's shape and dtype; none when `new` needs no gradient: Tensor._assign gives a fill_
    of a tensor that requires grad a zero-gradient edge first), and a stand-in keeps the value and
    history target had: the nodes computing `new` read it, and backward() routes the gradients of
    earlier readers of target to it (`as_read`). `walk_all`: `new` may reach ops that read `target`
    through tensors older than it (a view recomputed from its root, Tensor._refresh_view), so the
    whole history of `new` is walked."""
    if target.requires_grad and target.grad_fn is None:
        raise RuntimeError("a leaf tensor that requires grad is being used in an in-place operation; "
                           "write into it under flow.no_grad(), or use the out-of-place form")
    old = Tensor._wrap(target.numpy_view().copy(), target.dtype, target.device)
    old.requires_grad, old.grad_fn, old._version = target.requires_grad, target.grad_fn, version_of(target)
    if old.grad_fn is not None:
        old.grad_fn.ctx.outputs = tuple(old if o is target else o for o in old.grad_fn.ctx.outputs)
    target._earlier_values = target._earlier_values + ((target._version, old),)
    if not new.requires_grad:
        target.grad_fn, target.requires_grad = None, False
        return
    # A private node for target: `new` may be a tensor the caller still uses (copy_(src), x[:] = y).
    if tuple(new.shape) != tuple(target.shape):
        new = apply("expand", new, shape=tuple(target.shape))
    new = apply("cast", new, dtype=target.dtype)
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
        stack.extend(i for i in node.inputs if i is not old and (walk_all or i._serial > target._serial))
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


def _inputs_as_read(node) -> tuple:
    return tuple(as_read(t, own) for t, (own, _) in zip(node.inputs, node.versions))


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
            for i in _inputs_as_read(t.grad_fn):
                if i.requires_grad and id(i) not in seen:
                    stack.append((i, False))
    return list(reversed(order))


def _accumulate_global_grad(t, g) -> None:
    """Add the global gradient `g` into `t.grad`, laid out as `t` is (OneFlow boxes the gradient to
    the leaf's sbp: a partial_sum gradient of a broadcast parameter is all-reduced)."""
    g = g.to_global(t.placement, t.sbp)
    if t.grad is not None:
        g = t.grad + g
    t.grad = global_tensors().component_copy(g, t.dtype)
    for hook in t._post_accumulate_grad_hooks:
        hook(t)


def freed_message(op: str) -> str:
    """PyTorch's words for a second backward() through a graph the first one freed."""
    return (f"Trying to backward through the graph a second time (or directly access saved tensors after they "
            f"have already been freed): {op} was differentiated by an earlier backward() without "
            f"retain_graph=True. Specify retain_graph=True on the first backward() if you need to backward "
            f"through the graph again")


_backward_calls = itertools.count(1)


def backward(root, gradient=None, retain_graph=None, create_graph=False):
    """PyTorch's Tensor.backward: `retain_graph` (default `create_graph`) keeps the graph for
    another backward(); without it, a later backward() through an op whose gradient reads saved
    values raises, as PyTorch does."""
    if create_graph:
        raise NotImplementedError("backward(create_graph=True): flowgen's eager autograd does not record the "
                                  "backward pass itself (no higher-order gradients)")
    retain_graph = create_graph if retain_graph is None else bool(retain_graph)
    call = next(_backward_calls)
    if not root.requires_grad:
        raise RuntimeError("backward(): the tensor does not require grad and has no grad_fn")
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError(f"backward(): grad can be implicitly created only for scalar outputs; "
                               f"this tensor has shape {tuple(root.shape)}, pass gradient=")
        # In the root's dtype: Tensor() of a float64 array without dtype= would make it float32.
        gradient = Tensor(np.ones(root.shape, root.dtype.np_dtype), dtype=root.dtype, device=root.device)
        if root.is_global:   # a logical 1 on every rank (a partial_sum root too: d(sum)/d(part) = 1)
            gradient = gradient.to_global(root.placement, broadcast)
    elif not isinstance(gradient, Tensor):
        gradient = Tensor(gradient, dtype=root.dtype, device=root.device)
    elif gradient.dtype != root.dtype:   # PyTorch's engine casts a given gradient to its tensor's dtype
        gradient = apply("cast", gradient, dtype=root.dtype)
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
            reads_saved = node.op.extra.get("grad_reads_inputs", True)
            if node.freed and node.freed != call and reads_saved:
                raise RuntimeError(freed_message(node.name))
            if reads_saved and not retain_graph and not node.freed:
                node.freed = call
            # Multi-output nodes: pass zeros for the outputs that got no gradient.
            gouts = [g if o is t else None for o in node.ctx.outputs]
            inputs = _inputs_as_read(node)
            ctx = node.ctx
            if any(version_of(t) != shared for t, (_, shared) in zip(node.inputs, node.versions)):
                ctx = GradContext(tuple(i if version_of(t) == shared else _Overwritten(i, node.op.name)
                                        for t, i, (_, shared) in zip(node.inputs, inputs, node.versions)),
                                  ctx.outputs, ctx.attrs)
            in_grads = node.op.grad(ctx, *gouts) if len(gouts) > 1 else node.op.grad(ctx, g)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            for inp, ig in zip(inputs, in_grads):
                if ig is None or not inp.requires_grad:
                    continue
                if tuple(ig.shape) != tuple(inp.shape):
                    raise RuntimeError(f"gradient of {node.op.name} has shape {tuple(ig.shape)} "
                                       f"for an input of shape {tuple(inp.shape)}")
                if ig.dtype != inp.dtype:   # a gradient has its input's dtype (mixed precision; PyTorch's engine)
                    ig = apply("cast", ig, dtype=inp.dtype)
                prev = grads.get(id(inp))
                grads[id(inp)] = ig if prev is None else prev + ig


install_eager_runtime(Tensor, as_tensor_like, wrap_outputs)
