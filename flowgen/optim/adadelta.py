"""Adadelta (PyTorch semantics; OneFlow's is the same)."""
from __future__ import annotations

from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


class Adadelta(RuleOptimizer):
    """Per parameter with gradient g (PyTorch's algorithm)::

        g = -g if maximize else g
        g = g + weight_decay * w
        square_avg = rho * square_avg + (1 - rho) * g * g
        delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta * delta
        w = w - lr * delta
    """
    checkpoint_slot_names = {"square_avg": "square_avgs", "acc_delta": "acc_deltas"}

    def __init__(self, params, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0, *,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        if lr < 0.0:
            raise ValueError(f"Adadelta: invalid learning rate: {lr}")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Adadelta: invalid rho value: {rho}")
        if eps < 0.0:
            raise ValueError(f"Adadelta: invalid epsilon value: {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"Adadelta: invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("square_avg", "acc_delta")

    def update(self, group, w, g, slots, hypers):
        rho, eps = group["rho"], group["eps"]
        if group["weight_decay"]:
            g = g + w * group["weight_decay"]
        square_avg = slots["square_avg"] * rho + g * g * (1 - rho)
        delta = (slots["acc_delta"] + eps).sqrt() / (square_avg + eps).sqrt() * g
        acc_delta = slots["acc_delta"] * rho + delta * delta * (1 - rho)
        return w - hypers["lr"] * delta, {"square_avg": square_avg, "acc_delta": acc_delta}
