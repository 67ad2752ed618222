"""Data parallelism: average (or sum) every gradient over the ranks before the optimizer reads it.

Runs between autodiff and optimizer lowering (it needs the gradient of each parameter, which
only that point knows): one `all_reduce` node per bucket of gradients, in reverse parameter
order — roughly the order the backward pass finishes them — so the nodes' outputs replace the
gradients the update reads. An `all_reduce` has no kernel: the executor runs it on the host
(MPI) between the kernels around it (flowgen/distributed/collectives.py), one call per bucket.

`op` follows the loss: "mean" when each rank's loss is a mean over its part of the batch
(the global-batch mean is the average of equal parts), "sum" for a sum over the batch.
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


def all_reduce_gradients(graph, grads: dict, device, world_size: int, op: str, bucket_size: int):
    """Returns (graph with one all_reduce node per bucket appended, {name: reduced gradient})."""
    out = graph.copy_with()
    tracer = Tracer(graph.name, device)
    tracer.graph = out
    tracer.new_name = NameGen(start=next_value_index(graph))
    tracer.scopes.append(SCOPE)
    reduced = dict(grads)
    for bucket in gradient_buckets(list(grads), bucket_size):
        node = tracer.emit("all_reduce", [grads[n] for n in bucket], {"op": op, "world_size": world_size})
        reduced.update(zip(bucket, node.outputs))
    return out, reduced
