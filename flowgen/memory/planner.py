"""Arena memory planner: liveness of kernel-produced values -> byte offsets in one arena.

Input is plain data (no IR import needed, so codegen and tests can call it directly):

* ``steps``    — one `Step` per kernel launch, in execution order,
* ``aliases``  — ``view -> base``: a view shares its base's memory at offset 0 (views of
  views chain); the base stays alive over every use of its views,
* ``external`` — values with their own allocation (graph inputs, state, constants); ignored,
  and so are views of them,
* ``live_out`` — values that must survive the last step (outputs, state write-backs).

A value is live from the first step that touches it (normally the step that writes it) to
the last step that reads or writes it, or to the end (time ``len(steps)``) when it, or one
of its views, is live-out. Two values may share bytes only when their lifetimes are
disjoint, with two exceptions that hold by construction: a view and its base, and an
in-place pair (a step's output reusing an input of the same byte size and element count whose
last use is that step, where the step declares that pair safe: `Step.in_place`).

Placement is "greedy by size" (Pisarchyk & Lee 2020, as in TFLite's arena planner):
lifetime records, largest first (ties: first use, then name, then discovery order), each
go into the smallest gap between already-placed records that overlap it in time, or on
top of them when no gap fits. ``FLOWGEN_NAIVE_MEMORY=1`` (or ``naive=True``) gives every
value its own slot instead, for debugging.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_ALIGNMENT = 256


@dataclass(eq=False)
class Step:
    """One kernel launch: the values it reads and writes (``flowgen.ir.graph.Value``s).

    ``in_place`` is the kernel's promise that makes in-place reuse safe, pair by pair: the
    (write, read) pairs where the kernel reads every element of the read before it stores the
    write's bytes over it, and never afterwards (an elementwise kernel: every output over every
    full-size input; a row kernel: the pairs its op declares, `ops.lowering.Template.in_place`).
    Only such a write may take over the memory of its read, and only when the read's last use is
    this step (same byte size and element count). Any other pair never shares memory, whatever
    the sizes: an input read at other elements (a broadcast, a window, a weight every row reads)
    or after an output is stored. Codegen holds the other half of the contract: the two
    parameters of an in-place pair are not declared ``__restrict__``, and a launch whose buffers
    share memory outside its pairs is refused (`flowgen.codegen.program.declare_shared_memory`).
    """

    reads: list
    writes: list
    in_place: frozenset = frozenset()   # (write, read) value pairs
    name: str = ""   # optional, for error messages (e.g. the kernel name)


@dataclass(eq=False)
class MemoryPlan:
    offsets: dict            # Value -> byte offset in the arena (views get their base's offset)
    arena_bytes: int         # size of the arena
    lower_bound_bytes: int   # max over steps of the aligned bytes live at that step
    naive_bytes: int         # every arena buffer in its own allocation (aligned sizes summed)
    inplace: dict            # output Value -> input Value whose memory it reuses
    alignment: int = DEFAULT_ALIGNMENT
    lifetimes: dict = field(default_factory=dict)   # Value -> (first step, last step); end == n_steps
    strategy: str = "greedy_by_size"                # or "naive"
    n_buffers: int = 0       # arena values that own memory (views excluded)

    def describe(self) -> str:
        """One line, e.g. ``memory: 12 buffers, naive 1.20 MB -> arena 0.40 MB (lower bound 0.38 MB)``."""
        unit, scale = _unit(max(self.naive_bytes, self.arena_bytes))

        def fmt(n: int) -> str:
            return f"{n} B" if unit == "B" else f"{n / scale:.2f} {unit}"

        line = (f"memory: {self.n_buffers} buffers, naive {fmt(self.naive_bytes)} -> arena {fmt(self.arena_bytes)} "
                f"(lower bound {fmt(self.lower_bound_bytes)})")
        if self.inplace:
            line += f", {len(self.inplace)} in-place"
        if self.strategy != "greedy_by_size":
            line += f" [{self.strategy}]"
        return line

    def __str__(self) -> str:
        return self.describe()


def _unit(nbytes: int) -> tuple:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1


def align_up(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    return -(-int(nbytes) // alignment) * alignment


def _numel(v) -> int | None:
    n = getattr(v, "numel", None)
    if n is not None:
        return int(n)
    shape = getattr(v, "shape", None)
    if shape is None:
        return None
    result = 1
    for d in shape:
        result *= int(d)
    return result


def _name(v) -> str:
    return str(getattr(v, "name", ""))


class _Record:
    """A block of arena memory: one buffer, or several chained through in-place reuse."""

    __slots__ = ("members", "first", "last", "size", "order", "offset", "merged_steps")

    def __init__(self, root, first, last, size, order):
        self.members = [root]
        self.first = first
        self.last = last
        self.size = size
        self.order = order
        self.offset = None
        self.merged_steps = set()

    def overlaps(self, other) -> bool:
        return self.first <= other.last and other.first <= self.last


class _Liveness:
    """Roots (values owning memory), their lifetimes, and every arena value's root."""

    def __init__(self, steps, aliases, external, live_out, alignment):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"memory planner: alignment must be a power of two, got {alignment}")
        self.steps = list(steps)
        self.aliases = dict(aliases or {})
        self.external = external if external is not None else set()
        self.live_out = live_out if live_out is not None else set()
        self.alignment = alignment
        self.end = len(self.steps)
        self._root_cache: dict = {}

        self.root_of: dict = {}    # arena value (view or root) -> root, discovery order
        self.first: dict = {}      # root -> first step touching it (or its views)
        self.last: dict = {}       # root -> last step touching it; self.end if live-out
        self.order: dict = {}      # root -> discovery index (tie-break of last resort)
        for i, step in enumerate(self.steps):
            for v in list(step.reads) + list(step.writes):
                root = self._note(v)
                if root is None:
                    continue
                self.first[root] = min(self.first[root], i)
                self.last[root] = max(self.last[root], i)
        # Views that no step touches still get an offset when their root is in the arena
        # (e.g. a graph output that is a reshape of a kernel result).
        for view in self.aliases:
            root = self.root(view)
            if root is not None and root in self.first:
                self.root_of.setdefault(view, root)
        # Live-out: the root survives to the end (set iteration order does not matter: max).
        for v in self.live_out:
            root = self.root(v)
            if root is not None and root in self.last:
                self.last[root] = self.end
        self.size = {r: align_up(r.nbytes, alignment) for r in self.first}

    def root(self, v):
        """The value owning ``v``'s memory, or None when that memory is external."""
        key = id(v)
        if key in self._root_cache:
            return self._root_cache[key]
        seen = []
        cur = v
        while True:
            if cur in self.external:
                result = None
                break
            if cur not in self.aliases:
                result = cur
                break
            if any(cur is s for s in seen):
                chain = " -> ".join(_name(s) or repr(s) for s in seen + [cur])
                raise ValueError(f"memory planner: alias cycle {chain}")
            seen.append(cur)
            cur = self.aliases[cur]
        for s in seen + [v]:
            self._root_cache[id(s)] = result
        return result

    def _note(self, v):
        root = self.root(v)
        if root is None:
            return None
        if root not in self.first:
            self.first[root] = self.end
            self.last[root] = -1
            self.order[root] = len(self.order)
        self.root_of.setdefault(v, root)
        self.root_of.setdefault(root, root)
        return root

    def roots(self) -> list:
        return list(self.first)   # discovery order

    def lower_bound(self, records) -> int:
        delta = [0] * (self.end + 2)
        for r in records:
            delta[r.first] += r.size
            delta[r.last + 1] -= r.size
        best = cur = 0
        for d in delta:
            cur += d
            best = max(best, cur)
        return best


