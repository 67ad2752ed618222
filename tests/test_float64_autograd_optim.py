"""Float64 stays float64 on the autograd and optimizer paths (issue 24, item 4): the gradient seed
of backward(), given gradients, optimizer state and steps, gradient clipping, parameters_to_vector
and NumPy operands beside float64 tensors, each against PyTorch in float64.

A float32 value anywhere on these paths shows as an error of about 1e-8 relative; the tolerances
here are 1e-12 (a few float64 roundings in a different order), so each test fails on one."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim

RTOL = 1e-12


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _pair(torch, array):
    ours = flow.tensor(array, requires_grad=True)
    theirs = torch.tensor(array, requires_grad=True)
    assert ours.dtype == flow.float64
    return ours, theirs


def test_mean_backward_seeds_the_gradient_in_float64(torch):
    x, tx = _pair(torch, np.array([1.0, 2.0, 3.0]))
    x.mean().backward()
    tx.mean().backward()
    assert x.grad.dtype == flow.float64
    assert x.grad.numpy()[0] == 1 / 3 == tx.grad.numpy()[0]   # float32 seed: 0.3333333432674408


def test_backward_with_a_given_gradient_runs_in_the_tensors_dtype(torch):
    """A gradient given as a float64 tensor or a float32 tensor: PyTorch casts it to the output's
    dtype before going backward. flowgen also takes a list (PyTorch wants a tensor): its numbers in
    the output's dtype."""
    data = np.array([0.5, 1.5, 2.5])
    for given in ([1 / 3, 1 / 7, 2.0], np.array([1 / 3, 1 / 7, 2.0]), np.array([1 / 3, 1 / 7, 2.0], np.float32)):
        x, tx = _pair(torch, data)
        (x * x).backward(given if isinstance(given, list) else flow.tensor(given))
        (tx * tx).backward(torch.tensor(given, dtype=torch.float64) if isinstance(given, list) else
                           torch.tensor(given))
        assert x.grad.dtype == flow.float64
        np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=RTOL, atol=0)


def test_sum_of_two_branches_and_division_backward_in_float64(torch):
    data = np.linspace(0.1, 2.0, 7)
    x, tx = _pair(torch, data)
    ((x.exp() / 3.0).sum() + (x * x).mean() / 7.0).backward()
    ((tx.exp() / 3.0).sum() + (tx * tx).mean() / 7.0).backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=RTOL, atol=0)


def test_a_float64_numpy_operand_beside_a_float64_tensor_stays_exact(torch):
    x, tx = _pair(torch, np.zeros(3))
    third = np.full(3, 1 / 3)
    y, ty = x + third, tx + torch.tensor(third)
    assert y.dtype == flow.float64
    assert y.numpy()[0] == ty.detach().numpy()[0] == 1 / 3
    (y * [1 / 3, 1 / 7, 1 / 9]).sum().backward()
    (ty * torch.tensor([1 / 3, 1 / 7, 1 / 9], dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())


SHAPES = [(3, 4), (4,), ()]


def _float64_arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES]


@pytest.mark.parametrize("cls,kwargs", [
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True)),
    ("Adam", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.3)),
    ("Adadelta", dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1)),
])
def test_float64_optimizer_steps_and_state_match_torch(torch, cls, kwargs):
    ours = [nn.Parameter(flow.tensor(a)) for a in _float64_arrays(0)]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in _float64_arrays(0)]
    opt, topt = getattr(optim, cls)(ours, **kwargs), getattr(torch.optim, cls)(theirs, **kwargs)
    for step in range(5):
        for p, tp, g in zip(ours, theirs, _float64_arrays(step + 1)):
            p.grad, tp.grad = flow.tensor(g), torch.tensor(g)
        opt.step()
        topt.step()
    for p, tp in zip(ours, theirs):
        assert p.dtype == flow.float64
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=RTOL, atol=1e-15)
        for name, value in topt.state[tp].items():
            if name != "step":
                assert opt.state[p][name].dtype == flow.float64, name
                np.testing.assert_allclose(opt.state[p][name].numpy(), value.numpy(), rtol=RTOL, atol=1e-15,
                                           err_msg=name)


