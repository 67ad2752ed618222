"""`flow.device`: where a tensor lives ("cpu" or "cuda[:index]").

Eager computation always runs on the host with NumPy; the device label decides
where an `nn.Graph` built over these tensors runs (the CUDA runtime or the CPU
emulator).
"""
from __future__ import annotations


class device:  # noqa: N801 - PyTorch/OneFlow spell it in lower case
    __slots__ = ("type", "index")

    def __init__(self, spec="cpu", index: int | None = None):
        if isinstance(spec, device):
            self.type, self.index = spec.type, spec.index
            return
        if not isinstance(spec, str):
            raise TypeError(f"device: expected a string like 'cpu' or 'cuda:0', got {spec!r}")
        kind, _, idx = spec.partition(":")
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device: unknown device type {kind!r} (expected 'cpu' or 'cuda')")
        self.type = kind
        self.index = int(idx) if idx else index
        if self.type == "cuda" and self.index is None:
            self.index = 0

    def __eq__(self, other):
        try:
            other = device(other)
        except (TypeError, ValueError):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        return f"device(type='{self.type}', index={self.index})"


CPU = device("cpu")


def as_device(spec) -> device:
    return spec if isinstance(spec, device) else device(spec)
