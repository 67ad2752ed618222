"""nn.Graph end to end on the CPU emulator: numbers equal eager, passes verified, errors readable."""
import copy

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.ir.trace import TraceError
from flowgen.ir.interpret import interpret
from flowgen.ir.verify import IRError, verify
from flowgen.passes.pipeline import default_passes, run_passes
from graphs import InferGraph, MeanSquareGraph, SumLossGraph, TrainGraph, train_like_eager


def _mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_inference_graph_equals_eager_and_exposes_compiled():
    model = _mlp()
    x = flow.randn(4, 5)
    graph = InferGraph(model)
    out = graph(x)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    compiled = graph.compiled
    assert "kernels.cu" in compiled.sources
    assert "model.0" in compiled.sources["kernels.cu"]          # provenance in kernel names/comments
    assert compiled.num_launches < compiled.kernels_before_fusion  # bias add + relu fused
    mem = compiled.memory
    assert mem.lower_bound_bytes <= mem.arena_bytes <= mem.naive_bytes
    assert "%input_0" in str(compiled.ir)


@pytest.mark.parametrize("kernels", ["emulator", "native"])
def test_a_cpu_step_is_one_call_that_equals_launching_each_kernel(kernels, monkeypatch):
    """On the CPU the executor runs a step's launches from a table in one call into the library
    (flowgen_run_launches); the numbers are those of calling each launch from Python."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", kernels)
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.LayerNorm(7), nn.Linear(7, 3), nn.Softmax(-1))
    x = flow.randn(4, 5)
    graph = InferGraph(model)
    out = graph(x).numpy()
    executor = graph.compiled.executor
    assert executor.sequence is not None and len(executor.launches) > 1
    output = graph.compiled.program.graph.outputs[0]
    for launch in executor.launches:   # the same step, one ctypes call per launch
        launch()
    np.testing.assert_array_equal(executor.read_value(output), out)
    np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-5, atol=1e-6)


def _train_pair(make_opt, steps=6, make_sch=None, seed=0):
    """The MLP trained on `steps` random batches in a graph and in eager (see _train_like_eager)."""
    flow.manual_seed(seed)
    model = _mlp()
    batches = [(flow.randn(8, 5), flow.randn(8, 3)) for _ in range(steps)]
    return train_like_eager(model, make_opt, batches, loss_fn=nn.MSELoss(), make_sch=make_sch, loss_rtol=2e-5,
                             loss_atol=1e-6)


@pytest.mark.parametrize("make_opt", [
    lambda p: flow.optim.SGD(p, lr=0.1),
    lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, dampening=0.0),
    lambda p: flow.optim.Adam(p, lr=0.01, weight_decay=0.01),
    lambda p: flow.optim.AdamW(p, lr=0.01, weight_decay=0.1),
], ids=["sgd", "sgd-momentum-wd", "sgd-nesterov", "adam", "adamw"])
def test_training_graph_matches_eager_optimizers(make_opt):
    _train_pair(make_opt)


def test_training_graph_follows_lr_schedule():
    graph, opt_g, opt_e = _train_pair(lambda p: flow.optim.SGD(p, lr=0.1, momentum=0.5),
                                      make_sch=lambda o: flow.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    # weights follow the eager schedule; the graph advanced its own copy, not the user's objects (OneFlow)
    assert opt_g.param_groups[0]["lr"] == 0.1 and opt_e.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_every_pass_verifies_and_preserves_numbers():
    model = _mlp()
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    x, y = flow.randn(8, 5), flow.randn(8, 3)
    state = {name: p.numpy().copy() for name, p in model.named_parameters(prefix="model")}
    graph(x, y)
    ir = graph.compiled.ir
    verify(ir)
    # Rebuild the pre-fusion IR by re-running the passes on the traced+differentiated graph.
    unfused = copy.copy(ir)
    unfused.nodes = [n for node in ir.nodes for n in (node.body if node.op == "fused" else [node])]
    verify(unfused)
    full_state = {s.name: np.zeros(s.value.shape, s.value.dtype.np_dtype) for s in ir.state}
    full_state.update(state)
    for s in ir.state:
        if s.kind == "hyper":
            full_state[s.name] = np.float32(0.1)
    out_a, st_a = interpret(unfused, [x.numpy(), y.numpy()], full_state)
    again, _ = run_passes(unfused, default_passes(graph.config), check=True)
    out_b, st_b = interpret(again, [x.numpy(), y.numpy()], full_state)
    np.testing.assert_allclose(out_a[0], out_b[0], rtol=1e-6)
    for name in state:
        np.testing.assert_allclose(st_a[name], st_b[name], rtol=1e-6)


def test_a_pass_that_breaks_the_ir_contract_raises_after_the_pipeline():
    """Without `check`, the pipeline still verifies its result once: a pass that leaves an update
    of the wrong dtype raises IRError naming it, instead of compiling into a wrong buffer write."""
    model = _mlp()
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    graph(flow.randn(8, 5), flow.randn(8, 3))
    ir = graph.compiled.ir

    def retype_first_update(g):
        broken = copy.copy(g)
        name, value = g.updates[0]
        wrong = copy.copy(value)
        wrong.dtype = flow.float64
        broken.updates = [(name, wrong)] + list(g.updates[1:])
        return broken

    with pytest.raises(IRError, match="does not match"):
        run_passes(ir, [("retype", retype_first_update)])


def test_parameters_are_shared_with_eager():
    model = _mlp()
    opt = flow.optim.SGD(model.parameters(), lr=0.1)
    graph = TrainGraph(model, nn.MSELoss(), opt)
    x, y = flow.randn(8, 5), flow.randn(8, 3)
    before = model[0].weight.numpy().copy()
    graph(x, y)
    after = model[0].weight.numpy().copy()
    assert not np.allclose(before, after)          # graph training shows in eager
    with flow.no_grad():
        model[0].weight.zero_()                    # eager change is seen by the next call
    out = InferGraph(model)(x)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    graph(x, y)
    assert np.abs(model[0].weight.numpy()).max() < 1.0


def test_new_input_shape_retraces_and_caches():
    model = _mlp()
    graph = InferGraph(model)
    a = graph(flow.randn(2, 5))
    b = graph(flow.randn(3, 5))
    assert tuple(a.shape) == (2, 3) and tuple(b.shape) == (3, 3)
    assert len(graph._variants) == 2
    graph(flow.randn(2, 5))
    assert len(graph._variants) == 2


def test_repr_before_and_after_call():
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    graph = TrainGraph(model, nn.MSELoss(reduction="sum"), flow.optim.SGD(model.parameters(), lr=1e-3))
    text = repr(graph)
    assert text.splitlines()[0] == f"(GRAPH:{graph.name}:TrainGraph): ("
    assert "(CONFIG:config:GraphConfig(training=True, ))" in text
    assert "(MODULE:model.0:Linear(in_features=3, out_features=1, bias=True)): (" in text
    assert "(PARAMETER:model.0.weight:tensor(..., size=(1, 3), dtype=flowgen.float32, requires_grad=True)): ()" in text
    assert "INPUT:" not in text
    graph(flow.randn(20, 3), flow.randn(20))
    text = repr(graph)
    # OneFlow leaves the device out on the CPU
    assert f"(INPUT:_{graph.name}-input_0:tensor(..., size=(20, 3), dtype=flowgen.float32))" in text
    assert "(OUTPUT:_model.1-output_0:tensor(..., is_lazy='True', size=(20,), dtype=flowgen.float32))" in text
    assert "(MODULE:loss_fn:MSELoss()): (" in text


def test_graph_names_count_per_class():
    a, b = InferGraph(_mlp()), InferGraph(_mlp())
    assert int(b.name.rsplit("_", 1)[1]) == int(a.name.rsplit("_", 1)[1]) + 1


def test_debug_levels(capsys):
    model = _mlp()
    graph = InferGraph(model)
    graph.debug(3)
    graph(flow.randn(2, 5))
    out = capsys.readouterr().out
    assert "start building graph" in out and "end compiling" in out
    assert "(MODULE:model.0:Linear(in_features=5, out_features=" in out   # level 1
    assert "(OPERATOR: matmul" in out                           # level 2
    assert "(PASS:fusion)" in out and "graph InferGraph" in out  # IR after each pass
    assert "    at graphs.py:" in out                            # level 3: the user's build() line


def test_errors_name_the_problem():
    model = _mlp()

    class NumpyInBuild(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return flow.tensor(self.model(x).numpy())

    with pytest.raises(RuntimeError, match="numpy"):
        NumpyInBuild()(flow.randn(2, 5))
    with pytest.raises(TypeError, match="argument 0 .* list"):
        InferGraph(model)([1, 2, 3])

    class NoOptimizer(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    with pytest.raises(RuntimeError, match="add_optimizer"):
        NoOptimizer()(flow.randn(2, 5))

    class OptimizerAttr(nn.Graph):
        def __init__(self):
            super().__init__()
            self.opt = flow.optim.SGD(model.parameters(), lr=0.1)

    with pytest.raises(AttributeError, match="add_optimizer"):
        OptimizerAttr()

    with pytest.raises(ValueError, match=r"\(2, 4\)"):
        InferGraph(model)(flow.randn(2, 4))


def test_cuda_graph_without_gpu_says_so():
    from flowgen.runtime import cuda_driver

    if cuda_driver.available():
        pytest.skip("a GPU is present")
    model = _mlp().to("cuda")
    with pytest.raises(RuntimeError, match='device="cpu"|device=.cpu'):
        InferGraph(model)(flow.randn(2, 5).to("cuda"))


def test_generated_kernels_compile_with_nvrtc():
    from flowgen.runtime import nvrtc

    model = _mlp()
    graph = TrainGraph(model, nn.MSELoss(), flow.optim.Adam(model.parameters(), lr=0.01))
    graph(flow.randn(8, 5), flow.randn(8, 3))
    for arch in ("sm_80", "sm_90"):
        assert len(nvrtc.compile_cuda(graph.compiled.sources["kernels.cu"], arch)) > 0


def test_polyfit_graph_example_matches_eager_losses():
    import math

    x = flow.tensor(np.linspace(-math.pi, math.pi, 200), dtype=flow.float32)
    y = flow.tensor(np.sin(x), dtype=flow.float32)
    xx = flow.cat([x.unsqueeze(-1).pow(1), x.unsqueeze(-1).pow(2), x.unsqueeze(-1).pow(3)], dim=1)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    train_like_eager(model, lambda params: flow.optim.SGD(params, lr=1e-5), [(xx, y)] * 50,
                      loss_fn=nn.MSELoss(reduction="sum"))


def test_dropout_in_a_training_graph_draws_the_eager_masks():
    """Each call draws fresh Philox offsets, exactly as the eager loop does."""
    flow.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 4))
    eager = copy.deepcopy(model)

    graph = SumLossGraph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    opt = flow.optim.SGD(eager.parameters(), lr=0.1)
    x = flow.randn(8, 16)
    flow.manual_seed(5)
    graph_losses = [float(graph(x)) for _ in range(3)]
    flow.manual_seed(5)
    eager_losses = []
    for _ in range(3):
        loss = eager(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        eager_losses.append(float(loss))
    np.testing.assert_allclose(graph_losses, eager_losses, rtol=1e-5)
    assert len(set(np.round(graph_losses, 3))) == 3   # masks differ from call to call
    np.testing.assert_allclose(model[0].weight.numpy(), eager[0].weight.numpy(), atol=1e-5)


def test_activation_checkpointing_recomputes_and_lowers_peak_memory():
    def run(checkpoint: bool):
        flow.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
                                for _ in range(4)])

        class Step(nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.1))
                if checkpoint:
                    for block in self.model:
                        block.to(nn.graph.GraphModule).activation_checkpointing = True

            def build(self, x):
                loss = self.model(x).square().mean()
                loss.backward()
                return loss

        graph = Step()
        x = flow.randn(1024, 64)   # activations, not weights, dominate the peak
        losses = [float(graph(x)) for _ in range(3)]
        return losses, graph.compiled, model

    plain_losses, plain, _ = run(False)
    ckpt_losses, ckpt, _ = run(True)
    np.testing.assert_allclose(ckpt_losses, plain_losses, rtol=1e-6)
    assert "recompute" in str(ckpt.ir)
    assert ckpt.memory.lower_bound_bytes < plain.memory.lower_bound_bytes


def test_straighten_algorithm_gives_a_valid_schedule_and_same_numbers():
    model = _mlp()
    x = flow.randn(4, 5)
    graph = InferGraph(model)
    graph.config.enable_straighten_algorithm(True)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


def _eval_convnet():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    with flow.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(flow.randn(8))
                m.running_var.copy_(flow.rand(8) + 0.5)
    return model.eval()


def test_eval_convnet_runs_one_kernel_per_conv_and_sees_eager_changes():
    model = _eval_convnet()
    graph = InferGraph(model)
    x = flow.randn(2, 3, 8, 8)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)
    compiled = graph.compiled
    # conv+BN+act, depthwise conv+BN+act, pool, linear+bias: BN scales are prepared once.
    assert compiled.num_launches == 4
    assert len(compiled.program.prepare) == 2
    assert "epilogue: add, sub, mul, mul, add, clamp" in compiled.sources["kernels.cu"]
    with flow.no_grad():       # eager change to frozen state: the prepare kernels run again
        model[1].running_var.mul_(4.0)
        model[0].weight.mul_(0.5)
    np.testing.assert_allclose(graph(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)


def test_amp_graph_runs_matmuls_in_half_and_tracks_fp32_training():
    flow.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    loss_fn = nn.MSELoss()
    amp = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.05))
    amp.config.enable_amp(True)
    amp.set_grad_scaler(flow.amp.StaticGradScaler(128.0))
    fp32 = TrainGraph(reference, loss_fn, flow.optim.SGD(reference.parameters(), lr=0.05))
    x, y = flow.randn(16, 5), flow.randn(16, 3)
    for _ in range(5):
        la, lf = float(amp(x, y)), float(fp32(x, y))
        assert abs(la - lf) < 2e-2 * max(1.0, abs(lf))
    ir = str(amp.compiled.ir)
    assert "f16[" in ir and "cast" in ir
    assert "__half" in amp.compiled.sources["kernels.cu"]
    np.testing.assert_allclose(model[0].weight.numpy(), reference[0].weight.numpy(), atol=5e-3)


def test_gradient_accumulation_averages_micro_batch_gradients():
    flow.manual_seed(0)
    model = _mlp()
    eager = copy.deepcopy(model)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph.config.set_gradient_accumulation_steps(4)
    opt = flow.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x, y = flow.randn(16, 5), flow.randn(16, 3)
        losses = graph(x, y)
        assert tuple(losses.shape) == (4,)          # one loss per micro-batch
        opt.zero_grad()
        expected = []
        for j in range(4):
            loss = loss_fn(eager(x[4 * j:4 * j + 4]), y[4 * j:4 * j + 4])
            (loss / 4).backward()
            expected.append(float(loss))
        opt.step()
        np.testing.assert_allclose(losses.numpy(), expected, rtol=1e-5)
    for p, pe in zip(model.parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), pe.numpy(), rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="dim 0"):
        graph(flow.randn(6, 5), flow.randn(6, 3))


def test_update_written_in_place_never_clobbers_a_value_still_read_through_a_view():
    """Regression: BatchNorm's weight is read as a reshaped view by later backward kernels, so
    its SGD update must not overwrite the parameter buffer before them."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8))
    eager = copy.deepcopy(model)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=1.0))

        def build(self, x, t):
            loss = (self.model(x) * t).sum()
            loss.backward()
            return loss

    x, t = flow.randn(4, 3, 8, 8), flow.randn(4, 8, 4, 4)
    Step()(x, t)
    opt = flow.optim.SGD(eager.parameters(), lr=1.0)
    (eager(x) * t).sum().backward()
    opt.step()
    for p, pe in zip(model.parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), pe.numpy(), rtol=1e-5, atol=1e-4)


