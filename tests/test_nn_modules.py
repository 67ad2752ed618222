"""nn.Module API, containers, initialisers and every layer against PyTorch (skipped without torch)."""
import math

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn.module as module_mod
from flowgen import nn


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def copy_weights(flow_module, torch_module, torch):
    """Give the torch module the flowgen module's parameters and buffers."""
    state = {k: torch.from_numpy(np.array(v.numpy())) for k, v in flow_module.state_dict().items()}
    torch_module.load_state_dict(state)


def close(ours, theirs, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=rtol, atol=atol)


# ----------------------------------------------------------------- registration
class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(3, 2)
        self.scale = nn.Parameter(flow.ones(2))
        self.register_buffer("steps", flow.zeros(1, dtype=flow.int64))
        self.register_buffer("cache", flow.zeros(2), persistent=False)
        self.plain = 3

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) * self.scale


def test_setattr_registers_parameters_buffers_and_children():
    m = TwoLayer()
    assert [n for n, _ in m.named_parameters()] == ["scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [n for n, _ in m.named_buffers()] == ["steps", "cache"]
    assert [n for n, _ in m.named_children()] == ["fc1", "act", "fc2"]
    assert [n for n, _ in m.named_modules()] == ["", "fc1", "act", "fc2"]
    assert m.plain == 3 and "plain" not in m._parameters
    assert m.fc1.weight is m.get_parameter("fc1.weight")
    assert len(list(m.parameters())) == 5 and len(list(m.buffers())) == 2
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'scale'"):
        m.scale = flow.ones(2)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        m.nope
    del m.fc2
    assert "fc2" not in dict(m.named_children())


def test_shared_parameters_are_listed_once_and_missing_super_init_is_tolerated():
    class Tied(nn.Module):
        def __init__(self):  # no super().__init__(): registries are created on first assignment
            self.a = nn.Linear(2, 2)
            self.b = self.a

        def forward(self, x):
            return self.b(self.a(x))

    m = Tied()
    assert len(list(m.parameters())) == 2
    assert m(flow.ones(1, 2)).shape == (1, 2)


def test_parameter_shares_the_tensor_buffer():
    t = flow.randn(3)
    p = nn.Parameter(t)
    assert p.numpy_view() is t.numpy_view()
    assert p.requires_grad and p.is_leaf
    assert repr(p).startswith("Parameter containing:\ntensor(")


def test_state_dict_keys_and_non_persistent_buffers():
    m = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), TwoLayer())
    assert list(m.state_dict()) == [
        "0.weight", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
        "2.scale", "2.steps", "2.fc1.weight", "2.fc1.bias", "2.fc2.weight", "2.fc2.bias"]
    sd = m.state_dict()
    assert sd["0.weight"].numpy_view() is m[0].weight.numpy_view()  # shares memory
    assert not sd["0.weight"].requires_grad
    assert m.state_dict(keep_vars=True)["0.weight"] is m[0].weight


def test_reassigning_a_child_or_parameter_keeps_its_place_in_the_state_dict(torch):
    # pytorch/examples word_language_model: TransformerModel(nn.Transformer) replaces self.decoder with a
    # Linear; torch keeps the key where nn.Transformer registered it, and state_dict/parameters() order follows.
    def build(lib):
        class Model(lib.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = lib.nn.Parameter(lib.zeros(2))
                self.decoder = lib.nn.Linear(2, 2)
                self.emb = lib.nn.Embedding(3, 2)
                self.register_buffer("buf", lib.zeros(1))
                self.decoder = lib.nn.Linear(2, 3)
                self.w = lib.nn.Parameter(lib.ones(2))
                self.buf = lib.ones(1)
        return Model()

    expected = list(build(torch).state_dict())
    assert expected == ["w", "buf", "decoder.weight", "decoder.bias", "emb.weight"]
    m = build(flow)
    assert list(m.state_dict()) == expected
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in build(torch).named_parameters()]
    assert m.decoder.out_features == 3 and m.w.numpy().tolist() == [1.0, 1.0]


