"""sort / argsort / topk / cumsum / cumprod inside nn.Graph (issues 11, 12, 14): the `sort` and `scan`
kernel families on the CPU emulator, forward equal to eager flowgen bit for bit (values and
indices: the kernels are stable and scan sequentially in the dtype, as the NumPy references do)
and to PyTorch; graph training through them equal to eager and to PyTorch's gradients; the
kernels compile with NVRTC for sm_80 and sm_90."""
import copy

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen import dtype as dt
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.target import rendering_for
from flowgen.ir.graph import Node, Value
from flowgen.ops.registry import TensorMeta, get_op
from graphs import InferGraph, TrainGraph, train_like_eager
from torch_oracle import compare_with_torch, get_torch

RNG = np.random.default_rng(14)


def _ties(shape, dtype=np.float32):
    """Few distinct values (many ties), both signed zeros among the floats."""
    a = RNG.integers(-3, 4, shape).astype(dtype)
    if a.dtype.kind == "f":
        a[a == 0] = np.where(RNG.random(int((a == 0).sum())) < 0.5, -0.0, 0.0)
    return a


class Orders(nn.Module):
    """Every sort/topk variant along `dim`, as one tuple of outputs."""

    def __init__(self, dim, k):
        super().__init__()
        self.dim, self.k = dim, k

    def forward(self, x):
        up, down = flow.sort(x, self.dim), flow.sort(x, self.dim, descending=True)
        top, bottom = x.topk(self.k, dim=self.dim), x.topk(self.k, dim=self.dim, largest=False)
        first = flow.topk(x, 1, dim=self.dim)
        every = flow.topk(x, x.shape[self.dim], dim=self.dim, largest=False)
        return (up.values, up.indices, down.values, down.indices, flow.argsort(x, self.dim, descending=True),
                top.values, top.indices, bottom.values, bottom.indices, first.values, first.indices,
                every.values, every.indices)


class Scans(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return flow.cumsum(x, self.dim), flow.cumprod(x, self.dim)


def _assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=what)
    assert got.numpy().tobytes() == want.numpy().tobytes(), f"{what}: not the same bits (signed zeros, NaN)"


def _assert_graph_equals_eager(model, x, device="cpu"):
    got = InferGraph(model)(flow.tensor(x).to(device))
    want = model(flow.tensor(x))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same_bits(g, w, f"output {i}")
    return [g.numpy() for g in got]


# (id, input, dim, k): rows along a strided dim, the last dim, the first; rows longer than one block
# and than the sort family's run (SORT_RUN = 256: on the cpu target radix-sorted, their topk radix-
# selected; the CUDA programs rank them in runs, then merge once, twice, four times)
ORDER_CASES = [
    ("f32_ties_dim1_strided", _ties((3, 300, 2)), 1, 4),
    ("f32_ties_last", _ties((5, 7)), -1, 3),
    ("f32_dim0_neg", _ties((6, 4, 3)), -3, 2),
    ("i64_ties_last_long_rows", _ties((2, 700), np.int64), -1, 5),
    ("i64_dim0", _ties((9, 3), np.int64), 0, 9),
    ("f64_normal", RNG.standard_normal((4, 33)), 1, 7),
    ("f32_nan_inf", np.array([[1.0, np.nan, -np.inf, 2.0, np.nan, np.inf, 2.0, -0.0, 0.0, np.nan]] * 2,
                             np.float32), 1, 4),
    ("f32_one_row_1d", _ties((1000,)), 0, 10),
    ("i64_ties_four_merges", _ties((2, 2100), np.int64), 1, 2100),
]


@pytest.mark.parametrize("x, dim, k", [c[1:] for c in ORDER_CASES], ids=[c[0] for c in ORDER_CASES])
def test_sort_and_topk_graph_equal_eager_and_torch(x, dim, k):
    torch = get_torch()
    got = _assert_graph_equals_eager(Orders(dim, k), x)
    t = torch.from_numpy(x)
    up = torch.sort(t, stable=True, dim=dim)
    down = torch.sort(t, stable=True, dim=dim, descending=True)
    n = x.shape[dim]
    # topk as PyTorch documents it (sorted=True), ties in input order: a stable sort's first k
    want = [up.values, up.indices, down.values, down.indices, down.indices,
            down.values.narrow(dim, 0, k), down.indices.narrow(dim, 0, k),
            up.values.narrow(dim, 0, k), up.indices.narrow(dim, 0, k),
            down.values.narrow(dim, 0, 1), down.indices.narrow(dim, 0, 1),
            up.values.narrow(dim, 0, n), up.indices.narrow(dim, 0, n)]
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w.numpy(), err_msg=f"output {i} vs torch")
    # values only (PyTorch's topk breaks ties in its own order)
    np.testing.assert_array_equal(got[5], torch.topk(t, k, dim).values.numpy())


