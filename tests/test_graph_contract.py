"""nn.Graph keeps OneFlow's contract (issue 13): every config option acts, graph I/O takes what
OneFlow's takes, the Proxy / GraphModule API, `nn.functional.depend`, and `debug()` prints the
seeds' lines."""
import os
import random
import re

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import InferGraph, SumLossGraph, TrainGraph
from flowgen.memory import Step, check_plan, plan_memory
from flowgen.memory.search import compress
from flowgen.nn.graph import GraphModule, Proxy
from flowgen.runtime import cuda_driver


# ----------------------------------------------------------------- fusion switches
class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x) + x) * 0.5   # a residual add into the GEMM, then a scale


class CastLossGraph(nn.Graph):
    def __init__(self, model, switch=None):
        super().__init__()
        self.model = model
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if switch is not None:
            getattr(self.config, switch)(False)

    def build(self, x):
        loss = self.model(x).to(flow.float64).sum()   # a cast before the loss reduction
        loss.backward()
        return loss


def _train(switch, state, x):
    model = Residual()
    model.load_state_dict(state)
    graph = CastLossGraph(model, switch)
    losses = [graph(x).numpy() for _ in range(2)]
    return graph, losses, {k: v.numpy() for k, v in model.state_dict().items()}


def _fused_bodies(graph):
    return [(n.attrs["kind"], n.attrs["body"]) for n in graph.compiled.ir.nodes if n.op == "fused"]


def _mixes_update_and_gradient(body):
    return len({n.scope.startswith("optim") for n in body}) == 2


def _residual_in_anchor(kind, body):
    return kind in ("gemm", "conv") and any(
        n.op == "add" and all(v.numel == n.output.numel for v in n.inputs) for n in body)


def _cast_or_scale_with_neighbours(body):
    def is_cast_or_scale(n):
        return not n.scope.startswith("optim") and (
            n.op == "cast" or (n.op == "mul" and sorted(v.numel == 1 for v in n.inputs) == [False, True]))
    return len(body) > 1 and any(is_cast_or_scale(n) for n in body)


FAMILIES = {
    "allow_fuse_model_update_ops": lambda kind, body: _mixes_update_and_gradient(body),
    "allow_fuse_add_to_output": _residual_in_anchor,
    "allow_fuse_cast_scale": lambda kind, body: _cast_or_scale_with_neighbours(body),
}


def test_fusion_switches_turn_their_family_off_and_keep_the_numbers():
    state = Residual().state_dict()
    x = flow.randn(4, 8)
    fused, fused_losses, fused_params = _train(None, state, x)
    bodies = _fused_bodies(fused)
    for switch, in_family in FAMILIES.items():
        assert any(in_family(kind, body) for kind, body in bodies), f"on by default: {switch}'s family fuses"
        graph, losses, params = _train(switch, state, x)
        assert not any(in_family(kind, body) for kind, body in _fused_bodies(graph)), switch
        assert graph.compiled.num_launches > fused.compiled.num_launches, switch
        np.testing.assert_allclose(losses, fused_losses, rtol=1e-6)
        for name, value in params.items():
            np.testing.assert_allclose(value, fused_params[name], rtol=1e-6, atol=1e-7, err_msg=f"{switch}: {name}")


# ----------------------------------------------------------------- compress memory
def configured(model, config, value, momentum=0.0):
    """SumLossGraph with SGD, `config` (a GraphConfig method name) called with `value`."""
    graph = SumLossGraph(model, flow.optim.SGD(model.parameters(), lr=0.01 if momentum == 0 else 0.1, momentum=momentum))
    getattr(graph.config, config)(value)
    return graph


class _Gated(nn.Module):
    """Linear layers whose transposed weight two GEMMs read (a ReLU branch gated by a sigmoid one):
    an instance where the greedy plan leaves room that compress_memory's search finds."""

    def __init__(self, widths):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

    def forward(self, x):
        for layer in self.layers:
            wt = layer.weight.t()
            x = (x @ wt + layer.bias).relu() * (x @ wt).sigmoid()
        return x