def test_load_state_dict_copies_in_place_and_keeps_identity():
    src, dst = TwoLayer(), TwoLayer()
    weight, array = dst.fc1.weight, dst.fc1.weight.numpy_view()
    version = weight._version
    result = dst.load_state_dict(src.state_dict())
    assert repr(result) == "<All keys matched successfully>"
    assert dst.fc1.weight is weight and weight.numpy_view() is array
    assert weight._version > version
    np.testing.assert_array_equal(dst.fc1.weight.numpy(), src.fc1.weight.numpy())


def test_load_state_dict_strict_errors_name_missing_unexpected_and_shapes():
    m = TwoLayer()
    sd = dict(m.state_dict())
    del sd["fc2.bias"]
    sd["extra.weight"] = flow.zeros(1)
    sd["fc1.weight"] = flow.zeros(5, 4)
    before = m.fc2.weight.numpy().copy()
    sd["fc2.weight"] = flow.zeros(2, 3)
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(sd)
    msg = str(info.value)
    assert "Error(s) in loading state_dict for TwoLayer" in msg
    assert 'Missing key(s) in state_dict: "fc2.bias"' in msg
    assert 'Unexpected key(s) in state_dict: "extra.weight"' in msg
    assert "size mismatch for fc1.weight: copying a param with shape (5, 4) from checkpoint, the shape in " \
           "current model is (3, 4)" in msg
    np.testing.assert_array_equal(m.fc2.weight.numpy(), before)  # nothing written on failure
    del sd["fc1.weight"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert missing == ["fc1.weight", "fc2.bias"] and unexpected == ["extra.weight"]
    np.testing.assert_array_equal(m.fc2.weight.numpy(), np.zeros((2, 3)))


# ------------------------------------------------------------------------- repr
def test_repr_matches_pytorch_layout():
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0, 1))
    assert repr(model) == ("Sequential(\n  (0): Linear(in_features=3, out_features=1, bias=True)\n"
                           "  (1): Flatten(start_dim=0, end_dim=1)\n)")
    assert repr(nn.MSELoss(reduction="sum")) == "MSELoss()"
    assert repr(nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False)) == \
        "Conv2d(3, 32, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), bias=False)"
    assert repr(nn.Conv2d(8, 8, 3, groups=8, dilation=2)) == \
        "Conv2d(8, 8, kernel_size=(3, 3), stride=(1, 1), dilation=(2, 2), groups=8)"
    assert repr(nn.BatchNorm2d(32)) == "BatchNorm2d(32, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"
    assert repr(nn.Dropout(0.2)) == "Dropout(p=0.2, inplace=False)"
    assert repr(nn.ReLU6(inplace=True)) == "ReLU6(inplace=True)"
    assert repr(nn.LayerNorm(10)) == "LayerNorm((10,), eps=1e-05, elementwise_affine=True)"
    # PyTorch 2.13 also prints `bias=` for the norm layers; OneFlow's (and older PyTorch's) layout is kept.
    assert repr(nn.GroupNorm(2, 4)) == "GroupNorm(2, 4, eps=1e-05, affine=True)"
    assert repr(nn.InstanceNorm2d(3)) == \
        "InstanceNorm2d(3, eps=1e-05, momentum=0.1, affine=False, track_running_stats=False)"
    assert repr(nn.MaxPool2d(2)) == "MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)"
    assert repr(nn.Upsample(scale_factor=2)) == "Upsample(scale_factor=2.0, mode='nearest')"
    assert repr(nn.Embedding(10, 3, padding_idx=0)) == "Embedding(10, 3, padding_idx=0)"
    nested = nn.Sequential(nn.Sequential(nn.ReLU()), nn.GELU(approximate="tanh"))
    assert repr(nested) == ("Sequential(\n  (0): Sequential(\n    (0): ReLU()\n  )\n"
                            "  (1): GELU(approximate='tanh')\n)")


