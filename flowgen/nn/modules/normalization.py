"""Normalisation layers: BatchNorm1d/2d/3d, SyncBatchNorm, LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d.

SyncBatchNorm (PyTorch's) normalises with the statistics of the batch of all ranks together: each
rank sums its part per channel, an `all_reduce` (flowgen/distributed/collectives.py) adds the
sums, element counts included (parts may differ in size), then the sums of squared deviations
from the global mean; the running statistics take the global mean and the unbiased global
variance. The `sync_batch_norm_affine` op (flowgen/ops/norm_ops.py) all-reduces the backward's two
channel sums. The same code runs eagerly (each rank's local tensors, with or without
DistributedDataParallel: the all-reduces are MPI calls) and in a data-parallel `nn.Graph` (they
become all_reduce nodes in the forward and the backward; a loss like cross_entropy's mean is
differentiated as the rank's share of the global loss, passes/gradient_allreduce.py). In a process
started alone it is BatchNorm.
"""
from __future__ import annotations

import math

from flowgen import creation
from flowgen import dtype as dt
from flowgen import functional as F
from flowgen.autograd import no_grad
from flowgen.distributed.collectives import world
from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter, new_tensor
from flowgen.ops.registry import apply


class _NormBase(Module):
    """Shared state of batch and instance norm: affine weight/bias and running statistics."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = new_parameter((num_features,), 1.0, dtype, device)
            self.bias = new_parameter((num_features,), 0.0, dtype, device)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", new_tensor((num_features,), 0.0, dtype, device))
            self.register_buffer("running_var", new_tensor((num_features,), 1.0, dtype, device))
            self.register_buffer("num_batches_tracked", new_tensor((), 0, dt.int64, device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            init.zeros_(self.num_batches_tracked)

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_input_dim(self, x) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class _BatchNorm(_NormBase):
    def forward(self, x):
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                # Cumulative moving average, as PyTorch: factor 1/n at the n-th batch.
                factor = 1.0 / float(self.num_batches_tracked.item())
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return self._normalize(x, self.running_mean if track else None, self.running_var if track else None,
                               use_batch_stats, factor)

    def _normalize(self, x, running_mean, running_var, use_batch_stats: bool, factor: float):
        return NF.batch_norm(x, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor,
                             self.eps)


class BatchNorm1d(_BatchNorm):
    """Batch norm over (N, C) or (N, C, L) inputs."""

    def _check_input_dim(self, x) -> None:
        if x.ndim not in (2, 3):
            raise ValueError(f"BatchNorm1d: expected 2D or 3D input (got {x.ndim}D input of shape "
                             f"{tuple(x.shape)})")


class BatchNorm2d(_BatchNorm):
    """Batch norm over (N, C, H, W) inputs."""

    def _check_input_dim(self, x) -> None:
        if x.ndim != 4:
            raise ValueError(f"BatchNorm2d: expected 4D input (got {x.ndim}D input of shape {tuple(x.shape)})")


class BatchNorm3d(_BatchNorm):
    """Batch norm over (N, C, D, H, W) inputs."""

    def _check_input_dim(self, x) -> None:
        if x.ndim != 5:
            raise ValueError(f"BatchNorm3d: expected 5D input (got {x.ndim}D input of shape {tuple(x.shape)})")


class SyncBatchNorm(_BatchNorm):
    """Batch norm over (N, C, ...) inputs with the statistics of all ranks' batches (see the module
    doc). `process_group` must be None: the group is every rank."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        if process_group is not None:
            raise NotImplementedError("SyncBatchNorm: process_group must be None (the statistics are reduced "
                                      "over every rank); groups of ranks are not supported")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _check_input_dim(self, x) -> None:
        if x.ndim < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {x.ndim}D input of shape "
                             f"{tuple(x.shape)})")

    def _normalize(self, x, running_mean, running_var, use_batch_stats: bool, factor: float):
        world_size = world().size
        if not use_batch_stats or world_size == 1:
            return super()._normalize(x, running_mean, running_var, use_batch_stats, factor)
        if x.is_global:
            raise NotImplementedError(f"SyncBatchNorm: a global input (sbp {', '.join(map(str, x.sbp))}) on {world_size} ranks is not "
                                      f"supported; pass each rank's local batch (eager DistributedDataParallel) or "
                                      f"call it inside a data-parallel nn.Graph")
        return _sync_batch_norm(x, running_mean, running_var, self.weight, self.bias, factor, self.eps, world_size)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """`module` with every BatchNorm1d/2d/3d (itself included) replaced by a SyncBatchNorm holding
        the same parameter and buffer tensors, as PyTorch's."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            for name in ("weight", "bias"):
                if module.affine:
                    setattr(converted, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                converted.register_buffer(name, getattr(module, name))
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def _sync_batch_norm(x, running_mean, running_var, weight, bias, momentum: float, eps: float, world_size: int):
    """Training batch norm with the statistics of every rank's part of the batch together."""
    dims = (0,) + tuple(range(2, x.ndim))
    local_sum = F.sum(x, dims, keepdim=True)
    local_count = creation.full_like(local_sum, float(math.prod(x.shape[d] for d in dims)), dtype=dt.float32)
    total, count = apply("all_reduce", local_sum, local_count, op="sum", world_size=world_size)
    mean = total / count
    diff = x - mean
    var = apply("all_reduce", F.sum(diff * diff, dims, keepdim=True), op="sum", world_size=world_size) / count
    if running_mean is not None and running_var is not None:
        with no_grad():
            channels = (x.shape[1],)
            running_mean.copy_(running_mean + (F.reshape(mean, channels) - running_mean) * momentum)
            unbiased = F.reshape(var * count / F.clamp(count - 1.0, min=1.0), channels)
            running_var.copy_(running_var + (unbiased - running_var) * momentum)
    channel = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    return apply("sync_batch_norm_affine", x, mean, F.rsqrt(var + eps),
                   1.0 if weight is None else F.reshape(weight, channel),
                   0.0 if bias is None else F.reshape(bias, channel), count, world_size=world_size)


