"""Scatter-adds (embedding backward, index_add, scatter_add: the gradients of embedding,
index_select / x[idx] and gather) are deterministic and equal the eager reference bit for bit.

The scatter kernels group the entries by destination with integer work only and add each
destination's sources in ascending entry order in double, like the eager np.bincount. On a GPU
the fill kernel's atomic cursors put a segment's entries in any order; the emulator runs small
launches on one thread, so there they mostly arrive in order (the old float atomicAdd path was
ordered there too) and a graph test alone could not tell a missing sort.
`test_sort_restores_entry_order_whatever_the_fill_order` therefore scrambles the segments between
the fill and the sort, with values whose float sum depends on the order.
"""
import ctypes
import json
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

import flowgen as flow
import flowgen.nn as nn
from flowgen import dtype as dt
from flowgen.codegen import aot
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.target import rendering_for
from flowgen.ir.graph import Node, Value
from flowgen.ops.registry import TensorMeta, get_op
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library
from flowgen.runtime.nvrtc import compile_cuda
from torch_oracle import get_torch

V, D = 12, 5        # embedding rows and width
PAD = 3             # its padding_idx


class Lookups(nn.Module):
    """Three parameters read through indices: their gradients are the three scatter-adds."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=PAD)      # embedding_backward
        self.table = nn.Parameter(flow.zeros(7, 4))          # index_add: x[rows] (negative rows wrap), dim 1
        self.grid = nn.Parameter(flow.zeros(4, 6))           # scatter_add: gather along dim 1

    def forward(self, tokens, rows, cols, picks, g_emb, g_rows, g_cols, g_picks):
        return ((self.emb(tokens) * g_emb).sum() + (self.table[rows] * g_rows).sum()
                + (flow.index_select(self.table, 1, cols) * g_cols).sum()
                + (flow.gather(self.grid, 1, picks) * g_picks).sum())


class Step(nn.Graph):
    """One SGD step with lr 1 from zero parameters: each parameter becomes minus its gradient, exactly."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1.0))

    def build(self, *inputs):
        loss = self.model(*inputs)
        loss.backward()
        return loss


# Entry values by rank within their destination: each 1e30 cancels, and which small values
# survive depends on the order they meet it in (in order 3 is absorbed and the sum of six is 0.75;
# reversed, -0.5 + 0.25 + 1 is absorbed and the sum is 3).
PATTERN = np.array([3.0, 1e30, -1e30, 1.0, 0.25, -0.5], np.float32)