VOCAB = 50257   # GPT-2's vocabulary: nanoGPT's generate takes topk(logits, top_k) of rows this long


def _vocab_logits():
    """Two rows of VOCAB logits: many ties (eighths of small integers, both signed zeros) with 40
    NaNs, and distinct values (a permutation), where PyTorch's indices are the only ones."""
    tied = (RNG.integers(-40, 41, VOCAB) / 8).astype(np.float32)
    tied[tied == 0] = np.where(RNG.random(int((tied == 0).sum())) < 0.5, -0.0, 0.0)
    tied[RNG.choice(VOCAB, 40, replace=False)] = np.nan
    distinct = (RNG.permutation(VOCAB) - VOCAB // 2).astype(np.float32) / 64
    return np.stack([tied, distinct])


class TopKs(nn.Module):
    """topk(x, k) along the last dim, largest and smallest, for each k."""

    def __init__(self, ks):
        super().__init__()
        self.ks = ks

    def forward(self, x):
        return tuple(t for k in self.ks for largest in (True, False) for t in x.topk(k, dim=-1, largest=largest))


@pytest.mark.parametrize("ks", [(1, 50, 200, 1024), (1025, VOCAB)], ids=["select", "sort"])
def test_topk_of_vocab_rows_graph_equal_eager_and_torch(ks):
    """topk of up to 1024 from long rows takes the radix select kernel, of more (on the cpu target)
    the radix sort: both equal eager bit for bit (stable ties in index order, NaN largest) and
    PyTorch's values; the indices too in the row without ties."""
    torch = get_torch()
    x = _vocab_logits()
    model = TopKs(ks)
    graph = InferGraph(model)
    got = [g.numpy() for g in graph(flow.tensor(x))]
    for i, (g, w) in enumerate(zip(got, model(flow.tensor(x)))):
        assert g.tobytes() == w.numpy().tobytes(), f"output {i}: not eager's bits"
    t = torch.from_numpy(x)
    for i, (k, largest) in enumerate((k, largest) for k in ks for largest in (True, False)):
        want = torch.topk(t, k, dim=-1, largest=largest)
        np.testing.assert_array_equal(got[2 * i], want.values.numpy(), err_msg=f"k={k} largest={largest}")
        np.testing.assert_array_equal(got[2 * i + 1][1], want.indices[1].numpy(), err_msg=f"k={k} largest={largest}")
    kind = "radix select" if max(ks) <= 1024 else "radix sort"   # the cpu target sorts long rows by radix
    assert [kind in k.comment for k in graph.compiled.program.kernels] == [True] * (2 * len(ks))


def test_topk_select_cuda_program_equals_eager(monkeypatch):
    """The GPU's radix select (a block of threads per row sharing histograms and a prefix count of
    equal keys; on the emulator where no GPU is present): vocab rows, strided rows, float64, int64."""
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    _assert_graph_equals_eager(TopKs((1, 200)), _vocab_logits(), "cuda")
    _assert_graph_equals_eager(Orders(1, 9), _ties((3, 700, 2), np.float64), "cuda")
    _assert_graph_equals_eager(TopKs((300,)), _ties((2, 1500), np.int64), "cuda")


SCAN_CASES = [
    ("f32_dim1_strided_long", RNG.uniform(0.5, 1.5, (3, 300, 2)).astype(np.float32), 1),
    ("f32_last_neg", RNG.standard_normal((4, 9)).astype(np.float32), -1),
    ("f32_dim0", RNG.standard_normal((5, 3, 2)).astype(np.float32), 0),
    ("i64_last", RNG.integers(-4, 5, (3, 20)), -1),
    ("i64_wraps", np.full((1, 70), 3, np.int64), 1),          # 3^70 wraps around int64, as NumPy's
    ("f16_last", RNG.uniform(0.9, 1.1, (2, 600)).astype(np.float16), -1),
    ("f32_long_rows", RNG.uniform(0.99, 1.01, (2, 5000)).astype(np.float32), 1),   # chunks of the block scan
    ("f64_dim0_1d", RNG.standard_normal(50), 0),
]


@pytest.mark.parametrize("x, dim", [c[1:] for c in SCAN_CASES], ids=[c[0] for c in SCAN_CASES])
def test_scans_graph_equal_eager_bit_for_bit_and_torch(x, dim):
    torch = get_torch()
    got_sum, got_prod = _assert_graph_equals_eager(Scans(dim), x)
    # the eager reference itself is the sequential scan in the dtype
    rows = np.moveaxis(x, dim, 0)
    running_sum, running_prod = rows[0].copy(), rows[0].copy()
    for j in range(1, rows.shape[0]):
        running_sum, running_prod = running_sum + rows[j], running_prod * rows[j]
    np.testing.assert_array_equal(np.moveaxis(got_sum, dim, 0)[-1], running_sum)
    np.testing.assert_array_equal(np.moveaxis(got_prod, dim, 0)[-1], running_prod)
    if x.dtype == np.float16:
        return   # PyTorch's CPU scans accumulate float16 in float32
    t = torch.from_numpy(x)
    exact = x.dtype == np.int64
    for got, want in ((got_sum, torch.cumsum(t, dim)), (got_prod, torch.cumprod(t, dim))):
        if exact:
            np.testing.assert_array_equal(got, want.numpy())
        else:   # PyTorch's CPU scans accumulate float32 in double
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["sort_desc", "topk", "cumsum", "cumprod_zeros", "cumprod_two_zeros"])
def test_eager_gradients_match_torch(op):
    torch = get_torch()
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    if op.startswith("cumprod"):
        x[0, 2] = x[1, 0] = x[2, 5] = 0.0
        if op == "cumprod_two_zeros":
            x[0, 4] = 0.0
        compare_with_torch(lambda a: flow.cumprod(a, 1), lambda a: torch.cumprod(a, 1), x)
    elif op == "cumsum":
        compare_with_torch(lambda a: flow.cumsum(a, 0), lambda a: torch.cumsum(a, 0), x)
    elif op == "topk":
        compare_with_torch(lambda a: a.topk(2, dim=0).values, lambda a: a.topk(2, dim=0).values, x)
    else:
        compare_with_torch(lambda a: flow.sort(a, -1, descending=True).values,
                           lambda a: torch.sort(a, -1, descending=True).values, x)