def _naive_requested(naive) -> bool:
    if naive is not None:
        return bool(naive)
    return os.environ.get("FLOWGEN_NAIVE_MEMORY", "") not in ("", "0")


def plan_memory(steps, aliases=None, external=None, live_out=None, alignment: int = DEFAULT_ALIGNMENT,
                naive: bool | None = None, inplace: bool = True, placement=None) -> MemoryPlan:
    """Plan the arena. ``naive=None`` reads ``FLOWGEN_NAIVE_MEMORY``; ``inplace=False`` disables reuse
    of a step's input for its output (`Step.in_place`). ``placement(records, lower_bound)`` sets the
    records' offsets and returns its strategy name (default: greedy by size; memory/search.py
    searches several orders)."""
    if _naive_requested(naive):
        return plan_naive(steps, aliases, external, live_out, alignment)
    lv = _Liveness(steps, aliases, external, live_out, alignment)

    records: dict = {}     # root -> its record (in-place chains share one)
    for root in lv.roots():
        records[root] = _Record(root, lv.first[root], lv.last[root], lv.size[root], lv.order[root])
    pairs: dict = {}
    if inplace:
        pairs = _merge_inplace(lv, records)

    unique = []
    seen = set()
    for root in lv.roots():
        rec = records[root]
        if id(rec) not in seen:
            seen.add(id(rec))
            unique.append(rec)

    lower_bound = lv.lower_bound(unique)
    strategy = _greedy_by_size(unique) if placement is None else placement(unique, lower_bound)
    arena = max((r.offset + r.size for r in unique), default=0)
    offsets = {v: records[root].offset for v, root in lv.root_of.items()}
    return MemoryPlan(
        offsets=offsets,
        arena_bytes=arena,
        lower_bound_bytes=lower_bound,
        naive_bytes=sum(lv.size.values()),
        inplace=pairs,
        alignment=alignment,
        lifetimes={r: (lv.first[r], lv.last[r]) for r in lv.roots()},
        strategy=strategy,
        n_buffers=len(lv.first),
    )


