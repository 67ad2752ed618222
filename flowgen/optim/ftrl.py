"""FTRL (OneFlow's `flow.one_embedding.Ftrl`, following its ftrl_update kernel)."""
from __future__ import annotations

from flowgen import functional as F
from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


class FTRL(RuleOptimizer):
    """Per parameter with gradient g (OneFlow's algorithm; p = lr_power)::

        g = g + weight_decay * w
        acc' = acc + g * g                                  (acc starts at initial_accumulator_value)
        z = z + g - (acc'^p - acc^p) / lr * w
        w = (sign(z) * lambda1 - z) / ((beta + acc'^p) / lr + lambda2)   where |z| >= lambda1, else 0
    """
    checkpoint_slot_names = {"accumulator_value": "accumulate", "z": "z"}

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, lr_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, lambda1: float = 0.0, lambda2: float = 0.0,
                 beta: float = 0.0, *, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        if not lr > 0.0:
            raise ValueError(f"FTRL: lr must be > 0 (the update divides by it), got {lr}")
        if weight_decay < 0.0:
            raise ValueError(f"FTRL: weight_decay must be >= 0, got {weight_decay}")
        if not initial_accumulator_value > 0.0 and lr_power < 0.0:
            raise ValueError(f"FTRL: initial_accumulator_value must be > 0 with lr_power = {lr_power} < 0, got "
                             f"{initial_accumulator_value}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, lr_power=lr_power,
                                      initial_accumulator_value=initial_accumulator_value, lambda1=lambda1,
                                      lambda2=lambda2, beta=beta,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("accumulator_value", "z")

    def slot_init(self, group, name):
        return float(group["initial_accumulator_value"]) if name == "accumulator_value" else 0.0

    def update(self, group, w, g, slots, hypers):
        power, lambda1, lr = group["lr_power"], group["lambda1"], hypers["lr"]
        if group["weight_decay"]:
            g = g + w * group["weight_decay"]
        acc = slots["accumulator_value"] + g * g
        acc_powered = acc.pow(power)
        z = slots["z"] + g - (acc_powered - slots["accumulator_value"].pow(power)) / lr * w
        solved = (z.sign() * lambda1 - z) / ((acc_powered + group["beta"]) / lr + group["lambda2"])
        return F.where(F.ge(z.abs(), lambda1), solved, 0.0), {"accumulator_value": acc, "z": z}