class Ranked(nn.Module):
    """A Linear whose output goes through every op of the families, forward and backward; the
    ReLU gives cumprod exact zeros (its gradient's zero path)."""

    def __init__(self, width=300):
        super().__init__()
        self.lin = nn.Linear(4, width)

    def forward(self, x):
        h = self.lin(x)
        parts = [flow.sort(h, 1, descending=True).values, h.topk(3, dim=-1).values,
                 h.topk(1, dim=1, largest=False).values, flow.sort(h, -1).values[:, :5],
                 flow.cumsum(h, 1) * 0.1, flow.cumprod(flow.relu(h[:, :12]) + 0.5 * (h[:, :12] > 0), -1),
                 flow.cumprod(h[:, 12:20], 1)]
        return flow.cat(parts, dim=1)


def test_graph_training_through_sort_and_scans_equals_eager():
    flow.manual_seed(5)
    model = Ranked()
    x = flow.tensor(RNG.standard_normal((6, 4)).astype(np.float32))
    width = Ranked()(x).shape[1]
    batches = [(x, flow.tensor(RNG.standard_normal((6, width)).astype(np.float32))) for _ in range(3)]
    graph, _, _ = train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=0.01), batches, loss_fn=nn.MSELoss())
    ops = {op for k in graph.compiled.program.kernels for op in k.ops}
    assert {"sort", "topk", "cumsum", "cumprod", "scatter_add"} <= ops


