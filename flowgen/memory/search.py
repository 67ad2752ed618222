"""The stronger arena placement `graph.config.enable_compress_memory(True)` asks for.

Greedy by size is one fixed order; a different order can pack the same lifetimes tighter.
`compress` places the records in several orders (each with the planner's best-fit gap rule),
keeps the smallest arena, then runs a small deterministic local search (swap two records in
the best order, keep the swap when the arena does not grow). It stops early at the lower
bound (the most bytes ever live at one step): no placement can beat it.

Orders tried:

* ``size``      the planner's own order, so the result is never worse than greedy by size,
* ``breadth``   steps from the most bytes live to the least, each step's records largest
                first (TFLite's greedy by breadth),
* ``lifetime``  longest-lived first, then larger,
* ``area``      largest bytes x steps first,
* ``first_use`` in order of first use, larger first on ties.
"""
from __future__ import annotations

import random

from flowgen.memory.planner import by_size_key, place_in_order

# Local search moves: bounded by placement work (each move re-places every record, about
# n^2 overlap checks), so big graphs try fewer moves and planning stays within a second or so.
MAX_MOVES = 200
MOVE_BUDGET = 4_000_000


def _by_breadth(records: list) -> list:
    end = max(r.last for r in records) + 1
    breadth = [0] * end
    live = [[] for _ in range(end)]
    for r in records:
        for t in range(r.first, r.last + 1):
            breadth[t] += r.size
            live[t].append(r)
    order, seen = [], set()
    for t in sorted(range(end), key=lambda t: -breadth[t]):
        for r in sorted(live[t], key=by_size_key):
            if id(r) not in seen:
                seen.add(id(r))
                order.append(r)
    return order


ORDERS = (
    ("size", lambda rs: sorted(rs, key=by_size_key)),
    ("breadth", _by_breadth),
    ("lifetime", lambda rs: sorted(rs, key=lambda r: (r.first - r.last, by_size_key(r)))),
    ("area", lambda rs: sorted(rs, key=lambda r: (-r.size * (r.last - r.first + 1), by_size_key(r)))),
    ("first_use", lambda rs: sorted(rs, key=lambda r: (r.first, by_size_key(r)))),
)


def _arena(order: list) -> int:
    place_in_order(order)
    return max((r.offset + r.size for r in order), default=0)


def compress(records: list, lower_bound: int) -> str:
    """Set the records' offsets to the best placement found; return what found it."""
    if not records:
        return "compressed"
    best_name, best_order, best = None, None, None
    for name, make in ORDERS:
        order = make(records)
        arena = _arena(order)
        if best is None or arena < best:
            best_name, best_order, best = name, order, arena
        if best == lower_bound:
            break
    moves = min(MAX_MOVES, MOVE_BUDGET // len(records) ** 2) if best > lower_bound and len(records) > 1 else 0
    rng = random.Random(0)
    improved = False
    for _ in range(moves):
        i, j = rng.sample(range(len(best_order)), 2)
        order = list(best_order)
        order[i], order[j] = order[j], order[i]
        arena = _arena(order)
        if arena <= best:
            improved |= arena < best
            best_order, best = order, arena
            if best == lower_bound:
                break
    place_in_order(best_order)
    return f"compressed: {best_name}" + (" + local search" if improved else "")
