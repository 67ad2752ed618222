"""`flow.backends`: PyTorch's `torch.backends` switches that model files set, mapped to what they
mean for flowgen (which generates its own kernels and calls no vendor library).

* `flow.backends.cudnn` — `benchmark`, `deterministic`, `enabled`, `allow_tf32` (cudnn.py).
* `flow.backends.mps` — `is_available()` / `is_built()`: False, flowgen has no Metal backend.
"""
from flowgen.backends import cudnn, mps  # noqa: F401

__all__ = ["cudnn", "mps"]