def test_generated_source_is_deterministic():
    """Same graph, same bytes (the source text is also the compile-cache key)."""
    def source():
        flow.manual_seed(0)
        model = _mlp()
        graph = TrainGraph(model, nn.MSELoss(), flow.optim.Adam(model.parameters(), lr=0.01))
        graph(flow.randn(8, 5), flow.randn(8, 3))
        return graph.compiled.sources["kernels.cu"]   # a second instance (TrainGraph_1) reuses the cache

    assert source() == source()


def test_conv_tile_choices_render_the_chosen_variant(monkeypatch, tmp_path):
    """What the GPU conv search hands codegen (here forced to the cost model's runner-up)."""
    from flowgen.codegen.kernels.conv import conv_key, conv_tile_candidates
    from flowgen.nn.graph import compiled as compiled_mod

    def runner_up(graph, ir, device):
        convs = [n for node in ir.nodes for n in (node.body if node.op == "fused" else [node])
                 if n.op.startswith("conv2d")]
        return {conv_key(n): conv_tile_candidates(n)[1] for n in convs if len(conv_tile_candidates(n)) > 1}

    monkeypatch.setattr(compiled_mod, "_conv_tiles", runner_up)
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 24, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(24 * 6 * 6, 5))
    eager = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    graph = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=0.1))
    x, y = flow.randn(3, 8, 6, 6), flow.randint(0, 5, (3,))
    np.testing.assert_allclose(graph(x, y).numpy(), loss_fn(eager(x), y).numpy(), rtol=1e-5)
    chosen = runner_up(None, graph.compiled.ir, None)
    assert chosen
    source = graph.compiled.sources["kernels.cu"]
    for dims in chosen.values():
        assert f"implicit GEMM {dims[0]}x{dims[1]}" in source or f"1x1 as GEMM {dims[0]}x{dims[1]}" in source
    # The choices are attributes of the conv nodes: a saved graph's program renders them too.
    flow.save(graph, tmp_path / "saved")
    assert flow.load(tmp_path / "saved").program("cpu").source == source


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_is_one_kernel_each_way_and_equals_eager(reduction):
    """(N, C) logits with class indices: log-softmax + pick in one forward kernel, softmax - onehot
    in one backward kernel (cross_entropy_rows), ignored rows included; one SGD step equals eager."""
    flow.manual_seed(0)
    model = nn.Linear(6, 300)
    eager = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss(ignore_index=4, reduction=reduction)
    weights = flow.randn(7) if reduction == "none" else flow.tensor(1.0)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(flow.optim.SGD(model.parameters(), lr=0.5))

        def build(self, x, y, w):
            loss = (loss_fn(self.model(x), y) * w).sum()
            loss.backward()
            return loss

    x, y = flow.randn(7, 6), flow.tensor(np.array([4, 0, 299, 4, 17, 3, 250]))
    graph = Step()
    got = graph(x, y, weights)
    expected = (loss_fn(eager(x), y) * weights).sum()
    flow.optim.SGD(eager.parameters(), lr=0.5).zero_grad()
    expected.backward()
    with flow.no_grad():
        for p in eager.parameters():
            p.copy_(p - p.grad * 0.5)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5)
    for name, p in eager.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), p.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    names = [k.name for k in graph.compiled.program.kernels]
    assert sum("cross_entropy_rows_grad" in n for n in names) == 1
    assert sum("cross_entropy_rows" in n and "grad" not in n for n in names) == 1
    assert not any("softmax" in n or "gather" in n for n in names), names


