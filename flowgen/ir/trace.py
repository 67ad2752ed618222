"""Tracing: run `build()` with lazy tensors and record every op as an IR node.

While a `Tracer` is active, `registry.apply` hands it any op that touches a
lazy tensor, and every random op (they draw per call, ops/random_ops.py).
Parameters and buffers are made lazy for the duration of the trace (bound to
state values), so everything computed from them is recorded, and in-place writes
to them (BatchNorm running statistics) become state updates.

Free eager tensors (OneFlow's term: a tensor that existed before `build()` ran,
read by it, but neither a parameter nor a buffer of the graph's modules: a
module-level or closure tensor, a plain tensor attribute) follow OneFlow's
nn.Graph: they are bound as graph state (kind ``buffer``, named
``free_eager_tensor_<k>``), so every call reads the eager tensor's current value
(uploaded when eager code changed it), never a copy frozen at trace time. An
in-place op on one inside `build()` is part of the graph: later reads in that call
see the new value, but the eager tensor itself is left unchanged, in tracing and
in every call (OneFlow's test_graph_return_inplace_free_eager_tensor). Tensors
that `build()` creates itself (``flow.tensor(...)``, ``flow.zeros(...)``) are
constants of the graph.
"""
from __future__ import annotations

import functools
import os
import sys

import numpy as np

from flowgen import mixed_precision
from flowgen.autograd import freed_message
from flowgen.errors import TraceError
from flowgen.ir.graph import Graph, NameGen, Node, StateVar, Value
from flowgen.ops import registry
from flowgen.ops.registry import TensorMeta
from flowgen.tensor import Tensor, creation_mark

_FLOWGEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _user_file(filename: str) -> str | None:
    """The basename of a frame's file, None for flowgen's own files (each node recorded walks a
    few dozen frames: each file is looked at once)."""
    return None if filename.startswith(_FLOWGEN_DIR) else os.path.basename(filename)


