"""Adam and AdamW (PyTorch semantics, single-tensor path)."""
from __future__ import annotations

import math

import numpy as np

from flowgen.optim.optimizer import Optimizer, compute_view, group_lr, implementation_hints, write_back


def bias_corrections(group: dict, step: int) -> tuple[float, float]:
    """(1 - beta1^step, sqrt(1 - beta2^step)) for Adam's step `step` (1, 1 without bias correction)."""
    if not group["do_bias_correction"]:
        return 1.0, 1.0
    beta1, beta2 = group["betas"]
    return 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)


class Adam(Optimizer):
    """Per parameter with gradient g, at step t = 1, 2, ... (PyTorch's algorithm)::

        g = -g if maximize else g
        decoupled (AdamW):  w = w * (1 - lr * weight_decay)
        otherwise:          g = g + weight_decay * w
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        v_hat = max(v_max, v) if amsgrad else v        (v_max keeps the maximum)
        denom = sqrt(v_hat) / sqrt(1 - beta2^t) + eps
        w = w - (lr / (1 - beta1^t)) * m / denom

    lr is the group's lr times its lr_scale; with OneFlow's `do_bias_correction=False` both
    bias corrections are 1.
    """
    checkpoint_slot_names = {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "max_v"}

    _decoupled_weight_decay = False
    _kind = "adam"
    counts_steps = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False, do_bias_correction: bool = True,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize,
                                      do_bias_correction=do_bias_correction,
                                      **implementation_hints(foreach, fused, capturable, differentiable)))

    def _update_group(self, group: dict) -> None:
        lr, (beta1, beta2), eps = group_lr(group), group["betas"], group["eps"]
        weight_decay, amsgrad, maximize = group["weight_decay"], group["amsgrad"], group["maximize"]
        for p, w_store, g in self._params_with_grad(group):
            w = compute_view(w_store)
            f = w.dtype.type
            state = self.state[p]
            m = self._state_tensor(p, "exp_avg")
            v = self._state_tensor(p, "exp_avg_sq")
            state["step"] = step = state.get("step", 0) + 1
            g = -g if maximize else g
            if g.dtype != w.dtype:
                g = g.astype(w.dtype)
            if weight_decay:
                if self._decoupled_weight_decay:
                    w *= f(1 - lr * weight_decay)
                else:
                    g = g + f(weight_decay) * w
            m += f(1 - beta1) * (g - m)
            v *= f(beta2)
            v += f(1 - beta2) * g * g
            if amsgrad:
                v_hat = self._state_tensor(p, "max_exp_avg_sq")
                np.maximum(v_hat, v, out=v_hat)
            else:
                v_hat = v
            bias_correction1, bias_correction2_sqrt = bias_corrections(group, step)
            denom = np.sqrt(v_hat) / f(bias_correction2_sqrt) + f(eps)
            w -= f(lr / bias_correction1) * m / denom
            write_back(w_store, w)
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if name in state:
                    state[name]._version += 1
            p._version += 1


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01): ``w *= 1 - lr * weight_decay`` before the Adam step."""

    _decoupled_weight_decay = True
    _kind = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, do_bias_correction: bool = True,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         do_bias_correction=do_bias_correction, foreach=foreach, fused=fused,
                         capturable=capturable, differentiable=differentiable)
