"""LAMB (OneFlow's `flow.optim.LAMB`, following its lamb_update kernel)."""
from __future__ import annotations

from flowgen import functional as F
from flowgen.optim.optimizer import implementation_hints
from flowgen.optim.rule import RuleOptimizer


def trust_ratio(numerator_norm, denominator_norm):
    """numerator_norm / denominator_norm where both are > 0, else 1 (0-d tensors)."""
    safe = F.where(F.gt(denominator_norm, 0.0), denominator_norm, 1.0)
    return F.where(F.gt(numerator_norm, 0.0), F.where(F.gt(denominator_norm, 0.0), numerator_norm / safe, 1.0), 1.0)


def norm(x):
    return (x * x).sum().sqrt()


class LAMB(RuleOptimizer):
    """Per parameter with gradient g, at update t = 1, 2, ... (OneFlow's algorithm)::

        g = g + weight_decay * w                      (adam_w_mode=False: weight decay as L2)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)   (no corrections if not do_bias_correction)
        ratio = ||w|| / ||u|| (1 when either norm is 0)
        w = w - lr * ratio * (u + weight_decay * w)   (adam_w_mode=True: decoupled weight decay)
    """
    checkpoint_slot_names = {"exp_avg": "m", "exp_avg_sq": "v"}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adam_w_mode: bool = True, do_bias_correction: bool = True, amsgrad: bool = False, *,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        if amsgrad:
            raise ValueError("LAMB: amsgrad=True is not supported (OneFlow's LAMB has no AMSGrad variant)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"LAMB: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"LAMB: invalid beta parameter at index {i}: {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode, do_bias_correction=do_bias_correction,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def slot_names(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _betas(self, group):
        return group["betas"] if group["do_bias_correction"] else (0.0, 0.0)   # 1 - 0^t = 1

    def step_hypers(self, group, step):
        beta1, beta2 = self._betas(group)
        return {"inv_bc1": 1.0 / (1.0 - beta1 ** step), "inv_sqrt_bc2": 1.0 / (1.0 - beta2 ** step) ** 0.5}

    def hyper_schedule(self, group, name, offset):
        beta1, beta2 = self._betas(group)
        beta, power = (beta1, 1.0) if name == "inv_bc1" else (beta2, 0.5)
        return {"kind": "bias_correction", "scale": 1.0, "beta": beta, "power": power, "offset": offset}

    def update(self, group, w, g, slots, hypers):
        (beta1, beta2), wd = group["betas"], group["weight_decay"]
        if wd and not group["adam_w_mode"]:
            g = g + w * wd
        m = slots["exp_avg"] * beta1 + g * (1 - beta1)
        v = slots["exp_avg_sq"] * beta2 + g * g * (1 - beta2)
        u = (m * hypers["inv_bc1"]) / (v.sqrt() * hypers["inv_sqrt_bc2"] + group["eps"])
        step = u + w * wd if wd and group["adam_w_mode"] else u
        return w - (hypers["lr"] * trust_ratio(norm(w), norm(u))) * step, {"exp_avg": m, "exp_avg_sq": v}
