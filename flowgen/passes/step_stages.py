"""The stages of a training step, as passes over a `Step` (passes/step.py).

Each takes the step and the graph's `StepSettings` and returns the step, or the step it was
given, unchanged, where it does not apply (no backward(), no optimizer, one rank, no ZeRO, no
pipeline, no random op): `run_passes` then logs the pass as "no change". They run in the order
of passes/pipeline.py; each calls the IR function of its own module (passes/autodiff.py,
gradient_allreduce.py, optimizer.py, zero.py, random_streams.py; distributed/data_parallel.py's
output combining and distributed/pipeline.py's split) and keeps the bookkeeping beside the IR.
"""
from __future__ import annotations

from dataclasses import replace

from flowgen.distributed.collectives import world
from flowgen.distributed.data_parallel import (combine_outputs, gradient_reduction, shard_parameter_bindings,
                                               shard_slot_tensors)
from flowgen.distributed.global_tensor import covers_world, graph_storage
from flowgen.distributed.pipeline import split_stage
from flowgen.ir.graph import NameGen
from flowgen.ir.trace import Tracer
from flowgen.passes.autodiff import autodiff, next_value_index
from flowgen.passes.gradient_allreduce import all_reduce_gradients
from flowgen.passes.optimizer import lower_optimizers
from flowgen.passes.random_streams import bind_random_streams
from flowgen.passes.zero import shard_optimizer_state, shards_parameter


def on_some_ranks(tensor) -> bool:
    """A global tensor on a placement of some of the ranks (a pipeline stage's, OneFlow's way)."""
    return tensor.is_global and not covers_world(tensor.placement)


def _emitter(ir, device, first_index: int) -> Tracer:
    """A tracer appending nodes to `ir`, naming their values from t<first_index> on."""
    tracer = Tracer(ir.name, device)
    tracer.graph, tracer.new_name = ir, NameGen(start=first_index)
    return tracer


def differentiate(step, settings):
    """Autodiff: each recorded backward() differentiated where the trace left it (the end of its
    micro-batch), its gradients added to those of the micro-batches before it."""
    if not step.backward:
        return step
    ir, grads, ends, shift = step.ir, step.grads, list(step.micro_ends), 0
    for request in step.backward:
        at = request.at + shift   # the nodes inserted for earlier requests come before it
        head, new = backward_of(ir.copy_with(nodes=ir.nodes[:at]), request.roots, settings.wrt, settings.device,
                                settings.loss_scale, next_value_index(ir))
        if grads is None:
            grads = new
        else:   # gradient accumulation: this micro-batch's gradients added to the earlier ones
            emitter = _emitter(head, settings.device, max(next_value_index(head), next_value_index(ir)))
            with emitter:
                grads = {n: (emitter.lazy(grads[n]) + emitter.lazy(g))._value for n, g in new.items()}
        added = len(head.nodes) - at
        ends = [e + added if e >= at else e for e in ends]
        ir = head.copy_with(nodes=head.nodes + ir.nodes[at:])
        shift += added
    return replace(step, ir=ir, grads=grads, backward=(), micro_ends=tuple(ends))


def backward_of(ir, roots: tuple, wrt, device, loss_scale, first_index: int) -> tuple:
    """(a copy of `ir` with the backward of the sum of `roots` appended, {state name: gradient
    Value} of the state names in `wrt`); new values are named from t<first_index> on."""
    emitter = _emitter(ir.copy_with(), device, first_index)
    root = roots[0]
    with emitter:
        for other in roots[1:]:   # several backward() calls: their gradients add up, as in eager mode
            root = (emitter.lazy(root) + emitter.lazy(other))._value
    return autodiff(emitter.graph, root, list(wrt), device, loss_scale=loss_scale,
                    first_index=emitter.new_name.counter)


def reduce_gradients(step, settings):
    """Data parallel: the gradients averaged (or summed) over the ranks, one all_reduce per
    bucket (passes/gradient_allreduce.py); ZeRO-2 and 3 leave the gradients of the parameters
    they shard to their reduce-scatter (passes/zero.py)."""
    data_parallel, zero = settings.data_parallel, settings.zero
    if step.grads is None or data_parallel is None:
        return step
    reduction = gradient_reduction(settings.graph_name, step.ir, step.losses, data_parallel)
    if step.gradients_reduced:    # build() read the gradients: they were reduced there
        return replace(step, reduction=reduction)
    reduced_here = step.grads if zero is None or zero.stage == 1 else {
        n: g for n, g in step.grads.items()
        if not shards_parameter(g.numel, data_parallel.world_size, zero.shard_min_size)}
    ir, reduced = all_reduce_gradients(step.ir, reduced_here, settings.device, data_parallel.world_size, reduction,
                                       data_parallel.bucket_size)
    return replace(step, ir=ir, grads={**step.grads, **reduced}, reduction=reduction)


