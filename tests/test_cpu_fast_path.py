"""The cpu target's native kernels (codegen/cpu/: GEMMs and convs through OpenBLAS, loops for the
rest) against eager: training steps and inference of an MLP, conv nets with BatchNorm (strides,
padding, groups, dilation, depthwise), the example GPT; attention (masks, causal, dropout), slices
and their gradients, cat, row gathers and their gradients, also against the emulated kernels bit
for bit where both keep the same order; and the switch that keeps every kernel on the emulator."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen import aot
from graphs import InferGraph, train_like_eager

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import gpt_char  # noqa: E402


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")


def native_names(graph) -> list:
    program = graph.compiled.program
    return [k.name for k in program.prepare + program.kernels if k.native]


def batches(shape, classes, count=2):
    rng = np.random.default_rng(1)
    return [(flow.tensor(rng.standard_normal(shape).astype(np.float32)),
             flow.tensor(rng.integers(0, classes, shape[0]).astype(np.int64))) for _ in range(count)]


def test_mlp_training_matches_eager():
    model = nn.Sequential(nn.Linear(20, 48), nn.GELU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))
    graph, _, _ = train_like_eager(model, lambda p: flow.optim.SGD(p, lr=0.1, momentum=0.9), batches((16, 20), 5, 3))
    names = native_names(graph)
    assert len(names) >= 6   # three forward GEMMs, their grad-input and grad-weight GEMMs
    # each weight's transpose and its transpose back for the input gradient compose away
    # (passes/simplify.py compose_permutes): the GEMMs read the weights in place
    assert not any("permute" in n for n in names), names


class SmallConvNet(nn.Module):
    """A stem with stride and padding and a max pool, a grouped and a dilated conv, a
    depthwise-separable block, 1x1 convs with BatchNorm and a residual add."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=1, padding=1))
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2)
        self.depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8),
                                       nn.ReLU6())
        self.pointwise = nn.Sequential(nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12))
        self.head = nn.Linear(12, 4)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.dilated(self.grouped(x))
        x = self.pointwise(self.depthwise(x))
        return self.head(x.mean(dim=(2, 3)))


def test_conv_net_with_batch_norm_training_matches_eager():
    model = SmallConvNet()
    graph, _, _ = train_like_eager(model, lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9),
                                   batches((4, 3, 12, 12), 4), loss_rtol=1e-4)
    names = native_names(graph)
    for op in ("conv2d_grad_input", "conv2d_grad_weight", "max_pool2d_grad"):
        assert any(op in n for n in names), f"no native {op} kernel in {names}"
    depthwise = [k for k in graph.compiled.program.kernels if k.ops[0].startswith("conv2d") and "groups 8" in k.comment]
    assert len(depthwise) == 3 and all(k.native for k in depthwise), [k.comment for k in depthwise]


def test_conv_net_inference_matches_eager():
    model = SmallConvNet().eval()
    x = flow.tensor(np.random.default_rng(2).standard_normal((1, 3, 12, 12)).astype(np.float32))
    graph = InferGraph(model)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    assert native_names(graph)


def test_gpt_training_and_decoding_match_eager():
    config = gpt_char.GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    model = gpt_char.define(flow)(config)
    eager = copy.deepcopy(model)
    opt_g = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))
    opt_e = eager.configure_optimizer(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt_g)

        def build(self, x, y):
            loss = self.model(x, y)[1]
            loss.backward()
            flow.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            return loss

    step = Step()
    rng = np.random.default_rng(3)
    for _ in range(2):
        x, y = (flow.tensor(rng.integers(0, 32, (2, 16)).astype(np.int64)) for _ in range(2))
        got = step(x, y)
        loss = eager(x, y)[1]
        opt_e.zero_grad()
        loss.backward()
        flow.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        opt_e.step()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=1e-5)
    assert native_names(step)

    model.eval()
    decode = InferGraph(model)
    context = flow.tensor(rng.integers(0, 32, (1, 16)).astype(np.int64))
    np.testing.assert_allclose(decode(context)[0].numpy(), model.eval()(context)[0].numpy(), rtol=1e-4, atol=1e-5)


