"""Loss modules: hold `reduction` (and class weights), call the functional loss."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn.module import Module

_REDUCTIONS = ("none", "mean", "sum")


class _Loss(Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction


def _optional(**kwargs) -> dict:
    """Keyword arguments that are set (so the functional keeps its own defaults for the rest)."""
    return {k: v for k, v in kwargs.items() if v is not None}


class MSELoss(_Loss):
    def forward(self, input, target):
        return NF.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    def forward(self, input, target):
        return NF.l1_loss(input, target, reduction=self.reduction)


class _WeightedLoss(_Loss):
    def __init__(self, weight=None, reduction: str = "mean"):
        super().__init__(reduction)
        self.register_buffer("weight", weight)


class CrossEntropyLoss(_WeightedLoss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        super().__init__(weight, reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, input, target):
        return NF.cross_entropy(input, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                label_smoothing=self.label_smoothing, **_optional(weight=self.weight))


class NLLLoss(_WeightedLoss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(weight, reduction)
        self.ignore_index = ignore_index

    def forward(self, input, target):
        return NF.nll_loss(input, target, ignore_index=self.ignore_index, reduction=self.reduction,
                           **_optional(weight=self.weight))


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input, target):
        return NF.binary_cross_entropy_with_logits(input, target, reduction=self.reduction,
                                                   **_optional(weight=self.weight, pos_weight=self.pos_weight))


__all__ = ["MSELoss", "L1Loss", "CrossEntropyLoss", "NLLLoss", "BCEWithLogitsLoss"]


class BCELoss(_WeightedLoss):
    def forward(self, input, target):
        return NF.binary_cross_entropy(input, target, reduction=self.reduction, **_optional(weight=self.weight))


class KLDivLoss(_Loss):
    def __init__(self, reduction: str = "mean", log_target: bool = False):
        if reduction == "batchmean":
            super().__init__("mean")
            self.reduction = "batchmean"
        else:
            super().__init__(reduction)
        self.log_target = log_target

    def forward(self, input, target):
        return NF.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


class SmoothL1Loss(_Loss):
    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):
        return NF.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):
        return NF.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class MarginRankingLoss(_Loss):
    def __init__(self, margin: float = 0.0, reduction: str = "mean"):
        super().__init__(reduction)
        self.margin = margin

    def forward(self, input1, input2, target):
        return NF.margin_ranking_loss(input1, input2, target, margin=self.margin, reduction=self.reduction)


class CosineEmbeddingLoss(_Loss):
    def __init__(self, margin: float = 0.0, reduction: str = "mean"):
        super().__init__(reduction)
        self.margin = margin

    def forward(self, input1, input2, target):
        return NF.cosine_embedding_loss(input1, input2, target, margin=self.margin, reduction=self.reduction)


class TripletMarginLoss(_Loss):
    def __init__(self, margin: float = 1.0, p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                 reduction: str = "mean"):
        super().__init__(reduction)
        self.margin, self.p, self.eps, self.swap = margin, p, eps, swap

    def forward(self, anchor, positive, negative):
        return NF.triplet_margin_loss(anchor, positive, negative, margin=self.margin, p=self.p, eps=self.eps,
                                      swap=self.swap, reduction=self.reduction)


__all__ += ["BCELoss", "KLDivLoss", "SmoothL1Loss", "HuberLoss", "MarginRankingLoss", "CosineEmbeddingLoss",
            "TripletMarginLoss"]
