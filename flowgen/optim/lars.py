"""LARS (OneFlow's `flow.optim.LARS`, following its lars_update kernel)."""
from __future__ import annotations

from flowgen import functional as F
from flowgen.optim.lamb import norm
from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


class LARS(RuleOptimizer):
    """Per parameter with gradient g (OneFlow's algorithm)::

        local_lr = lr * trust_coefficient * ||w|| / (eps + ||g|| + weight_decay * ||w||)
                   (lr itself when ||w|| or ||g|| is 0)
        buf = momentum * buf - local_lr * g
        w = w + buf - local_lr * weight_decay * w
    """
    checkpoint_slot_names = {"momentum_buffer": "momentum"}

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 epsilon: float = 1e-8, trust_coefficient: float = 1e-3, *,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                            ("epsilon", epsilon), ("trust_coefficient", trust_coefficient)):
            if value < 0.0:
                raise ValueError(f"LARS: {name} must be >= 0, got {value}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, epsilon=epsilon,
                                      trust_coefficient=trust_coefficient,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("momentum_buffer",)

    def update(self, group, w, g, slots, hypers):
        wd = group["weight_decay"]
        w_norm, g_norm = norm(w), norm(g)
        scaled = w_norm * group["trust_coefficient"] / (g_norm + w_norm * wd + group["epsilon"])
        lars = F.where(F.gt(w_norm, 0.0), F.where(F.gt(g_norm, 0.0), scaled, 1.0), 1.0)
        local_lr = hypers["lr"] * lars
        buf = slots["momentum_buffer"] * group["momentum"] - local_lr * g
        new_w = w + buf - (local_lr * wd) * w if wd else w + buf
        return new_w, {"momentum_buffer": buf}
