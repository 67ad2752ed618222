"""`nn.Embedding`: a lookup table of vectors."""
from __future__ import annotations

from flowgen.nn import functional as NF
from flowgen.nn import init
from flowgen.nn.module import Module
from flowgen.nn.modules._utils import new_parameter
from flowgen.nn.parameter import Parameter


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight=None, _freeze: bool = False, device=None, dtype=None):
        super().__init__()
        if sparse:
            raise NotImplementedError("Embedding: sparse=True (sparse gradients) is not supported; the weight gets "
                                      "a dense gradient with sparse=False")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} must be within num_embeddings "
                                 f"({num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = bool(scale_grad_by_freq), sparse
        if _weight is None:
            self.weight = new_parameter((num_embeddings, embedding_dim), dtype=dtype, device=device)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"Embedding: _weight has shape {tuple(_weight.shape)}, expected "
                                 f"{(num_embeddings, embedding_dim)}")
            self.weight = Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight.numpy_view()[self.padding_idx] = 0
            self.weight._version += 1

    def forward(self, x):
        return NF.embedding(x, self.weight, padding_idx=self.padding_idx, max_norm=self.max_norm,
                            norm_type=self.norm_type, scale_grad_by_freq=self.scale_grad_by_freq)

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, padding_idx: int | None = None, **kwargs):
        if embeddings.ndim != 2:
            raise ValueError("Embedding.from_pretrained: embeddings must be 2-D")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx=padding_idx, _weight=embeddings, _freeze=freeze, **kwargs)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s
