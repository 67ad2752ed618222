"""Adagrad (PyTorch semantics)."""
from __future__ import annotations

from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


class Adagrad(RuleOptimizer):
    """Per parameter with gradient g, at update t = 1, 2, ... (PyTorch's algorithm)::

        g = -g if maximize else g
        g = g + weight_decay * w
        sum = sum + g * g                                 (sum starts at initial_accumulator_value)
        w = w - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)
    """
    checkpoint_slot_names = {"sum": "sum"}

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        for name, value in (("learning rate", lr), ("lr_decay value", lr_decay),
                            ("weight_decay value", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("epsilon value", eps)):
            if value < 0.0:
                raise ValueError(f"Adagrad: invalid {name}: {value}")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps,
                                      maximize=maximize,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("sum",)

    def slot_init(self, group, name):
        return float(group["initial_accumulator_value"])

    def step_hypers(self, group, step):
        return {"lr_decay_factor": 1.0 / (1.0 + (step - 1) * group["lr_decay"])}

    def hyper_schedule(self, group, name, offset):
        return {"kind": "inverse_linear", "rate": float(group["lr_decay"]), "offset": offset - 1}

    def update(self, group, w, g, slots, hypers):
        if group["weight_decay"]:
            g = g + w * group["weight_decay"]
        total = slots["sum"] + g * g
        w = w - (hypers["lr"] * hypers["lr_decay_factor"]) * g / (total.sqrt() + group["eps"])
        return w, {"sum": total}