def test_repr_matches_torch_for_every_layer(torch):
    tnn = torch.nn
    pairs = [
        (nn.Linear(3, 4, bias=False), tnn.Linear(3, 4, bias=False)),
        (nn.Conv2d(4, 8, (3, 1), stride=(2, 1), padding=(1, 0)),
         tnn.Conv2d(4, 8, (3, 1), stride=(2, 1), padding=(1, 0))),
        (nn.Softmax(dim=1), tnn.Softmax(dim=1)), (nn.LogSoftmax(dim=-1), tnn.LogSoftmax(dim=-1)),
        (nn.AvgPool2d(3, 2, 1), tnn.AvgPool2d(3, 2, 1)), (nn.AdaptiveAvgPool2d((1, 1)), tnn.AdaptiveAvgPool2d((1, 1))),
        (nn.Upsample(size=(4, 4), mode="bilinear", align_corners=False),
         tnn.Upsample(size=(4, 4), mode="bilinear", align_corners=False)),
        (nn.SiLU(), tnn.SiLU()), (nn.Sigmoid(), tnn.Sigmoid()), (nn.LeakyReLU(0.2), tnn.LeakyReLU(0.2)),
        (nn.ELU(), tnn.ELU()), (nn.Hardtanh(-2.0, 3.0), tnn.Hardtanh(-2.0, 3.0)), (nn.Softplus(), tnn.Softplus()),
        (nn.Hardswish(), tnn.Hardswish()), (nn.Tanh(), tnn.Tanh()), (nn.Identity(), tnn.Identity()),
        (nn.CrossEntropyLoss(), tnn.CrossEntropyLoss()), (nn.BCEWithLogitsLoss(), tnn.BCEWithLogitsLoss()),
        (nn.ModuleList([nn.ReLU(), nn.Linear(1, 2)]), tnn.ModuleList([tnn.ReLU(), tnn.Linear(1, 2)])),
    ]
    assert [repr(ours) for ours, _ in pairs] == [repr(theirs) for _, theirs in pairs]


# ------------------------------------------------------------------- containers
def test_sequential_indexing_slicing_and_editing():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3), nn.Sigmoid()]
    seq = nn.Sequential(*layers)
    assert len(seq) == 4 and seq[0] is layers[0] and seq[-1] is layers[3]
    tail = seq[1:3]
    assert isinstance(tail, nn.Sequential) and list(tail) == layers[1:3]
    assert list(tail._modules) == ["1", "2"]  # slicing keeps the names, as PyTorch
    with pytest.raises(IndexError):
        seq[4]
    seq.append(nn.Tanh())
    assert len(seq) == 5 and list(seq._modules)[-1] == "4"
    del seq[1]
    assert list(seq._modules) == ["0", "1", "2", "3"] and seq[1] is layers[2]
    seq.insert(1, nn.ReLU())
    assert isinstance(seq[1], nn.ReLU) and len(seq) == 5
    seq[0] = nn.Linear(2, 2, bias=False)
    assert seq[0].bias is None
    assert seq(flow.ones(3, 2)).shape == (3, 3)


def test_module_list_and_dict():
    ml = nn.ModuleList([nn.Linear(1, 1) for _ in range(3)])
    ml.append(nn.ReLU())
    ml.extend([nn.Tanh()])
    assert len(ml) == 5 and isinstance(ml[-1], nn.Tanh) and len(ml[1:3]) == 2
    del ml[0]
    assert list(ml._modules) == ["0", "1", "2", "3"]
    assert len(list(ml.parameters())) == 4
    md = nn.ModuleDict({"a": nn.Linear(1, 2), "b": nn.ReLU()})
    md["c"] = nn.Tanh()
    assert list(md.keys()) == ["a", "b", "c"] and "b" in md and len(md) == 3
    assert [n for n, _ in md.named_parameters()] == ["a.weight", "a.bias"]


