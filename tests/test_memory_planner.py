"""Memory planner: exact hand examples, properties over random programs, network-like ratios."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


import flowgen as flow
import flowgen.memory.planner as planner
import flowgen.nn as nn
import flowgen.nn.functional as F
from flowgen import dtype as dt
from flowgen.codegen.kernel import BufferArg, Kernel
from flowgen.codegen.program import declare_shared_memory
from flowgen.ir.graph import Value
Step, plan_memory, plan_naive = planner.Step, planner.plan_memory, planner.plan_naive


@dataclass(eq=False)
class V:
    """Stand-in for flowgen.ir.graph.Value (the planner only uses name, nbytes, numel)."""

    name: str
    nbytes: int
    itemsize: int = 4

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize

    def __repr__(self) -> str:
        return f"%{self.name}"


KB = 1024


def elementwise(reads, writes):
    """A step whose every write may take over every read (an elementwise kernel's promise)."""
    return Step(reads, writes, frozenset((w, r) for w in writes for r in reads))


def _plan(steps, aliases=None, external=(), live_out=(), **kw):
    return plan_memory(steps, aliases or {}, set(external), set(live_out), **kw)


# ----------------------------------------------------------------------------------------------
# Independent checker (does not reuse the planner's liveness code).

def _root(v, aliases, external):
    while True:
        if v in external:
            return None
        if v not in aliases:
            return v
        v = aliases[v]


def _align(n, a):
    return (n + a - 1) // a * a


def verify(plan, steps, aliases, external, live_out, alignment=256):
    external, live_out = set(external), set(live_out)
    n = len(steps)
    first, last = {}, {}
    for i, s in enumerate(steps):
        for v in list(s.reads) + list(s.writes):
            r = _root(v, aliases, external)
            if r is None:
                assert v not in plan.offsets, f"{v} is external but got an offset"
                continue
            assert v in plan.offsets, f"{v} has no offset"
            assert plan.offsets[v] == plan.offsets[r], f"view {v} not at its base {r}"
            first[r] = min(first.get(r, i), i)
            last[r] = max(last.get(r, i), i)
    for v in live_out:
        r = _root(v, aliases, external)
        if r in last:
            last[r] = n
    size = {r: _align(r.nbytes, alignment) for r in first}

    assert plan.arena_bytes % alignment == 0 or plan.arena_bytes == 0
    for r in first:
        assert plan.offsets[r] % alignment == 0, f"{r} offset {plan.offsets[r]} not aligned"
        assert plan.offsets[r] + size[r] <= plan.arena_bytes

    # In-place pairs must be legitimate: same step, elementwise, input dead after it, same size.
    handoff = {}
    for out, inp in plan.inplace.items():
        s = first[out]
        step = steps[s]
        assert (out, inp) in step.in_place, f"in-place {out} <- {inp}: not a pair step {s} declares"
        assert any(out is w for w in step.writes) and any(inp is r for r in step.reads)
        rin = _root(inp, aliases, external)
        assert last[rin] == s, f"in-place {out} <- {inp}: input still live after step {s}"
        assert out.nbytes == inp.nbytes == rin.nbytes and out.numel == inp.numel
        assert plan.offsets[out] == plan.offsets[rin]
        handoff[frozenset((id(out), id(rin)))] = s

    naive = sum(size.values())
    assert plan.naive_bytes == naive
    peak = 0
    roots = list(first)
    for t in range(n + 1):
        live = [r for r in roots if first[r] <= t <= last[r]]
        for i, a in enumerate(live):
            a0, a1 = plan.offsets[a], plan.offsets[a] + size[a]
            for b in live[i + 1:]:
                b0, b1 = plan.offsets[b], plan.offsets[b] + size[b]
                if a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1:
                    assert handoff.get(frozenset((id(a), id(b)))) == t, (
                        f"step {t}: {a} [{a0},{a1}) overlaps {b} [{b0},{b1})")
        # live bytes counting an in-place pair at its handoff step once
        total = sum(size[r] for r in live)
        total -= sum(size[r] for r in live for o, i in plan.inplace.items()
                     if o is r and first[o] == t and _root(i, aliases, external) in live)
        peak = max(peak, total)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.naive_bytes
    if not plan.inplace:
        assert plan.lower_bound_bytes == peak
    return first, last


# ----------------------------------------------------------------------------------------------
# Hand examples with exact numbers.

def test_chain_reuses_memory():
    x = V("x", 4 * KB)
    a, b, c = V("a", KB), V("b", KB), V("c", KB)
    steps = [Step([x], [a]), Step([a], [b]), Step([b], [c])]
    plan = _plan(steps, external=[x], live_out=[c])
    verify(plan, steps, {}, [x], [c])
    assert x not in plan.offsets
    assert plan.offsets == {a: 0, b: KB, c: 0}
    assert (plan.arena_bytes, plan.lower_bound_bytes, plan.naive_bytes) == (2 * KB, 2 * KB, 3 * KB)
    assert plan.inplace == {}
    assert plan.lifetimes == {a: (0, 1), b: (1, 2), c: (2, 3)}


def test_inplace_elementwise_shares():
    x = V("x", KB)
    a, b, c = V("a", KB), V("b", KB), V("c", KB)
    steps = [Step([x], [a]), elementwise([a], [b]), elementwise([b], [c])]
    plan = _plan(steps, external=[x], live_out=[c])
    verify(plan, steps, {}, [x], [c])
    assert plan.inplace == {b: a, c: b}
    assert plan.offsets == {a: 0, b: 0, c: 0}
    assert (plan.arena_bytes, plan.lower_bound_bytes, plan.naive_bytes) == (KB, KB, 3 * KB)
    no_inplace = _plan(steps, external=[x], live_out=[c], inplace=False)
    assert no_inplace.inplace == {} and no_inplace.arena_bytes == 2 * KB


def test_inplace_rejected_when_unsafe():
    x = V("x", KB)
    a, small, later = V("a", KB), V("small", 256), V("later", KB)
    wide = V("wide", KB, itemsize=8)             # same bytes, half the elements: broadcast read
    out1, out2, out3 = V("o1", KB), V("o2", KB), V("o3", KB)
    steps = [
        Step([x], [a, small, wide, later]),
        elementwise([small, wide], [out1]),         # no input with the output's size and element count
        elementwise([a, later], [out2]),            # a dies here but `later` is read again below
        elementwise([later, out1, out2], [out3]),   # later: last use -> in-place OK
    ]
    plan = _plan(steps, external=[x], live_out=[out3])
    verify(plan, steps, {}, [x], [out3])
    assert out1 not in plan.inplace
    assert plan.inplace[out2] is a
    assert plan.inplace[out3] is later


def test_inplace_only_for_the_pairs_a_step_declares():
    """A row kernel declares which inputs an output may take over: cross_entropy's gradient over
    the logits, never over the incoming gradient, though with one class both have its size and
    both die at that step."""
    x = V("x", KB)
    g, logits, dx = V("g", KB), V("logits", KB), V("dx", KB)
    steps = [Step([x], [g, logits]), Step([g, logits], [dx], frozenset({(dx, logits)}))]
    plan = _plan(steps, external=[x], live_out=[dx])
    verify(plan, steps, {}, [x], [dx])
    assert plan.inplace == {dx: logits} and plan.offsets[dx] == plan.offsets[logits] != plan.offsets[g]
    only_g = [Step([x], [g]), Step([g], [dx], frozenset({(dx, logits)}))]   # the declared input is not read
    plan = _plan(only_g, external=[x], live_out=[dx])
    verify(plan, only_g, {}, [x], [dx])
    assert plan.inplace == {} and plan.offsets[dx] != plan.offsets[g]


def test_one_input_not_shared_by_two_outputs():
    x = V("x", KB)
    a, p, q = V("a", KB), V("p", KB), V("q", KB)
    steps = [Step([x], [a]), elementwise([a], [p, q])]     # p: a dead write
    plan = _plan(steps, external=[x], live_out=[q])
    verify(plan, steps, {}, [x], [q])
    assert plan.inplace == {p: a}
    assert plan.offsets[q] != plan.offsets[p]
    assert plan.arena_bytes == 2 * KB


def test_live_out_never_reused():
    x = V("x", KB)
    a, b, c = V("a", KB), V("b", KB), V("c", KB)
    steps = [Step([x], [a]), Step([a], [b]), Step([b], [c])]
    plan = _plan(steps, external=[x], live_out=[a, c])
    verify(plan, steps, {}, [x], [a, c])
    assert plan.lifetimes[a] == (0, 3)
    assert plan.arena_bytes == 3 * KB and len(set(plan.offsets.values())) == 3
    # in-place may not take over a live-out input, but may chain after it
    steps_ip = [Step([x], [a]), elementwise([a], [b]), elementwise([b], [c])]
    plan = _plan(steps_ip, external=[x], live_out=[a, c])
    verify(plan, steps_ip, {}, [x], [a, c])
    assert plan.inplace == {c: b}
    assert plan.offsets[a] not in (plan.offsets[b], plan.offsets[c])
    assert plan.arena_bytes == 2 * KB


def test_views_keep_base_alive():
    x = V("x", KB)
    a, b, c = V("a", KB), V("b", KB), V("c", KB)
    va, vva = V("va", KB), V("vva", KB)     # reshape(a), reshape(reshape(a))
    aliases = {va: a, vva: va}
    without = [Step([x], [a]), Step([x], [b]), Step([b], [c])]
    plan = _plan(without, aliases, external=[x], live_out=[c])
    assert plan.offsets[a] == plan.offsets[b] and plan.arena_bytes == 2 * KB   # a is dead before b
    with_view = [Step([x], [a]), Step([x], [b]), Step([b, vva], [c])]
    plan = _plan(with_view, aliases, external=[x], live_out=[c])
    verify(plan, with_view, aliases, [x], [c])
    assert plan.lifetimes[a] == (0, 2)
    assert plan.offsets[vva] == plan.offsets[va] == plan.offsets[a]
    assert len({plan.offsets[a], plan.offsets[b], plan.offsets[c]}) == 3
    assert plan.arena_bytes == 3 * KB and plan.naive_bytes == 3 * KB and plan.n_buffers == 3


def test_live_out_view_extends_base_and_views_of_external_are_external():
    x, a, b = V("x", KB), V("a", KB), V("b", KB)
    vx, va = V("vx", KB), V("va", KB)
    aliases = {vx: x, va: a}
    steps = [Step([vx], [a]), Step([x], [b])]
    plan = _plan(steps, aliases, external=[x], live_out=[va])
    verify(plan, steps, aliases, [x], [va])
    assert vx not in plan.offsets and x not in plan.offsets
    assert plan.lifetimes[a] == (0, 2) and plan.offsets[va] == plan.offsets[a]
    assert plan.offsets[a] != plan.offsets[b]


def test_alignment_and_best_fit():
    x = V("x", 1)
    big, mid, tiny, later = V("big", 3 * KB), V("mid", 257), V("tiny", 1), V("later", 200)
    steps = [
        Step([x], [big]),
        Step([big], [mid]),
        Step([mid], [tiny]),     # big dead: [0, 3K) free
        Step([tiny], [later]),
    ]
    plan = _plan(steps, external=[x], live_out=[later], alignment=256)
    verify(plan, steps, {}, [x], [later])
    assert planner.align_up(257, 256) == 512 and planner.align_up(0) == 0
    assert plan.naive_bytes == 3 * KB + 512 + 256 + 256
    assert plan.offsets[big] == 0 and plan.offsets[mid] == 3 * KB
    assert plan.offsets[tiny] == 0 and plan.offsets[later] == 256
    assert plan.arena_bytes == 3 * KB + 512 == plan.lower_bound_bytes
    plan64 = _plan(steps, external=[x], live_out=[later], alignment=64)
    verify(plan64, steps, {}, [x], [later], alignment=64)
    assert plan64.naive_bytes == 3 * KB + 320 + 64 + 256


def test_empty_and_external_only():
    assert _plan([]).arena_bytes == 0
    x, y = V("x", KB), V("y", KB)
    plan = _plan([elementwise([x], [y])], external=[x, y])
    assert plan.offsets == {} and plan.arena_bytes == plan.naive_bytes == plan.lower_bound_bytes == 0
    assert plan.describe() == "memory: 0 buffers, naive 0 B -> arena 0 B (lower bound 0 B)"


def test_describe_format():
    x = V("x", 4)
    vals = [V(f"t{i}", 400_000) for i in range(3)]
    steps = [Step([x], [vals[0]]), Step([vals[0]], [vals[1]]), Step([vals[1]], [vals[2]])]
    text = _plan(steps, external=[x], live_out=[vals[2]]).describe()
    assert text == "memory: 3 buffers, naive 1.20 MB -> arena 0.80 MB (lower bound 0.80 MB)", text
    steps[1] = elementwise([vals[0]], [vals[1]])
    text = _plan(steps, external=[x], live_out=[vals[2]]).describe()
    assert re.fullmatch(r"memory: 3 buffers, naive 1\.20 MB -> arena 0\.80 MB \(lower bound 0\.80 MB\), 1 in-place",
                        text), text


def test_naive_fallback(monkeypatch):
    x = V("x", KB)
    a, b, c = V("a", KB), V("b", 2 * KB), V("c", KB)
    steps = [elementwise([x], [a]), Step([a], [b]), Step([b], [c])]
    plan = plan_naive(steps, {}, {x}, {c})
    verify(plan, steps, {}, [x], [c])
    assert plan.offsets == {a: 0, b: KB, c: 3 * KB} and plan.arena_bytes == plan.naive_bytes == 4 * KB
    assert plan.strategy == "naive" and "[naive]" in plan.describe()
    monkeypatch.setenv("FLOWGEN_NAIVE_MEMORY", "1")
    assert plan_memory(steps, {}, {x}, {c}).strategy == "naive"
    assert plan_memory(steps, {}, {x}, {c}, naive=False).strategy == "greedy_by_size"
    monkeypatch.setenv("FLOWGEN_NAIVE_MEMORY", "0")
    assert plan_memory(steps, {}, {x}, {c}).arena_bytes == 3 * KB


def test_alias_cycle_is_an_error():
    a, b = V("a", KB), V("b", KB)
    with pytest.raises(ValueError, match="alias cycle"):
        _plan([Step([a], [])], {a: b, b: a})


def test_with_real_ir_values():
    from flowgen import dtype as dt
    from flowgen.ir.graph import Value

    x = Value("x", (8, 32), dt.float32)
    a, b = Value("a", (8, 32), dt.float32), Value("b", (8, 32), dt.float32)
    steps = [Step([x], [a]), elementwise([a], [b])]
    plan = plan_memory(steps, {}, {x}, {b})
    assert plan.inplace == {b: a} and plan.arena_bytes == 1024


# ----------------------------------------------------------------------------------------------
# The in-place contract between the planner and the kernels: buffers of one launch share memory
# only as an output written over an input read at the element it writes, and such a pair is not
# declared __restrict__ (with it the compiler may load the input after the store).

def _signature_params(source: str, name: str) -> dict:
    head = f"void {name}("
    start = source.index(head) + len(head)
    params = source[start:source.index(")", start)].split(", ")
    return {p.split()[-1]: p for p in params}


def _toy_kernel(in_place):
    x, y = Value("x", (4, 8), dt.float32), Value("y", (4, 8), dt.float32)
    source = ("// toy\nextern \"C\" __global__ void k0_toy(const float* __restrict__ in0, "
              "float* __restrict__ out0) {\n  out0[0] = in0[1];\n}\n")
    kernel = Kernel("k0_toy", source, [BufferArg(x, "const float*"), BufferArg(y, "float*")], (1, 1, 1), (1, 1, 1),
                    in_place=frozenset(in_place(x, y)))
    plan = planner.MemoryPlan(offsets={x: 0, y: 0}, arena_bytes=128, lower_bound_bytes=128, naive_bytes=256,
                              inplace={y: x})
    return kernel, plan


def test_shared_pair_loses_restrict_and_other_sharing_raises():
    kernel, plan = _toy_kernel(lambda x, y: {(y, x)})
    (declared,) = declare_shared_memory([kernel], plan, {}, {})
    params = _signature_params(declared.source, "k0_toy")
    assert params == {"in0": "const float* in0", "out0": "float* out0"}
    assert "// in place, so these parameters are not __restrict__: out0 (%y) overwrites in0 (%x)" in declared.source
    apart = planner.MemoryPlan(offsets={v.value: 128 * k for k, v in enumerate(kernel.args)}, arena_bytes=256,
                               lower_bound_bytes=256, naive_bytes=256, inplace={})
    assert declare_shared_memory([kernel], apart, {}, {}) == [kernel]
    # The same placement for a kernel that reads x at other elements than it writes: a planner bug.
    kernel, plan = _toy_kernel(lambda x, y: ())
    with pytest.raises(AssertionError, match="k0_toy: %y would overwrite the memory of %x"):
        declare_shared_memory([kernel], plan, {}, {})


class _NormOfScaled(nn.Module):
    """((LayerNorm(x * p) - x * p) ** 2).sum(): the elementwise kernel computing LayerNorm's
    output also reads x * p, whose memory the planner hands to one of its outputs."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(flow.tensor(np.linspace(0.5, 1.5, 8).astype(np.float32)))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = x * self.p
        return ((self.norm(h) - h) ** 2).sum()


class _TrainStep(nn.Graph):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)

    def build(self, x):
        loss = self.model(x)
        loss.backward()
        return loss


def test_in_place_kernels_train_like_eager():
    """In a graph this trained with loss 0.0 (eager: 12.5, 11.4, 10.6): the in-place output's
    store was moved before the load of the input it overwrote."""
    flow.manual_seed(0)
    model, eager = _NormOfScaled(), _NormOfScaled()
    eager.load_state_dict(model.state_dict())
    graph = _TrainStep(model, flow.optim.SGD(model.parameters(), lr=0.01))
    eager_opt = flow.optim.SGD(eager.parameters(), lr=0.01)
    x = flow.tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    for _ in range(3):
        graph_loss = float(graph(x).numpy())
        loss = eager(x)
        eager_opt.zero_grad()
        loss.backward()
        eager_opt.step()
        np.testing.assert_allclose(graph_loss, float(loss.numpy()), rtol=1e-5)
    np.testing.assert_allclose(model.p.numpy(), eager.p.numpy(), rtol=1e-5, atol=1e-6)

    program = graph.compiled.program
    assert program.plan.inplace, "the regression needs an in-place pair"
    for out, inp in program.plan.inplace.items():
        (kernel,) = [k for k in program.kernels
                     if any(getattr(a, "value", None) is out and not a.ctype.startswith("const") for a in k.args)]
        params = _signature_params(kernel.source, kernel.name)
        names = [p.split()[-1] for p in params.values()]
        by_value = {id(a.value): names[i] for i, a in enumerate(kernel.args) if getattr(a, "value", None) is not None}
        for v in (out, inp):
            assert "__restrict__" not in params[by_value[id(v)]], kernel.source


class _Classifier(nn.Module):
    """Logits wider than anything else, then cross-entropy (a language model's head)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 300)

    def forward(self, x, y):
        logits = self.head(x)
        return F.cross_entropy(logits, y) + F.log_softmax(logits * 0.5, 1).mean() * 0.1


def test_logits_gradient_takes_over_the_logits_memory_and_trains_like_eager():
    """Row kernels may write over the input their op declares (Template.in_place): the [N, V]
    logits and their gradient are never live side by side."""
    flow.manual_seed(0)
    model, eager = _Classifier(), _Classifier()
    eager.load_state_dict(model.state_dict())

    class ClassifierStep(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x, y):
            loss = self.model(x, y)
            loss.backward()
            return loss

    graph, eager_opt = ClassifierStep(), flow.optim.SGD(eager.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    x = flow.tensor(rng.standard_normal((16, 8)).astype(np.float32))
    y = flow.tensor(rng.integers(0, 300, 16))
    for _ in range(3):
        graph_loss = float(graph(x, y).numpy())
        loss = eager(x, y)
        eager_opt.zero_grad()
        loss.backward()
        eager_opt.step()
        np.testing.assert_allclose(graph_loss, float(loss.numpy()), rtol=1e-5)
    np.testing.assert_allclose(model.head.weight.numpy(), eager.head.weight.numpy(), rtol=1e-5, atol=1e-6)
    program = graph.compiled.program
    row_kernels = {k.name: k for k in program.kernels if set(k.ops) & {"cross_entropy_rows_grad", "log_softmax"}}
    in_place = [k for k in row_kernels.values()
                if any(getattr(a, "value", None) in program.plan.inplace for a in k.args
                       if not a.ctype.startswith("const"))]
    assert any("cross_entropy_rows_grad" in k.ops for k in in_place), sorted(row_kernels)


# ----------------------------------------------------------------------------------------------
# Properties over random programs.

SIZES = st.sampled_from([0, 1, 4, 100, 255, 256, 257, 1000, 1024, 4096, 5000, 65536])


@st.composite
def programs(draw):
    counter = iter(range(10**6))

    def new(nbytes, itemsize=4):
        return V(f"v{next(counter)}", nbytes, itemsize)

    external = [new(draw(SIZES)) for _ in range(draw(st.integers(0, 3)))]
    pool = list(external)
    aliases = {}
    steps = []
    for _ in range(draw(st.integers(0, 24))):
        if pool and draw(st.integers(0, 5)) == 0:          # a view (maybe of a view / external)
            base = draw(st.sampled_from(pool))
            view = new(base.nbytes, base.itemsize)
            aliases[view] = base
            pool.append(view)
        reads = []
        if pool:
            recent = pool[-5:]
            reads = draw(st.lists(st.sampled_from(recent), max_size=3))
            if draw(st.booleans()):
                reads.append(draw(st.sampled_from(pool)))
        writes = []
        for _ in range(draw(st.integers(1, 2))):
            choice = draw(st.integers(0, 9))
            if choice < 4 and reads:                       # same shape as an input: in-place candidate
                src = draw(st.sampled_from(reads))
                writes.append(new(src.nbytes, src.itemsize))
            elif choice == 4 and pool:                     # rewrite an existing value (state, accumulate)
                writes.append(draw(st.sampled_from(pool)))
            else:
                writes.append(new(draw(SIZES), draw(st.sampled_from([1, 2, 4]))))
        for w in writes:
            if not any(w is p for p in pool):
                pool.append(w)
        declared = draw(st.sampled_from(["none", "all", "some"]))   # elementwise, or a row kernel's pairs
        pairs = [(w, r) for w in writes for r in reads]
        if declared == "some":
            pairs = [p for p in pairs if draw(st.booleans())]
        steps.append(Step(reads, writes, frozenset(pairs) if declared != "none" else frozenset()))
    live_out = draw(st.lists(st.sampled_from(pool), max_size=4)) if pool else []
    alignment = draw(st.sampled_from([256, 256, 64, 1]))
    return steps, aliases, external, live_out, alignment


def _clone(steps, aliases, external, live_out):
    """The same program with fresh Value objects (different ids and hash order)."""
    fresh = {}

    def f(v):
        if id(v) not in fresh:
            fresh[id(v)] = V(v.name, v.nbytes, v.itemsize)
        return fresh[id(v)]

    for v in reversed([v for s in steps for v in s.reads + s.writes] + list(aliases) + external + live_out):
        f(v)
    return ([Step([f(v) for v in s.reads], [f(v) for v in s.writes], frozenset((f(w), f(r)) for w, r in s.in_place))
             for s in steps],
            {f(k): f(b) for k, b in aliases.items()}, [f(v) for v in external], [f(v) for v in live_out])


def _by_name(plan):
    return ({v.name: o for v, o in plan.offsets.items()}, plan.arena_bytes, plan.lower_bound_bytes,
            plan.naive_bytes, {o.name: i.name for o, i in plan.inplace.items()})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_never_overlap(prog):
    steps, aliases, external, live_out, alignment = prog
    plan = plan_memory(steps, aliases, set(external), set(live_out), alignment=alignment, naive=False)
    verify(plan, steps, aliases, external, live_out, alignment)
    planner.check_plan(plan, steps, aliases, set(external), set(live_out))
    assert plan.describe().startswith("memory: ")

    again = plan_memory(steps, aliases, set(reversed(external)), set(reversed(live_out)), alignment=alignment,
                        naive=False)
    assert _by_name(again) == _by_name(plan)
    cloned = _clone(steps, aliases, external, live_out)
    other = plan_memory(cloned[0], cloned[1], set(cloned[2]), set(cloned[3]), alignment=alignment, naive=False)
    assert _by_name(other) == _by_name(plan)

    naive = plan_naive(steps, aliases, set(external), set(live_out), alignment=alignment)
    verify(naive, steps, aliases, external, live_out, alignment)
    assert naive.arena_bytes == naive.naive_bytes == plan.naive_bytes
    no_ip = plan_memory(steps, aliases, set(external), set(live_out), alignment=alignment, naive=False, inplace=False)
    verify(no_ip, steps, aliases, external, live_out, alignment)
    assert plan.lower_bound_bytes <= no_ip.lower_bound_bytes


# ----------------------------------------------------------------------------------------------
# Network-like programs: forward + backward + optimizer, as autodiff and fusion would emit them.

def network_like(seed: int, n_blocks: int = 8, training: bool = True):
    """A random stack of MLP / residual / norm / attention / downsampling blocks; with
    ``training`` a generic reverse pass (each op's backward reads its output gradient and the
    saved forward inputs), gradient accumulation, and in-place parameter updates."""
    rng = random.Random(seed)
    counter = iter(range(10**6))
    batch = rng.choice([8, 16, 32, 64])
    steps, external, params, tape = [], [], [], []

    def new(per_sample, prefix="t", itemsize=4):
        return V(f"{prefix}{next(counter)}", batch * per_sample * itemsize, itemsize)

    def param(nbytes):
        p = V(f"p{next(counter)}", nbytes)
        external.append(p)
        params.append(p)
        return p

    def op(inputs, per_sample, is_elementwise=False, itemsize=4):
        out = new(per_sample, itemsize=itemsize)
        steps.append(elementwise(list(inputs), [out]) if is_elementwise else Step(list(inputs), [out]))
        tape.append((list(inputs), out, is_elementwise))
        return out

    width = rng.choice([256, 784, 1024, 3072])
    x = new(width, "x")
    external.append(x)
    h = x
    for _ in range(n_blocks):
        kind = rng.choice(["mlp", "mlp", "res", "norm", "attn", "down"])
        if kind in ("mlp", "res", "down"):
            out_w = {"mlp": rng.choice([256, 512, 1024, 2048, 4096]), "res": width,
                     "down": max(64, width // rng.choice([2, 4]))}[kind]
            y = op([h, param(width * out_w * 4)], out_w)                 # gemm / conv (+ bias epilogue)
            a = op([y], out_w, is_elementwise=True)                      # activation
            if kind == "res":
                a = op([a, h], out_w, is_elementwise=True)               # residual add
            h, width = a, out_w
        elif kind == "norm":
            stats = op([h], 2)                                           # mean / rstd
            h = op([h, stats, param(width * 4)], width)                  # normalize + affine
        else:
            seq = rng.choice([64, 128, 256])
            q, k, v = (op([h, param(width * width * 4)], width) for _ in range(3))
            scores = op([q, k], seq * rng.choice([4, 8, 16]))            # q k^T (large)
            probs = op([scores], scores.nbytes // (batch * 4))           # softmax
            mask = op([probs], probs.nbytes // (batch * 4), itemsize=1)  # dropout mask (bytes)
            probs = op([probs, mask], probs.nbytes // (batch * 4), is_elementwise=True)
            ctx = op([probs, v], width)
            o = op([ctx, param(width * width * 4)], width)
            h = op([o, h], width, is_elementwise=True)
    classes = rng.choice([10, 100, 1000])
    logits = op([h, param(width * classes * 4)], classes)
    loss = V(f"loss{next(counter)}", 4)
    steps.append(Step([logits], [loss]))
    live_out = [loss]
    if not training:
        return steps, {}, external, live_out

    grad = {}
    glogits = V(f"g{logits.name}", logits.nbytes)
    steps.append(elementwise([logits], [glogits]))                       # softmax-xent backward
    grad[logits] = glogits
    for inputs, out, is_elementwise in reversed(tape):
        gout = grad.pop(out, None)
        if gout is None:
            continue
        for inp in inputs:
            if inp is x or inp.itemsize == 1:
                continue
            g = V(f"g{inp.name}_{next(counter)}", inp.nbytes)
            if is_elementwise and inp.nbytes == out.nbytes:
                steps.append(elementwise([gout] + inputs, [g]))
            else:
                steps.append(Step([gout] + inputs, [g]))
            if inp in grad:                                              # used twice: accumulate
                acc = V(f"acc{next(counter)}", inp.nbytes)
                steps.append(elementwise([grad[inp], g], [acc]))
                g = acc
            grad[inp] = g
    for p in params:                                                     # optimizer: in state
        steps.append(elementwise([p, grad.pop(p)], [p]))
    return steps, {}, external, live_out


RATIO_SEEDS = list(range(8))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("seed", RATIO_SEEDS)
def test_network_like_close_to_lower_bound(seed, training):
    steps, aliases, external, live_out = network_like(seed, n_blocks=6 + seed % 5, training=training)
    plan = plan_memory(steps, aliases, set(external), set(live_out), naive=False)
    verify(plan, steps, aliases, external, live_out)
    ratio = plan.arena_bytes / plan.lower_bound_bytes
    assert ratio <= 1.15, f"seed {seed}: {plan.describe()} ratio {ratio:.3f}"
    assert plan.arena_bytes < plan.naive_bytes


def test_network_like_ratio_distribution():
    """Training steps (forward + backward + update) stay within 1.15x of the lower bound.
    Short inference chains with in-place runs can fragment (greedy by size is a heuristic):
    most are exact, none is far off."""
    for training in (True, False):
        ratios = []
        for seed in range(100, 160):
            steps, aliases, external, live_out = network_like(seed, n_blocks=4 + seed % 12, training=training)
            plan = plan_memory(steps, aliases, set(external), set(live_out), naive=False)
            ratios.append(plan.arena_bytes / plan.lower_bound_bytes)
        if training:
            assert max(ratios) <= 1.15, max(ratios)
        else:
            assert sum(r <= 1.15 for r in ratios) >= 0.9 * len(ratios) and max(ratios) <= 1.5, sorted(ratios)[-5:]