def test_compress_memory_finds_a_smaller_arena_with_the_same_numbers():
    widths = [100, 30, 120, 20, 90, 1]
    state = _Gated(widths).state_dict()
    x = flow.randn(8, 100)
    results = []
    for compress_memory in (False, True):
        model = _Gated(widths)
        model.load_state_dict(state)
        graph = configured(model, "enable_compress_memory", compress_memory)
        results.append((graph(x).numpy(), graph.compiled.memory, model.layers[0].weight.numpy()))
    (loss, greedy, w), (loss_c, compressed, w_c) = results
    assert compressed.lower_bound_bytes <= compressed.arena_bytes < greedy.arena_bytes
    assert "[compressed: " in compressed.describe()
    np.testing.assert_array_equal(loss_c, loss)
    np.testing.assert_array_equal(w_c, w)


class _V:
    def __init__(self, name, nbytes):
        self.name, self.nbytes, self.numel = name, nbytes, nbytes // 4


def test_compressed_placement_is_valid_and_never_worse_than_greedy():
    rng = random.Random(7)
    for _ in range(40):
        values = [_V(f"v{i}", rng.choice([256, 512, 768, 1024, 2048, 4096])) for i in range(rng.randint(3, 14))]
        steps, produced = [], []
        for v in values:   # each step writes one value and reads up to two earlier ones
            reads = rng.sample(produced, min(len(produced), rng.randint(0, 2)))
            steps.append(Step(reads=reads, writes=[v], in_place=frozenset((v, r) for r in reads if rng.random() < 0.5)))
            produced.append(v)
        live_out = {values[-1]}
        greedy = plan_memory(steps, live_out=live_out)
        searched = plan_memory(steps, live_out=live_out, placement=compress)
        check_plan(searched, steps, live_out=live_out)
        assert searched.lower_bound_bytes <= searched.arena_bytes <= greedy.arena_bytes


# ----------------------------------------------------------------- options that cannot act on one device
def test_zero_and_set_stage_warn_that_they_have_no_effect_on_one_device():
    graph = CastLossGraph(Residual())
    with pytest.warns(UserWarning, match=r"enable_zero has no effect on a single device"):
        graph.config.enable_zero(True)
    with pytest.warns(UserWarning, match=r"set_stage has no effect on a single device"):
        graph.model.fc.to(GraphModule).set_stage(0)
    with pytest.raises(ValueError, match="set_outputs_buffer_size"):
        graph.config.set_outputs_buffer_size(0)
    graph.config.enable_cudnn_conv_heuristic_search_algo(True)
    with pytest.warns(UserWarning, match=r"enable_cudnn_conv_heuristic_search_algo has no effect on the cpu"):
        graph(flow.randn(4, 8))


# ----------------------------------------------------------------- graph I/O
class PassThrough(nn.Module):
    def forward(self, t, pair, nothing, count, word, **kwargs):
        return t * 2, pair, nothing, count, word, kwargs


class IOGraph(nn.Graph):
    def __init__(self):
        super().__init__()
        self.m = PassThrough()

    def build(self, t, pair, nothing, scale=1.0, **kwargs):
        doubled, pair, nothing, count, word, extra = self.m(t, pair, nothing, 3, "w", **kwargs)
        return doubled * scale, {"pair": pair, "none": nothing}, count, word, extra


def test_graph_takes_keywords_nested_structures_and_non_tensor_values():
    t, a, b, c, k = (flow.randn(2, 3) for _ in range(5))
    graph = IOGraph()
    doubled, nested, count, word, extra = graph(t, [a, {"b": b}], None, scale=3.0, kw=(c, k))
    np.testing.assert_allclose(doubled.numpy(), t.numpy() * 6, rtol=1e-6)
    assert isinstance(nested["pair"], list) and isinstance(nested["pair"][1], dict)
    np.testing.assert_array_equal(nested["pair"][0].numpy(), a.numpy())
    np.testing.assert_array_equal(nested["pair"][1]["b"].numpy(), b.numpy())
    assert nested["none"] is None and count == 3 and word == "w"
    assert isinstance(extra["kw"], tuple)
    np.testing.assert_array_equal(extra["kw"][1].numpy(), k.numpy())
    # a different non-tensor value is a different program
    graph.config.set_outputs_buffer_size(1)
    again = graph(t, [a, {"b": b}], None, scale=-1.0, kw=(c, k))[0]
    np.testing.assert_allclose(again.numpy(), t.numpy() * -2, rtol=1e-6)
    # outputs are fresh tensors: the first call's are still valid after later calls
    graph(t * 0, [a, {"b": b}], None, scale=3.0, kw=(c, k))
    np.testing.assert_allclose(doubled.numpy(), t.numpy() * 6, rtol=1e-6)
    with pytest.raises(TypeError, match=r"argument 1\[0\] is a set"):
        graph(t, [{1, 2}], None)