def _merge_inplace(lv: _Liveness, records: dict) -> dict:
    """Fold each eligible (output, input) pair of a step (declared in `Step.in_place`) into one record."""
    pairs: dict = {}
    for i, step in enumerate(lv.steps):
        if not step.in_place:
            continue
        step_roots = {id(lv.root(v)) for v in step.writes if lv.root(v) is not None}
        for w in step.writes:
            if w in lv.aliases or lv.root(w) is not w or lv.first[w] != i or w in pairs:
                continue
            wrec = records[w]
            if len(wrec.members) != 1:
                continue
            for r in step.reads:
                rroot = lv.root(r)
                if rroot is None or rroot is w or id(rroot) in step_roots or (w, r) not in step.in_place:
                    continue
                rec = records[rroot]
                if (rec.last != i or i in rec.merged_steps or r.nbytes != w.nbytes
                        or rroot.nbytes != w.nbytes or _numel(r) != _numel(w)):
                    continue
                rec.members.append(w)
                rec.last = max(rec.last, wrec.last)
                rec.merged_steps.add(i)
                records[w] = rec
                pairs[w] = r
                break
    return pairs


def by_size_key(r):
    return (-r.size, r.first, _name(r.members[0]), r.order)


def _greedy_by_size(records: list) -> str:
    place_in_order(sorted(records, key=by_size_key))
    return "greedy_by_size"


def place_in_order(records: list) -> None:
    """Set ``offset`` of each record, in the given order: best-fit gap among the placed records
    overlapping it in time, or on top of them."""
    placed: list = []
    for rec in records:
        neighbours = sorted((p for p in placed if p.overlaps(rec)), key=lambda p: (p.offset, p.size))
        best_offset = None
        best_gap = None
        prev_end = 0
        for p in neighbours:
            gap = p.offset - prev_end
            if gap >= rec.size and (best_gap is None or gap < best_gap):
                best_gap = gap
                best_offset = prev_end
            prev_end = max(prev_end, p.offset + p.size)
        rec.offset = prev_end if best_offset is None else best_offset
        placed.append(rec)


def plan_naive(steps, aliases=None, external=None, live_out=None,
               alignment: int = DEFAULT_ALIGNMENT) -> MemoryPlan:
    """Every buffer in its own slot, in order of first use (views still share their base)."""
    lv = _Liveness(steps, aliases, external, live_out, alignment)
    roots = sorted(lv.roots(), key=lambda r: (lv.first[r], lv.order[r]))
    slot: dict = {}
    cursor = 0
    records = []
    for r in roots:
        slot[r] = cursor
        rec = _Record(r, lv.first[r], lv.last[r], lv.size[r], lv.order[r])
        rec.offset = cursor
        records.append(rec)
        cursor += lv.size[r]
    return MemoryPlan(
        offsets={v: slot[root] for v, root in lv.root_of.items()},
        arena_bytes=cursor,
        lower_bound_bytes=lv.lower_bound(records),
        naive_bytes=cursor,
        inplace={},
        alignment=alignment,
        lifetimes={r: (lv.first[r], lv.last[r]) for r in lv.roots()},
        strategy="naive",
        n_buffers=len(roots),
    )


def check_plan(plan: MemoryPlan, steps, aliases=None, external=None, live_out=None) -> None:
    """Raise ``AssertionError`` if two buffers live at the same step share bytes (views with
    their base and a declared in-place pair at its step excepted). For tests and debugging."""
    lv = _Liveness(steps, aliases, external, live_out, plan.alignment)
    for v, root in lv.root_of.items():
        if v not in plan.offsets:
            raise AssertionError(f"memory plan: no offset for %{_name(v)}")
        if plan.offsets[v] != plan.offsets[root]:
            raise AssertionError(f"memory plan: view %{_name(v)} not at its base %{_name(root)}")
    roots = lv.roots()
    pair_step = {}
    for out, inp in plan.inplace.items():
        pair_step[frozenset((id(out), id(lv.root(inp))))] = lv.first[out]
    for a_idx, a in enumerate(roots):
        a_lo, a_hi = plan.offsets[a], plan.offsets[a] + lv.size[a]
        if a_lo % plan.alignment or a_hi > plan.arena_bytes:
            raise AssertionError(f"memory plan: %{_name(a)} misplaced at [{a_lo}, {a_hi})")
        for b in roots[a_idx + 1:]:
            lo, hi = max(lv.first[a], lv.first[b]), min(lv.last[a], lv.last[b])
            if lo > hi:
                continue
            b_lo, b_hi = plan.offsets[b], plan.offsets[b] + lv.size[b]
            if a_lo < b_hi and b_lo < a_hi:
                step = pair_step.get(frozenset((id(a), id(b))))
                if step is not None and lo == hi == step:
                    continue
                raise AssertionError(
                    f"memory plan: %{_name(a)} [{a_lo}, {a_hi}) steps {lv.first[a]}..{lv.last[a]} overlaps "
                    f"%{_name(b)} [{b_lo}, {b_hi}) steps {lv.first[b]}..{lv.last[b]}")
