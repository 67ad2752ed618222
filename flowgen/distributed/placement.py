"""`flow.placement(type, ranks)`: the device type and the ranks a global tensor lives on."""
from __future__ import annotations

import numbers

import numpy as np

from flowgen.distributed import env


def _flat_ranks(ranks) -> list:
    """`ranks` as a list of Python ints: an int, a sequence or a 1-d NumPy array of integers
    (NumPy integer scalars included, as OneFlow accepts). Nested lists and arrays of more than one
    dimension describe hierarchical placements, which flowgen does not have."""
    if isinstance(ranks, np.ndarray):
        if ranks.ndim > 1:
            raise ValueError(f"flow.placement: ranks {ranks.tolist()} form a {ranks.ndim}-d hierarchy; flowgen "
                             f"has no hierarchical (nested) placements, give a flat list of ranks")
        ranks = ranks.reshape(-1).tolist()
    elif isinstance(ranks, numbers.Integral) and not isinstance(ranks, bool):
        ranks = [ranks]
    ranks = list(ranks)
    if not ranks or any(not isinstance(r, numbers.Integral) or isinstance(r, (bool, np.bool_)) for r in ranks):
        raise ValueError(f"flow.placement: ranks must be a non-empty flat list of ints, got {ranks!r} "
                         f"(flowgen has no hierarchical (nested) placements)")
    return [int(r) for r in ranks]


class placement:  # noqa: N801 - OneFlow spells it in lower case
    __slots__ = ("type", "ranks")

    def __init__(self, type: str = "cpu", ranks=None):  # noqa: A002 - OneFlow's keyword
        if type not in ("cpu", "cuda"):
            raise ValueError(f"flow.placement: type must be 'cpu' or 'cuda', got {type!r}")
        ranks = list(range(env.get_world_size())) if ranks is None else _flat_ranks(ranks)
        world = env.get_world_size()
        if any(not 0 <= r < world for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"flow.placement: ranks {ranks} must be distinct ranks of this world of {world}")
        self.type, self.ranks = type, ranks

    @classmethod
    def all(cls, type: str) -> "placement":  # noqa: A002
        """Every rank of the world."""
        return cls(type, range(env.get_world_size()))

    @property
    def hierarchy(self) -> tuple:
        return (len(self.ranks),)

    def __eq__(self, other):
        return isinstance(other, placement) and (self.type, self.ranks) == (other.type, other.ranks)

    def __hash__(self):
        return hash((self.type, tuple(self.ranks)))

    def __repr__(self):
        return f'flowgen.placement(type="{self.type}", ranks={self.ranks})'