# ----------------------------------------------------------------- Proxy / GraphModule
class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.heads = nn.ModuleDict({"left": nn.Linear(4, 2), "right": nn.Linear(4, 2)})

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.heads["left"](x)


def test_proxy_and_graph_module_api():
    blocks = Blocks()
    graph = CastLossGraph(blocks)
    assert isinstance(graph.model, Proxy) and isinstance(graph.model.heads["left"], Proxy)
    assert isinstance(graph.model, Blocks) and isinstance(graph.model.heads["left"], nn.Linear)
    left = graph.model.heads["left"].to(GraphModule)
    assert (left.name, left.name_prefix, left.type) == ("left", "model.heads.", "MODULE")
    assert graph.model.heads["left"].to(nn.Module) is blocks.heads["left"]
    assert InferGraph(graph.model).model.to(nn.Module) is blocks   # a proxy given to another graph
    last = graph.model.layers[-1].to(GraphModule)
    assert (last.name, last.name_prefix) == ("2", "model.layers.")
    assert [p.to(GraphModule).name for p in graph.model.layers] == ["0", "1", "2"]
    top = graph.model.to(GraphModule)
    assert (top.name, top.name_prefix) == ("model", "")
    left.activation_checkpointing = True   # the same object comes back for the same path
    assert graph.model.heads.left.to(GraphModule).activation_checkpointing


# ----------------------------------------------------------------- depend
class DependModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        early = x.exp()
        y = self.fc(nn.functional.depend(x, early))
        return y, early


def test_depend_orders_the_dependency_first_and_is_the_identity():
    model = DependModel()
    x = flow.randn(3, 6)
    eager_y, eager_early = model(x)
    assert nn.functional.depend(x, [eager_early]) is x   # eager: nothing to order
    @nn.Graph.trace
    def graph(x):
        return model(x)

    with pytest.warns(UserWarning, match="not registered into a nn.Graph"):
        y, early = graph(x)
    np.testing.assert_allclose(y.numpy(), eager_y.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(early.numpy(), eager_early.numpy(), rtol=1e-6)
    # the GEMM reads x through the depend node, which reads the dependency: an order edge
    nodes = graph.compiled.ir.nodes
    at = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    depend = next(n for n in nodes if n.op == "depend")
    gemm = next(n for n in nodes if n.op == "fused" and n.attrs["kind"] == "gemm")
    assert depend.output in gemm.inputs and depend.inputs[0] is graph.compiled.ir.inputs[0]
    assert at[depend.inputs[1]] < at[depend.output] < at[gemm.output]
    names = [k.name for k in graph.compiled.program.kernels]
    assert [n for n in names if "exp" in n or "matmul" in n] == names and "exp" in names[0], names


# ----------------------------------------------------------------- debug output
SEED_004_DEBUG_1 = """\
(GRAPH:LinearTrainGraph_{n}:LinearTrainGraph) start building forward graph.
(INPUT:_LinearTrainGraph_{n}-input_0:tensor(..., size=(20, 3), dtype=flowgen.float32))
(INPUT:_LinearTrainGraph_{n}-input_1:tensor(..., size=(20,), dtype=flowgen.float32))
(MODULE:model:Sequential())
(INPUT:_model-input_0:tensor(..., is_lazy='True', size=(20, 3), dtype=flowgen.float32))
(MODULE:model.0:Linear(in_features=3, out_features=1, bias=True))
(INPUT:_model.0-input_0:tensor(..., is_lazy='True', size=(20, 3), dtype=flowgen.float32))
(PARAMETER:model.0.weight:tensor(..., size=(1, 3), dtype=flowgen.float32, requires_grad=True))
(PARAMETER:model.0.bias:tensor(..., size=(1,), dtype=flowgen.float32, requires_grad=True))
(OUTPUT:_model.0-output_0:tensor(..., is_lazy='True', size=(20, 1), dtype=flowgen.float32))
(MODULE:model.1:Flatten(start_dim=0, end_dim=1))
(INPUT:_model.1-input_0:tensor(..., is_lazy='True', size=(20, 1), dtype=flowgen.float32))
(OUTPUT:_model.1-output_0:tensor(..., is_lazy='True', size=(20,), dtype=flowgen.float32))
(OUTPUT:_model-output_0:tensor(..., is_lazy='True', size=(20,), dtype=flowgen.float32))
(MODULE:loss_fn:MSELoss())
(INPUT:_loss_fn-input_0:tensor(..., is_lazy='True', size=(20,), dtype=flowgen.float32))
(INPUT:_loss_fn-input_1:tensor(..., is_lazy='True', size=(20,), dtype=flowgen.float32))
(OUTPUT:_loss_fn-output_0:tensor(..., is_lazy='True', size=(), dtype=flowgen.float32))
(OUTPUT:_LinearTrainGraph_{n}-output_0:tensor(..., is_lazy='True', size=(), dtype=flowgen.float32))
(GRAPH:LinearTrainGraph_{n}:LinearTrainGraph) end building forward graph.
"""


class LinearTrainGraph(nn.Graph):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1e-6))

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def _seed_004_graph():
    return LinearTrainGraph(nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1)), nn.MSELoss(reduction="sum"))


