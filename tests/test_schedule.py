"""Scheduler: stable topological order, memory-aware straightening, order checking."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


import flowgen.schedule.order as order_mod
topological_order = order_mod.topological_order
straighten = order_mod.straighten
check_order = order_mod.check_order
ScheduleError = order_mod.ScheduleError


@dataclass(eq=False)
class K:
    """Stand-in kernel group (identity-hashed, like the real ones)."""

    name: str
    size: int = 0

    def __repr__(self) -> str:
        return self.name


def _valid(order, deps) -> bool:
    pos = {id(n): i for i, n in enumerate(order)}
    return all(pos[id(d)] < pos[id(n)] for n in order for d in deps.get(n, ()))


def _peak(order, deps, size_of) -> int:
    """Bytes live at the worst point: an item's output lives until its last dependent has run."""
    users = {id(n): 0 for n in order}
    for n in order:
        for d in set(map(id, deps.get(n, ()))):
            users[d] += 1
    by_id = {id(n): n for n in order}
    live = peak = 0
    for n in order:
        live += size_of(n)
        peak = max(peak, live)
        for d in set(map(id, deps.get(n, ()))):
            users[d] -= 1
            if users[d] == 0:
                live -= size_of(by_id[d])
    return peak


@st.composite
def dags(draw, max_nodes=30):
    """(nodes in a valid order, deps dict, a permutation of the nodes)."""
    n = draw(st.integers(0, max_nodes))
    nodes = [K(f"k{i}", draw(st.integers(0, 1 << 20))) for i in range(n)]
    deps = {}
    for j in range(n):
        if j:
            picks = draw(st.lists(st.integers(0, j - 1), max_size=3))
            deps[nodes[j]] = [nodes[i] for i in picks]
    perm = draw(st.permutations(nodes))
    return nodes, deps, perm


@settings(max_examples=200, deadline=None)
@given(dags())
def test_random_dags_valid_and_stable(dag):
    nodes, deps, shuffled = dag
    assert topological_order(nodes, deps) == nodes                    # already valid: unchanged
    out = topological_order(shuffled, deps)
    assert sorted(map(id, out)) == sorted(map(id, nodes)) and _valid(out, deps)
    check_order(out, deps)
    assert topological_order(shuffled, deps) == out                   # deterministic
    assert topological_order(shuffled, lambda k: deps.get(k, ())) == out
    straight = straighten(shuffled, deps, lambda k: k.size)
    assert sorted(map(id, straight)) == sorted(map(id, nodes)) and _valid(straight, deps)
    check_order(straight, deps)
    assert straighten(shuffled, deps, {k: k.size for k in nodes}) == straight
    if _valid(shuffled, deps):
        assert out == list(shuffled)


@settings(max_examples=60, deadline=None)
@given(dags(max_nodes=7))
def test_kahn_is_the_smallest_valid_order_by_index(dag):
    nodes, deps, shuffled = dag
    index = {id(k): i for i, k in enumerate(shuffled)}
    valid = [p for p in itertools.permutations(shuffled) if _valid(p, deps)]
    best = min(valid, key=lambda p: [index[id(k)] for k in p])
    assert topological_order(shuffled, deps) == list(best)


def test_reorders_only_what_it_must():
    a, b, c, d = K("a"), K("b"), K("c"), K("d")
    deps = {b: [d], c: [a]}
    assert topological_order([a, b, c, d], deps) == [a, c, d, b]
    assert topological_order([], {}) == []


def test_straighten_finishes_a_branch_before_starting_the_next():
    r, a1, b1 = K("r", 1), K("a1", 100), K("b1", 100)
    a2, b2, s = K("a2", 1), K("b2", 1), K("s", 1)
    deps = {a1: [r], b1: [r], a2: [a1], b2: [b1], s: [a2, b2]}
    size = lambda k: k.size  # noqa: E731
    breadth_first = [r, a1, b1, a2, b2, s]
    assert topological_order(breadth_first, deps) == breadth_first
    straight = straighten(breadth_first, deps, size)
    assert straight == [r, a1, a2, b1, b2, s]
    assert _peak(breadth_first, deps, size) == 201 and _peak(straight, deps, size) == 102
    assert order_mod.order_kernels(breadth_first, deps, size, straighten_algorithm=True) == straight
    assert order_mod.order_kernels(breadth_first, deps, size) == breadth_first
    assert order_mod.order_kernels(breadth_first, deps, None, straighten_algorithm=True) == breadth_first


def test_cycles_and_bad_dependencies_are_errors():
    a, b, c = K("a"), K("b"), K("c")
    with pytest.raises(ScheduleError, match=r"cycle .*(a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"):
        topological_order([a, b, c], {a: [c], b: [a], c: [b]})
    with pytest.raises(ScheduleError, match="cycle"):
        straighten([a, b], {a: [b], b: [a]}, lambda k: 0)
    with pytest.raises(ScheduleError, match="depends on itself"):
        topological_order([a], {a: [a]})
    with pytest.raises(ScheduleError, match="not among the items"):
        topological_order([a], {a: [b]})
    with pytest.raises(ScheduleError, match="appears twice"):
        topological_order([a, a], {})


def test_check_order_messages():
    a, b = K("a"), K("b")
    check_order([a, b], {b: [a]})
    with pytest.raises(ScheduleError, match=r"a \(position 0\) depends on b, which comes later \(position 1\)"):
        check_order([a, b], {a: [b]})
    with pytest.raises(ScheduleError, match="not in the order"):
        check_order([a], {a: [b]})
    with pytest.raises(ScheduleError, match="depends on itself"):
        check_order([a], {a: [a]})


def test_unhashable_items_by_identity():
    a, b = ["a"], ["b"]
    deps = lambda item: [a] if item is b else []  # noqa: E731
    order = topological_order([b, a], deps)
    assert order[0] is a and order[1] is b
    check_order(order, deps)
    assert [x[0] for x in straighten([b, a], deps, lambda item: 1)] == ["a", "b"]
