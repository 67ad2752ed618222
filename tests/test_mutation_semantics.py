"""In-place ops, views and several backward() calls: eager flowgen equals PyTorch, and a graph
equals eager (issue 24: DCGAN's `label.fill_` after a read, `errD_real.backward();
errD_fake.backward()`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flowgen as flow
from flowgen import nn


class FnGraph(nn.Graph):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def build(self, *args):
        return self.fn(*args)


def _label_program(x):
    label = flow.full((4,), 1.0)
    first = (label * x).sum()
    label.fill_(0.0)
    second = (label + x).sum()
    label.mul_(3.0).add_(2.0)
    third = (label * x).sum()
    return flow.stack([first, second, third])


def test_inplace_on_a_tensor_build_made_after_a_read():
    x = flow.arange(4).float()
    np.testing.assert_array_equal(_label_program(x).numpy(), [6, 6, 12])
    np.testing.assert_array_equal(FnGraph(_label_program)(x).numpy(), [6, 6, 12])


def _views_program(x):
    h = x * 1.0
    h[0].fill_(1)
    h.view(-1)[3:5].add_(10)
    h[:, 1:] *= 2
    h.t()[0].mul_(-1)
    row = h[1]
    h[1, 0] = 7.0
    seen = row * 1          # the row sees the write made through its base
    h[h > 5] = 0.5
    h[[0, 2]] = h[[0, 2]] + 100
    h.transpose(0, 1).reshape(-1).fill_(0)   # reshape of a permuted tensor is a copy: h unchanged
    h.unsqueeze(0).expand(2, 3, 4).sum().neg()   # reading an expanded view is fine
    return h.sum(0) + seen.sum() * 0.001, h


def test_views_see_writes_eager_and_graph_like_torch():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    want = [t.numpy() for t in _views_program(torch.tensor(x))]
    for got in (_views_program(flow.tensor(x)), FnGraph(_views_program)(flow.tensor(x))):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)


def _grad_programs():
    def setitem(w, y):
        h = w * 2
        h[0] = y.sum() * 3
        h[:, 1].mul_(y[0])
        v = h.view(-1)
        v[2:4] += y[1:3]
        return (h * h).sum() + (v ** 3).sum()

    def refreshed_view(w, y):
        h = w * 2
        v = h.view(-1)
        v[2:4].add_(y[1:3])
        return (v ** 3).sum() + (h[1] * y).sum()

    def alias_iadd(w, y):
        h = w * 1.5
        alias = h
        h += y        # in place: the alias sees it (it did not under autograd)
        return (alias ** 2).sum()
    return [setitem, refreshed_view, alias_iadd]


@pytest.mark.parametrize("program", _grad_programs(), ids=lambda f: f.__name__)
def test_gradients_through_inplace_writes_to_views_match_torch(program):
    rng = np.random.default_rng(0)
    w0, y0 = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    tw, ty = torch.tensor(w0, requires_grad=True), torch.tensor(y0, requires_grad=True)
    program(tw, ty).backward()
    fw, fy = flow.tensor(w0, requires_grad=True), flow.tensor(y0, requires_grad=True)
    loss = program(fw, fy)
    loss.backward()
    np.testing.assert_allclose(fw.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fy.grad.numpy(), ty.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_inplace_errors_are_torchs():
    with pytest.raises(RuntimeError, match="same element of its base"):
        flow.zeros(3).expand(2, 3).add_(1)
    a = flow.ones(2, 3, requires_grad=True) * 1
    row = a[0]
    loss = (row * row).sum()
    a.mul_(2)                       # row (saved by mul) shares a's version
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        loss.backward()
    p = flow.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        p[0] = 2.0


def test_graph_setitem_with_a_mask_computed_in_the_graph():
    def masked(x):
        y = x * 2
        y[y > 3] = 0.0
        return y
    x = flow.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(FnGraph(masked)(x).numpy(), masked(x).numpy())

    def integer_index(x):
        y = x * 1
        y[x.argmax(1)] = 1.0
        return y
    with pytest.raises(NotImplementedError, match="index computed in the graph"):
        FnGraph(integer_index)(x)


class _TwoLosses(nn.Graph):
    def __init__(self, model, opt, weight=None):
        super().__init__()
        self.model, self.weight = model, weight
        self.add_optimizer(opt)

    def build(self, x, y):
        first = ((self.model(x) - y) ** 2).mean()
        first.backward()
        out = self.model(x * 2)
        if self.weight is None:
            out.sum().backward()
        else:
            out.backward(self.weight)
        return first


@pytest.mark.parametrize("weighted", [False, True])
def test_several_backward_calls_in_build_accumulate_like_eager(weighted):
    rng = np.random.default_rng(1)
    x, y = flow.tensor(rng.standard_normal((5, 4)).astype(np.float32)), flow.tensor(
        rng.standard_normal((5, 3)).astype(np.float32))
    weight = flow.tensor(rng.standard_normal((5, 3)).astype(np.float32)) if weighted else None

    def make():
        flow.manual_seed(0)
        model = nn.Linear(4, 3)
        return model, flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = make()
    for _ in range(3):
        ((model(x) - y) ** 2).mean().backward()
        out = model(x * 2)
        out.backward(weight) if weighted else out.sum().backward()
        opt.step()
        opt.zero_grad()
    graph_model, graph_opt = make()
    graph = _TwoLosses(graph_model, graph_opt, weight)
    for _ in range(3):
        graph(x, y)
    for p, q in zip(model.parameters(), graph_model.parameters()):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-6)


class _Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


class _Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class _DStep(nn.Graph):
    def __init__(self, netD, netG, opt, criterion):
        super().__init__()
        self.netD, self.netG, self.criterion = netD, netG, criterion
        self.add_optimizer(opt)

    def build(self, real, noise):
        label = flow.full((real.shape[0],), 1.0)
        errD_real = self.criterion(self.netD(real), label)
        errD_real.backward()
        fake = self.netG(noise)
        label.fill_(0.0)
        errD_fake = self.criterion(self.netD(fake.detach()), label)
        errD_fake.backward()
        return errD_real + errD_fake


class _GStep(nn.Graph):
    def __init__(self, netD, netG, opt, criterion):
        super().__init__()
        self.netD, self.netG, self.criterion = netD, netG, criterion
        self.add_optimizer(opt)

    def build(self, noise):
        label = flow.full((noise.shape[0],), 0.0)
        label.fill_(1.0)
        errG = self.criterion(self.netD(self.netG(noise)), label)
        errG.backward()
        return errG


def test_dcgan_training_loop_in_two_graphs_equals_eager():
    rng = np.random.default_rng(2)
    reals = [flow.tensor(rng.standard_normal((4, 6)).astype(np.float32)) for _ in range(3)]
    noises = [flow.tensor(rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(3)]

    def make():
        flow.manual_seed(3)
        netD, netG = _Discriminator(), _Generator()
        return (netD, netG, flow.optim.Adam(netD.parameters(), lr=0.01, betas=(0.5, 0.999)),
                flow.optim.Adam(netG.parameters(), lr=0.01, betas=(0.5, 0.999)))
    criterion = nn.BCELoss()
    netD, netG, optD, optG = make()
    for real, noise in zip(reals, noises):      # the DCGAN example's loop, as published
        netD.zero_grad()
        label = flow.full((4,), 1.0)
        errD_real = criterion(netD(real), label)
        errD_real.backward()
        fake = netG(noise)
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()), label)
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake), label)
        errG.backward()
        optG.step()
    gD, gG, gOptD, gOptG = make()
    d_step, g_step = _DStep(gD, gG, gOptD, criterion), _GStep(gD, gG, gOptG, criterion)
    for real, noise in zip(reals, noises):
        d_step(real, noise)
        g_step(noise)
    for eager_net, graph_net in ((netD, gD), (netG, gG)):
        for p, q in zip(eager_net.parameters(), graph_net.parameters()):
            np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make_loss, raises", [
    (lambda lib, w: (w * 2).sum(), True), (lambda lib, w: lib.tanh(w).sum(), True),
    (lambda lib, w: (w + 1).sum(), False), (lambda lib, w: w.mean(), False)], ids=["mul", "tanh", "add", "mean"])
def test_second_backward_without_retain_graph_raises_where_torch_does(make_loss, raises):
    grads = []
    for lib in (torch, flow):
        w = lib.ones(3, requires_grad=True)
        loss = make_loss(lib, w)
        loss.backward()
        if raises:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        else:
            loss.backward()
        w2 = lib.ones(3, requires_grad=True)
        loss = make_loss(lib, w2)
        loss.backward(retain_graph=True)
        loss.backward()                 # retained: the gradient accumulates twice
        grads.append((np.array(w.grad.tolist()), np.array(w2.grad.tolist())))
    for want, got in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-6)


class _Twice(nn.Graph):
    def __init__(self, model, opt, retain):
        super().__init__()
        self.model, self.retain = model, retain
        self.add_optimizer(opt)

    def build(self, x):
        loss = flow.tanh(self.model(x)).sum()
        loss.backward(retain_graph=self.retain)
        loss.backward()
        return loss


def test_graph_second_backward_needs_retain_graph_as_eager():
    x = flow.tensor(np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32))
    flow.manual_seed(0)
    model = nn.Linear(3, 1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _Twice(model, flow.optim.SGD(model.parameters(), lr=0.1), retain=False)(x)
    flow.manual_seed(0)
    eager = nn.Linear(3, 1)
    opt = flow.optim.SGD(eager.parameters(), lr=0.1)
    loss = flow.tanh(eager(x)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    flow.manual_seed(0)
    graph_model = nn.Linear(3, 1)
    _Twice(graph_model, flow.optim.SGD(graph_model.parameters(), lr=0.1), retain=True)(x)
    np.testing.assert_allclose(graph_model.weight.numpy(), eager.weight.numpy(), rtol=1e-6)


def test_writes_through_data_and_detach_reach_a_compiled_graph():
    """`p.data.mul_()` / `p.detach().zero_()` between graph calls: the graph and eager mode both
    see them (the write was lost: p's version did not change, so the graph neither uploaded it nor
    kept it, and its device copy overwrote the eager write)."""
    flow.manual_seed(0)
    model = nn.Linear(3, 2)
    graph = FnGraph(model)
    x = flow.ones(1, 3)
    before = graph(x).numpy().copy()
    assert np.abs(before).max() > 0
    model.weight.data.mul_(0.5)
    model.bias.detach().zero_()
    want = x.numpy() @ model.weight.numpy().T
    np.testing.assert_allclose(model(x).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(graph(x).numpy(), want, rtol=1e-6)


def _read_then_write_programs():
    """A tensor read, then written in place (itself or through a view), then read again: the
    gradient of each read reaches the value it read (fuzz: an earlier reader's gradient went into
    the write's history, and reads whose gradient needs no saved value were refused)."""
    def add_then_write_a_slice(w, p):
        h = w * 1.0
        y = h + p
        h[:, 1:] += p[1:]
        return (y * h).sum()

    def sum_then_clamp(w, p):
        h = w * 1.0
        y = h.sum(1, keepdim=True)
        h.clamp_(min=-0.2, max=0.5)
        return (y * h * p).sum()

    def constant_mul_tanh_sigmoid_then_write_a_row(w, p):   # PyTorch saves none of h for these
        h = w * 1.0
        y = h * 2.0 + h.tanh() + h.sigmoid()
        h[0].mul_(p)
        return (y * h).sum()

    def copy_a_leaf_into_a_row(w, p):
        h = w * 1.0
        h[1].copy_(p)
        return (h * h).sum()

    def fill_through_unsqueeze(w, p):
        h = w * 1.0
        h.unsqueeze(0)[0, 1].fill_(2.0)
        return (h * h * p).sum()

    def write_through_detach(w, p):   # h's values change, its gradient does not (autograd does not see it)
        h = w * 1.0
        y = h + 1.0
        h.detach()[0].mul_(2.0)
        return (y * h * p).sum()

    def inplace_methods_and_a_view_read_before(w, p):
        h = w * 1.0
        column = h[:, 2]
        h.masked_fill_(h > 0.5, 0.5)
        h[:, 0].mul_(p[0])
        h.relu_()
        return (h * p).sum() + (column * column).sum()

    def fill_keeps_the_gradient_of_earlier_reads(w, p):
        h = w * 2.0
        y = h + 1.0
        h.fill_(3.0)
        return (h * p).sum() * (y * y).sum()

    def copy_a_source_with_a_gradient_over_a_computed_tensor(w, p):   # w: a zero gradient, not None
        h = w * 2.0
        h.copy_(p * 3.0)
        return (h * p).sum()
    return [add_then_write_a_slice, sum_then_clamp, constant_mul_tanh_sigmoid_then_write_a_row,
            copy_a_leaf_into_a_row, fill_through_unsqueeze, write_through_detach,
            inplace_methods_and_a_view_read_before, fill_keeps_the_gradient_of_earlier_reads,
            copy_a_source_with_a_gradient_over_a_computed_tensor]


def _torch_gradients(program, w0, p0):
    tw, tp = torch.tensor(w0, requires_grad=True), torch.tensor(p0, requires_grad=True)
    loss = program(tw, tp)
    loss.backward()
    return loss.item(), tw.grad.numpy(), tp.grad.numpy()


@pytest.mark.parametrize("program", _read_then_write_programs(), ids=lambda f: f.__name__)
def test_reads_before_an_inplace_write_get_their_gradients_like_torch(program):
    rng = np.random.default_rng(5)
    w0, p0 = rng.standard_normal((3, 4)), rng.standard_normal(4)
    want = _torch_gradients(program, w0, p0)
    fw = flow.tensor(w0, dtype=flow.float64, requires_grad=True)
    fp = flow.tensor(p0, dtype=flow.float64, requires_grad=True)
    loss = program(fw, fp)
    loss.backward()
    for got, expected in zip((float(loss.numpy()), fw.grad.numpy(), fp.grad.numpy()), want):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


class _Programs(nn.Module):
    def __init__(self, programs, w0, p0):
        super().__init__()
        self.programs = programs
        self.ws = nn.ParameterList([nn.Parameter(flow.tensor(w0, dtype=flow.float64)) for _ in programs])
        self.ps = nn.ParameterList([nn.Parameter(flow.tensor(p0, dtype=flow.float64)) for _ in programs])

    def forward(self):
        return [program(w, p) for program, w, p in zip(self.programs, self.ws, self.ps)]


class _SumOfLosses(nn.Graph):
    def __init__(self, module, opt):
        super().__init__()
        self.module = module
        self.add_optimizer(opt)

    def build(self, zero):
        losses = self.module()
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        total.backward()
        return flow.stack(losses) + zero


def test_graph_reads_before_an_inplace_write_get_their_gradients_like_torch():
    """The programs above in one training graph (SGD, lr 1: a parameter moves by minus its
    gradient); a write through a detach()ed view cut the gradient in graphs (with_value)."""
    programs = _read_then_write_programs()
    rng = np.random.default_rng(5)
    w0, p0 = rng.standard_normal((3, 4)), rng.standard_normal(4)
    module = _Programs(programs, w0, p0)
    losses = _SumOfLosses(module, flow.optim.SGD(module.parameters(), lr=1.0))(
        flow.zeros(len(programs), dtype=flow.float64)).numpy()
    for k, program in enumerate(programs):
        loss, w_grad, p_grad = _torch_gradients(program, w0, p0)
        np.testing.assert_allclose(losses[k], loss, rtol=1e-12, err_msg=program.__name__)
        np.testing.assert_allclose(w0 - module.ws[k].numpy(), w_grad, rtol=1e-9, atol=1e-12, err_msg=program.__name__)
        np.testing.assert_allclose(p0 - module.ps[k].numpy(), p_grad, rtol=1e-9, atol=1e-12, err_msg=program.__name__)


@pytest.mark.parametrize("read", [
    lambda h, p: h * 2.0, lambda h, p: h.tanh(), lambda h, p: h.sigmoid(), lambda h, p: h.sum(0),
    lambda h, p: h.cumsum(1), lambda h, p: h + p, lambda h, p: h[1:].t(),
    lambda h, p: h * p, lambda h, p: h.sin(), lambda h, p: h ** 2, lambda h, p: h.abs(), lambda h, p: h @ p],
    ids=["mul_constant", "tanh", "sigmoid", "sum", "cumsum", "add", "view", "mul", "sin", "pow", "abs", "matvec"])
def test_a_read_before_an_inplace_write_raises_where_torch_does(read):
    """PyTorch refuses backward() only where a gradient needs a saved value the write changed
    (`h * p`: yes; `h * 2.0`, `tanh` (it saves its output): no); flowgen refused every op not marked
    grad_reads_inputs=False."""
    rng = np.random.default_rng(6)
    w0, p0 = rng.standard_normal((3, 4)), rng.standard_normal(4)
    outcomes = []
    for lib in (torch, flow):
        w, p = lib.tensor(w0, requires_grad=True), lib.tensor(p0, requires_grad=True)
        h = w * 1.0
        y = read(h, p)
        h.mul_(3.0)
        try:
            (y.sum() + h.sum()).backward()
            outcomes.append((np.asarray(w.grad.tolist()), np.asarray(p.grad.tolist()) if p.grad is not None else None))
        except RuntimeError as error:
            assert "modified by an in" in str(error)
            outcomes.append("raised")
    if outcomes[0] == "raised" or outcomes[1] == "raised":
        assert outcomes[0] == outcomes[1] == "raised"
        return
    for want, got in zip(*outcomes):
        if want is None:
            assert got is None or not np.any(got)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("make_view", [
    lambda x: x.t(), lambda x: x[:, ::2], lambda x: x.permute(1, 0), lambda x: x[1:].t(),
    lambda x: x.reshape(1, 4, 6).transpose(2, 1)[0:1], lambda x: x.reshape(2, 2, 6).permute(2, 0, 1),
    lambda x: x.reshape(1, 4, 6)[0:1].transpose(2, 1)],
    ids=["t", "step_slice", "permute", "slice_t", "transpose_slice", "permute3", "leading_1"])
def test_reshape_is_a_view_exactly_where_torch_can_view(make_view):
    """A reshape of a view writes through to its base where PyTorch's view() can (its strides
    allow it, computeStride), else it is a copy (fuzz: select on a transposed [1, 4, 6] -- a
    reshape dropping the leading 1 of a permuted tensor -- was taken for a copy, so the write to
    `h.transpose(2, 1)[0]` was lost); stride() and is_contiguous() are torch's."""
    x0 = np.arange(24, dtype=np.float64).reshape(4, 6)
    torch_view, flow_view = make_view(torch.tensor(x0)), make_view(flow.tensor(x0, dtype=flow.float64))
    assert flow_view.stride() == torch_view.stride()
    assert flow_view.is_contiguous() == torch_view.is_contiguous()
    n = torch_view.numel()
    for shape in [(n,), (1, n), tuple(torch_view.shape)[::-1], tuple(torch_view.shape) + (1,),
                  (torch_view.shape[0], -1), (-1, torch_view.shape[-1])]:
        results = []
        for lib, view, make in ((torch, torch_view, torch.tensor), (flow, flow_view, flow.tensor)):
            base = make(x0 * 1.0)
            view = make_view(base)
            view.reshape(shape)[..., 0] = -1.0    # a view's write reaches base, a copy's does not
            results.append(np.asarray(base.tolist()))
        np.testing.assert_array_equal(results[1], results[0], err_msg=str(shape))


def test_transposed_select_of_a_leading_1_writes_through_in_graphs():
    def program(x):
        h = x[0:1] * 1.0
        h.transpose(2, 1)[0].fill_(0.25)
        return h
    x0 = np.random.default_rng(7).standard_normal((2, 4, 5)).astype(np.float32)
    want = program(torch.tensor(x0)).numpy()
    np.testing.assert_array_equal(program(flow.tensor(x0)).numpy(), want)
    np.testing.assert_array_equal(FnGraph(program)(flow.tensor(x0)).numpy(), want)


class _ConstantOperandStep(nn.Module):
    """Fuzz seeds 431291/435551: `h[0] = 2.0` makes a one-element slice a constant, which a
    Linear(1, 4) then multiplies (K = 1): the GEMM renderers refused the constant operand."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 4)
        self.back = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        h = x[2:3:2, 1:2]
        h[0] = 2.0
        left = self.lin(h)                       # [1, 1] constant @ weight^T
        right = self.back(left) * h              # ... then multiplied by the constant again
        col = x[:, :1] @ h                       # [N, 1] @ [1, 1] constant
        return left.sum() + right.sum() + (col * col).sum()


@pytest.mark.parametrize("kernels", ["emulator", "native"])
def test_a_one_element_constant_gemm_operand_compiles_and_trains_like_eager(kernels, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", kernels)
    flow.manual_seed(0)
    model = _ConstantOperandStep()
    twin = _ConstantOperandStep()
    twin.load_state_dict(model.state_dict())
    x = flow.tensor(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = twin
            self.add_optimizer(flow.optim.SGD(twin.parameters(), lr=0.1))

        def build(self, x):
            loss = self.model(x)
            loss.backward()
            return loss

    opt = flow.optim.SGD(model.parameters(), lr=0.1)
    graph = Step()
    for _ in range(2):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        np.testing.assert_allclose(graph(x).numpy(), loss.numpy(), rtol=1e-6)
    for name, p in model.state_dict().items():
        np.testing.assert_allclose(twin.state_dict()[name].numpy(), p.numpy(), rtol=1e-6, err_msg=name)