def test_debug_levels_print_the_seed_lines(capsys):
    graph = _seed_004_graph()
    graph.debug(1)
    graph(flow.randn(20, 3), flow.randn(20))
    out = capsys.readouterr().out
    n = graph.name.rsplit("_", 1)[1]
    start = out.index(f"(GRAPH:{graph.name}:LinearTrainGraph) start building forward graph.")
    assert out[start:].startswith(SEED_004_DEBUG_1.format(n=n))
    assert re.search(rf"\(GRAPH:{graph.name}:LinearTrainGraph\) building graph Done! Cost time: \d+\.\d\ds\.", out)

    quiet = _seed_004_graph()
    quiet.debug(0)
    quiet(flow.randn(20, 3), flow.randn(20))
    stages = capsys.readouterr().out.splitlines()
    head = f"(GRAPH:{quiet.name}:LinearTrainGraph)"
    assert [line[len(head) + 1:] for line in stages if not line.startswith(head + " building graph Done")
            and not line.startswith(head + " compiling plan and init graph runtime Done")] == [
        "start building graph.", "end building graph.",
        "start compiling plan and init graph runtime.", "end compiling plan and init graph rumtime."]
    with pytest.raises(ValueError, match="v_level"):
        quiet.debug(4)


def test_print_wraps_tensor_lines_as_the_seeds_show():
    graph = LinearTrainGraph(nn.Sequential(nn.Linear(3, 1).to("cuda")), nn.MSELoss())
    text = repr(graph)
    assert ("      (PARAMETER:model.0.weight:tensor(..., device='cuda:0', size=(1, 3), dtype=flowgen.float32,\n"
            "             requires_grad=True)): ()") in text
    assert "(MODULE:model.0:Linear(in_features=3, out_features=1, bias=True)): (" in text


