"""`flow.inference_mode`: PyTorch's inference mode, as a context manager and a decorator.

Inside `inference_mode()` (mode=True) no op is recorded for autograd, as under `no_grad()`, and
every tensor made there is an inference tensor: `t.is_inference()` is True, and outside the mode
`t.requires_grad_(True)` on it is refused, as in PyTorch. `inference_mode(False)` inside it makes
ordinary tensors again and turns gradient recording back on (PyTorch's InferenceMode(false)).

PyTorch also refuses an inference tensor saved for backward by an op recorded outside the mode,
and an in-place write to one outside it; flowgen computes both (its tensors are NumPy arrays
either way, so the gradients and values are right) and does not refuse them.
"""
from __future__ import annotations

import contextlib

from flowgen.autograd import enable_grad, no_grad
from flowgen.tensor import inference_mode_state


def is_inference_mode_enabled() -> bool:
    return inference_mode_state.enabled


class inference_mode(contextlib.ContextDecorator):  # noqa: N801 - PyTorch spelling
    """``with flow.inference_mode():``, ``@flow.inference_mode()``, ``@flow.inference_mode`` and
    ``inference_mode(False)``."""

    def __new__(cls, mode=True):
        if isinstance(mode, bool):
            return super().__new__(cls)
        if callable(mode):                     # bare @flow.inference_mode
            return cls()(mode)
        raise TypeError(f"inference_mode(mode): mode must be True or False, got {mode!r}")

    def __init__(self, mode: bool = True):
        self.mode = mode

    def _recreate_cm(self):
        return type(self)(self.mode)           # a decorated function may run in several threads or recurse

    def __enter__(self):
        self._previous = inference_mode_state.enabled
        self._grad_mode = no_grad() if self.mode else enable_grad()
        self._grad_mode.__enter__()
        inference_mode_state.enabled = self.mode
        return self

    def __exit__(self, *exc):
        inference_mode_state.enabled = self._previous
        return self._grad_mode.__exit__(*exc)
