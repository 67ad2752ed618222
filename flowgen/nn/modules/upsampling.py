"""`nn.Upsample` (nearest / bilinear) and its fixed-mode aliases."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn.module import Module


class Upsample(Module):
    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None):
        super().__init__()
        if (size is None) == (scale_factor is None):
            raise ValueError("Upsample: give exactly one of size and scale_factor")
        if mode not in ("nearest", "bilinear"):
            raise NotImplementedError(f"Upsample: mode {mode!r} is not supported (nearest, bilinear)")
        if mode == "nearest" and align_corners is not None:
            raise ValueError("Upsample: align_corners only applies to mode='bilinear'")
        self.size = size
        self.scale_factor = (tuple(float(s) for s in scale_factor) if isinstance(scale_factor, (tuple, list))
                             else float(scale_factor) if scale_factor is not None else None)
        self.mode = mode
        self.align_corners = align_corners

    def forward(self, x):
        kwargs = {"align_corners": self.align_corners} if self.align_corners is not None else {}
        return NF.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode=self.mode, **kwargs)

    def extra_repr(self) -> str:
        info = f"scale_factor={self.scale_factor!r}" if self.scale_factor is not None else f"size={self.size!r}"
        return info + f", mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


__all__ = ["Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"]