# ----------------------------------------------------------------- debug mode, devices, dtypes
def test_debug_mode_logs_the_lr_each_step_used(tmp_path, monkeypatch):
    """ONEFLOW_DEBUG_MODE / FLOWGEN_DEBUG_MODE: the graph writes `train_step, lr` per step to
    log/flowgen/<pid>-train_step2lr.csv (OneFlow's file), the LRs eager's scheduler gives."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLOWGEN_DEBUG_MODE", "1")
    model = nn.Linear(3, 2)
    sgd = flow.optim.SGD(model.parameters(), lr=0.1)
    schedule = flow.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(sgd, lr_sch=schedule)

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    step = Step()
    for _ in range(5):
        step(flow.randn(4, 3))
    log = tmp_path / "log" / "flowgen" / f"{os.getpid()}-train_step2lr.csv"
    lines = log.read_text().splitlines()
    assert lines[0] == "train_step, lr"
    logged = [(int(a), float(b)) for a, b in (line.split(",") for line in lines[1:])]
    assert logged == [(0, 0.1), (1, 0.1), (2, 0.05), (3, 0.05), (4, 0.025)]
    Step()(flow.randn(4, 3))   # a new graph starts the file afresh
    assert len(log.read_text().splitlines()) == 2


def test_cuda_graphs_run_on_the_emulator_when_asked(monkeypatch):
    """FLOWGEN_EMULATE_CUDA=1 without a GPU: a graph on 'cuda' runs its CUDA program on the
    emulator (equal to eager); without the switch it says how to get there."""
    if cuda_driver.available():
        pytest.skip("a GPU is present: 'cuda' graphs run on it")
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).to("cuda")
    x = flow.randn(2, 4).to("cuda")
    with pytest.raises(cuda_driver.NoCudaDevice, match="FLOWGEN_EMULATE_CUDA=1"):
        InferGraph(model)(x)
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    out = InferGraph(model)(x)
    assert out.device.type == "cuda"
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)


def test_small_integer_dtypes_in_eager_and_graphs():
    """flow.int8 / uint8 / int16: PyTorch's promotion (int8 + uint8 -> int16), graph == eager."""
    a = flow.tensor(np.array([1, -2, 3], np.int8))
    b = flow.tensor(np.array([200, 2, 3], np.uint8))
    assert (a + b).dtype == flow.int16 and (a * 2).dtype == flow.int8 and (b + 1.5).dtype == flow.float32
    assert b.type() == "flowgen.ByteTensor" and flow.ones(2, dtype=flow.int8).dtype == flow.int8

    class Mix(nn.Graph):
        def build(self, x, y):
            return x + y, (x * 3).to(flow.float32), x > 0

    for got, want in zip(Mix()(a, b), (a + b, (a * 3).to(flow.float32), a > 0)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_to_the_tensor_class_returns_the_tensor():
    """OneFlow's `graph.block.weight.to(flow.Tensor)`."""
    w = flow.randn(2, 2)
    assert w.to(flow.Tensor) is w


@pytest.mark.parametrize("kernels", ["emulator", "native"])
@pytest.mark.parametrize("a_shape,b_shape", [((9, 5), (5, 7)), ((1, 128), (128, 128)), ((3, 16, 40), (40, 24)),
                                             ((128, 200), (200, 2)), ((40, 33), (33, 16)), ((7, 64), (64, 1))])
def test_small_matmuls_are_fused_multiply_add_chains_in_graphs_and_eager(a_shape, b_shape, kernels, monkeypatch):
    """Flowgen's GEMM kernels accumulate c = fma(a, b, c) along k, as the GPU's FFMA does; eager
    computes small float32 products the same way (large ones go to BLAS), and so does the cpu
    target's native GEMM for those sizes (where OpenBLAS's GEMV and small-matrix paths would sum in
    other orders), so a graph's small matmuls equal eager's bit for bit (OneFlow's graph tests
    compare Linear outputs with np.array_equal) and both equal a sequential fused-multiply-add
    reference."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", kernels)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    fused = np.zeros(a_shape[:-1] + b_shape[-1:], np.float32)
    for k in range(a_shape[-1]):   # float64 holds a*b exactly; one rounding of a*b + c to float32 is fmaf
        fused = (a[..., k:k + 1].astype(np.float64) * b[k].astype(np.float64) + fused).astype(np.float32)

    class Product(nn.Graph):
        def build(self, x, y):
            return flow.matmul(x, y)

    np.testing.assert_array_equal(Product()(flow.tensor(a), flow.tensor(b)).numpy(), fused)
    np.testing.assert_array_equal(flow.matmul(flow.tensor(a), flow.tensor(b)).numpy(), fused)


# ----------------------------------------------------------------- multi-tensor update (OneFlow's pass)
def test_enable_multi_tensor_update_switches_the_multi_tensor_kernel():
    """Conv weights' updates cannot join their gradient's template kernel: on (flowgen's default) they
    share one multi-tensor kernel, off each runs alone; the numbers are the same."""
    flow.manual_seed(0)
    state = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).state_dict()
    x = flow.randn(2, 3, 5, 5)
    runs = {}
    for mode in (True, False):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1))
        model.load_state_dict(state)
        graph = configured(model, "enable_multi_tensor_update", mode, momentum=0.9)
        losses = [graph(x).numpy() for _ in range(2)]
        multi = [k for k in graph.compiled.program.kernels if k.horizontal]
        runs[mode] = (graph.compiled.num_launches, multi, losses, model[0].weight.numpy())
    (launches_on, multi_on, losses_on, w_on), (launches_off, multi_off, losses_off, w_off) = runs[True], runs[False]
    assert len(multi_on) == 1 and "2 independent segments" in multi_on[0].source
    assert multi_off == [] and launches_off > launches_on
    np.testing.assert_array_equal(losses_off, losses_on)
    np.testing.assert_array_equal(w_off, w_on)


def test_enable_fused_model_update_cast_says_it_cannot_act():
    """OneFlow's update writes a float16 weight copy under AMP; flowgen keeps none and says so."""
    config = nn.Graph().config
    with pytest.warns(UserWarning, match="enable_fused_model_update_cast has no effect"):
        config.enable_fused_model_update_cast(True)


# ----------------------------------------------------------------- _compile / _is_compiled (OneFlow's)
def test_compile_without_running_then_call_runs_the_compiled_step():
    """`graph._compile(x)` (OneFlow's) compiles without a step: weights stay; the next call reuses it."""
    flow.manual_seed(0)
    model = nn.Linear(4, 2)
    before = model.weight.numpy().copy()
    graph = configured(model, "enable_compress_memory", False)
    x = flow.randn(3, 4)
    assert not graph._is_compiled
    assert graph._compile(x) is None and graph._is_compiled
    np.testing.assert_array_equal(model.weight.numpy(), before)
    compiled = graph.compiled
    assert "(INPUT:_SumLossGraph_" in repr(graph)     # the compiled graph's repr, as after a call
    eager_loss = model(x).sum().numpy()
    np.testing.assert_allclose(graph(x).numpy(), eager_loss, rtol=1e-6)
    assert graph.compiled is compiled and len(graph._variants) == 1
    assert not np.array_equal(model.weight.numpy(), before)


def test_sysconfig_says_there_is_no_grpc_backend():
    """OneFlow's tests skip gRPC-only multi-process paths with `flow.sysconfig.has_rpc_backend_grpc()`."""
    import flowgen.sysconfig

    assert flow.sysconfig is flowgen.sysconfig and flow.sysconfig.has_rpc_backend_grpc() is False


def test_graph_without_inputs_or_parameters_runs_on_the_device_of_what_build_makes(monkeypatch):
    """OneFlow (test_graph_arange): a graph with nothing to take a device from runs where the
    tensors build() creates are; tensors on two devices are still refused."""
    if not cuda_driver.available():
        monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")

    class Arange(nn.Graph):
        def build(self):
            return flow.arange(start=0, end=100, step=3, device="cuda") * 2

    out = Arange()()
    assert out.device.type == "cuda"
    np.testing.assert_array_equal(out.numpy(), np.arange(0, 100, 3) * 2)

    class OnCpu(nn.Graph):
        def build(self):
            return flow.arange(10) + 1

    out = OnCpu()()
    assert out.device.type == "cpu"
    np.testing.assert_array_equal(out.numpy(), np.arange(10) + 1)

    class Mixed(nn.Graph):
        def build(self):
            return flow.arange(10, device="cuda"), flow.arange(10)

    with pytest.raises(Exception, match="a tensor on cpu was used in a graph running on cuda"):
        Mixed()()


def test_cpu_target_runs_reductions_updates_and_depthwise_grads_one_thread_per_block(monkeypatch):
    """On the cpu target reductions, softmax rows, depthwise grad_weight and multi-tensor updates run
    without barriers (one thread per block, no fibers: the emulator's slow path), and a training
    step equals the CUDA program's (run on the emulator) to rounding."""
    if cuda_driver.available():
        pytest.skip("a GPU is present: the cuda program runs there, not on the emulator")
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")

    def train(device):
        flow.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5), nn.Softmax(dim=1)).to(device)
        graph = TrainGraph(model, lambda p, y: -(p * y).sum(), flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        x, y = flow.randn(4, 3, 6, 6).to(device), flow.rand(4, 5).to(device)
        for _ in range(2):
            graph(x, y)
        return graph.compiled.program.kernels, {k: v.numpy() for k, v in model.state_dict().items()}

    kernels, on_cpu = train("cpu")
    _, on_cuda = train("cuda")
    for name, value in on_cpu.items():
        np.testing.assert_allclose(value, on_cuda[name], rtol=1e-5, atol=1e-6, err_msg=name)
    serial = [k for k in kernels if any(op in k.name for op in ("sum", "mean", "softmax", "multi_tensor", "grad_weight"))]
    assert serial and all(k.block == (1, 1, 1) or "softmax" in k.name for k in serial), \
        [(k.name, k.block) for k in serial if k.block != (1, 1, 1)]
    assert not any(k.needs_fibers for k in serial), [k.name for k in serial if k.needs_fibers]