def test_optimized_parameter_outside_the_graph_modules_is_an_error():
    """A Parameter set on the Graph itself (not in a module) would be captured as a constant and
    never trained; the graph says so instead of silently diverging from eager."""
    w = nn.Parameter(flow.randn(3))

    class Loose(nn.Graph):
        def __init__(self):
            super().__init__()
            self.w = w
            self.add_optimizer(flow.optim.SGD([w], lr=0.1))

        def build(self, x):
            loss = (self.w * x).sum()
            loss.backward()
            return loss

    with pytest.raises(TraceError, match=r"parameter of shape \(3,\) that the optimizer trains but that belongs "
                                         r"to no module"):
        Loose()(flow.randn(3))


def test_batchnorm_training_kernels_recompute_x_minus_mean():
    """Conv -> BatchNorm -> ReLU6 training step: BatchNorm's forward is 3 kernels (mean; variance
    with x - mean recomputed in its prologue, not stored for the backward; normalise + ReLU6) and
    its backward 3 (ReLU6 mask; one pass for both channel reductions sum(g), sum(g * xhat) with the
    weight and bias updates in its epilogue; dx); two SGD-momentum steps equal eager."""
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    graph, _, _ = train_like_eager(model, lambda params: flow.optim.SGD(params, lr=0.1, momentum=0.9),
                                    [(flow.randn(4, 3, 16, 16), flow.randint(0, 4, (4,)))] * 2)
    bn_kernels = [k.name for k in graph.compiled.program.kernels if "_model_1_" in k.name]
    forward = [k for k in bn_kernels if "backward" not in k and "ge_le" not in k and "num_batches" not in k]
    assert len([k for k in forward if "mean" in k or "batch_norm_affine" in k]) == 3, bn_kernels
    backward = [k for k in graph.compiled.program.kernels if "_model_1_" in k.name and k.name not in forward]
    assert len(backward) == 3, bn_kernels
    assert sum("acc1" in k.source and "acc2" not in k.source for k in backward) == 1   # two reductions, one pass
    from flowgen.runtime import nvrtc

    assert len(nvrtc.compile_cuda(graph.compiled.sources["kernels.cu"], "sm_80")) > 0
    # no kernel computes x - mean on its own: it is recomputed inside the two reductions
    assert not any(k.endswith("_sub_mul") for k in bn_kernels), bn_kernels