class Weighted(nn.Module):
    """out = ops(w * x) for a parameter w of ones: one SGD step with lr 1 leaves w = 1 - dL/dw,
    and dL/dw = x * dL/d(w x), PyTorch's gradient of the same ops scaled by x."""

    def __init__(self, shape, fn):
        super().__init__()
        self.w = nn.Parameter(flow.ones(*shape))
        self.fn = fn

    def forward(self, x):
        return self.fn(self.w * x)


GRAD_CASES = {
    "sort_dim0_desc": (lambda a: flow.sort(a, 0, descending=True).values,
                       lambda t, a: t.sort(a, stable=True, dim=0, descending=True).values),
    "topk_k1_dim_neg": (lambda a: a.topk(1, dim=-2).values, lambda t, a: a.topk(1, dim=-2).values),
    "topk_smallest": (lambda a: a.topk(3, dim=-1, largest=False).values,
                      lambda t, a: a.topk(3, dim=-1, largest=False).values),
    "cumsum_dim1": (lambda a: flow.cumsum(a, 1), lambda t, a: t.cumsum(a, 1)),
    "cumprod_last_zeros": (lambda a: flow.cumprod(a, -1), lambda t, a: t.cumprod(a, -1)),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_graph_gradients_equal_torch(name):
    torch = get_torch()
    flow_fn, torch_fn = GRAD_CASES[name]
    x = RNG.standard_normal((5, 6, 4)).astype(np.float32)
    if name.startswith("cumprod"):   # zeros: a row's first element, and one inside every row of x[3]
        x[1, 2, 0] = x[3, :, 1] = 0.0
    g = torch_fn(torch, torch.from_numpy(x)).detach().numpy()
    target = RNG.standard_normal(g.shape).astype(np.float32)
    model = Weighted(x.shape, flow_fn)
    train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=1.0), [(flow.tensor(x), flow.tensor(target))],
                     loss_fn=nn.MSELoss(reduction="sum"))
    w = torch.ones(x.shape, requires_grad=True)
    ((torch_fn(torch, w * torch.from_numpy(x)) - torch.from_numpy(target)) ** 2).sum().backward()
    np.testing.assert_allclose(model.w.numpy(), 1 - w.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cuda_programs_equal_eager(monkeypatch):
    """The CUDA programs (on a GPU, else on the emulator): forward bit for bit (long strided rows,
    ties, NaN; the block-per-row scan of few long rows), and training."""
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")   # used only where no GPU is present
    nan_inf = dict((c[0], c[1]) for c in ORDER_CASES)["f32_nan_inf"]
    for x, dim, k in ((_ties((3, 700, 2)), 1, 5), (nan_inf, -1, 3), (_ties((2, 2100), np.int64), 1, 7)):
        _assert_graph_equals_eager(Orders(dim, k), x, "cuda")
    for case in ("f32_dim1_strided_long", "f16_last", "f32_long_rows", "i64_wraps", "f64_dim0_1d"):
        _, x, dim = next(c for c in SCAN_CASES if c[0] == case)
        _assert_graph_equals_eager(Scans(dim), x, "cuda")
    flow.manual_seed(5)
    model = Ranked(width=2500)   # long rows: the sort's merges, the block scan's chunks both ways
    eager = copy.deepcopy(model)
    x = flow.tensor(RNG.standard_normal((6, 4)).astype(np.float32))
    y = flow.tensor(RNG.standard_normal(tuple(eager(x).shape)).astype(np.float32))
    model.to("cuda")
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.01))
    opt = flow.optim.SGD(eager.parameters(), lr=0.01)
    for _ in range(3):
        got = graph(x.to("cuda"), y.to("cuda"))
        loss = nn.MSELoss()(eager(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=1e-5)
    for p, pe in zip(model.parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), pe.numpy(), rtol=1e-4, atol=1e-6)
    scans = [k.comment for k in graph.compiled.program.kernels if k.ops == ["cumsum"]]
    assert any("reversed (block per row)" in c for c in scans) and any("] (block per row)" in c for c in scans)


