"""flow.from_torch: PyTorch models imported through torch.export run in flowgen eagerly and in
nn.Graphs (inference and SGD training) with PyTorch's numbers and state_dict names."""
import copy
import subprocess
import sys

import numpy as np
import pytest

import flowgen as flow

torch = pytest.importorskip("torch")
from from_torch_models import MLP, OpZoo, SmallCNN, TinyGPT, Upsampler  # noqa: E402

F = flow.nn.functional
# torch.export's own use of a pytree API it deprecated (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def _flow(t):
    return flow.from_dlpack(t)


def _close(got, expected, atol=1e-5, rtol=1e-5, what="output"):
    np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), atol=atol, rtol=rtol, err_msg=what)


def _state_close(flow_module, torch_module, atol=1e-6):
    theirs = torch_module.state_dict()
    assert list(flow_module.state_dict()) == list(theirs)
    for name, value in flow_module.state_dict().items():
        _close(value, theirs[name], atol=atol, what=name)


class TrainGraph(flow.nn.Graph):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)

    def build(self, x, target):
        loss = F.cross_entropy(self.model(x).reshape(-1, 5 if x.ndim == 4 else 32), target.reshape(-1))
        loss.backward()
        return loss


class InferenceGraph(flow.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def test_mlp_shares_parameters_and_state_dict_names_with_the_torch_model():
    model = MLP()
    x = torch.randn(5, 8)
    imported = flow.from_torch(model, (x,))
    assert list(imported.state_dict()) == list(model.state_dict()) == ["net.0.weight", "net.0.bias",
                                                                       "net.2.weight", "net.2.bias"]
    _close(imported(_flow(x)), model(x), atol=1e-6)
    with torch.no_grad():
        model.net[0].weight.mul_(2.0)   # one memory (DLPack): the import sees the change
    _close(imported(_flow(x)), model(x), atol=1e-6)
    other = MLP()
    imported.load_state_dict(other.state_dict())   # a PyTorch state dict loads by the same names
    _close(imported(_flow(x)), other(x), atol=1e-6)


def test_cnn_eager_training_mode_updates_running_statistics_as_torch_and_eval_reexports():
    model = SmallCNN().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    imported = flow.from_torch(model, (x,))
    assert imported.training
    out, expected = imported(_flow(x)), reference(x)
    _close(out, expected, atol=1e-5)
    _state_close(imported, reference)
    assert int(imported.bn.num_batches_tracked.numpy()) == 1

    out.sum().backward()                    # flowgen autograd through the imported ops
    expected.sum().backward()
    for name, p in imported.named_parameters():
        _close(p.grad, reference.get_parameter(name).grad, atol=1e-4, what=f"grad of {name}")

    imported.eval()
    reference.eval()
    _close(imported(_flow(x)), reference(x), atol=1e-5, what="eval output (running statistics)")
    _state_close(imported, reference)       # evaluation leaves the running statistics as they were


def test_tiny_gpt_eager_outputs_and_gradients_match_torch():
    model = TinyGPT().eval()
    idx = torch.randint(0, 32, (2, 8))
    imported = flow.from_torch(model, (idx,))
    assert list(imported.state_dict()) == list(model.state_dict())   # the tied head.weight included
    assert imported.head.weight is imported.wte.weight
    out = imported(_flow(idx))
    expected = model(idx)
    _close(out, expected, atol=2e-5)
    g = torch.randn(expected.shape)
    (out * _flow(g)).sum().backward()
    (expected * g).sum().backward()
    for name, p in imported.named_parameters():
        _close(p.grad, model.get_parameter(name).grad, atol=1e-4, what=f"grad of {name}")


def test_many_aten_ops_give_torch_outputs_and_gradients():
    torch.manual_seed(0)
    model = OpZoo()
    args = (torch.randn(2, 3, 5, 5), torch.randn(2, 4, 7), torch.randint(0, 7, (1, 1, 5)))
    imported = flow.from_torch(model, args)
    outputs = imported(*[_flow(a) for a in args])
    expected = model(*args)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got.dtype == (flow.bool if want.dtype == torch.bool else flow.float32)
        _close(got, want, atol=1e-5, what=f"output {i}")
    (outputs[0] + outputs[1].sum()).backward()
    (expected[0] + expected[1].sum()).backward()
    for name, p in imported.named_parameters():
        _close(p.grad, model.get_parameter(name).grad, atol=1e-4, what=f"grad of {name}")


def test_upsampling_and_transposed_convolution_give_torch_outputs_and_gradients():
    """aten.upsample_nearest2d.vec / upsample_bilinear2d.vec (by a size, by scale factors, with and
    without align_corners) and a transposed convolution with output_padding, eagerly with gradients."""
    torch.manual_seed(0)
    model = Upsampler()
    x = torch.randn(2, 3, 5, 6)
    imported = flow.from_torch(model, (x,))
    out, expected = imported(_flow(x)), model(x)
    _close(out, expected, atol=1e-5 * float(expected.abs().max()))
    out.sum().backward()
    expected.sum().backward()
    for name, p in imported.named_parameters():
        want = model.get_parameter(name).grad
        _close(p.grad, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4, what=f"grad of {name}")


def test_inference_graph_runs_the_imported_cnn_in_eval_mode():
    model = SmallCNN().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 8, 8)
    graph = InferenceGraph(flow.from_torch(model, (x,)))
    _close(graph(_flow(x)), model(x), atol=1e-5)