def user_location() -> str:
    """file:line of the innermost frame outside flowgen (what the user wrote)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = _user_file(frame.f_code.co_filename)
        if name is not None:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class Tracer:
    """`capture_free_tensors`: bind free eager tensors as state (the tracer of `build()`; the
    passes that trace gradient and optimizer formulas leave it off)."""

    def __init__(self, name: str, device, log=None, autocast=None, capture_free_tensors: bool = False):
        self.graph = Graph(name)
        self.new_name = NameGen()
        self.device = device          # None: the device of the first eager tensor the trace reads
        self.scopes: list = []
        self.state_of: dict = {}      # id(tensor) -> StateVar
        self.state_tensors: list = []  # the eager tensors bound to state, in order
        self.constants: dict = {}     # id(tensor) -> (tensor, Value, version): a node per captured version
        self.backward_roots: list = []   # losses whose backward() is pending
        self.losses: list = []           # every loss backward() was called on, in order (micro-batches)
        self.differentiate = None     # set by nn.Graph: (in_build) -> backward of the marked loss, {state name: grad}
        self.grads = None             # the step's gradients once build() asked for them (nn.utils clipping)
        self.gradient_pieces: dict = {}   # ZeRO-2/3, gradients read in build(): {state name: (this rank's piece
        #                                 of the reduced gradient, every rank's piece size)} (passes/zero.py)
        self.log = log                # callable(level, text) for graph.debug()
        self.autocast = autocast      # mixed precision: None, or the 16-bit dtype of flowgen/mixed_precision.py
        self.capture_free_tensors = capture_free_tensors
        self.first_new = None         # creation mark at __enter__: older eager tensors are free ones
        self.free_tensors: list = []  # free eager tensors bound as state, in order
        self.free_values: dict = {}   # id(free tensor) -> its value now (in-place ops in build() rebind it)
        self.rebound: list = []       # eager tensors build() created and then wrote in place
        self.spent_nodes: set = set()  # ids of nodes a backward() without retain_graph went through

    # ------------------------------------------------------------------ state
    def add_state(self, name: str, tensor, kind: str) -> StateVar:
        value = Value(name, tuple(tensor.shape), tensor.dtype)
        var = StateVar(name, value, kind)
        self.graph.state.append(var)
        self.state_of[id(tensor)] = var
        self.state_tensors.append(tensor)
        assert isinstance(tensor, Tensor)
        return var

    def add_input(self, tensor, index: int):
        value = Value(f"input_{index}", tuple(tensor.shape), tensor.dtype)
        self.graph.inputs.append(value)
        return Tensor(_value=value, device=tensor.device)

    def lazy(self, value: Value, requires_grad: bool = False):
        t = Tensor(_value=value, device=self.device)
        t.requires_grad = requires_grad
        return t

    # -------------------------------------------------------------- recording
    @property
    def scope(self) -> str:
        return self.scopes[-1] if self.scopes else ""

    def is_free(self, tensor) -> bool:
        """An eager tensor that existed before build() ran (see the module docstring)."""
        return self.first_new is not None and not tensor.is_lazy and tensor._serial < self.first_new

    def records(self, op, tensors) -> bool:
        """Whether an op on eager `tensors` belongs in the graph: a random op (it must draw on
        every call), or one that reads a free eager tensor."""
        return op.extra.get("random", False) or any(self.is_free(t) for t in tensors)

    def _check_device(self, tensor):
        if self.device is None and tensor.numel() > 1:
            # A graph with no inputs and no parameters runs where the tensors build() makes are (OneFlow).
            self.device = tensor.device
            if self.log is not None:
                self.log(2, f"(DEVICE: {self.device}, of a tensor made in {self.scope or 'build()'})")
        if tensor.device != self.device and tensor.numel() > 1:
            raise TraceError(f"a tensor on {tensor.device} was used in a graph running on {self.device} "
                             f"(in {self.scope or 'build()'}); move it with .to('{self.device}')")

    def free_value(self, tensor) -> Value:
        """The value of free eager tensor `tensor` in the graph, binding it as state on first use.
        The tensor itself stays eager: tracing never reads or writes its data."""
        value = self.free_values.get(id(tensor))
        if value is not None:
            return value
        self._check_device(tensor)
        var = self.add_state(f"free_eager_tensor_{len(self.free_tensors)}", tensor, "buffer")
        self.free_tensors.append(tensor)
        self.free_values[id(tensor)] = var.value
        if self.log is not None:
            self.log(2, f"(FREE_EAGER_TENSOR: {var.name} {var.value.type_str} read in {self.scope or 'build'} "
                        f"at {user_location()})")
        return var.value

    def value_of(self, tensor) -> Value:
        if tensor._view_is_stale:
            tensor._refresh_view()   # its root was written in place since (Tensor._refresh_view)
        if tensor.is_lazy:
            return tensor._value
        if self.is_free(tensor):
            return self.free_value(tensor)
        cached = self.constants.get(id(tensor))
        if cached is not None and cached[2] == tensor._version:
            return cached[1]
        # A tensor build() made is a constant of the graph, as its data is now: an eager in-place
        # op on it since (`label.fill_(0)` after a read, DCGAN) bumped its version, so later reads
        # take a new constant, the value eager code would read there.
        self._check_device(tensor)
        node = self.emit("constant", [], {"value": np.array(tensor.numpy_view())})
        self.constants[id(tensor)] = (tensor, node.output, tensor._version)
        return node.output

    def emit(self, op_name: str, inputs: list, attrs: dict) -> Node:
        op = registry.get_op(op_name)
        try:
            metas = op.infer(*(TensorMeta(v.shape, v.dtype) for v in inputs), **attrs)
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise type(exc)(f"{exc} (op {op_name} in {self.scope or 'build()'} at {user_location()})") from None
        metas = metas if isinstance(metas, tuple) else (metas,)
        outputs = [Value(self.new_name(), tuple(m.shape), m.dtype) for m in metas]
        node = Node(op_name, list(inputs), outputs, dict(attrs), self.scope, user_location())
        self.graph.nodes.append(node)
        if self.log is not None:
            self.log(2, f"(OPERATOR: {node.op} in {node.scope or 'build'}: "
                        f"{', '.join(v.type_str for v in inputs)} -> {', '.join(v.type_str for v in outputs)})")
            self.log(3, f"    at {node.loc}")
        return node

    def __call__(self, op, tensors, attrs):
        """The registry hook: record `op` on `tensors` and return lazy results."""
        node = self.emit(op.name, [self.value_of(t) for t in tensors], attrs)
        needs_grad = op.grad is not None and any(t.requires_grad for t in tensors)
        outs = [self.lazy(v, needs_grad and v.dtype.is_floating) for v in node.outputs]
        return tuple(outs) if len(outs) > 1 else outs[0]

    def assign(self, target, new):
        """`target.copy_(new)` while tracing: rebind, and record a state update."""
        new_value = self.value_of(new)
        if tuple(new_value.shape) != tuple(target.shape):
            node = self.emit("expand", [new_value], {"shape": tuple(target.shape)})
            new_value = node.output
        if new_value.dtype != target.dtype:
            new_value = self.emit("cast", [new_value], {"dtype": target.dtype}).output
        if self.is_free(target):
            # The graph uses the new value for the rest of the call; the eager tensor is left
            # unchanged (OneFlow), so every call starts again from its current eager value.
            self.free_value(target)
            self.free_values[id(target)] = new_value
            return target
        if not target.is_lazy:
            if not self.capture_free_tensors:
                raise TraceError(f"in-place write to a tensor that is neither a graph input nor graph state "
                                 f"(in {self.scope or 'build()'} at {user_location()})")
            self.rebound.append(target)   # created by build(): a value of this trace from now on
        var = self.state_of.get(id(target))
        if var is not None:
            self.graph.updates = [(n, v) for n, v in self.graph.updates if n != var.name]
            self.graph.updates.append((var.name, new_value))
        target._value = new_value
        return target

    def mark_backward(self, loss, gradient=None, retain_graph=None):
        """`loss.backward(gradient)` in build(): the loss joins the pending roots. Several
        backward() calls before the optimizer step accumulate their gradients, as in eager mode
        (the roots are differentiated together, as their sum); `gradient` weighs a non-scalar
        loss (the vector-Jacobian product: the gradients of sum(loss * gradient))."""
        if gradient is None:
            if loss.numel() != 1:
                raise TraceError(f"loss.backward() in build() needs a scalar loss, got shape {tuple(loss.shape)} "
                                 f"(in {self.scope or 'build()'} at {user_location()}); pass gradient=")
            root = loss
        else:
            gradient = gradient if isinstance(gradient, Tensor) else Tensor(gradient, dtype=loss.dtype)
            if tuple(gradient.shape) != tuple(loss.shape):
                raise TraceError(f"loss.backward(gradient) in build(): gradient shape {tuple(gradient.shape)} does not "
                                 f"match the loss shape {tuple(loss.shape)} (in {self.scope or 'build()'} at "
                                 f"{user_location()})")
            root = (loss * gradient.detach()).sum()
        # As eager (autograd.backward): a backward() through ops an earlier backward() without
        # retain_graph already differentiated raises.
        reached = self._differentiable_ancestors(loss._value)
        if reached & self.spent_nodes:
            op = next(n.op for n in self.graph.nodes if id(n) in reached & self.spent_nodes)
            raise RuntimeError(freed_message(op) + f" (in {self.scope or 'build()'} at {user_location()})")
        if not retain_graph:
            self.spent_nodes |= reached
        self.backward_roots.append(root._value)
        self.losses.append(loss._value)

    def _differentiable_ancestors(self, value) -> set:
        """ids of the nodes `value` is computed from whose gradient reads saved values and that
        a parameter reaches (what eager's backward() would differentiate and free)."""
        params = {var.value for var in self.graph.state if var.kind == "param"}
        trained, producer = set(params), {}
        for node in self.graph.nodes:
            for out in node.outputs:
                producer[out] = node
            if any(v in trained for v in node.inputs):
                trained.update(node.outputs)
        found, stack, seen = set(), [value], set()
        while stack:
            node = producer.get(stack.pop())
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            op = registry.get_op(node.op)
            if op.grad is not None and op.extra.get("grad_reads_inputs", True) and \
                    any(v in trained for v in node.inputs):
                found.add(id(node))
            stack.extend(node.inputs)
        return found

    def _accumulate(self, grads: dict) -> dict:
        """The step's gradients after another backward: added to those build() already read."""
        if self.grads is None:
            return grads
        out = dict(self.grads)
        for name, g in grads.items():
            out[name] = g if name not in out else (self.lazy(out[name]) + self.lazy(g))._value
        return out

    def step_gradients(self, caller: str) -> dict:
        """{state name: gradient Value} of the step being traced; differentiates a pending
        `loss.backward()` now, so code after it in build() (gradient clipping) can use them."""
        if self.backward_roots:
            self.grads = self._accumulate(self.differentiate(True))
        if self.grads is None:
            raise TraceError(f"{caller} in build() needs the gradients: call loss.backward() before it")
        return self.grads

    def replace_step_gradients(self, grads: dict) -> None:
        self.grads = {**self.grads, **grads}

    def take_step_gradients(self):
        """After build(): the step's gradients (None without loss.backward()); resets for the next micro-batch."""
        if self.backward_roots:
            self.grads = self._accumulate(self.differentiate(False))
        grads, self.grads = self.grads, None
        return grads

    # ------------------------------------------------------------- activation
    def __enter__(self):
        for t in self.state_tensors:
            t._value = self.state_of[id(t)].value
        if self.capture_free_tensors:
            self.first_new = creation_mark()
        self._previous = registry.set_tracer_hook(self)
        mixed_precision.push(self.autocast)     # registry.apply casts each op's inputs as flowgen/mixed_precision.py says
        return self

    def __exit__(self, *exc):
        registry.set_tracer_hook(self._previous)
        mixed_precision.pop()
        for t in self.state_tensors + self.rebound:
            t._value = None
        self.first_new = None
        return False