def _ranked(keys):
    """PATTERN[rank of each entry among the entries with its key, in entry order]."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    ranks = np.empty(keys.size, np.int64)
    ranks[order] = np.arange(keys.size) - np.searchsorted(ranked, ranked, side="left")
    return PATTERN[ranks % PATTERN.size]


def _inputs(rng, big):
    """Indices with repeats (index 0, padding, one index taken many times, negative rows) and
    upstream gradients: standard normal, or (`big`) PATTERN by rank in each destination, whose
    sum depends on the order the sources are added in."""
    tokens = np.concatenate([np.zeros(9, np.int64), np.full(7, PAD), np.full(40, 5), rng.integers(0, V, 24)])
    tokens = rng.permutation(tokens).reshape(8, 10)
    rows = rng.permutation(np.array([0, 0, 6, -1, -1, -7, 2, 2, 2, 5, -3, 0] * 3))
    cols = np.array([3, 0, 3, 3, 1, 0, 3])
    picks = rng.integers(0, 6, (4, 9))
    picks[:, :5] = 2
    shapes = [(8, 10, D), (rows.size, 4), (7, cols.size), picks.shape]
    if big:   # the destinations: token, row (mod 7), column, (row, pick)
        grads = [np.broadcast_to(_ranked(tokens.ravel()).reshape(8, 10, 1), shapes[0]),
                 np.broadcast_to(_ranked(rows % 7)[:, None], shapes[1]),
                 np.broadcast_to(_ranked(cols)[None, :], shapes[2]),
                 _ranked((np.arange(4)[:, None] * 6 + picks).ravel()).reshape(shapes[3])]
        grads = [np.ascontiguousarray(g) for g in grads]
    else:
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    return [tokens, rows, cols, picks, *grads]


def _zero(model):
    for p in model.parameters():
        nn.init.zeros_(p)


def _eager_grads(model, arrays):
    _zero(model)
    for p in model.parameters():
        p.grad = None
    model(*[flow.tensor(a) for a in arrays]).backward()
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def _graph_grads(graph, model, arrays):
    _zero(model)
    graph(*[flow.tensor(a) for a in arrays])
    return {name: -p.numpy() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def lookups():
    model = Lookups()
    return model, Step(model)


@pytest.mark.parametrize("big", [False, True], ids=["normal", "order_sensitive"])
def test_graph_gradients_equal_eager_bit_for_bit_every_run(lookups, big):
    model, graph = lookups
    arrays = _inputs(np.random.default_rng(3), big)
    want = _eager_grads(model, arrays)
    first = _graph_grads(graph, model, arrays)
    again = _graph_grads(graph, model, arrays)
    for name in want:
        assert np.array_equal(first[name], want[name]), name
        assert np.array_equal(again[name], first[name]), name
    assert not want["emb.weight"][PAD].any() and want["emb.weight"][5].any()   # padding, 40 lookups
    ops = {op for k in graph.compiled.program.kernels for op in k.ops}
    assert {"embedding_backward", "index_add", "scatter_add"} <= ops


def test_graph_gradients_match_torch(lookups):
    torch = get_torch()
    model, graph = lookups
    arrays = _inputs(np.random.default_rng(4), big=False)
    got = _graph_grads(graph, model, arrays)
    tokens, rows, cols, picks, g_emb, g_rows, g_cols, g_picks = [torch.from_numpy(a.copy()) for a in arrays]
    emb = torch.zeros(V, D, requires_grad=True)
    table = torch.zeros(7, 4, requires_grad=True)
    grid = torch.zeros(4, 6, requires_grad=True)
    loss = ((torch.nn.functional.embedding(tokens, emb, padding_idx=PAD) * g_emb).sum()
            + (table[rows] * g_rows).sum() + (torch.index_select(table, 1, cols) * g_cols).sum()
            + (torch.gather(grid, 1, picks) * g_picks).sum())
    loss.backward()
    for name, t in [("emb.weight", emb), ("table", table), ("grid", grid)]:
        np.testing.assert_allclose(got[name], t.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


class ConstantTokens(nn.Graph):
    """Embedding lookups of a constant index: the segment kernels read only it."""

    TOKENS = np.array([[0, 1, 5, 0], [5, 5, 2, 0]])

    def __init__(self, emb):
        super().__init__()
        self.emb = emb
        self.add_optimizer(flow.optim.SGD(emb.parameters(), lr=1.0))

    def build(self, g):
        loss = (self.emb(flow.tensor(self.TOKENS)) * g).sum()
        loss.backward()
        return loss


def test_a_constant_index_builds_its_segments_once():
    """The rows / fill / sort kernels of a constant index move to the prepare kernels (run once,
    their scratch kept); the sum still runs every step and equals eager."""
    emb = nn.Embedding(6, 3, padding_idx=1)
    graph = ConstantTokens(emb)
    rng = np.random.default_rng(8)
    for _ in range(2):
        g = rng.standard_normal((2, 4, 3)).astype(np.float32)
        nn.init.zeros_(emb.weight)
        graph(flow.tensor(g))
        w = flow.zeros(6, 3, requires_grad=True)
        (nn.functional.embedding(flow.tensor(ConstantTokens.TOKENS), w, padding_idx=1) * flow.tensor(g)).sum().backward()
        assert np.array_equal(-emb.weight.numpy(), w.grad.numpy())
    program = graph.compiled.program
    assert [k.name.rsplit("_", 1)[1] for k in program.prepare] == ["rows", "fill", "sort"]
    assert any(k.name == program.prepare[0].name[:-len("_rows")] for k in program.kernels)


@pytest.mark.slow
def test_standalone_program_keeps_the_prepared_segments(tmp_path):
    """flow.save + the standalone program: the prepare kernels' scratch (written by three
    kernels) is one persistent buffer each, and a step gives the eager gradient."""
    emb = nn.Embedding(6, 3, padding_idx=1)
    graph = ConstantTokens(emb)
    g = np.random.default_rng(9).standard_normal((2, 4, 3)).astype(np.float32)
    graph(flow.tensor(g))
    nn.init.zeros_(emb.weight)
    flow.save(graph, tmp_path / "saved")
    aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")
    binary = tmp_path / "out" / json.loads((tmp_path / "out" / "manifest.json").read_text())["binary"]
    np.save(tmp_path / "g.npy", g)
    proc = subprocess.run([binary, "--input", tmp_path / "g.npy", "--out", tmp_path / "result"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    w = flow.zeros(6, 3, requires_grad=True)
    (nn.functional.embedding(flow.tensor(ConstantTokens.TOKENS), w, padding_idx=1) * flow.tensor(g)).sum().backward()
    got = load_file(tmp_path / "result" / "weights.safetensors")["emb.weight"]
    assert np.array_equal(got, -w.grad.numpy())


class HotTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4)

    def forward(self, tokens, g):
        return (self.emb(tokens) * g).sum()


def test_a_cuda_program_with_a_hot_index(monkeypatch):
    """The GPU rendering in a whole 'cuda' program (the block-wide rows kernel, a block sorting a
    600-entry segment), order-sensitive values: equal to eager. Without a GPU it runs on the
    emulator (FLOWGEN_EMULATE_CUDA=1); with one, on the GPU."""
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    rng = np.random.default_rng(10)
    tokens = rng.permutation(np.concatenate([np.full(600, 7), rng.integers(0, 50, 400)])).reshape(10, 100)
    g = np.ascontiguousarray(np.broadcast_to(_ranked(tokens.ravel()).reshape(10, 100, 1), (10, 100, 4)))
    model = HotTokens()
    want = _eager_grads(model, [tokens, g])["emb.weight"]
    model.to("cuda")
    graph = Step(model)
    nn.init.zeros_(model.emb.weight)
    graph(flow.tensor(tokens).to("cuda"), flow.tensor(g).to("cuda"))
    assert np.array_equal(-model.emb.weight.numpy(), want)
    assert any(k.name.endswith("_sort_long") for k in graph.compiled.program.kernels)


# --------------------------------------------------------------------------
# the kernels on their own, with the fill order scrambled

def _cases(rng):
    """(op, arrays, attrs) with long, order-sensitive segments; one with more than 1024 entries and
    8192 destinations (the rows kernel's block scan takes two chunks of 1024 threads x 8 keys) and
    a destination of 1000 entries (a block sorts it on the GPU)."""
    tokens = rng.integers(0, 6, 60)
    many = rng.integers(0, 9000, 3000)
    many[::3] = 7
    rows = rng.integers(-5, 5, 50)
    picks = rng.integers(0, 3, (4, 40))
    return [
        ("embedding_backward", [np.repeat(_ranked(tokens)[:, None], 4, 1), tokens], dict(num_weights=6, padding_idx=2)),
        ("embedding_backward", [np.repeat(_ranked(many)[:, None], 2, 1), many], dict(num_weights=9000, padding_idx=-1)),
        ("index_add", [rows, np.broadcast_to(_ranked(rows % 5)[None, :, None], (3, 50, 2)).copy()],
         dict(shape=(3, 5, 2), dim=1, wrap_negative=True)),
        ("scatter_add", [picks, _ranked((np.arange(4)[:, None] * 3 + picks).ravel()).reshape(4, 40)],
         dict(shape=(4, 3), dim=1)),
    ]


def _node(op, arrays, attrs, k):
    inputs = [Value(f"in{j}", a.shape, dt.from_numpy(a.dtype)) for j, a in enumerate(arrays)]
    meta = get_op(op).infer(*(TensorMeta(v.shape, v.dtype) for v in inputs), **attrs)
    return Node(op, inputs, [Value("out", tuple(meta.shape), meta.dtype)], dict(attrs), scope=f"case{k}")


@pytest.fixture(scope="module")
def scrambled():
    """The cases rendered for the GPU (a block-wide scan) and for the cpu target (one thread)."""
    cases = _cases(np.random.default_rng(5))
    rendered = []
    for target in ("cuda", "cpu"):
        with rendering_for(target):
            for k, (op, arrays, attrs) in enumerate(cases):
                node = _node(op, arrays, attrs, k)
                rendered.append((op, arrays, attrs, node, render_node(node, RenderContext(name=f"k{k}_{target}_{op}"))))
    source = '#include "flowgen_cuda_prelude.h"\n' + "\n".join(kn.source for *_, ks in rendered for kn in ks)
    return rendered, source


def _run(module, node, arrays, kernels, scramble, skip_sort=False):
    buffers = {v: np.ascontiguousarray(a) for v, a in zip(node.inputs, arrays)}
    buffers.update((a.value, np.full(a.value.shape, -7, a.value.dtype.np_dtype))
                   for k in kernels for a in k.args if a.value not in buffers)
    for k in kernels:
        if k.name.endswith("_sort"):
            offsets, positions = (buffers[a.value] for a in k.args)
            for lo, hi in zip(offsets[:-1], offsets[1:]):          # the order a GPU's atomics might give
                positions[lo:hi] = scramble(positions[lo:hi])
        if skip_sort and "_sort" in k.name:
            continue
        module.launch(k.name, k.grid, k.block, k.smem, [ctypes.c_void_p(buffers[a.value].ctypes.data) for a in k.args])
    return buffers[node.output]


def test_sort_restores_entry_order_whatever_the_fill_order(scrambled):
    rendered, source = scrambled
    module = CpuModule(build_cpu_library(source, "test_scatter_deterministic"))
    rng = np.random.default_rng(6)
    long_sorts = [ks[3] for *_, ks in rendered if ks[3].name.endswith("_sort_long")]
    assert len(long_sorts) == 1, "rendered for the GPU, a destination of 1000 entries is sorted by a block"
    for op, arrays, attrs, node, kernels in rendered:
        want = np.asarray(get_op(op).ref(*arrays, **attrs)).astype(node.output.dtype.np_dtype)
        for scramble in (lambda p: p[::-1], rng.permutation):
            got = _run(module, node, arrays, kernels, scramble)
            assert np.array_equal(got, want), kernels[-1].comment
        # the values make the order matter: without the sort a scrambled segment sums differently
        unsorted = _run(module, node, arrays, kernels, lambda p: p[::-1], skip_sort=True)
        assert not np.array_equal(unsorted, want), kernels[-1].comment


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_the_scatter_kernels(arch, scrambled):
    _, source = scrambled
    assert len(compile_cuda(source, arch, tag=f"test_scatter_deterministic_{arch}")) > 1000