def test_emulator_switch_renders_every_kernel_as_cuda(monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "emulator")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = flow.randn(4, 8)
    graph = InferGraph(model)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert native_names(graph) == []
    assert "flowgen_cpu.h" not in graph.compiled.program.source


def test_unknown_cpu_kernels_setting_is_refused(monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="FLOWGEN_CPU_KERNELS"):
        InferGraph(nn.Linear(2, 2))(flow.randn(1, 2))


def test_standalone_program_links_openblas_and_matches_the_graph(tmp_path):
    """`flowgen build --target cpu` of a graph with native kernels: OpenBLAS copied beside the
    binary and recorded in the manifest, the same logits as the graph; `--target emulator` none."""
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 6 * 6, 4)).eval()
    graph = InferGraph(model)
    x = flow.randn(2, 3, 6, 6)
    expected = graph(x).numpy()
    flow.save(graph, tmp_path / "saved")
    np.save(tmp_path / "x.npy", x.numpy())
    for target in ("cpu", "emulator"):
        out = tmp_path / target
        manifest = aot.build(tmp_path / "saved", out, target=target).manifest
        proc = subprocess.run([str(out / manifest["binary"]), "--input", str(tmp_path / "x.npy"), "--out",
                               str(out / "res")], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_allclose(np.load(out / "res" / "output_0.npy"), expected, rtol=1e-4, atol=1e-5)
        if target == "cpu":
            assert manifest["native_kernels"] >= 2 and manifest["blas"]["package"] == "scipy-openblas32"
            assert (out / os.path.basename(manifest["blas"]["library"])).is_file()
        else:
            assert manifest["native_kernels"] == 0 and manifest["blas"] is None


def test_gemm_layouts_and_permutes_match_eager():
    """Broadcast batches on either side, batched, transposed operands read in place, a transposed
    store, float64 (the emulated GEMM), products large enough to split over threads, permutes
    (an index map, tiles, whole rows)."""
    rng = np.random.default_rng(4)

    def t(*shape, dtype=np.float32):
        return flow.tensor(rng.standard_normal(shape).astype(dtype))

    cases = [(lambda a, b: flow.matmul(a, b) + 1.0, (t(2, 3, 4, 5), t(5, 6))),
             (lambda a, b: flow.matmul(a, b).relu(), (t(4, 5), t(2, 3, 5, 6))),
             (lambda a, b: flow.matmul(a.transpose(-1, -2), b) * 2, (t(3, 5, 4), t(3, 5, 6))),
             (lambda a, b: flow.matmul(a, b.transpose(-1, -2)), (t(3, 4, 5), t(3, 6, 5))),
             (lambda a, b: flow.matmul(a, b).transpose(0, 1) + 1, (t(40, 50), t(50, 60))),
             (lambda a, b: flow.matmul(a, b).tanh(), (t(4, 5, dtype=np.float64), t(5, 6, dtype=np.float64))),
             (lambda a, b: flow.matmul(a.t(), b.t()) - 0.5, (t(200, 300), t(500, 200))),
             (lambda a: a.permute(0, 2, 3, 1) * 1.5, (t(2, 3, 40, 50),)),
             # permutes: 32 x 32 tiles with ragged edges (batched, and one matrix), rows kept whole
             (lambda a: a.transpose(-1, -2) * 1.5, (t(3, 40, 50),)),
             (lambda a: a.t() - 1.0, (t(33, 70),)),
             (lambda a: a.permute(2, 0, 1, 3) + 0.5, (t(2, 3, 5, 7),))]

    class All(nn.Graph):
        def build(self, *xs):
            outs, at = [], 0
            for fn, args in cases:
                outs.append(fn(*xs[at:at + len(args)]))
                at += len(args)
            return tuple(outs)

    inputs = [x for _, args in cases for x in args]
    graph = All()
    for (fn, args), got in zip(cases, graph(*inputs)):
        np.testing.assert_allclose(got.numpy(), fn(*args).numpy(), rtol=1e-5, atol=1e-5)
    assert len(native_names(graph)) >= 7


@pytest.mark.slow
def test_cpu_vs_torch_benchmark_runs(tmp_path):
    """benchmarks/cpu_vs_torch.py end to end on its smallest case (it times, this only checks it runs)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "cpu_vs_torch.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "cpu_vs_torch.py"), "--cases", "mlp_train",
                           "--rows", "flowgen_graph", "torch_eager", "--repeats", "3", "--iters", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["flowgen_graph"]["native_launches"] > 0 and rows["torch_eager"]["median_ms"] > 0


def test_cross_entropy_rows_and_their_label_check():
    """The native cross-entropy rows (ignore_index, label smoothing off) train as eager, and a label
    out of range raises the emulated kernels' IndexError after the step."""
    model = nn.Linear(6, 5)
    loss_fn = nn.CrossEntropyLoss(ignore_index=2)
    data = [(x, y) for x, y in batches((7, 6), 5)]
    graph, _, _ = train_like_eager(model, lambda p: flow.optim.SGD(p, lr=0.1), data, loss_fn=loss_fn)
    assert any("cross_entropy_rows" in n for n in native_names(graph))
    with pytest.raises(IndexError, match="label 7 out of range"):
        graph(data[0][0], flow.tensor(np.array([0, 1, 7, 3, 4, 0, 1], np.int64)))


# ---- the families of the GPT step: attention, slices and their gradients, cat, embedding ----

class Probe(nn.Module):
    """Parameters `tensors` fed to `fn` with the step's input x: (fn(x, *params) * weights).sum()
    is the loss, so every output element gets its own gradient."""

    def __init__(self, fn, *tensors):
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList([nn.Parameter(flow.tensor(t)) for t in tensors])

    def forward(self, x, weights):
        return (self.fn(x, *self.params) * weights).sum()


def steps_like_eager(model, data, kernels="native", rtol=1e-5, atol=1e-6):
    """Two SGD steps on `model` as an nn.Graph (the cpu target's kernels: `kernels`) and eagerly on
    a copy, each from flow.manual_seed(0) (the same dropout draws): equal losses and parameters.
    Returns the graph's parameters after the steps."""
    os.environ["FLOWGEN_CPU_KERNELS"] = kernels
    eager = copy.deepcopy(model)
    opt_g, opt_e = flow.optim.SGD(model.parameters(), lr=0.5), flow.optim.SGD(eager.parameters(), lr=0.5)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt_g)

        def build(self, x, weights):
            loss = self.model(x, weights)
            loss.backward()
            return loss

    step = Step()
    flow.manual_seed(0)
    got = [step(*inputs).numpy() for inputs in data]
    assert bool(native_names(step)) == (kernels == "native")
    flow.manual_seed(0)
    want = []
    for inputs in data:
        loss = eager(*inputs)
        opt_e.zero_grad()
        loss.backward()
        opt_e.step()
        want.append(loss.numpy())
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=rtol, atol=atol, err_msg=name)
    return step, [p.numpy() for p in model.parameters()]


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