def test_train_eval_apply_zero_grad_and_requires_grad():
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.BatchNorm1d(2)))
    assert m.training and m[2][0].training
    m.eval()
    assert not any(mod.training for mod in m.modules())
    m.train()
    assert all(mod.training for mod in m.modules())
    seen = []
    m.apply(lambda mod: seen.append(type(mod).__name__))
    assert seen == ["Linear", "Dropout", "BatchNorm1d", "Sequential", "Sequential"]
    m[0](flow.ones(1, 2)).sum().backward()
    assert m[0].weight.grad is not None
    m.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(m[0].weight.grad.numpy(), np.zeros((2, 2)))
    m.zero_grad()
    assert m[0].weight.grad is None
    m.requires_grad_(False)
    assert not any(p.requires_grad for p in m.parameters())


def test_to_keeps_the_same_parameter_objects():
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    params = list(m.parameters())
    buffers = list(m.buffers())
    assert m.to("cuda") is m
    assert all(a is b for a, b in zip(m.parameters(), params))
    assert all(p.device == flow.device("cuda") for p in m.parameters())
    assert all(b.device == flow.device("cuda") for b in m.buffers())
    m.to(flow.float64)
    assert all(a is b for a, b in zip(m.parameters(), params))
    assert all(b1 is b2 for b1, b2 in zip(m.buffers(), buffers))
    assert m[0].weight.dtype == flow.float64 and m[1].running_mean.dtype == flow.float64
    assert m[1].num_batches_tracked.dtype == flow.int64  # integer buffers keep their dtype
    m.cpu().float()
    assert m[0].weight.dtype == flow.float32 and m[0].weight.device == flow.device("cpu")


# ------------------------------------------------------------------------ hooks
def test_module_call_hook_sees_every_module_call():
    model = nn.Sequential(nn.Linear(3, 2), nn.Flatten(0, 1))
    calls = []

    def hook(module, forward, args, kwargs):
        calls.append((type(module).__name__, tuple(args[0].shape)))
        out = forward(*args, **kwargs)
        calls.append(("out", tuple(out.shape)))
        return out

    previous = module_mod.set_module_call_hook(hook)
    try:
        out = model(flow.ones(4, 3))
    finally:
        module_mod.set_module_call_hook(previous)
    assert module_mod._module_call_hook is previous
    assert out.shape == (8,)
    assert calls == [("Sequential", (4, 3)), ("Linear", (4, 3)), ("out", (4, 2)), ("Flatten", (4, 2)),
                     ("out", (8,)), ("out", (8,))]


def test_forward_hooks_and_pre_hooks():
    lin = nn.Linear(2, 2)
    handle = lin.register_forward_hook(lambda mod, args, out: out * 0)
    pre = lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    assert np.all(lin(flow.ones(1, 2)).numpy() == 0)
    handle.remove()
    np.testing.assert_allclose(lin(flow.ones(1, 2)).numpy(), lin.forward(flow.full((1, 2), 2.0)).numpy())
    pre.remove()
    assert not lin._forward_hooks and not lin._forward_pre_hooks


# ----------------------------------------------------------------- initialisers
def test_default_inits_follow_pytorch_bounds_and_manual_seed():
    flow.manual_seed(3)
    a = nn.Linear(50, 40)
    flow.manual_seed(3)
    b = nn.Linear(50, 40)
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    bound = 1 / math.sqrt(50)
    assert np.abs(a.weight.numpy()).max() <= bound and np.abs(a.weight.numpy()).max() > 0.9 * bound
    assert np.abs(a.bias.numpy()).max() <= bound
    conv = nn.Conv2d(4, 6, 3)
    assert np.abs(conv.weight.numpy()).max() <= 1 / math.sqrt(36)
    bn = nn.BatchNorm2d(3)
    assert np.all(bn.weight.numpy() == 1) and np.all(bn.bias.numpy() == 0)
    assert np.all(bn.running_var.numpy() == 1) and bn.num_batches_tracked.item() == 0
    emb = nn.Embedding(1000, 8, padding_idx=-1)
    assert emb.padding_idx == 999 and np.all(emb.weight.numpy()[999] == 0)
    assert abs(emb.weight.numpy()[:999].std() - 1) < 0.05


