"""RMSprop (PyTorch semantics)."""
from __future__ import annotations

from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


class RMSprop(RuleOptimizer):
    """Per parameter with gradient g (PyTorch's algorithm)::

        g = -g if maximize else g
        g = g + weight_decay * w
        square_avg = alpha * square_avg + (1 - alpha) * g * g
        centered:   grad_avg = alpha * grad_avg + (1 - alpha) * g
                    avg = sqrt(square_avg - grad_avg * grad_avg) + eps
        otherwise:  avg = sqrt(square_avg) + eps
        momentum:   buf = momentum * buf + g / avg;  w = w - lr * buf
        otherwise:  w = w - lr * g / avg
    """
    checkpoint_slot_names = {"square_avg": "mean_square", "grad_avg": "mean_gradient", "momentum_buffer": "momentum"}

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        for name, value in (("learning rate", lr), ("epsilon value", eps), ("momentum value", momentum),
                            ("weight_decay value", weight_decay), ("alpha value", alpha)):
            if value < 0.0:
                raise ValueError(f"RMSprop: invalid {name}: {value}")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered, maximize=maximize,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ()) + \
            (("grad_avg",) if group["centered"] else ())

    def update(self, group, w, g, slots, hypers):
        alpha, eps, momentum = group["alpha"], group["eps"], group["momentum"]
        if group["weight_decay"]:
            g = g + w * group["weight_decay"]
        new = {"square_avg": slots["square_avg"] * alpha + g * g * (1 - alpha)}
        if group["centered"]:
            new["grad_avg"] = slots["grad_avg"] * alpha + g * (1 - alpha)
            avg = (new["square_avg"] - new["grad_avg"] * new["grad_avg"]).sqrt() + eps
        else:
            avg = new["square_avg"].sqrt() + eps
        if momentum > 0:
            new["momentum_buffer"] = slots["momentum_buffer"] * momentum + g / avg
            return w - hypers["lr"] * new["momentum_buffer"], new
        return w - hypers["lr"] * g / avg, new