@pytest.mark.parametrize("make_opt", [lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
                                      lambda p: flow.optim.Adam(p, lr=0.01)], ids=["sgd_momentum", "adam"])
def test_grad_scaler_skips_inf_steps_and_adapts_the_scale_like_eager(make_opt):
    """A dynamic GradScaler inside the graph: a scale so large the gradients overflow skips the
    step (parameters, slots and Adam's step count unchanged) and backs off; clean steps grow it
    every growth_interval. Scale, losses and parameters follow eager GradScaler step for step."""
    scales = scaled_training_like_eager(_mlp(), make_opt, flow.randn(8, 5), flow.randn(8, 3) * 10, steps=12)
    steps = list(zip([2.0 ** 126] + scales, scales))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps)     # skipped steps and growth


def scaled_training_like_eager(model, make_opt, x, y, steps, device="cpu", rtol=1e-5):
    """`steps` MSE training steps with a GradScaler (init 2**126: the first steps overflow) in a graph
    on `device` and in eager: equal losses, scales and trackers each step, equal parameters after;
    returns the scales."""
    flow.manual_seed(0)
    eager = copy.deepcopy(model)
    model.to(device)
    loss_fn = nn.MSELoss()
    make_scaler = lambda: flow.amp.GradScaler(init_scale=2.0 ** 126, backoff_factor=0.25,  # noqa: E731
                                              growth_interval=2)
    graph = TrainGraph(model, loss_fn, make_opt(model.parameters()))
    graph.set_grad_scaler(make_scaler())
    opt, scaler = make_opt(eager.parameters()), make_scaler()
    scales = []
    for _ in range(steps):
        got = graph(x.to(device), y.to(device))
        loss = loss_fn(eager(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        np.testing.assert_allclose(got.numpy(), loss.numpy(), rtol=rtol)
        assert graph._grad_scaler.get_scale() == scaler.get_scale()
        assert graph._grad_scaler._growth_tracker == scaler._growth_tracker
        scales.append(scaler.get_scale())
    for name, value in eager.state_dict().items():
        expected = value.numpy()
        np.testing.assert_allclose(model.state_dict()[name].numpy(), expected, rtol=1e-4,
                                   atol=1e-5 * np.abs(expected).max(), err_msg=name)
    return scales


@pytest.mark.slow
def test_updates_of_conv_weights_share_one_multi_tensor_kernel(monkeypatch, tmp_path):
    """Conv weight gradients come from template kernels, so their SGD-momentum updates cannot join
    them: they run as segments of one kernel (chunked when the buffers would not fit CUDA's
    parameter space). Numbers equal eager; the saved graph's standalone program keeps it."""
    from flowgen.codegen import aot
    from flowgen.passes import fusion

    def run(max_pointers):
        monkeypatch.setattr(fusion, "MULTI_MAX_POINTERS", max_pointers)
        flow.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                              nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        graph, _, _ = train_like_eager(model, lambda params: flow.optim.SGD(params, lr=0.1, momentum=0.9),
                                        [(flow.randn(2, 3, 6, 6), flow.randint(0, 3, (2,)))] * 3)
        return graph, [k for k in graph.compiled.program.kernels if k.horizontal]

    default = fusion.MULTI_MAX_POINTERS
    _, small = run(16)                              # room for two segments' buffers: 2 + 1
    assert len(small) == 1 and "2 independent segments" in small[0].source
    graph, multi = run(default)
    assert len(multi) == 1 and "3 independent segments" in multi[0].source   # the three conv weights
    from flowgen.runtime import nvrtc

    assert len(nvrtc.compile_cuda(graph.compiled.sources["kernels.cu"], "sm_90")) > 0
    flow.save(graph, tmp_path / "saved")
    aot.build(tmp_path / "saved", tmp_path / "out", target="cpu")
    assert "multi_tensor" in (tmp_path / "out" / "program.cu").read_text()


def test_reductions_with_few_outputs_split_over_blocks(tmp_path, monkeypatch):
    """A whole-tensor sum and BatchNorm over few channels: several blocks per output write partial
    results, a second kernel combines them and runs the epilogue (optimizer updates included).
    Training equals eager; a saved graph's program (scratch buffers in its arena) runs the same.
    The emulator fills as many blocks as a GPU here (a CPU target has few to fill and splits less);
    its blocks are one thread each, so the sum of 2^19 elements splits 264 ways."""
    from flowgen.codegen import target

    monkeypatch.setitem(target.TARGET_BLOCKS, "cpu", target.TARGET_BLOCKS["cuda"])
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 32 * 32, 2))
    graph, _, _ = train_like_eager(model, lambda params: flow.optim.SGD(params, lr=0.01, momentum=0.9),
                                    [(flow.randn(16, 3, 32, 32), flow.randint(0, 2, (16,)))] * 2)
    partial = [k for k in graph.compiled.program.kernels if k.name.endswith("_partial")]
    assert partial and all(k.grid[1] > 1 for k in partial)
    assert any("model_1" in k.name for k in partial)               # BatchNorm's channel statistics

    x = flow.randn(512, 1024)
    total = InferGraph(nn.Flatten(0, 1))
    total.build = lambda t: (t * 2).sum()
    np.testing.assert_allclose(total(x).numpy(), (x * 2).sum().numpy(), rtol=1e-5)
    assert [k.grid for k in total.compiled.program.kernels if k.name.endswith("_partial")] == [(1, 264, 1)]
    flow.save(total, tmp_path / "saved")
    np.testing.assert_allclose(flow.load(tmp_path / "saved").run(x.numpy())[0], total(x).numpy(), rtol=1e-6)