def test_init_functions_write_in_place():
    t = flow.empty(64, 32)
    array = t.numpy_view()
    nn.init.kaiming_uniform_(t, a=0, nonlinearity="relu")
    assert t.numpy_view() is array
    assert np.abs(array).max() <= math.sqrt(6 / 32)
    nn.init.xavier_uniform_(t)
    assert np.abs(array).max() <= math.sqrt(6 / 96)
    nn.init.constant_(t, 0.5)
    assert np.all(array == 0.5)
    nn.init.zeros_(t)
    assert np.all(array == 0)
    nn.init.ones_(t)
    assert np.all(array == 1)
    nn.init.normal_(t, 2.0, 0.1)
    assert abs(array.mean() - 2.0) < 0.02
    nn.init.uniform_(t, -1, 1)
    assert array.min() >= -1 and array.max() <= 1
    assert nn.init.calculate_gain("leaky_relu", math.sqrt(5)) == pytest.approx(math.sqrt(1 / 3))


# ------------------------------------------------------------- layers vs torch
def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check_layer(ours, theirs, torch, *inputs, grad=True, rtol=1e-5, atol=1e-5):
    """Same weights, same inputs: outputs and (optionally) input/parameter gradients agree."""
    copy_weights(ours, theirs, torch)
    xs = [flow.tensor(a, requires_grad=grad and a.dtype.kind == "f") for a in inputs]
    txs = [torch.tensor(a, requires_grad=grad and a.dtype.kind == "f") for a in inputs]
    out, tout = ours(*xs), theirs(*txs)
    close(out, tout, rtol, atol)
    if grad:
        seed = _x(*tout.shape, seed=7)
        (out * flow.tensor(seed)).sum().backward()
        (tout * torch.tensor(seed)).sum().backward()
        for x, tx in zip(xs, txs):
            if tx.grad is not None:
                close(x.grad, tx.grad, rtol, atol)
        tparams = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            close(p.grad, tparams[name].grad, rtol, atol)
    return out, tout


