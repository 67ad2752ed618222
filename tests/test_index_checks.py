"""Out-of-range indices (cross-entropy labels, embedding / gather / index_select indices) in a
graph raise IndexError naming the op, the module path, the value and the valid range, after
the step; they never make a kernel read or write out of bounds; the standalone program exits
with status 1 and the same message.

Graphs run on the CPU emulator; the checked kernels are also compiled with NVRTC.
"""
import ctypes
import json
import subprocess

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
import flowgen.nn.functional as F
from flowgen import dtype as dt
from flowgen.codegen import aot
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.ir.graph import Node, Value
from flowgen.ops.registry import TensorMeta, get_op
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library
from graphs import TrainGraph

HUGE = 1 << 40   # read unchecked, this index would fault


class Classifier(nn.Module):
    def __init__(self, loss_fn):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.loss_fn = loss_fn

    def forward(self, x, y):
        return self.loss_fn(self.fc(x), y)


class StepGraph(nn.Graph):
    """model(x, y), and a training step when given an optimizer."""

    def __init__(self, model, optimizer=None):
        super().__init__()
        self.model = model
        if optimizer is not None:
            self.add_optimizer(optimizer)
        self.training_step = optimizer is not None

    def build(self, x, y):
        loss = self.model(x, y)
        if self.training_step:
            loss.backward()
        return loss


def _raises(graph, *args, match):
    with pytest.raises(IndexError) as info:
        graph(*args)
    assert str(info.value) == match


def test_cross_entropy_rows_in_a_training_graph():
    model = Classifier(nn.CrossEntropyLoss())
    graph = StepGraph(model, flow.optim.SGD(model.parameters(), lr=0.5))
    x = flow.randn(2, 4)
    weight, bias = model.fc.weight.numpy().copy(), model.fc.bias.numpy().copy()

    _raises(graph, x, flow.tensor([0, 5]), match="cross_entropy in model.loss_fn: label 5 out of range [0, 3)")
    # The step happened with the bad row contributing nothing (loss row 0, gradient 0): the same
    # update as eager SGD on the good row alone, scaled by 1/2 (the mean still counts the bad row).
    ref = Classifier(nn.CrossEntropyLoss())
    with flow.no_grad():
        ref.fc.weight.copy_(flow.tensor(weight))
        ref.fc.bias.copy_(flow.tensor(bias))
    (ref(x[:1], flow.tensor([0])) * 0.5).backward()
    np.testing.assert_allclose(model.fc.weight.numpy(), weight - 0.5 * ref.fc.weight.grad.numpy(), rtol=1e-5,
                               atol=1e-6)

    _raises(graph, x, flow.tensor([HUGE, 1]), match=f"cross_entropy in model.loss_fn: label {HUGE} out of range [0, 3)")
    _raises(graph, x, flow.tensor([0, -1]), match="cross_entropy in model.loss_fn: label -1 out of range [0, 3)")

    # ignore_index (-100) is not an error; good data after the errors trains normally.
    for labels in ([0, -100], [2, 1]):
        y = flow.tensor(labels)
        expected = model(x, y).item()    # eager, on the parameters the graph left
        assert graph(x, y).item() == pytest.approx(expected, rel=1e-5)


def test_composite_cross_entropy_with_class_weights_and_nll_loss():
    """Class weights (and nll_loss) take the composite path: the pick is a gather."""
    weights = flow.tensor([1.0, 2.0, 0.5])
    weighted = StepGraph(Classifier(nn.CrossEntropyLoss(weight=weights)))
    x = flow.randn(3, 4)
    # The label picks a log-probability (gather) and a class weight (index_select); whichever
    # kernel the schedule runs first reports it.
    with pytest.raises(IndexError, match=r"^(gather|index_select) in model\.loss_fn: index 3 out of range \[0, 3\) "
                                         r"for dim [01]$"):
        weighted(x, flow.tensor([1, 3, 0]))
    assert weighted(x, flow.tensor([1, -100, 0])).item() == pytest.approx(
        weighted.model(x, flow.tensor([1, -100, 0])).item(), rel=1e-5)

    class LogSoftmaxNLL(nn.Module):
        def forward(self, logits, y):
            return F.nll_loss(F.log_softmax(logits, 1), y)

    nll = StepGraph(Classifier(LogSoftmaxNLL()))
    _raises(nll, x, flow.tensor([0, 1, -7]), match="gather in model.loss_fn: index -7 out of range [0, 3) for dim 1")
    assert nll(x, flow.tensor([0, 1, 2])).item() == pytest.approx(nll.model(x, flow.tensor([0, 1, 2])).item(),
                                                                  rel=1e-5)


