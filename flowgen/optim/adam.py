"""Adam and AdamW (PyTorch semantics, single-tensor path)."""
from __future__ import annotations

import math

import numpy as np

from flowgen.optim.optimizer import Optimizer, compute_view, write_back


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
    """

    _decoupled_weight_decay = False
    _kind = "adam"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False):
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
                                      amsgrad=amsgrad, maximize=maximize))

    def _update_group(self, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
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
            bias_correction1 = 1 - beta1 ** step
            bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
            denom = np.sqrt(v_hat) / f(bias_correction2_sqrt) + f(eps)
            w -= f(lr / bias_correction1) * m / denom
            write_back(w_store, w)
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if name in state:
                    state[name]._version += 1
            p._version += 1

    def update_rule(self) -> list[dict]:
        """Per group: ``{"kind": "adam" | "adamw", "lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad",
        "maximize", "params": [...], "param_indices": [...], "state": {"step": "int, counts from 1",
        "exp_avg": "zeros", "exp_avg_sq": "zeros", ("max_exp_avg_sq": "zeros" if amsgrad)}}`` — the arithmetic
        is the class docstring's; "adamw" decays the weight before the update."""
        rules = []
        for group, indices in zip(self.param_groups, self._param_indices()):
            state = {"step": "int, counts from 1", "exp_avg": "zeros", "exp_avg_sq": "zeros"}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = "zeros"
            rules.append({
                "kind": self._kind, "lr": float(group["lr"]), "beta1": float(group["betas"][0]),
                "beta2": float(group["betas"][1]), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]), "amsgrad": bool(group["amsgrad"]),
                "maximize": bool(group["maximize"]), "params": list(group["params"]), "param_indices": indices,
                "state": state,
            })
        return rules


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01): ``w *= 1 - lr * weight_decay`` before the Adam step."""

    _decoupled_weight_decay = True
    _kind = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