@pytest.mark.parametrize("kwargs", [
    dict(), dict(stride=2, padding=1), dict(dilation=2, padding=2, bias=False), dict(groups=4, padding=1),
    dict(padding="same"),
])
def test_conv2d_matches_torch(torch, kwargs):
    _check_layer(nn.Conv2d(4, 8, 3, **kwargs), torch.nn.Conv2d(4, 8, 3, **kwargs), torch, _x(2, 4, 7, 6),
                 rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_conv2d_same_padding_with_an_even_kernel(torch):
    _check_layer(nn.Conv2d(2, 3, (4, 2), padding="same"), torch.nn.Conv2d(2, 3, (4, 2), padding="same"), torch,
                 _x(1, 2, 5, 5), rtol=1e-4, atol=1e-4)


def test_linear_matches_torch_and_numpy(torch):
    lin = nn.Linear(5, 3)
    x = _x(4, 5)
    np.testing.assert_allclose(lin(flow.tensor(x)).numpy(), x @ lin.weight.numpy().T + lin.bias.numpy(), rtol=1e-6)
    _check_layer(lin, torch.nn.Linear(5, 3), torch, x)
    _check_layer(nn.Linear(5, 3, bias=False), torch.nn.Linear(5, 3, bias=False), torch, _x(2, 4, 5))


@pytest.mark.parametrize("cls,shape", [("BatchNorm1d", (6, 3)), ("BatchNorm1d", (6, 3, 5)),
                                       ("BatchNorm2d", (4, 3, 5, 5))])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_training_updates_running_stats_like_torch(torch, cls, shape, momentum):
    ours, theirs = getattr(nn, cls)(3, momentum=momentum), getattr(torch.nn, cls)(3, momentum=momentum)
    for step in range(3):
        _check_layer(ours, theirs, torch, _x(*shape, seed=step) * 2 + 1, grad=step == 0, rtol=1e-4, atol=1e-5)
        for name in ("running_mean", "running_var"):
            close(getattr(ours, name), getattr(theirs, name), rtol=1e-5, atol=1e-6)
        assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == step + 1
        # _check_layer copies our buffers into torch each step, so both start every step equal
    ours.eval()
    theirs.eval()
    _check_layer(ours, theirs, torch, _x(*shape, seed=9), rtol=1e-4)


def test_norm_layers_match_torch(torch):
    _check_layer(nn.LayerNorm(5), torch.nn.LayerNorm(5), torch, _x(3, 4, 5), rtol=1e-4, atol=1e-5)
    _check_layer(nn.LayerNorm((4, 5), elementwise_affine=False), torch.nn.LayerNorm((4, 5), elementwise_affine=False),
                 torch, _x(3, 4, 5), rtol=1e-4, atol=1e-5)
    _check_layer(nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4), torch, _x(2, 4, 3, 3), rtol=1e-4, atol=1e-5)
    _check_layer(nn.InstanceNorm2d(3), torch.nn.InstanceNorm2d(3), torch, _x(2, 3, 4, 4), rtol=1e-4, atol=1e-5)
    _check_layer(nn.InstanceNorm2d(3, affine=True), torch.nn.InstanceNorm2d(3, affine=True), torch,
                 _x(3, 4, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,args", [
    ("ReLU", ()), ("ReLU6", ()), ("SiLU", ()), ("Sigmoid", ()), ("Tanh", ()), ("GELU", ()), ("GELU", ("tanh",)),
    ("Softmax", (1,)), ("LogSoftmax", (-1,)), ("Flatten", ()), ("Flatten", (0, 1)), ("Identity", ()),
    ("MaxPool2d", (2,)), ("MaxPool2d", (3, 2, 1)), ("AvgPool2d", (2,)), ("AvgPool2d", (3, 2, 1)),
    ("AdaptiveAvgPool2d", ((1, 1),)), ("AdaptiveAvgPool2d", (2,)),
    ("Hardswish", ()), ("Hardsigmoid", ()), ("Mish", ()), ("LeakyReLU", (0.2,)), ("ELU", (0.5,)),
    ("Hardtanh", (-2.0, 3.0)), ("Softplus", (2.0, 5.0)),
])
def test_stateless_layers_match_torch(torch, name, args):
    x = _x(2, 3, 6, 6) * 4
    _check_layer(getattr(nn, name)(*args), getattr(torch.nn, name)(*args), torch, x, rtol=1e-5, atol=1e-5)


def test_relu6_and_softmax_numbers_vs_numpy():
    x = np.array([[-1.0, 0.5, 7.0]], np.float32)
    np.testing.assert_array_equal(nn.ReLU6()(flow.tensor(x)).numpy(), np.clip(x, 0, 6))
    e = np.exp(x - x.max())
    np.testing.assert_allclose(nn.Softmax(dim=1)(flow.tensor(x)).numpy(), e / e.sum(), rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(scale_factor=2), dict(size=(5, 7)),
                                    dict(scale_factor=2, mode="bilinear", align_corners=False),
                                    dict(size=(5, 7), mode="bilinear", align_corners=True)])
def test_upsample_matches_torch(torch, kwargs):
    _check_layer(nn.Upsample(**kwargs), torch.nn.Upsample(**kwargs), torch, _x(2, 3, 4, 3), rtol=1e-5, atol=1e-5)


def test_embedding_matches_torch(torch):
    ids = np.array([[0, 2, 4], [4, 3, 0]], np.int64)
    ours, theirs = nn.Embedding(5, 3, padding_idx=0), torch.nn.Embedding(5, 3, padding_idx=0)
    _check_layer(ours, theirs, torch, ids)
    assert np.all(ours.weight.grad.numpy()[0] == 0)  # the padding row gets no gradient


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_scale_grad_by_freq_matches_torch(torch, padding_idx):
    ids = np.array([[0, 2, 4, 4], [4, 3, 0, 2]], np.int64)   # 4 three times, 0 and 2 twice
    kwargs = dict(padding_idx=padding_idx, scale_grad_by_freq=True)
    ours, theirs = nn.Embedding(5, 3, **kwargs), torch.nn.Embedding(5, 3, **kwargs)
    _check_layer(ours, theirs, torch, ids)
    if padding_idx is not None:
        assert np.all(ours.weight.grad.numpy()[padding_idx] == 0)
    assert repr(ours).endswith("scale_grad_by_freq=True)")