def test_broadcast_chain_fused_with_a_reshape_reads_the_right_elements():
    """Regression: an elementwise chain with a per-channel operand fused with the reshape after it
    (flatten before a Linear) indexed the operand by the reshaped shape's coordinates."""
    x, b = flow.randn(16, 4, 8, 8), flow.randn(1, 4, 1, 1)

    class Flat(nn.Graph):
        def build(self, x, b):
            return flow.relu(x * b + b).reshape(16, 256)

    graph = Flat()
    np.testing.assert_allclose(graph(x, b).numpy(), flow.relu(x * b + b).reshape(16, 256).numpy(), rtol=1e-6)
    assert len(graph.compiled.program.kernels) == 1


def test_a_step_whose_loss_folds_to_a_constant_returns_it():
    """Every element of the output overwritten with a constant (fuzz seed 422408): the loss folds to
    a scalar constant, which the step returns; kernels inline scalar constants, so a returned one
    needs a buffer of its own."""
    class Overwritten(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(flow.randn(2, 3))

        def forward(self, x):
            h = x.sum(2) * 1.0
            h[0] = self.p[0]
            h[[0, 1]] = -0.5
            return h

    model = Overwritten()
    start = model.p.numpy().copy()
    loss, out = MeanSquareGraph(model, flow.optim.Adagrad(model.parameters(), lr=0.1))(flow.randn(2, 3, 4))
    assert float(loss) == 0.25
    np.testing.assert_array_equal(out.numpy(), np.full((2, 3), -0.5, np.float32))
    np.testing.assert_array_equal(model.p.numpy(), start)   # its gradient is 0
