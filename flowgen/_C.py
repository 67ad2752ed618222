"""`flow._C`: OneFlow's functional namespace, for user code that calls it directly.

OneFlow binds its C++ functional API here (oneflow/core/functional/functional_api.yaml);
users call some of it (``flow._C.dropout``, ``flow._C.sparse_softmax_cross_entropy``...).
Each name below follows that signature and is built on flowgen's own ops, so it runs in
eager code and traces into graphs. A name OneFlow has and flowgen does not is absent:
``flow._C.<name>`` then raises AttributeError naming this module.
"""
from __future__ import annotations

from flowgen import functional as _F
from flowgen.nn import functional as _NF

__all__ = [
    "relu", "gelu", "rrelu", "flatten", "matmul", "dropout", "exponential_", "sparse_softmax_cross_entropy",
]


def relu(x, inplace=False):
    return _NF.relu(x, inplace)


def gelu(x):
    return _F.gelu(x)


def rrelu(x, lower=0.125, upper=1.0 / 3, training=False, inplace=False):
    return _NF.rrelu(x, lower, upper, training, inplace)


def flatten(x, start_dim=0, end_dim=-1):
    return _F.flatten(x, start_dim, end_dim)


def matmul(input, other, transpose_a=False, transpose_b=False, alpha=1.0):
    """``alpha * op(input) @ op(other)``, op transposing the last two dims when asked."""
    a = _F.transpose(input, -2, -1) if transpose_a else input
    b = _F.transpose(other, -2, -1) if transpose_b else other
    out = _F.matmul(a, b)
    return out if alpha == 1.0 else out * float(alpha)


def _refuse_generator(name, generator):
    if generator is not None:
        raise NotImplementedError(f"flow._C.{name}(generator=...): flowgen draws from its Philox stream only; "
                                  f"drop generator= (seed with flow.manual_seed)")


def dropout(input, p=0.5, training=True, inplace=False, generator=None, *, addend=None):
    """Dropout, then ``+ addend`` when given (OneFlow's fused dropout-add)."""
    _refuse_generator("dropout", generator)
    if addend is None:
        return _NF.dropout(input, p, training, inplace)
    out = _NF.dropout(input, p, training) + addend
    return input._assign(out) if inplace else out


def exponential_(x, lambd=1.0, generator=None):
    _refuse_generator("exponential_", generator)
    return x.exponential_(lambd)


def sparse_softmax_cross_entropy(logits, label):
    """``-log softmax(logits)[label]`` along the last dim (no reduction), shape of `label`: OneFlow's
    functional order of `nn.functional.sparse_softmax_cross_entropy(labels, logits)`."""
    return _NF.sparse_softmax_cross_entropy(label, logits)


def __getattr__(name):
    raise AttributeError(f"module 'flowgen._C' has no attribute {name!r}: flowgen implements these OneFlow "
                         f"functional names: {', '.join(__all__)}")