def test_embedding_options_train_in_a_graph_like_eager():
    from graphs import train_like_eager

    flow.manual_seed(4)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=1, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 3))
    ids = flow.tensor(np.array([[1, 2, 2], [5, 1, 2]], np.int64))
    train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=0.5), [(ids, flow.tensor(np.array([0, 2])))] * 3)
    assert np.all(model[0].weight.numpy()[1] == 0)   # the padding row never moves


@pytest.mark.parametrize("norm_type, kwargs", [(2.0, {}), (1.0, dict(padding_idx=2, scale_grad_by_freq=True))])
def test_embedding_max_norm_renormalises_touched_rows_like_torch(torch, norm_type, kwargs):
    ids = np.array([[0, 2, 4, 4], [4, 3, 0, 2]], np.int64)   # rows 1 and 5 are not touched
    ours = nn.Embedding(6, 3, max_norm=1.5, norm_type=norm_type, **kwargs)
    theirs = torch.nn.Embedding(6, 3, max_norm=1.5, norm_type=norm_type, **kwargs)
    with flow.no_grad():
        ours.weight.copy_(ours.weight * 2)   # most rows over the limit
    _check_layer(ours, theirs, torch, ids)
    close(ours.weight, theirs.weight, 1e-5, 1e-6)   # renormalised in place, the untouched rows kept


def test_embedding_max_norm_in_a_graph_like_eager():
    from graphs import InferGraph, train_like_eager

    flow.manual_seed(4)
    ids = flow.tensor(np.array([[0, 2, 2], [5, 3, 2]], np.int64))
    emb = nn.Embedding(7, 4, max_norm=1.0)
    before = emb.weight.numpy().copy()
    eager = nn.Embedding(7, 4, max_norm=1.0, _weight=emb.weight.detach().clone())
    np.testing.assert_allclose(InferGraph(emb)(ids).numpy(), eager(ids).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(emb.weight.numpy(), eager.weight.numpy(), rtol=1e-6, atol=1e-7)   # written back
    assert not np.allclose(emb.weight.numpy(), before)
    model = nn.Sequential(nn.Embedding(6, 4, max_norm=0.8, norm_type=3.0), nn.Flatten(), nn.Linear(12, 3))
    train_like_eager(model, lambda ps: flow.optim.SGD(ps, lr=0.5, momentum=0.9),
                     [(ids, flow.tensor(np.array([0, 2])))] * 3)
    train_like_eager(model, lambda ps: flow.optim.Adam(ps, lr=0.1), [(ids, flow.tensor(np.array([1, 2])))] * 2)


def test_embedding_sparse_gradients_are_refused():
    with pytest.raises(NotImplementedError, match="sparse=True"):
        nn.Embedding(4, 2, sparse=True)


def test_dropout_train_and_eval():
    d = nn.Dropout(0.25)
    x = flow.ones(200, 100)
    out = d(x).numpy()
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(out[kept], 1 / 0.75, rtol=1e-6)
    d.eval()
    np.testing.assert_array_equal(d(x).numpy(), x.numpy())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses_match_torch(torch, reduction):
    logits, target = _x(6, 4), np.array([0, 3, 1, 1, 2, 3], np.int64)
    weight = np.array([1.0, 2.0, 0.5, 1.5], np.float32)
    cases = [
        (nn.MSELoss(reduction=reduction), torch.nn.MSELoss(reduction=reduction), (_x(6, 4), _x(6, 4, seed=1))),
        (nn.L1Loss(reduction=reduction), torch.nn.L1Loss(reduction=reduction), (_x(6, 4), _x(6, 4, seed=1))),
        (nn.CrossEntropyLoss(reduction=reduction), torch.nn.CrossEntropyLoss(reduction=reduction), (logits, target)),
        (nn.CrossEntropyLoss(ignore_index=1, label_smoothing=0.1, reduction=reduction),
         torch.nn.CrossEntropyLoss(ignore_index=1, label_smoothing=0.1, reduction=reduction), (logits, target)),
        (nn.CrossEntropyLoss(weight=flow.tensor(weight), reduction=reduction),
         torch.nn.CrossEntropyLoss(weight=torch.tensor(weight), reduction=reduction), (logits, target)),
        (nn.NLLLoss(reduction=reduction), torch.nn.NLLLoss(reduction=reduction),
         (np.log(np.full((6, 4), 0.25, np.float32)) + _x(6, 4) * 0.1, target)),
        (nn.BCEWithLogitsLoss(reduction=reduction), torch.nn.BCEWithLogitsLoss(reduction=reduction),
         (_x(6, 4), (_x(6, 4, seed=2) > 0).astype(np.float32))),
        (nn.BCEWithLogitsLoss(pos_weight=flow.tensor(weight), reduction=reduction),
         torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(weight), reduction=reduction),
         (_x(6, 4), (_x(6, 4, seed=2) > 0).astype(np.float32))),
    ]
    for ours, theirs, inputs in cases:
        _check_layer(ours, theirs, torch, *inputs, rtol=1e-5, atol=1e-6)