EDGE_CASES = [  # (id, function, input): 0-d tensors, k = 0 (empty outputs), dims of 1 and 0, bool, int32
    ("zero_dim", lambda x: (*flow.sort(x, 0), flow.cumsum(x, 0), flow.cumprod(x, 0), *x.topk(1, 0)),
     np.array(3.5, np.float32)),
    ("k0", lambda x: (*x.topk(0, 1), flow.cumsum(x, 1)), np.ones((3, 4), np.float32)),
    ("dim_of_1", lambda x: (*flow.sort(x, 1), flow.cumprod(x, 1)), np.ones((3, 1), np.float32)),
    ("no_rows", lambda x: (*flow.sort(x, 1), flow.cumsum(x, 0)), np.ones((0, 5), np.float32)),
    ("bool_desc", lambda x: tuple(flow.sort(x, 0, descending=True)), np.array([True, False, True, False])),
    ("i32", lambda x: (*flow.sort(x, -1, descending=True), flow.cumsum(x, -1)), np.array([[3, 1, 3, -2]], np.int32)),
]


@pytest.mark.parametrize("fn, x", [c[1:] for c in EDGE_CASES], ids=[c[0] for c in EDGE_CASES])
def test_edge_shapes_and_dtypes_graph_equal_eager(fn, x):
    class Edge(nn.Module):
        def forward(self, x):
            return fn(x)

    _assert_graph_equals_eager(Edge(), x)


def test_scan_refuses_bool():
    x = Value("x", (3, 4), dt.bool_)
    node = Node("cumsum", [x], [Value("y", (3, 4), dt.bool_)], {"dim": 1, "reverse": False})
    with pytest.raises(NotImplementedError, match="cumsum: boolean input"):
        render_node(node, RenderContext(name="k_bool"))


def _nodes():
    """One node per kernel variant: ops x dtypes x directions x strided/innermost dims x row lengths."""
    variants = [("sort", (4, 9, 3), dt.float32, dict(dim=1, descending=True)),
                ("sort", (300,), dt.int64, dict(dim=0, descending=False)),
                ("sort", (5, 6), dt.bool_, dict(dim=1, descending=False)),
                ("topk", (4, 70), dt.float16, dict(k=5, dim=1, largest=True)),
                ("topk", (8, 3), dt.bfloat16, dict(k=2, dim=0, largest=False)),
                ("topk", (2, 40), dt.float64, dict(k=40, dim=1, largest=False)),
                ("cumsum", (4, 9, 3), dt.float32, dict(dim=1, reverse=True)),
                ("cumsum", (6, 10), dt.int32, dict(dim=1, reverse=False)),
                ("cumsum", (6, 10), dt.bfloat16, dict(dim=0, reverse=False)),
                ("cumprod", (6, 10), dt.int64, dict(dim=1, reverse=False)),
                ("cumprod", (3, 5), dt.float16, dict(dim=1, reverse=True)),
                ("cumprod", (7,), dt.float64, dict(dim=0, reverse=False)),
                ("topk", (2, 1100), dt.bfloat16, dict(k=3, dim=1, largest=True)),      # radix select
                ("topk", (3, 600, 2), dt.float64, dict(k=20, dim=1, largest=False)),
                ("topk", (2, 50257), dt.int64, dict(k=1024, dim=1, largest=True)),
                ("sort", (2, 1100), dt.bfloat16, dict(dim=1, descending=True)),        # ranked in runs, merged
                ("cumsum", (2, 3000), dt.float16, dict(dim=1, reverse=True)),          # block per row
                ("cumprod", (3, 1000), dt.int64, dict(dim=1, reverse=False))]
    nodes = []
    for op, shape, dtype, attrs in variants:
        x = Value("x", shape, dtype)
        metas = get_op(op).infer(TensorMeta(shape, dtype), **attrs)
        metas = metas if isinstance(metas, tuple) else (metas,)
        nodes.append(Node(op, [x], [Value(f"out{i}", m.shape, m.dtype) for i, m in enumerate(metas)], attrs))
    return nodes


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_with_nvrtc(arch):
    from flowgen.runtime.nvrtc import compile_cuda

    with rendering_for("cuda"):
        kernels = [k for i, node in enumerate(_nodes()) for k in render_node(node, RenderContext(name=f"k{i}_{node.op}"))]
    cubin = compile_cuda("\n".join(k.source for k in kernels), arch, tag=f"test_sort_scan_{arch}")
    assert len(cubin) > 1000
