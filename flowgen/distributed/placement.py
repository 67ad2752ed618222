"""`flow.placement(type, ranks)`: the device type and the ranks a global tensor lives on."""
from __future__ import annotations

from flowgen.distributed import env


class placement:  # noqa: N801 - OneFlow spells it in lower case
    __slots__ = ("type", "ranks")

    def __init__(self, type: str = "cpu", ranks=None):  # noqa: A002 - OneFlow's keyword
        if type not in ("cpu", "cuda"):
            raise ValueError(f"flow.placement: type must be 'cpu' or 'cuda', got {type!r}")
        ranks = list(range(env.get_world_size())) if ranks is None else list(ranks)
        if not ranks or any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"flow.placement: ranks must be a non-empty flat list of ints, got {ranks!r} "
                             f"(flowgen has no hierarchical (nested) placements)")
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