@pytest.mark.parametrize("cls", ["LAMB", "LARS", "FTRL"])
def test_oneflow_optimizers_keep_float64_state(cls):
    """No PyTorch twin: the state is float64 and the float64 step agrees with the float32 one
    to float32 precision while differing from it (it was not computed in float32)."""
    arrays = _float64_arrays(0)
    grads = _float64_arrays(1)
    results = {}
    for dtype in (np.float64, np.float32):
        params = [nn.Parameter(flow.tensor(a.astype(dtype))) for a in arrays]
        opt = getattr(optim, cls)(params, lr=0.1)
        for p, g in zip(params, grads):
            p.grad = flow.tensor(g.astype(dtype))
        opt.step()
        for p in params:
            for name, value in opt.state[p].items():
                if name != "step":
                    assert value.dtype == flow.tensor(np.zeros(1, dtype)).dtype, name
        results[dtype] = [p.numpy() for p in params]
    for high, low in zip(results[np.float64], results[np.float32]):
        assert high.dtype == np.float64
        np.testing.assert_allclose(high, low, rtol=1e-5, atol=1e-6)
    assert any(not np.array_equal(high, low.astype(np.float64))
               for high, low in zip(results[np.float64], results[np.float32]))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_float64_clip_grad_norm_matches_torch(torch, norm_type):
    ours = [nn.Parameter(flow.tensor(a)) for a in _float64_arrays(0)]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in _float64_arrays(0)]
    for p, tp, g in zip(ours, theirs, _float64_arrays(1)):
        p.grad, tp.grad = flow.tensor(g / 3), torch.tensor(g / 3)
    total = nn.utils.clip_grad_norm_(ours, 0.7, norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(theirs, 0.7, norm_type)
    assert total.dtype == flow.float64
    np.testing.assert_allclose(total.numpy(), ttotal.numpy(), rtol=RTOL)
    for p, tp in zip(ours, theirs):
        assert p.grad.dtype == flow.float64
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=RTOL, atol=1e-15)


def test_clip_grad_norm_without_gradients_is_a_float32_zero_as_in_torch(torch):
    total = nn.utils.clip_grad_norm_([nn.Parameter(flow.tensor(np.ones(2)))], 1.0)
    ttotal = torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))], 1.0)
    assert total.dtype == flow.float32 and ttotal.dtype == torch.float32
    assert total.item() == ttotal.item() == 0.0


def test_float64_clip_grad_value_and_zero_grad_keep_the_dtype(torch):
    p, tp = nn.Parameter(flow.tensor(np.array([1 / 3, -2.0, 0.5]))), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad, tp.grad = flow.tensor(np.array([1 / 3, -2.0, 0.5])), torch.tensor([1 / 3, -2.0, 0.5], dtype=torch.float64)
    nn.utils.clip_grad_value_([p], 0.4)
    torch.nn.utils.clip_grad_value_([tp], 0.4)
    assert p.grad.dtype == flow.float64
    np.testing.assert_array_equal(p.grad.numpy(), tp.grad.numpy())
    opt = optim.SGD([p], lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert p.grad.dtype == flow.float64 and not p.grad.numpy().any()


def test_parameters_to_vector_keeps_float64_and_is_differentiable(torch):
    arrays = _float64_arrays(2)
    ours = [nn.Parameter(flow.tensor(a)) for a in arrays]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in arrays]
    vec = nn.utils.parameters_to_vector(ours)
    tvec = torch.nn.utils.parameters_to_vector(theirs)
    assert vec.dtype == flow.float64
    np.testing.assert_array_equal(vec.numpy(), tvec.detach().numpy())
    weights = np.linspace(1 / 3, 3.0, vec.shape[0])
    (vec * weights).sum().backward()
    (tvec * torch.tensor(weights)).sum().backward()
    for p, tp in zip(ours, theirs):
        np.testing.assert_array_equal(p.grad.numpy(), tp.grad.numpy())