def test_embedding_in_a_training_graph():
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Flatten(), nn.Linear(8, 3))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    y = flow.tensor([0, 2])
    _raises(graph, flow.tensor([[1, 2], [12, 4]]), y, match="embedding in model.0: index 12 out of range [0, 10)")
    _raises(graph, flow.tensor([[1, -HUGE], [3, 4]]), y,
            match=f"embedding in model.0: index {-HUGE} out of range [0, 10)")
    x = flow.tensor([[0, 9], [3, 0]])      # padding_idx and the last row are valid
    expected = F.cross_entropy(model(x), y).item()
    assert graph(x, y).item() == pytest.approx(expected, rel=1e-5)


def test_gather_and_indexing():
    class Picks(nn.Module):
        def forward(self, x, index):
            return flow.gather(x, 1, index).sum() + x[:, index[0]].sum()

    graph = StepGraph(Picks())
    x = flow.randn(2, 5)
    # x[:, index[0]] counts -5 from the end; gather refuses it
    _raises(graph, x, flow.tensor([[4, -5], [0, 1]]), match="gather in model: index -5 out of range [0, 5) for dim 1")
    index = flow.tensor([[4, 1], [0, 3]])
    assert graph(x, index).item() == pytest.approx(graph.model(x, index).item(), rel=1e-5)

    class Rows(nn.Module):
        def forward(self, x, index):
            return x[index] * 2

    rows = StepGraph(Rows())
    table = flow.randn(4, 3)
    np.testing.assert_allclose(rows(table, flow.tensor([3, -1, -4])).numpy(), table.numpy()[[3, -1, -4]] * 2)
    _raises(rows, table, flow.tensor([0, -5]), match="index_select in model: index -5 out of range [-4, 4) for dim 0")
    _raises(rows, table, flow.tensor([HUGE]),
            match=f"index_select in model: index {HUGE} out of range [-4, 4) for dim 0")
    np.testing.assert_allclose(rows(table, flow.tensor([1, 1, 2])).numpy(), table.numpy()[[1, 1, 2]] * 2)


def test_eager_names_the_op_and_value():
    x, labels = flow.randn(2, 3), flow.tensor([0, 5])
    cases = [
        (lambda: F.cross_entropy(x, labels), "cross_entropy: index 5"),
        (lambda: F.cross_entropy(x, labels, weight=flow.ones(3)), "cross_entropy: target 5"),
        (lambda: F.nll_loss(x, labels), "nll_loss: target 5"),
        (lambda: F.embedding(flow.tensor([3]), x.t()), "embedding: index 3"),
        (lambda: flow.gather(x, 1, flow.tensor([[0], [-1]])), "gather: index -1"),
        (lambda: flow.index_select(x, 1, flow.tensor([-1])), "index_select: index -1"),
        (lambda: x[:, flow.tensor([-4])], "index -4"),
    ]
    for run, message in cases:
        with pytest.raises(IndexError, match=message):
            run()
    np.testing.assert_array_equal(x[:, flow.tensor([-1])].numpy(), x.numpy()[:, [-1]])


# --------------------------------------------------------------------------
# each checked kernel on its own: the error record, no out-of-bounds access, NVRTC

# (op, input arrays with one bad index, attrs, the bad value)
KERNEL_CASES = [
    ("cross_entropy_rows", [np.ones((3, 4), np.float32), np.array([1, HUGE, 2])], dict(ignore_index=-100), HUGE),
    ("cross_entropy_rows_grad", [np.ones(3, np.float32), np.ones((3, 4), np.float32), np.array([1, 3, -4])],
     dict(ignore_index=3), -4),
    ("gather", [np.ones((3, 4), np.float32), np.array([[0], [HUGE], [1]])], dict(dim=1), HUGE),
    ("index_select", [np.ones((3, 4), np.float32), np.array([2, -1])], dict(dim=0), -1),
    ("index_select", [np.ones((3, 4), np.float32), np.array([-3, -HUGE])], dict(dim=0, wrap_negative=True), -HUGE),
    ("embedding", [np.ones((5, 2), np.float32), np.array([[1, 5]])], dict(padding_idx=-1), 5),
    ("scatter_add", [np.array([[0, -HUGE]]), np.ones((1, 2), np.float32)], dict(shape=(1, 3), dim=1), -HUGE),
    ("index_add", [np.array([1, HUGE]), np.ones((2, 3), np.float32)], dict(shape=(4, 3), dim=0), HUGE),
    ("embedding_backward", [np.ones((2, 3), np.float32), np.array([3, -2])], dict(num_weights=4, padding_idx=0), -2),
]
GUARD = 64   # canary elements on each side of every output


def _kernel_node(op, arrays, attrs, k):
    inputs = [Value(f"in{j}", a.shape, dt.from_numpy(a.dtype)) for j, a in enumerate(arrays)]
    meta = get_op(op).infer(*(TensorMeta(v.shape, v.dtype) for v in inputs), **attrs)
    return Node(op, inputs, [Value("out", tuple(meta.shape), meta.dtype)], dict(attrs), scope=f"case{k}")


