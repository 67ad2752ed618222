"""Data parallelism: average (or sum) every gradient over the ranks before the optimizer reads it.

Runs between autodiff and optimizer lowering (it needs the gradient of each parameter, which
only that point knows): one `all_reduce` node per bucket of gradients, in reverse parameter
order — roughly the order the backward pass finishes them — so the nodes' outputs replace the
gradients the update reads. An `all_reduce` has no kernel: the executor runs it on the host
(MPI) between the kernels around it (flowgen/distributed/collectives.py), one call per bucket.

`reduction` (distributed/data_parallel.BatchReduction) follows the loss: "sum" sums the
gradients, "mean" averages them (equal parts of the batch). A "ratio" loss S / D (D a sum over the
batch, such as cross_entropy's count of non-ignored targets) is differentiated as the rank's share
of the global-batch loss, S_r / sum_r D_r (`divide_ratio_loss_by_global_count`: the count is
all-reduced before autodiff), so its gradients are summed too: their sum is the global-batch
gradient of (sum_r S_r) / (sum_r D_r), a rank whose targets are all ignored (D_r = 0) included.
ZeRO reduce-scatters the same summed gradients (passes/zero.py); `BatchReduction.gradient_op`
says which collective op each kind takes.

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
    for bucket in gradient_buckets(list(grads), bucket_size):
        node = tracer.emit("all_reduce", [grads[n] for n in bucket],
                           {"op": reduction.gradient_op, "world_size": world_size})
        reduced.update(zip(bucket, node.outputs))
    return out, reduced


def divide_ratio_loss_by_global_count(tracer, world_size: int) -> None:
    """A "ratio" loss S / D (cross_entropy's mean over the targets not ignored): before autodiff,
    the loss to differentiate becomes S_r / (sum_r D_r) (one all_reduce of D), the rank's share of
    the global-batch loss, and its gradients are summed over the ranks (by plain data parallel's
    all-reduce or ZeRO's reduce-scatter alike). Weighting each rank's gradients by D_r after the
    backward instead would fail twice: with SyncBatchNorm a rank's inputs reach every rank's loss
    through the shared statistics, and a rank with D_r = 0 differentiates 0 / 0. The loss the graph
    returns is still S_r / D_r, combined over the ranks as a ratio (data_parallel.combine_outputs)."""
    root = tracer.backward_roots[-1]
    reduction = batch_reduction(tracer.graph, root)
    if reduction is None or reduction.kind != "ratio":
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
