"""The IR: plain data with a readable text form.

A `Graph` is one training or inference step:

* ``inputs``   — values fed per call (the arguments of ``build()``),
* ``state``    — persistent values (parameters, buffers, optimizer slots, the
  step counter) that live across calls,
* ``nodes``    — ops in a valid execution order; each names its module path,
* ``outputs``  — values returned per call,
* ``updates``  — (state name, value) pairs written back at the end of the step.

Nodes whose ``op`` is ``"fused"`` carry a ``body`` (a list of nodes over the
fused node's inputs) and a ``kind`` attribute; they are produced by the fusion
pass and interpreted by running their body.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from flowgen import dtype as dt
from flowgen.ir.text import format_graph


@dataclass(eq=False)
class Value:
    name: str
    shape: tuple
    dtype: dt.DType

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def type_str(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    scope: str = ""   # module path, e.g. "model.features.0.0"
    loc: str = ""     # user source location, e.g. "train.py:42"

    @property
    def output(self) -> Value:
        return self.outputs[0]

    @property
    def body(self) -> list:
        return self.attrs.get("body", [])


@dataclass(eq=False)
class StateVar:
    name: str
    value: Value
    kind: str   # "param" | "buffer" | "optim" | "hyper"
    # For "hyper" state: how the value moves from one step to the next, as plain data, so a
    # standalone program can advance it without Python (see passes/optimizer.py, random_streams.py).
    schedule: dict | None = None


@dataclass(eq=False)
class Graph:
    name: str
    inputs: list = field(default_factory=list)
    state: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    updates: list = field(default_factory=list)   # [(state name, Value)]

    def state_by_name(self) -> dict:
        return {s.name: s for s in self.state}

    def producers(self) -> dict:
        """Value -> the node that produces it."""
        return {v: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict:
        """Value -> list of nodes that read it."""
        result: dict = {}
        for n in self.nodes:
            for v in n.inputs:
                result.setdefault(v, []).append(n)
        return result

    def live_out(self) -> set:
        """Values that must exist after the last node: outputs and state updates."""
        return set(self.outputs) | {v for _, v in self.updates}

    def copy_with(self, **changes) -> "Graph":
        """A shallow copy with some fields replaced (passes build new graphs)."""
        fields = dict(name=self.name, inputs=list(self.inputs), state=list(self.state), nodes=list(self.nodes),
                      outputs=list(self.outputs), updates=list(self.updates))
        fields.update(changes)
        return Graph(**fields)

    def __str__(self) -> str:
        return format_graph(self)


class NameGen:
    """Fresh, readable value names: t0, t1, ... (deterministic per graph)."""

    def __init__(self, start: int = 0, prefix: str = "t"):
        self.counter = start
        self.prefix = prefix

    def __call__(self) -> str:
        name = f"{self.prefix}{self.counter}"
        self.counter += 1
        return name