@pytest.fixture(scope="module")
def checked_kernels():
    rendered = [(case, node, render_node(node, RenderContext(name=f"k{k}_{case[0]}", check_id=100 + k)))
                for k, case in enumerate(KERNEL_CASES) for node in [_kernel_node(*case[:3], k)]]
    source = '#include "flowgen_cuda_prelude.h"\n' + "\n".join(kn.source for *_, ks in rendered for kn in ks)
    return rendered, source


def test_checked_kernels_record_the_first_bad_index_and_stay_in_bounds(checked_kernels):
    rendered, source = checked_kernels
    module = CpuModule(build_cpu_library(source, "test_index_checks"))
    record = (ctypes.c_longlong * 2).from_address(module.global_address("flowgen_index_error"))
    for k, ((op, arrays, attrs, bad), node, kernels) in enumerate(rendered):
        record[0] = record[1] = 0
        out = node.output
        padded = np.full(out.numel + 2 * GUARD, 7, out.dtype.np_dtype)
        buffers = {v: np.ascontiguousarray(a) for v, a in zip(node.inputs, arrays)}
        address = {v: a.ctypes.data for v, a in buffers.items()}
        address[out] = padded[GUARD:].ctypes.data
        scratch = {a.value: np.zeros(a.value.shape, a.value.dtype.np_dtype) for kn in kernels for a in kn.args
                   if a.value not in address}           # a scatter's int32 segment buffers
        address.update((v, a.ctypes.data) for v, a in scratch.items())
        for kernel in kernels:
            module.launch(kernel.name, kernel.grid, kernel.block, kernel.smem,
                          [ctypes.c_void_p(address[a.value]) for a in kernel.args])
        assert (record[0], record[1]) == (100 + k, bad), op
        assert [kn.index_check.id for kn in kernels if kn.index_check] == [100 + k]
        assert (padded[:GUARD] == 7).all() and (padded[GUARD + out.numel:] == 7).all(), f"{op} wrote out of bounds"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_the_checked_kernels(arch, checked_kernels):
    from flowgen.runtime.nvrtc import compile_cuda

    _, source = checked_kernels
    assert len(compile_cuda(source, arch, tag=f"test_index_checks_{arch}")) > 1000


# --------------------------------------------------------------------------
# the standalone program

def test_standalone_program_exits_1_naming_the_bad_index(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    x, y = np.array([[1, 2], [3, 4]]), np.array([0, 2])
    graph(flow.tensor(x), flow.tensor(y))
    flow.save(graph, tmp_path / "saved")
    with pytest.raises(IndexError, match=r"^cross_entropy in loss_fn: label 3 out of range \[0, 3\)$"):
        flow.load(tmp_path / "saved").run(x, np.array([3, 0]))
    aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")
    binary = tmp_path / "out" / json.loads((tmp_path / "out" / "manifest.json").read_text())["binary"]

    def run(xs, ys):
        np.save(tmp_path / "x.npy", xs)
        np.save(tmp_path / "y.npy", ys)
        result = tmp_path / f"result{len(list(tmp_path.glob('result*')))}"
        proc = subprocess.run([binary, "--input", tmp_path / "x.npy", "--input", tmp_path / "y.npy",
                               "--out", result], capture_output=True, text=True, timeout=120)
        return proc, result

    proc, result = run(np.concatenate([x, x]), np.concatenate([y, y]))
    assert proc.returncode == 0, proc.stderr
    proc, result = run(np.concatenate([x, x]), np.array([0, 2, 1, HUGE]))
    assert proc.returncode == 1
    assert (f"error: IndexError: cross_entropy in loss_fn: label {HUGE} out of range [0, 3) (step 2)"
            in proc.stderr), proc.stderr
    assert not (result / "weights.safetensors").exists()
    proc, _ = run(np.array([[1, 2], [3, 10]]), y)
    assert proc.returncode == 1
    assert "error: IndexError: embedding in model.0: index 10 out of range [0, 10) (step 1)" in proc.stderr, proc.stderr


@pytest.mark.gpu
def test_cuda_graph_raises_and_recovers():
    model = Classifier(nn.CrossEntropyLoss()).to("cuda")
    graph = StepGraph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    x = flow.randn(2, 4).to("cuda")
    for _ in range(3):   # the second call onwards replays a captured CUDA graph
        _raises(graph, x, flow.tensor([0, 5]).to("cuda"),
                match="cross_entropy in model.loss_fn: label 5 out of range [0, 3)")
        assert np.isfinite(graph(x, flow.tensor([0, 2]).to("cuda")).item())
