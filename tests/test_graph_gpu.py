"""The same graphs on a real GPU (skipped without one): CUDA results equal eager and the emulator."""
import copy
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from graphs import InferGraph, TrainGraph

pytestmark = pytest.mark.gpu


def _mlp():
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.0), nn.Linear(64, 5))


def test_inference_on_cuda_equals_eager_and_emulator():
    model = _mlp()
    x = flow.randn(17, 33)
    expected = model(x).numpy()
    cpu_out = InferGraph(copy.deepcopy(model))(x).numpy()
    gpu_model = copy.deepcopy(model).to("cuda")
    graph = InferGraph(gpu_model)
    out = graph(x.to("cuda"))
    assert out.device.type == "cuda"
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), cpu_out, rtol=1e-4, atol=1e-5)
    out2 = graph(x.to("cuda"))   # second call replays the captured CUDA graph
    np.testing.assert_allclose(out2.numpy(), out.numpy())


@pytest.mark.parametrize("make_opt", [lambda p: flow.optim.SGD(p, lr=0.05, momentum=0.9),
                                      lambda p: flow.optim.Adam(p, lr=1e-3)], ids=["sgd", "adam"])
def test_training_on_cuda_matches_eager(make_opt):
    flow.manual_seed(0)
    model = _mlp()
    eager = copy.deepcopy(model)
    gpu_model = model.to("cuda")
    loss_fn = nn.CrossEntropyLoss()
    graph = TrainGraph(gpu_model, loss_fn, make_opt(gpu_model.parameters()))
    opt = make_opt(eager.parameters())
    for step in range(5):
        x, y = flow.randn(16, 33), flow.randint(0, 5, (16,))
        lg = graph(x.to("cuda"), y.to("cuda"))
        le = loss_fn(eager(x), y)
        opt.zero_grad()
        le.backward()
        opt.step()
        np.testing.assert_allclose(lg.numpy(), le.numpy(), rtol=1e-4, atol=1e-5)
    for p, pe in zip(gpu_model.parameters(), eager.parameters()):
        np.testing.assert_allclose(p.numpy(), pe.numpy(), rtol=1e-3, atol=1e-5)


def test_polyfit_graph_on_cuda():
    x = flow.tensor(np.linspace(-math.pi, math.pi, 2000), dtype=flow.float32)
    y = flow.tensor(np.sin(x), dtype=flow.float32)
    xx = flow.cat([x.unsqueeze(-1).pow(1), x.unsqueeze(-1).pow(2), x.unsqueeze(-1).pow(3)], dim=1)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    eager = copy.deepcopy(model)
    model.to("cuda")
    loss_fn = nn.MSELoss(reduction="sum")
    graph = TrainGraph(model, loss_fn, flow.optim.SGD(model.parameters(), lr=1e-6))
    opt = flow.optim.SGD(eager.parameters(), lr=1e-6)
    for _ in range(200):
        lg = graph(xx.to("cuda"), y.to("cuda"))
        le = loss_fn(eager(xx), y)
        opt.zero_grad()
        le.backward()
        opt.step()
    np.testing.assert_allclose(lg.numpy(), le.numpy(), rtol=1e-3)
    np.testing.assert_allclose(model[0].weight.numpy(), eager[0].weight.numpy(), rtol=1e-3, atol=1e-6)


def test_dropout_masks_on_cuda_equal_eager():
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.4))
    x = flow.randn(8, 16)
    flow.manual_seed(3)
    gpu = InferGraph(copy.deepcopy(model).to("cuda"))(x.to("cuda")).numpy()
    flow.manual_seed(3)
    ref = model(x).numpy()
    np.testing.assert_allclose(gpu, ref, rtol=1e-5, atol=1e-6)


def test_conv_algorithm_search_picks_measured_tiles_and_caches_them():
    from flowgen.codegen.kernels.conv import conv_key, conv_tile_candidates
    from flowgen.runtime import cuda_driver
    from flowgen.runtime.autotune import _cache_path

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 1), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    eager = copy.deepcopy(model)
    gpu_model = model.to("cuda")
    loss_fn = nn.CrossEntropyLoss()
    graph = TrainGraph(gpu_model, loss_fn, flow.optim.SGD(gpu_model.parameters(), lr=0.05))
    graph.config.enable_cudnn_conv_heuristic_search_algo(True)
    opt = flow.optim.SGD(eager.parameters(), lr=0.05)
    x, y = flow.randn(4, 16, 8, 8), flow.randint(0, 10, (4,))
    lg = graph(x.to("cuda"), y.to("cuda"))
    le = loss_fn(eager(x), y)
    np.testing.assert_allclose(lg.numpy(), le.numpy(), rtol=1e-4)
    cache = _cache_path(cuda_driver.CudaContext.get().arch).read_text()
    convs = [n for node in graph.compiled.ir.nodes for n in (node.body if node.op == "fused" else [node])
             if n.op.startswith("conv2d")]
    assert convs and all(conv_key(n) in cache for n in convs)
    # the measured tiles are attributes of the conv nodes (saved graphs and programs keep them)
    assert all(n.attrs.get("tile") for n in convs if conv_tile_candidates(n))


@pytest.mark.parametrize("dtype", [flow.float32, flow.float64], ids=["f32", "f64"])
def test_tiny_mobilenet_training_on_cuda_equals_eager(dtype):
    """Convs (regular, depthwise, 1x1), training BatchNorm (closed-form backward), ReLU6,
    residual adds and the fused cross-entropy on the GPU: in float64 the parameters equal eager
    to rounding, in float32 the losses within 2e-4."""
    from test_convnet_graph import train_graph_and_eager

    run = train_graph_and_eager(dtype, device="cuda")
    if dtype == flow.float32:
        np.testing.assert_allclose(run["graph_losses"], run["eager_losses"], rtol=2e-4)
        return
    np.testing.assert_allclose(run["graph_losses"], run["eager_losses"], rtol=1e-12)
    eager_state = run["eager"].state_dict()
    for name, value in run["model"].state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(value.numpy(), eager_state[name].numpy(), rtol=1e-9, atol=1e-11,
                                       err_msg=name)


def test_grad_scaler_on_cuda_follows_eager():
    """Overflowing steps are skipped and the scale backs off / grows on the GPU as in eager."""
    from test_graph_spine import scaled_training_like_eager

    scaled_training_like_eager(_mlp(), lambda params: flow.optim.Adam(params, lr=1e-2), flow.randn(8, 33),
                               flow.randn(8, 5) * 10, steps=10, device="cuda", rtol=1e-4)