@pytest.mark.parametrize("make, shape", [(SmallCNN, (4, 3, 8, 8)), (TinyGPT, (2, 8))], ids=["cnn", "gpt"])
def test_sgd_training_graph_matches_torch_steps(make, shape):
    torch.manual_seed(0)
    model = make().train()
    reference = copy.deepcopy(model)
    gpt = make is TinyGPT
    xs = [torch.randint(0, 32, shape) if gpt else torch.randn(shape) for _ in range(3)]
    targets = [torch.randint(0, 32 if gpt else 5, shape if gpt else shape[:1]) for _ in range(3)]
    imported = flow.from_torch(model, (xs[0],))
    graph = TrainGraph(imported, flow.optim.SGD(imported.parameters(), lr=0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, target in zip(xs, targets):
        loss = graph(_flow(x), _flow(target))
        optimizer.zero_grad()
        expected = torch.nn.functional.cross_entropy(reference(x).reshape(-1, 32 if gpt else 5), target.reshape(-1))
        expected.backward()
        optimizer.step()
        np.testing.assert_allclose(loss.numpy(), expected.item(), rtol=1e-5, atol=1e-6)
    _state_close(imported, reference, atol=2e-5)   # parameters and BatchNorm's running statistics


def test_keyword_inputs_and_nested_outputs_keep_their_structure():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)

        def forward(self, x, *, bias):
            h = self.body(x) + bias
            return {"sum": h.sum(-1), "parts": (h.relu(), h.tanh())}

    model = TwoHeads()
    x, bias = torch.randn(3, 4), torch.randn(4)
    imported = flow.from_torch(model, (x,), {"bias": bias})
    out, expected = imported(_flow(x), bias=_flow(bias)), model(x, bias=bias)
    assert set(out) == {"sum", "parts"} and isinstance(out["parts"], tuple)
    _close(out["sum"], expected["sum"], atol=1e-6)
    for got, want in zip(out["parts"], expected["parts"]):
        _close(got, want, atol=1e-6)
    with pytest.raises(TypeError, match=r"keywords \[\]; it was exported with 1 and \['bias'\]"):
        imported(_flow(x))


def test_an_exported_program_keeps_its_mode_and_refuses_the_other():
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    imported = flow.from_torch(torch.export.export(model, (x,)), (x,))
    assert not imported.training
    _close(imported(_flow(x)), model(x), atol=1e-5)
    imported.train()
    with pytest.raises(RuntimeError, match="exported in evaluation mode"):
        imported(_flow(x))


def test_unsupported_ops_are_refused_together_with_their_source_lines():
    class Unsupported(torch.nn.Module):
        def forward(self, x):
            a = torch.special.i0(x)
            b = x.cummax(0).values
            return a + b + torch.special.i0(2 * x)

    with pytest.raises(NotImplementedError) as info:
        flow.from_torch(Unsupported(), (torch.randn(3, 4),))
    message = str(info.value)
    assert "2 ATen op(s)" in message and "aten.i0.default  (2 uses)" in message and "aten.cummax.default" in message
    assert message.count("test_from_torch.py") == 3 and "b = x.cummax(0).values" in message


def test_dynamic_shapes_are_refused_until_the_ir_has_symbolic_sizes():
    x = torch.randn(5, 8)
    with pytest.raises(NotImplementedError, match="dynamic_shapes is not supported yet"):
        flow.from_torch(MLP(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    imported = flow.from_torch(MLP(), (x,))
    with pytest.raises(ValueError, match=r"argument 0 is float32\[3, 8\]; the graph was exported for float32\[5, 8\]"):
        imported(flow.randn(3, 8))
    with pytest.raises(TypeError, match="example_args must be a tuple"):
        flow.from_torch(MLP(), x)


def test_import_flowgen_does_not_import_torch():
    probe = "import sys, flowgen; flowgen.from_torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_readme_snippet_runs_as_written(tmp_path, monkeypatch):
    """README.md's "Bring your PyTorch model" snippet (a ```py block: tests/test_readme_snippets.py
    runs the ```python ones, which need no torch)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Bring your PyTorch model", 1)[1].split("\n## ", 1)[0]
    block, _ = re.findall(r"^```py\n(.*?)^```", section, flags=re.S | re.M)   # the second: Hugging Face
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    torch._dynamo.reset()
    flow.frontends.register_torch_compile_backend()   # this process imported flowgen before torch
    exec(compile(block, "README.md from_torch snippet", "exec"), namespace)
    net, logits = namespace["net"], namespace["logits"]
    assert np.isfinite(namespace["step_loss"].numpy()) and tuple(logits.shape) == (16, 10)
    assert all(p.grad is not None for p in net.parameters())


def test_readme_hugging_face_snippet_runs_as_written():
    """The section's second ```py block: a tiny GPT-2 from transformers (optional; a broken install
    skips too), its logits against PyTorch's."""
    import re
    from pathlib import Path

    try:
        from transformers import GPT2LMHeadModel  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"README's Hugging Face snippet needs transformers: {type(e).__name__}: {e}")
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Bring your PyTorch model", 1)[1].split("\n## ", 1)[0]
    _, hugging_face_block = re.findall(r"^```py\n(.*?)^```", section, flags=re.S | re.M)
    namespace = {"__name__": "__readme__"}
    exec(compile(hugging_face_block, "README.md Hugging Face snippet", "exec"), namespace)
    expected = namespace["gpt2"](namespace["idx"]).logits.detach().numpy()
    np.testing.assert_allclose(namespace["logits"].numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


_X = np.array([[0.5, -1.0, 0.0], [2.0, 3.0, -0.25]], np.float32)
_B = np.random.default_rng(0).standard_normal((3, 2, 2)).astype(np.float32)
_RNG = np.random.default_rng(1)
_UP = _RNG.standard_normal((2, 4, 4, 6)).astype(np.float32)
_TABLE_CASES = [   # (ATen overload, positional arguments, keyword arguments): arrays become tensors
    ("aten.pow.Scalar", (2.0, _X), {}), ("aten.where.ScalarSelf", (_X > 0, 1.5, _X), {}),
    ("aten.baddbmm.default", (_B, _B, _B), {"beta": 0.5, "alpha": 2.0}), ("aten.rsub.Scalar", (_X, 2.0, 3), {}),
    ("aten.var.correction", (_X, [1]), {"correction": 0, "keepdim": True}),
    ("aten.div.Tensor_mode", (_X, 0.7), {"rounding_mode": "floor"}),
    ("aten.slice.Tensor", (_X, 1, -2, 2 ** 63 - 1, 1), {}), ("aten.amax.default", (_X, [0]), {}),
    ("aten.clamp.default", (_X, None, 1.0), {}), ("aten.copy.default", (_B[:, :1, :1].repeat(3, 2), _X[0]), {}),
    ("aten.elu.default", (_X, 1.67, 1.05), {}), ("aten.squeeze.dims", (_B[:1, :1], [0, 1]), {}),
    ("aten.index_put.default", (np.zeros((4, 3), np.float32), [np.array([1, 1, 3])], _X[:1], True), {}),
    ("aten.index_put.default", (np.zeros((4, 3), np.float32), [np.array([1, 3])], _X), {}),
    ("aten.index.Tensor", (_B, [None, np.array([1, 0, 1])]), {}),
    ("aten.native_group_norm.default", (_B[:, :, :, None].repeat(2, 3), _X[0, :2], _X[1, :2], 3, 2, 4, 2, 1e-5), {}),
    ("aten.native_layer_norm.default", (_B, [2], _X[0, :2], _X[1, :2], 1e-5), {}),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default", (_B[None], _B[None], _B[None]), {"is_causal": True}),
    ("aten.convolution_backward.default", (_B[:2, None], _B[:2, None, :, :1].repeat(3, 3), _B[:1, None, :1, :],
                                          [1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]), {}),
    ("aten.max_pool2d_with_indices_backward.default", (_B[None, :, :1, :1], _B[None], [2, 2], [2, 2], [0, 0], [1, 1],
                                                       False, np.zeros((1, 3, 1, 1), np.int64)), {}),
    ("aten._adaptive_avg_pool2d_backward.default", (_B[None, :, :1], _B[None]), {}),
    # accumulating over two adjacent index tensors (a nearest upsampling's gradient under torch.compile)
    ("aten.index_put.default", (np.zeros((2, 3, 3), np.float32), [None, np.array([[0], [2], [0]]), np.array([1, 1])],
                                np.arange(12, dtype=np.float32).reshape(2, 3, 2), True), {}),
    # a transposed convolution's gradients: stride 2, padding 1, output_padding 1
    ("aten.convolution_backward.default", (_RNG.standard_normal((2, 3, 6, 4)).astype(np.float32),
                                          _RNG.standard_normal((2, 2, 3, 2)).astype(np.float32),
                                          _RNG.standard_normal((2, 3, 3, 3)).astype(np.float32), [3], [2, 2],
                                          [1, 1], [1, 1], True, [1, 1], 1, [True, True, True]), {}),
    ("aten.upsample_nearest2d.default", (_UP, [5, 7]), {}),
    ("aten.upsample_nearest2d.default", (_UP, [8, 12], 2.0, 2.0), {}),
    ("aten.upsample_bilinear2d.default", (_UP, [6, 9], True), {}),
    ("aten.upsample_bilinear2d.default", (_UP, [6, 9], False, 1.5, 1.5), {}),
    ("aten.upsample_nearest2d.vec", (_UP, None, [1.5, 2.0]), {}),
    ("aten.upsample_bilinear2d.vec", (_UP, [3, 5], False, None), {}),
    ("aten.upsample_nearest2d_backward.default", (_UP[:, :, :3, :5], [3, 5], [2, 4, 4, 6]), {}),
    ("aten.upsample_bilinear2d_backward.default", (np.tile(_UP[:, :, :3, :5], (1, 1, 2, 2)), [6, 10], [2, 4, 4, 6],
                                                   False, 1.5, 1.5), {}),
]


@pytest.mark.parametrize("name, args, kwargs", _TABLE_CASES, ids=[c[0] for c in _TABLE_CASES])
def test_table_entries_compute_what_the_aten_ops_do(name, args, kwargs):
    from flowgen.frontends.aten_table import ATEN_OPS

    namespace, op, overload = name.split(".")
    aten_op = getattr(getattr(getattr(torch.ops, namespace), op), overload)

    def convert(value, tensor):
        if isinstance(value, np.ndarray):
            return tensor(value)
        if isinstance(value, list):
            return [convert(v, tensor) for v in value]
        return value

    got = ATEN_OPS[name](*convert(list(args), flow.tensor), **kwargs)
    expected = aten_op(*convert(list(args), torch.from_numpy), **kwargs)
    got, expected = (got, expected) if isinstance(expected, tuple) else ((got,), (expected,))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert tuple(g.shape) == tuple(e.shape), f"{name} output {i}"
        np.testing.assert_allclose(g.numpy().astype(np.float64), e.numpy().astype(np.float64), atol=1e-6,
                                   rtol=1e-6, err_msg=f"{name} output {i}")