def combine_data_parallel_outputs(step, settings):
    """A data-parallel step with global inputs returns global outputs: a ratio loss combined over
    the ranks in the graph (distributed/data_parallel.combine_outputs)."""
    data_parallel = settings.data_parallel
    if data_parallel is None or data_parallel.contract != "global":
        return step
    emitter = _emitter(step.ir.copy_with(), settings.device, next_value_index(step.ir))
    emitter.scopes.append("data_parallel.outputs")
    ir, combine = combine_outputs(emitter.graph, emitter.emit, data_parallel.world_size)
    return replace(step, ir=ir, output_combine=tuple(combine))


def lower_step_optimizers(step, settings):
    """The optimizers' updates as IR (passes/optimizer.py); their slots and hyper-parameters
    become state, bound to the optimizer's tensors and to host scalars."""
    if step.grads is None:
        return step
    ir, host, slots, checks = lower_optimizers(step.ir, step.grads, settings.optimizers, settings.param_name,
                                               settings.device, settings.counter,
                                               grad_unscale=settings.grad_unscale, scaler=settings.scaler)
    state = ir.state_by_name()
    return replace(step, ir=ir, slots=tuple(slots), checks=tuple(checks),
                   bindings=step.bindings + _slot_bindings(state, slots),
                   placed=step.placed | {s.state_name for s in slots if on_some_ranks(s.tensor)},
                   host_scalars=step.host_scalars + tuple((state[h.name].value, h) for h in host))


def _slot_bindings(state: dict, slots) -> tuple:
    return tuple((state[s.state_name].value, graph_storage(s.tensor, s.state_name)) for s in slots)


def shard_for_zero(step, settings):
    """ZeRO: each rank keeps and updates a shard of the optimizer slots (stage 3: of the
    parameters too), bound to its pieces of the eager tensors (passes/zero.py)."""
    zero, data_parallel = settings.zero, settings.data_parallel
    if zero is None or step.grads is None:
        return step
    pieces = {step.grads[n]: piece for n, (piece, _) in step.gradient_pieces.items()}
    ir, shards = shard_optimizer_state(step.ir, world().rank, data_parallel.world_size, zero.shard_min_size,
                                       settings.device, data_parallel.bucket_size, zero.stage,
                                       step.reduction.gradient_op, pieces)
    slots, sharded_slots = shard_slot_tensors(settings.zero_store, list(step.slots), shards)
    slot_names = {s.state_name for s in step.slots}
    others = [(v, t) for v, t in step.bindings if v.name not in slot_names]
    bindings, sharded_params = shard_parameter_bindings(settings.zero_store, others, ir.state_by_name(), shards)
    return replace(step, ir=ir, slots=tuple(slots), sharded_slots=tuple(sharded_slots + sharded_params),
                   bindings=tuple(bindings) + _slot_bindings(ir.state_by_name(), slots))


def split_pipeline_stage(step, settings):
    """A set_stage pipeline: this rank's stage of the step, with send/recv at the boundaries
    (distributed/pipeline.py); it keeps the bindings of the state its stage holds."""
    if settings.pipeline is None:
        return step
    _refuse_sync_batch_norm(settings.graph_name, step.ir)
    program = split_stage(settings.graph_name, step.ir, settings.pipeline, list(step.micro_ends))
    bindings, host_scalars = program.keep_bindings(step.ir, list(step.bindings), list(step.host_scalars),
                                                   step.placed)
    return replace(step, ir=program.ir, structure=program.user_structure(step.structure), bindings=tuple(bindings),
                   host_scalars=tuple(host_scalars), stage_program=program)


def _refuse_sync_batch_norm(graph_name, ir):
    # the op is the subject: SyncBatchNorm's statistics over the ranks, refused by name with its fix
    synced = [n.scope for n in ir.nodes if n.op == "sync_batch_norm_affine"]
    if synced:
        raise NotImplementedError(f"{graph_name}: SyncBatchNorm ({synced[0]}) in a pipelined graph: it reduces its "
                                  f"statistics over every rank, but each rank runs one stage on the whole batch; "
                                  f"use BatchNorm")


def bind_step_random_streams(step, settings):
    """Random ops draw a fresh Philox offset on every call, from a host scalar (passes/random_streams.py)."""
    ir, rng = bind_random_streams(step.ir)
    if rng is None:
        return step
    return replace(step, ir=ir, host_scalars=step.host_scalars + ((ir.state_by_name()[rng.name].value, rng),))