ATTENTION_CASES = {
    # rows not a multiple of the threads, keys != queries, head dims apart, no mask
    "plain": dict(lead=(2, 3), L=5, S=7, E=3, Ev=5),
    "causal": dict(lead=(2, 3), L=5, S=7, E=3, Ev=5, is_causal=True),
    "bool_mask": dict(lead=(2, 3), L=5, S=7, E=4, Ev=4, mask="bool"),
    "float_mask": dict(lead=(2, 3), L=5, S=7, E=4, Ev=4, mask="float"),
    # dropout over a Philox block boundary in every row (S = 7), with a mask and causal
    "dropout_bool_mask": dict(lead=(2, 3), L=5, S=7, E=4, Ev=4, mask="bool", dropout_p=0.3),
    "dropout_causal": dict(lead=(2, 3), L=6, S=6, E=4, Ev=4, is_causal=True, dropout_p=0.2),
    # more rows than one piece of the pool's loop, more keys than one chunk of dot products (64)
    "long_causal_dropout": dict(lead=(2, 2), L=80, S=80, E=8, Ev=8, is_causal=True, dropout_p=0.1),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_forward_and_backward_match_eager_and_the_emulated_kernels(case):
    c = ATTENTION_CASES[case]
    rng = np.random.default_rng(5)
    lead, L, S, E, Ev = c["lead"], c["L"], c["S"], c["E"], c["Ev"]
    mask = None
    if c.get("mask") == "bool":
        keep = rng.random((L, S)) > 0.3
        keep[1] = False                        # a fully masked row: output 0
        mask = flow.tensor(keep)
    elif c.get("mask") == "float":
        mask = flow.tensor(np.where(rng.random((1, L, S)) > 0.3, rng.standard_normal((1, L, S)), -np.inf)
                           .astype(np.float32))

    def attention(x, q, k, v):
        return flow.nn.functional.scaled_dot_product_attention(q + x, k, v, attn_mask=mask,
                                                               dropout_p=c.get("dropout_p", 0.0),
                                                               is_causal=c.get("is_causal", False))

    model = Probe(attention, _randn(rng, *lead, L, E), _randn(rng, *lead, S, E), _randn(rng, *lead, S, Ev))
    data = [(flow.tensor(_randn(rng, *lead, L, E)), flow.tensor(_randn(rng, *lead, L, Ev))) for _ in range(2)]
    emulated = copy.deepcopy(model)
    step, native = steps_like_eager(model, data)
    assert sum("attention" in k.name and k.native for k in step.compiled.program.kernels) == 2   # forward, backward
    # the native rows keep the emulated kernels' arithmetic per row: the same bits
    _, cuda = steps_like_eager(emulated, data, kernels="emulator")
    for got, want in zip(native, cuda):
        np.testing.assert_array_equal(got, want)


def test_slices_their_gradients_and_cat_match_eager():
    """Slices with steps and offsets on several dims (the rows of their gradients partly or not at
    all selected), a slice of the last dim (a GPT's q, k, v split), cat along a middle and the last
    dim, float32 and float64."""
    rng = np.random.default_rng(6)

    def pieces(x, a, b):
        q, k, v = a.split(4, dim=2)
        parts = [a[1:3, ::2, 5:11:3], b[:, 1:, :2], q * k + v]
        mixed = flow.cat([a[:, :2, :], b.to(flow.float32)[:, :, :12]], dim=1)
        return flow.cat([p.reshape(3, -1) for p in parts] + [mixed.reshape(3, -1), x], dim=1)

    a, b = _randn(rng, 3, 5, 12), rng.standard_normal((3, 7, 13))
    model = Probe(pieces, a, b)
    width = pieces(flow.zeros(3, 0), flow.tensor(a), flow.tensor(b)).shape[1]
    data = [(flow.tensor(_randn(rng, 3, 4)), flow.tensor(_randn(rng, 3, width + 4))) for _ in range(2)]
    step, _ = steps_like_eager(model, data)
    names = native_names(step)
    for op in ("slice", "slice_backward", "cat"):
        assert any(op in n for n in names), f"no native {op} kernel in {names}"


def test_embedding_and_index_select_rows_their_gradients_and_index_check():
    """Rows gathered by an embedding (with a padding_idx, repeated ids) and by index_select (outer >
    1, a repeated index) train as eager, their gradients (embedding_backward, index_add: entries
    added in order in double) bit for bit as the emulated kernels; an index out of range raises
    the emulated kernels' IndexError after the step."""
    rng = np.random.default_rng(7)

    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(11, 20, padding_idx=4)
            self.w = nn.Parameter(flow.tensor(_randn(rng, 3, 9, 4)))

        def forward(self, ids, weights):
            rows = self.table(ids)                                      # [5, 20]
            picked = flow.index_select(self.w, 1, flow.tensor(np.array([8, 0, 3, 3, 5])))   # [3, 5, 4]
            return (rows * rows).sum() + (picked * weights).sum()

    model = Lookup()
    emulated = copy.deepcopy(model)
    data = [(flow.tensor(np.array([0, 10, 4, 0, 7])), flow.tensor(_randn(rng, 3, 5, 4))) for _ in range(2)]
    step, native = steps_like_eager(model, data)
    names = native_names(step)
    for op in ("embedding", "index_select", "embedding_backward", "index_add"):
        assert any(f"_{op}" in n for n in names), f"no native {op} kernel in {names}"
    _, cuda = steps_like_eager(emulated, data, kernels="emulator")
    for got, want in zip(native, cuda):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError, match="index 11 out of range"):
        step(flow.tensor(np.array([0, 11, 4, 4, 7])), data[0][1])


