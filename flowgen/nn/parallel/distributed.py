"""`flow.nn.parallel.DistributedDataParallel(module)`: every rank trains a replica of `module` on
its own part of the batch; gradients are averaged over the ranks during `backward()`.

As in OneFlow it returns the module itself (state-dict keys do not change), after:

* broadcasting its parameters (and buffers) from rank 0, so every replica starts equal;
* grouping its parameters into buckets of `bucket_size` parameters, in reverse registration
  order (roughly the order backward produces their gradients); when the last gradient of a bucket
  has been accumulated into `.grad`, the bucket is averaged over the ranks in one MPI call
  (`Tensor.register_post_accumulate_grad_hook`);
* (with `broadcast_buffers`) re-broadcasting buffers from rank 0 before every forward.

Every parameter that requires grad must receive a gradient in every backward pass: a forward
that finds a bucket half reduced raises, naming the parameters that got none.

Inside an `nn.Graph`, a module wrapped this way makes the graph data parallel: the graph inserts
the bucketed all-reduce itself (passes/gradient_allreduce.py) and the eager hooks stay idle.
"""
from __future__ import annotations

from flowgen.distributed.collectives import world


class DataParallelState:
    """What the wrapper attaches to the module (`module._data_parallel`)."""

    def __init__(self, module, bucket_size: int, broadcast_buffers: bool):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        ordered = list(reversed(named))
        self.buckets = [ordered[i:i + bucket_size] for i in range(0, len(ordered), bucket_size)]
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for _, p in bucket}
        self.ready: list = [set() for _ in self.buckets]
        self.broadcast_buffers = broadcast_buffers
        self.bucket_size = bucket_size

    def gradient_ready(self, param):
        k = self.bucket_of[id(param)]
        self.ready[k].add(id(param))
        if len(self.ready[k]) < len(self.buckets[k]):
            return
        params = [p for _, p in self.buckets[k]]
        averaged = world().all_reduce([p.grad.numpy() for p in params], "mean")
        for p, g in zip(params, averaged):
            p.grad._data[...] = g.reshape(p.grad._data.shape)
        self.ready[k].clear()

    def check_no_bucket_pending(self):
        for k, ready in enumerate(self.ready):
            if ready:
                missing = [n for n, p in reversed(self.buckets[k]) if id(p) not in ready]   # in module order
                raise RuntimeError(f"DistributedDataParallel: the last backward pass gave no gradient to "
                                   f"{', '.join(missing)}, so their bucket was never averaged over the ranks; "
                                   f"every parameter that requires grad must take part in the loss "
                                   f"(or set requires_grad=False on it before wrapping)")


def DistributedDataParallel(module, *, broadcast_buffers: bool = True, broadcast_parameters: bool = True,
                            bucket_size: int = 10, use_bucket: bool = True):  # noqa: N802 - OneFlow's name
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"DistributedDataParallel: bucket_size must be a positive number of parameters, "
                         f"got {bucket_size!r}")
    if getattr(module, "_data_parallel", None) is not None:
        raise RuntimeError(f"DistributedDataParallel: this {type(module).__name__} is already wrapped")
    comm = world()
    if broadcast_parameters:
        for p in module.parameters():
            p._data[...] = comm.broadcast(p.numpy(), root=0)
            p._version += 1
    state = DataParallelState(module, bucket_size if use_bucket else 1, broadcast_buffers)
    for bucket in state.buckets:
        for _, p in bucket:
            p.register_post_accumulate_grad_hook(state.gradient_ready)

    def before_forward(mod, args):
        if any(p.is_lazy for p in mod.parameters()):
            return None     # traced by an nn.Graph, which all-reduces in the compiled step
        state.check_no_bucket_pending()
        if state.broadcast_buffers:
            _broadcast_buffers(mod, comm)
        return None

    if broadcast_buffers:
        _broadcast_buffers(module, comm)
    module.register_forward_pre_hook(before_forward)
    object.__setattr__(module, "_data_parallel", state)
    return module


def _broadcast_buffers(module, comm):
    for b in module.buffers():
        if b is not None:
            b._data[...] = comm.broadcast(b.numpy(), root=0)
            b._version += 1
