"""A linear order of kernel groups that respects every dependency.

* `topological_order` — stable Kahn's algorithm: among ready items, the one with the smallest
  original index goes first, so an order that is already valid comes back unchanged.
* `straighten` — memory-aware: among ready items, the one that frees the most bytes net of
  what it allocates (ties: original index). Used when the graph config enables the
  straighten algorithm; always a valid order too.
* `check_order` — raises `ScheduleError` naming the first violated dependency.

``deps`` is a dict ``item -> iterable of items it depends on`` (missing key: no deps) or a
callable ``item -> iterable``. Items are compared by identity when unhashable.
"""
from __future__ import annotations

import heapq


class ScheduleError(ValueError):
    """An invalid dependency graph (cycle, unknown item) or an order that violates it."""


def _label(item) -> str:
    name = getattr(item, "name", None)
    if isinstance(name, str) and name:
        return name
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."


class _Index:
    """item -> position, by hash when possible, else by identity."""

    def __init__(self, items):
        self.by_hash: dict = {}
        self.by_id: dict = {}
        for i, item in enumerate(items):
            if self.get(item) is not None:
                raise ScheduleError(f"schedule: item {_label(item)} appears twice (positions {self.get(item)} and {i})")
            try:
                self.by_hash[item] = i
            except TypeError:
                self.by_id[id(item)] = i

    def get(self, item):
        try:
            return self.by_hash.get(item)
        except TypeError:
            return self.by_id.get(id(item))


def _deps_of(deps, item) -> list:
    if callable(deps):
        result = deps(item)
    else:
        try:
            result = deps.get(item, ())
        except TypeError:
            result = ()
    return list(result or ())


def _graph(nodes, deps):
    """Per item index: sorted unique indices of its dependencies."""
    nodes = list(nodes)
    index = _Index(nodes)
    preds = []
    for i, item in enumerate(nodes):
        ps = set()
        for d in _deps_of(deps, item):
            j = index.get(d)
            if j is None:
                raise ScheduleError(f"schedule: {_label(item)} depends on {_label(d)}, which is not among the items")
            if j == i:
                raise ScheduleError(f"schedule: {_label(item)} depends on itself")
            ps.add(j)
        preds.append(sorted(ps))
    succs = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for j in ps:
            succs[j].append(i)
    return nodes, preds, succs


def _cycle_error(nodes, preds, done) -> ScheduleError:
    remaining = [i for i in range(len(nodes)) if not done[i]]
    # Walk dependencies inside the remaining set until an item repeats: that is a cycle.
    pos: dict = {}
    path = []
    cur = remaining[0]
    while cur not in pos:
        pos[cur] = len(path)
        path.append(cur)
        cur = next(j for j in preds[cur] if not done[j])
    cycle = path[pos[cur]:] + [cur]
    chain = " -> ".join(_label(nodes[i]) for i in reversed(cycle))
    return ScheduleError(f"schedule: dependency cycle among {len(remaining)} items: {chain}")


def topological_order(nodes, deps) -> list:
    """A valid order, deterministic: stable Kahn's algorithm by original index."""
    nodes, preds, succs = _graph(nodes, deps)
    missing = [len(p) for p in preds]
    ready = [i for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    done = [False] * len(nodes)
    order = []
    while ready:
        i = heapq.heappop(ready)
        done[i] = True
        order.append(nodes[i])
        for s in succs[i]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(nodes):
        raise _cycle_error(nodes, preds, done)
    return order


def straighten(nodes, deps, size_of) -> list:
    """A valid order that keeps few bytes live: among ready items pick the one with the largest
    (bytes freed - bytes allocated); ties by original index.

    ``size_of(item)`` (callable or dict) is the bytes an item's outputs occupy; an item's outputs
    are freed once every item depending on it has run (items nobody depends on keep theirs).
    """
    nodes, preds, succs = _graph(nodes, deps)

    def size(item) -> int:
        if callable(size_of):
            return int(size_of(item) or 0)
        try:
            return int(size_of.get(item, 0) or 0)
        except TypeError:
            return 0

    sizes = [size(n) for n in nodes]
    missing = [len(p) for p in preds]
    users_left = [len(s) for s in succs]
    ready = [i for i, m in enumerate(missing) if m == 0]
    done = [False] * len(nodes)
    order = []
    while ready:
        best_pos = None
        best_key = None
        for pos, i in enumerate(ready):
            freed = sum(sizes[j] for j in preds[i] if users_left[j] == 1)
            key = (sizes[i] - freed, i)
            if best_key is None or key < best_key:
                best_key, best_pos = key, pos
        i = ready.pop(best_pos)
        done[i] = True
        order.append(nodes[i])
        for j in preds[i]:
            users_left[j] -= 1
        for s in succs[i]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(order) != len(nodes):
        raise _cycle_error(nodes, preds, done)
    return order


def check_order(order, deps) -> None:
    """Raise `ScheduleError` unless every item comes after all the items it depends on."""
    order = list(order)
    index = _Index(order)
    for i, item in enumerate(order):
        for d in _deps_of(deps, item):
            j = index.get(d)
            if j is None:
                raise ScheduleError(
                    f"schedule: {_label(item)} (position {i}) depends on {_label(d)}, which is not in the order")
            if j >= i:
                what = "itself" if j == i else f"{_label(d)}, which comes later (position {j})"
                raise ScheduleError(f"schedule: {_label(item)} (position {i}) depends on {what}")


def order_kernels(nodes, deps, size_of=None, straighten_algorithm: bool = False) -> list:
    """The scheduler entry point: `straighten` when enabled (and sizes are known), else the stable
    topological order. The result is always checked."""
    if straighten_algorithm and size_of is not None:
        order = straighten(nodes, deps, size_of)
    else:
        order = topological_order(nodes, deps)
    check_order(order, deps)
    return order
