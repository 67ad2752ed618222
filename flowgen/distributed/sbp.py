"""`flow.sbp`: how a global tensor's logical value is laid out over the ranks of its placement.

* `broadcast`    — every rank holds the whole value;
* `split(dim)`   — rank i holds the i-th piece along `dim` (pieces as even as possible, the
  first ones one longer when the size does not divide);
* `partial_sum`  — every rank holds a tensor of the full shape and the value is their sum.
"""
from __future__ import annotations


class sbp:  # noqa: N801 - OneFlow spells the type flow.sbp.sbp
    __slots__ = ("kind", "dim")

    def __init__(self, kind: str, dim: int | None = None):
        if kind not in ("broadcast", "split", "partial_sum"):
            raise ValueError(f"flow.sbp: unknown kind {kind!r} (expected broadcast, split or partial_sum)")
        self.kind, self.dim = kind, dim

    def __eq__(self, other):
        return isinstance(other, sbp) and (self.kind, self.dim) == (other.kind, other.dim)

    def __hash__(self):
        return hash((self.kind, self.dim))

    def __call__(self) -> "sbp":
        """OneFlow lets `flow.sbp.broadcast()` and `flow.sbp.partial_sum()` stand for the values
        themselves: calling an sbp returns it."""
        return self

    def __repr__(self):
        return f"flowgen.sbp.split(dim={self.dim})" if self.kind == "split" else f"flowgen.sbp.{self.kind}"


broadcast = sbp("broadcast")
partial_sum = sbp("partial_sum")


def split(dim: int) -> sbp:
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ValueError(f"flow.sbp.split: dim must be a non-negative int, got {dim!r}")
    return sbp("split", dim)