class _InstanceNorm(_NormBase):
    """Per-sample, per-channel normalisation over the spatial dims; unbatched inputs too."""

    spatial_dims = 2

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def forward(self, x):
        batched = self.spatial_dims + 2
        if x.ndim not in (batched - 1, batched):
            raise ValueError(f"{self._get_name()}: expected {batched - 1}D or {batched}D input (got {x.ndim}D "
                             f"input of shape {tuple(x.shape)})")
        if x.ndim == batched - 1:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        # momentum=None is 0 here, as PyTorch's InstanceNorm (not BatchNorm's cumulative average): the
        # running statistics then keep their initial values.
        momentum = 0.0 if self.momentum is None else self.momentum
        return NF.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                use_input_stats=self.training or not self.track_running_stats,
                                momentum=momentum, eps=self.eps)


class InstanceNorm1d(_InstanceNorm):
    spatial_dims = 1


class InstanceNorm2d(_InstanceNorm):
    spatial_dims = 2


class InstanceNorm3d(_InstanceNorm):
    spatial_dims = 3


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = NF.normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = new_parameter(self.normalized_shape, 1.0, dtype, device)
            if bias:
                self.bias = new_parameter(self.normalized_shape, 0.0, dtype, device)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        return NF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    """x / sqrt(mean(x^2 over normalized_shape) + eps) * weight; eps None is the input dtype's
    machine epsilon (PyTorch)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.normalized_shape = NF.normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = new_parameter(self.normalized_shape, 1.0, dtype, device)
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, x):
        return NF.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps = eps
        self.affine = affine
        if affine:
            self.weight = new_parameter((num_channels,), 1.0, dtype, device)
            self.bias = new_parameter((num_channels,), 0.0, dtype, device)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, x):
        return NF.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "InstanceNorm1d", "InstanceNorm2d",
           "InstanceNorm3d", "LayerNorm", "GroupNorm"]
