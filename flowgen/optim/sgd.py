"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay (PyTorch semantics)."""
from __future__ import annotations

from flowgen.optim.optimizer import Optimizer, compute_view, group_lr, implementation_hints, required, write_back


class SGD(Optimizer):
    """Per parameter with gradient g (PyTorch's algorithm)::

        d = -g if maximize else g
        if weight_decay: d = d + weight_decay * w
        if momentum:
            buf = d                                       (first step: no state yet)
            buf = momentum * buf + (1 - dampening) * d    (later steps)
            d = d + momentum * buf if nesterov else buf
        w = w - lr * d                                    (lr: the group's lr times its lr_scale)
    """
    checkpoint_slot_names = {"momentum_buffer": "momentum"}

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def _update_group(self, group: dict) -> None:
        lr, momentum, dampening = group_lr(group), group["momentum"], group["dampening"]
        weight_decay, nesterov, maximize = group["weight_decay"], group["nesterov"], group["maximize"]
        for p, w_store, g in self._params_with_grad(group):
            w = compute_view(w_store)
            f = w.dtype.type  # scalars in the parameter's precision, as PyTorch's kernels use them
            d = -g if maximize else g
            if d.dtype != w.dtype:
                d = d.astype(w.dtype)
            if weight_decay:
                d = d + f(weight_decay) * w
            if momentum:
                state = self.state[p]
                if state.get("momentum_buffer") is None:
                    buf = self._state_tensor(p, "momentum_buffer", d)
                else:
                    buf = state["momentum_buffer"].numpy_view()
                    buf *= f(momentum)
                    buf += f(1 - dampening) * d
                    state["momentum_buffer"]._version += 1
                d = d + f(momentum) * buf if nesterov else buf
            w -= f(lr) * d
            write_back(w_store, w)
            p._version += 1