def test_fused_reductions_match_eager_and_the_emulated_kernels():
    """Sums, means, max and min over leading, trailing and middle dims with their prologues and
    epilogues (a norm, BatchNorm-like sums of g and g * x, keepdim, a whole-tensor sum), in
    float32 (sums in double) and float64."""
    rng = np.random.default_rng(9)

    def reductions(x, a, b):
        s1 = (a * a).sum(dim=1)                                   # rows of [6, 40]
        s2 = a.abs().mean(dim=0, keepdim=True)                    # columns
        m = a.amax(dim=1) - a.amin(dim=1)                         # max and min rows
        g = b * 0.5
        bn = g.sum(dim=(0, 2, 3)) + (g * b).sum(dim=(0, 2, 3))    # per channel over N, H, W
        total = (x * x).sum().sqrt()                              # whole tensor
        return flow.cat([s1, s2.reshape(-1), m, bn, total.reshape(1), b.double().mean(dim=2).reshape(-1).float()])

    a, b = _randn(rng, 6, 40), _randn(rng, 3, 5, 4, 7)
    model = Probe(reductions, a, b)
    width = 6 + 40 + 6 + 5 + 1 + 3 * 5 * 7
    emulated = copy.deepcopy(model)
    data = [(flow.tensor(_randn(rng, 6, 40)), flow.tensor(_randn(rng, width))) for _ in range(2)]
    step, native = steps_like_eager(model, data, rtol=1e-5, atol=1e-5)
    reductions_native = [k for k in step.compiled.program.kernels if k.native and "output per iteration" in k.comment]
    assert len(reductions_native) >= 4, [k.comment for k in step.compiled.program.kernels]
    _, cuda = steps_like_eager(emulated, data, kernels="emulator", rtol=1e-5, atol=1e-5)
    for got, want in zip(native, cuda):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_broadcast_elementwise_rows_match_eager_and_the_emulated_kernels():
    """Elementwise kernels whose inputs are broadcast run as rows (codegen/cpu/elementwise.py
    rows_of): per-channel inputs over NCHW planes of 37 * 41 pixels (rows that the pool's pieces
    cut: 3 * 7 * 1517 elements), a bias along the last dim, both with a per-channel input of
    another layout, and a dropout whose Philox draws run in the rows. The same bits as the
    emulated kernels, and eager's numbers."""
    rng = np.random.default_rng(11)

    def broadcasts(x, scale, shift, bias, col):
        planes = (x * scale - shift).relu() * 0.5                    # [3, 7, 37, 41] by [7, 1, 1]
        rows = (x + bias) * col                                      # [41] along the last dim, [37, 1] per row
        dropped = flow.nn.functional.dropout(x * scale, p=0.25, training=True)
        return flow.cat([planes.reshape(-1), rows.reshape(-1), dropped.reshape(-1)])

    shapes = [(3, 7, 37, 41), (7, 1, 1), (7, 1, 1), (41,), (37, 1)]
    model = Probe(broadcasts, *[_randn(rng, *s) for s in shapes[1:]])
    numel = 3 * 3 * 7 * 37 * 41
    data = [(flow.tensor(_randn(rng, *shapes[0])), flow.tensor(_randn(rng, numel))) for _ in range(2)]
    emulated = copy.deepcopy(model)
    step, native = steps_like_eager(model, data)
    rows = [k for k in step.compiled.program.kernels if k.native and "consecutive elements" in k.source]
    assert len(rows) >= 2, [k.comment for k in step.compiled.program.kernels]
    assert any("i - row_start" in k.source for k in rows)   # the bias along the last dim
    _, cuda = steps_like_eager(emulated, data, kernels="emulator")
    for got, want in zip(native, cuda):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stride,padding,dilation,multiplier,kernel", [
    (1, 1, 1, 1, 3), (2, 1, 1, 1, 3), (2, 2, 2, 2, 3), (1, 0, 1, 1, 5), (3, 2, 1, 1, (3, 2))])
