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
"""
from __future__ import annotations

from flowgen.distributed import collectives  # noqa: F401  (registers the all_reduce op)
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
    if reduction.kind == "ratio":
        weight = reduction.denominator
        total = tracer.emit("all_reduce", [weight], {"op": "sum", "world_size": world_size}).output
    op = "mean" if reduction.kind == "mean" else "sum"
    for bucket in gradient_buckets(list(grads), bucket_size):
        values = [grads[n] if weight is None else tracer.emit("mul", [grads[n], weight], {}).output for n in bucket]
        node = tracer.emit("all_reduce", values, {"op": op, "world_size": world_size})
        outputs = node.outputs if total is None else [tracer.emit("div", [v, total], {}).output for v in node.outputs]
        reduced.update(zip(bucket, outputs))
    return out, reduced