def test_mse_loss_sum_vs_numpy():
    a, b = _x(10), _x(10, seed=1)
    loss = nn.MSELoss(reduction="sum")(flow.tensor(a), flow.tensor(b))
    assert loss.shape == () and loss.item() == pytest.approx(float(((a - b) ** 2).sum()), rel=1e-5)


def test_small_convnet_forward_backward_matches_torch(torch):
    """A MobileNetV2-style block stack: conv-bn-relu6, depthwise conv, pooling, dropout(eval), linear."""

    def build(m):
        return m.Sequential(
            m.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), m.BatchNorm2d(8), m.ReLU6(),
            m.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), m.BatchNorm2d(8), m.ReLU6(),
            m.Conv2d(8, 16, 1, bias=False), m.BatchNorm2d(16),
            m.AdaptiveAvgPool2d((1, 1)), m.Flatten(), m.Dropout(0.2), m.Linear(16, 10))

    ours, theirs = build(nn), build(torch.nn)
    ours[10].eval()
    theirs[10].eval()
    x, y = _x(4, 3, 16, 16), np.array([1, 0, 9, 3], np.int64)
    copy_weights(ours, theirs, torch)
    loss = nn.CrossEntropyLoss()(ours(flow.tensor(x)), flow.tensor(y))
    tloss = torch.nn.CrossEntropyLoss()(theirs(torch.tensor(x)), torch.tensor(y))
    close(loss, tloss, rtol=1e-5)
    loss.backward()
    tloss.backward()
    tparams = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, tparams[name].grad, rtol=1e-3, atol=1e-5)
    for name, b in ours.named_buffers():
        close(b, dict(theirs.named_buffers())[name], rtol=1e-5, atol=1e-6)


def test_norms_refuse_a_single_value_per_channel_like_pytorch(torch):
    """GroupNorm over one value per group in the whole batch (and training BatchNorm over one value
    per channel) raise PyTorch's ValueError instead of returning the bias; other small shapes run
    (found by the program fuzzer, seed 20271)."""
    for shape in [(1, 2, 1, 1), (3, 2, 1, 1), (1, 4, 1, 1), (1, 2, 2)]:
        outcomes = []
        for lib in (torch, flow):
            try:
                lib.nn.functional.group_norm(lib.ones(*shape), 2)
                outcomes.append("ran")
            except ValueError as error:
                assert "Expected more than 1 value per channel" in str(error)
                outcomes.append("refused")
        assert outcomes[0] == outcomes[1], shape
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(3)(flow.ones(1, 3))