def test_depthwise_conv_rows_match_the_emulated_kernels(stride, padding, dilation, multiplier, kernel):
    """Depthwise convs (forward with a fused epilogue, grad_input, grad_weight) as row loops
    (templates/cpu_depthwise.cpp.j2): strides, padding wider than some taps' reach, dilation, a
    channel multiplier, non-square kernels; the same bits as the emulated kernels."""
    rng = np.random.default_rng(13)
    channels = 5

    def depthwise(x, w, b):
        y = flow.nn.functional.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=channels)
        return y.relu()

    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    model = Probe(depthwise, _randn(rng, channels * multiplier, 1, kh, kw), _randn(rng, channels * multiplier))
    x = flow.tensor(_randn(rng, 2, channels, 13, 11))
    out_shape = depthwise(x, *model.params).shape
    data = [(flow.tensor(_randn(rng, 2, channels, 13, 11)), flow.tensor(_randn(rng, *out_shape))) for _ in range(2)]

    class WithInput(nn.Module):   # the input a parameter too, so grad_input runs
        def __init__(self):
            super().__init__()
            self.inner = model
            self.shift = nn.Parameter(flow.tensor(_randn(rng, 2, channels, 13, 11)))

        def forward(self, x, weights):
            return self.inner(x * self.shift, weights)

    wrapped = WithInput()
    emulated = copy.deepcopy(wrapped)
    step, native = steps_like_eager(wrapped, data, rtol=1e-5, atol=1e-5)
    ops = {op for k in step.compiled.program.kernels if k.native and "depthwise" in k.comment for op in k.ops}
    assert {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"} <= ops, ops
    _, cuda = steps_like_eager(emulated, data, kernels="emulator", rtol=1e-5, atol=1e-5)
    for got, want in zip(native, cuda):
        np.testing.assert_array_equal(got, want)


def test_layer_norm_rows_match_the_emulated_kernels():
    """layer_norm, add_layer_norm (a residual sum normalized) and their backward as native row
    loops (codegen/cpu/rows.py): rows wider than the 32 lanes' first pass and narrower ones, with
    and without the affine; the same bits as the emulated kernels."""
    rng = np.random.default_rng(17)

    def norms(x, w, b, r):
        wide = flow.nn.functional.layer_norm(x + r, (70,), w, b, eps=1e-5)     # add_layer_norm
        narrow = flow.nn.functional.layer_norm(x[..., :6] * 2.0, (6,))          # no affine
        return flow.cat([wide.reshape(-1), narrow.reshape(-1)])

    model = Probe(norms, _randn(rng, 70), _randn(rng, 70), _randn(rng, 3, 5, 70))
    data = [(flow.tensor(_randn(rng, 3, 5, 70)), flow.tensor(_randn(rng, 3 * 5 * 76))) for _ in range(2)]
    emulated = copy.deepcopy(model)
    step, native = steps_like_eager(model, data, rtol=1e-5, atol=1e-5)
    ops = {op for k in step.compiled.program.kernels if k.native for op in k.ops}
    assert {"layer_norm_backward"} <= ops and ops & {"layer_norm", "add_layer_norm"}, ops
    _, cuda = steps_like_eager(emulated, data, kernels="emulator", rtol=1e-5, atol=1e-5)
    for got, want in zip(native, cuda):
        np.testing.assert_array_equal(got, want)
