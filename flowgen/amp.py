"""`flow.amp.GradScaler`: dynamic loss scaling with PyTorch's eager semantics; `flow.amp.autocast`
(flowgen/mixed_precision.py: the op lists of mixed precision, eager and nn.Graph alike).

Eager flowgen computes in the tensors' own dtypes (float32 by default), so
with fp32 models the scaler mostly passes through: it still multiplies the
loss, divides the gradients back, skips `optimizer.step()` when a gradient is
inf/NaN and adapts the scale exactly as PyTorch does. `nn.Graph` reads the
same settings (`state_dict()`) through `set_grad_scaler` to build the scaling
into the compiled step.
"""
from __future__ import annotations

import numpy as np

from flowgen.mixed_precision import autocast  # noqa: F401 - flow.amp.autocast, as torch.amp.autocast
from flowgen.tensor import Tensor

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _f32(value: float) -> float:
    return float(np.float32(value))


class GradScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, device: str = "cuda"):
        if growth_factor <= 1.0:
            raise ValueError("The growth factor must be > 1.0.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError("The backoff factor must be < 1.0 and > 0.")
        if growth_interval <= 0:
            raise ValueError("growth_interval must be a positive integer")
        self._enabled = enabled
        self._scale = _f32(init_scale)
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}

    # ------------------------------------------------------------------ loop
    def scale(self, outputs):
        """Multiply a loss (or a nested list/tuple of them) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            with np.errstate(over="ignore"):     # an overflowing scale is what update() corrects
                return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"GradScaler.scale: outputs must be a Tensor or a list/tuple of Tensors, got "
                        f"{type(outputs).__name__}")

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": False})

    def unscale_(self, optimizer) -> None:
        """Divide this optimizer's gradients by the scale (in place of them) and record inf/NaN."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = np.float32(1.0 / np.float64(self._scale))
        found_inf = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.numpy_view()
                if not np.isfinite(grad).all():
                    found_inf = True
                # Replace, don't write in place: eager gradients may share one buffer.
                with np.errstate(invalid="ignore"):
                    p.grad._data = np.array(grad * inv_scale, dtype=grad.dtype, order="C")
                p.grad._version += 1
        state["found_inf"] = found_inf
        state["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """Unscale if not done yet, then `optimizer.step()` unless a gradient was inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        result = None if state["found_inf"] else optimizer.step(*args, **kwargs)
        state["stage"] = _STEPPED
        return result

    def update(self, new_scale=None) -> None:
        """Back off after an inf/NaN step, grow after `growth_interval` clean ones (or set `new_scale`)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = _f32(new_scale.item() if isinstance(new_scale, Tensor) else new_scale)
        else:
            if not self._per_optimizer:
                raise RuntimeError("No inf checks were recorded prior to update.")
            if any(s["found_inf"] for s in self._per_optimizer.values()):
                self._scale = _f32(self._scale * self._backoff_factor)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale = _f32(self._scale * self._growth_factor)
                    self._growth_tracker = 0
        self._per_optimizer.clear()

    # --------------------------------------------------------------- access
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        scale = state_dict["scale"]
        self._scale = _f32(scale.item() if isinstance(scale, Tensor) else scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        self._growth_tracker = int(tracker.item() if isinstance(tracker, Tensor) else tracker)


class StaticGradScaler(GradScaler):
    """A fixed loss scale (OneFlow's `flow.amp.StaticGradScaler`): never grows or backs off."""

    def __init__(self, scale_factor: float):
        super().__init__(init_scale=scale_factor)

    def update(self, new_scale=None) -> None:
        self._per_optimizer.clear()
