"""Data parallelism: average (or sum) every gradient over the ranks before the optimizer reads it.

Runs between autodiff and optimizer lowering (it needs the gradient of each parameter, which
only that point knows): one `all_reduce` node per bucket of gradients, in reverse parameter
order — roughly the order the backward pass finishes them — so the nodes' outputs replace the
gradients the update reads. An `all_reduce` has no kernel: the executor runs it on the host
(MPI) between the kernels around it (flowgen/distributed/collectives.py), one call per bucket.

`reduction` (distributed/data_parallel.BatchReduction) follows the loss: "sum" sums the
gradients, "mean" averages them (equal parts of the batch), "ratio" (a loss S / D, D a sum over
the batch such as cross_entropy's count of non-ignored targets) weights each rank by its D:
grad = sum_r D_r g_r / sum_r D_r, which is the global-batch gradient of (sum_r S_r) / (sum_r D_r).

With SyncBatchNorm a "ratio" loss is differentiated as S_r / sum_r D_r instead and the
gradients are summed (`divide_ratio_loss_by_global_count`).

When build() reads the gradients after `loss.backward()` (gradient clipping, as nanoGPT's loop
clips every step), `reduce_traced_gradients` runs the same reduction at that point of the trace:
the clipping then works on the reduced gradients, and its norm is the global-batch norm.
"""
from __future__ import annotations

from flowgen.distributed import collectives  # noqa: F401  (registers the all_reduce op)
from flowgen.distributed.data_parallel import batch_reduction
from flowgen.ir.graph import NameGen
from flowgen.ir.trace import Tracer
from flowgen.passes.autodiff import next_value_index

SCOPE = "data_parallel.all_reduce"


def gradient_buckets(names: list, bucket_size: int) -> list:
    """`names` (parameter order) in reverse, cut into buckets of `bucket_size` gradients."""
    ordered = list(reversed(names))
    return [ordered[i:i + bucket_size] for i in range(0, len(ordered), bucket_size)]


def all_reduce_gradients(graph, grads: dict, device, world_size: int, reduction, bucket_size: int):
    """Returns (graph with one all_reduce node per bucket appended, {name: reduced gradient})."""
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph))
    tracer.scopes.append(SCOPE)
    reduced = dict(grads)
    weight = total = None
    if reduction.kind == "ratio" and not has_sync_batch_norm(graph):   # else divide_ratio_loss_by_global_count
        weight = reduction.denominator
        total = tracer.emit("all_reduce", [weight], {"op": "sum", "world_size": world_size}).output
    op = "mean" if reduction.kind == "mean" else "sum"
    for bucket in gradient_buckets(list(grads), bucket_size):
        values = [grads[n] if weight is None else tracer.emit("mul", [grads[n], weight], {}).output for n in bucket]
        node = tracer.emit("all_reduce", values, {"op": op, "world_size": world_size})
        outputs = node.outputs if total is None else [tracer.emit("div", [v, total], {}).output for v in node.outputs]
        reduced.update(zip(bucket, outputs))
    return out, reduced


def has_sync_batch_norm(graph) -> bool:
    return any(n.op == "sync_batch_norm_affine" for n in graph.nodes)


def divide_ratio_loss_by_global_count(tracer, world_size: int) -> None:
    """SyncBatchNorm with a "ratio" loss S / D (cross_entropy's mean): before autodiff, the loss
    to differentiate becomes S_r / (sum_r D_r) (one all_reduce of D), the rank's share of the
    global-batch loss, and its gradients are summed. Weighting each rank's gradients by D_r after
    the backward (the plain "ratio" rule) cannot work with SyncBatchNorm: a rank's inputs reach
    every rank's loss through the shared statistics, even when its own D_r is 0."""
    root = tracer.backward_roots[-1]
    reduction = batch_reduction(tracer.graph, root)
    if reduction is None or reduction.kind != "ratio" or not has_sync_batch_norm(tracer.graph):
        return
    tracer.scopes.append(SCOPE)
    total = tracer.emit("all_reduce", [reduction.denominator], {"op": "sum", "world_size": world_size}).output
    share = tracer.lazy(reduction.numerator) / tracer.lazy(total) * reduction.factor
    tracer.scopes.pop()
    tracer.backward_roots[-1] = share._value


def reduce_traced_gradients(tracer, grads: dict, reduction, data_parallel) -> dict:
    """Inside build(), when it reads the step's gradients (`nn.utils.clip_grad_norm_`): the
    all_reduce nodes are appended to the graph being traced right away, so build() clips the
    gradients reduced over the ranks (the global-batch gradients, as one process would) and the
    pass after build() has nothing left to reduce. Returns {name: reduced gradient}."""
    ir, reduced = all_reduce_gradients(tracer.graph, grads, tracer.device, data_parallel.world_size, reduction,
                                       data_parallel.bucket_size)
    tracer.graph, tracer.new_name = ir, NameGen(start=next_value_index(ir))
    return {**grads, **reduced}
