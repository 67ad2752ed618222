"""Sub-pixel rearrangements: PixelShuffle and its inverse."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn.module import Module


class PixelShuffle(Module):
    def __init__(self, upscale_factor: int):
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, x):
        return NF.pixel_shuffle(x, self.upscale_factor)

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"


class PixelUnshuffle(Module):
    def __init__(self, downscale_factor: int):
        super().__init__()
        self.downscale_factor = downscale_factor

    def forward(self, x):
        return NF.pixel_unshuffle(x, self.downscale_factor)

    def extra_repr(self) -> str:
        return f"downscale_factor={self.downscale_factor}"
