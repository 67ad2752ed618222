"""The training step as the pass pipeline sees it: the IR and what its stages hand on.

The trace of `build()` (nn/graph/trace_step.py) makes a `Step`; every pass of the compile
pipeline (passes/pipeline.py) takes one and returns one. The step stages (autodiff, gradient
reduction, output combining, optimizer lowering, ZeRO, the pipeline split, random streams:
passes/step_stages.py) change the IR and the bookkeeping the runtime needs beside it (which
eager tensor each state value binds to, which scalars the host writes before a call); the IR
passes after them change `ir` alone. `StepSettings` is what the stages read from the graph
being compiled; it does not change along the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass(frozen=True)
class Backward:
    """A `loss.backward()` the trace left to the autodiff pass: its roots (differentiated
    together, as their sum) and where its backward nodes go, before node `at` of the traced IR
    (the end of its micro-batch, so its activations die before the next micro-batch starts)."""
    roots: tuple
    at: int


@dataclass(frozen=True)
class Step:
    ir: object                          # ir.graph.Graph
    structure: Callable                 # build()'s output structure over the flat outputs
    bindings: tuple = ()                # (state Value, eager Tensor): the state the executor reads and writes
    host_scalars: tuple = ()            # (state Value, HostScalar): written by the host before each call
    placed: frozenset = frozenset()     # names of state held by some of the ranks (a pipeline stage's)
    backward: tuple = ()                # Backward: what the autodiff pass differentiates, in trace order
    micro_ends: tuple = ()              # micro-batch j's nodes end before node micro_ends[j]
    grads: dict | None = None           # {parameter state name: gradient Value}; None: no backward()
    gradients_reduced: bool = False     # data parallel: build() read the gradients, which were reduced there
    losses: tuple = ()                  # every value backward() was called on (data parallel reads their form)
    gradient_pieces: dict = field(default_factory=dict)  # ZeRO-2/3: reduce-scattered in build() (Tracer's)
    reduction: object = None            # data_parallel.BatchReduction the gradients follow
    slots: tuple = ()                   # SlotBinding: optimizer slots the optimizer lowering added
    checks: tuple = ()                  # run on the host before every call (a traced optimizer's options)
    output_combine: tuple | None = None  # per output, how a data-parallel step makes it global
    sharded_slots: tuple = ()           # ShardedSlot: slots (stage 3: parameters too) ZeRO split
    stage_program: object = None        # distributed.pipeline.StageProgram: this rank's pipeline stage

    def with_ir(self, ir) -> "Step":
        return replace(self, ir=ir)


@dataclass(frozen=True)
class StepSettings:
    """What the step stages read from the graph being compiled."""
    graph_name: str
    device: object
    wrt: tuple                  # state names of the parameters the optimizers train
    loss_scale: object          # seeds the backward pass: a number, or a GradScaler's scale Value
    optimizers: list            # [(Optimizer, LR scheduler or None)]
    param_name: dict            # id(parameter) -> state name
    counter: dict               # the graph's step counter (passes/optimizer.py)
    grad_unscale: float         # divides the loss scaling and the micro-batch count out of the gradients
    scaler: object = None       # passes/optimizer.GraphScaler of a dynamic GradScaler
    data_parallel: object = None  # distributed/data_parallel.DataParallel
    zero: object = None         # ZeroSettings when ZeRO shards the optimizer
    zero_store: dict = None     # the graph's ShardedSlots, shared by its variants
    pipeline: object = None     # distributed/pipeline.Pipeline of a set_stage graph


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    shard_min_size: int
