"""Random ops inside build(), the random state in checkpoints, free eager tensors and
`.numpy()` on tensors a graph holds (issue 13, items 2, 3 and 8)."""
import numpy as np
import pytest

import flowgen as flow
from flowgen import nn
from flowgen.ir.trace import TraceError
from graphs import SumLossGraph


def _draws(x):
    """Every random creation function and in-place random fill, as build() and eager code call them."""
    return (flow.rand(3, 4) + x,
            flow.randn(3, 4),
            flow.normal(2.0, 3.0, (4,)),
            flow.randint(-3, 7, (5,)),
            flow.bernoulli(flow.sigmoid(x)),
            x.new_empty(3, 1).bernoulli_(0.25),        # the drop-path / stochastic-depth mask
            flow.zeros(2, 2).uniform_(-1.0, 3.0),
            flow.zeros(2, 2).normal_(0.5, 2.0),
            flow.normal(0.0, 1.0, (2, 3), out=flow.zeros(2, 3, dtype=flow.float64)),
            flow.rand_like(x) < 0.5,
            flow.randn_like(x))


class DrawGraph(nn.Graph):
    def build(self, x):
        return _draws(x)


def test_random_ops_in_build_draw_the_eager_numbers_fresh_on_every_call():
    x = flow.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    flow.manual_seed(7)
    graph = DrawGraph()
    compiled = [graph(x) for _ in range(3)]
    flow.manual_seed(7)
    eager = [_draws(x) for _ in range(3)]
    for call, (got, want) in enumerate(zip(compiled, eager)):
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype, (call, k)
            np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=f"call {call}, draw {k}")
    for k in range(len(compiled[0])):
        assert not np.array_equal(compiled[0][k].numpy(), compiled[1][k].numpy()), f"draw {k} repeated"
    assert not any(n.op == "constant" and n.output.numel > 1 for n in graph.compiled.ir.nodes)


def test_stochastic_depth_trains_like_eager():
    """A residual block dropped per sample by `flow.rand(n, 1) < keep` (drop path): the graph
    trains to the eager losses only if the mask is redrawn on every step."""

    class DropPathNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(6, 6)
            self.head = nn.Linear(6, 1)

        def forward(self, x, keep=0.5):
            mask = (flow.rand(x.shape[0], 1) < keep).to(x.dtype) / keep
            return self.head(x + self.block(x) * mask)

    def make():
        flow.manual_seed(1)
        model = DropPathNet()
        return model, flow.optim.SGD(model.parameters(), lr=0.05)

    class Train(nn.Graph):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x, y):
            loss = ((self.model(x) - y) ** 2).mean()
            loss.backward()
            return loss

    rng = np.random.default_rng(0)
    x = flow.tensor(rng.standard_normal((16, 6)).astype(np.float32))
    y = flow.tensor(rng.standard_normal((16, 1)).astype(np.float32))
    model, opt = make()
    graph = Train(model, opt)
    graph_losses = [float(graph(x, y).numpy()) for _ in range(5)]
    model, opt = make()
    eager_losses = []
    for _ in range(5):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        eager_losses.append(float(loss.numpy()))
    np.testing.assert_allclose(graph_losses, eager_losses, rtol=1e-5)


def test_randperm_in_build_shuffles_like_eager_on_every_call():
    class Shuffle(nn.Graph):
        def build(self, x):
            return x[flow.randperm(40)], flow.randint(low=0, high=10, size=(6,))

    x = flow.arange(40)
    flow.manual_seed(11)
    graph = Shuffle()
    compiled = [graph(x) for _ in range(2)]
    flow.manual_seed(11)
    eager = [(x[flow.randperm(40)], flow.randint(low=0, high=10, size=(6,))) for _ in range(2)]
    for got, want in zip(compiled, eager):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert sorted(got[0].tolist()) == list(range(40))
    assert compiled[0][0].tolist() != compiled[1][0].tolist()


def test_random_op_with_a_numpy_generator_is_refused_in_build():
    class WithGenerator(nn.Graph):
        def build(self, x):
            return x + flow.rand(4, generator=np.random.default_rng(0))

    with pytest.raises(TraceError, match=r"flow\.rand\(generator=\.\.\.\) inside nn\.Graph\.build\(\)"):
        WithGenerator()(flow.ones(4))


def test_rng_state_round_trip_restores_every_random_source():
    flow.manual_seed(3)
    flow.rand(5)
    state = flow.get_rng_state()
    first = (flow.randn(6).numpy().copy(), nn.Linear(4, 2).weight.numpy().copy(), flow.randperm(9).numpy().copy())
    flow.set_rng_state(state)
    again = (flow.randn(6).numpy(), nn.Linear(4, 2).weight.numpy(), flow.randperm(9).numpy())
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="set_rng_state"):
        flow.set_rng_state(flow.zeros(3))


class NoisyTrain(nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        noisy = x + 0.1 * flow.randn(*x.shape)
        loss = ((self.model(noisy) - y) ** 2).mean()
        loss.backward()
        return loss


def _noisy_setup(seed):
    flow.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))
    return NoisyTrain(model, flow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def test_resume_with_dropout_and_random_ops_is_bit_identical(tmp_path):
    rng = np.random.default_rng(1)
    batches = [(flow.tensor(rng.standard_normal((8, 5)).astype(np.float32)),
                flow.tensor(rng.standard_normal((8, 1)).astype(np.float32))) for _ in range(6)]
    graph = _noisy_setup(seed=0)
    for b in batches[:3]:
        graph(*b)
    flow.save(graph.state_dict(), tmp_path / "ckpt")
    uninterrupted = [float(graph(*b).numpy()) for b in batches[3:]]

    resumed = _noisy_setup(seed=99)     # fresh objects: a different random position and weights
    resumed.load_state_dict(flow.load(tmp_path / "ckpt"))
    assert [float(resumed(*b).numpy()) for b in batches[3:]] == uninterrupted


def test_free_eager_tensor_is_read_fresh_on_every_call():
    offset = flow.tensor([1.0, 2.0, 3.0])
    scale = flow.tensor(2.0)

    class Shift(nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def build(self, x):
            return self.lin(x) * scale + offset + offset.sum()   # offset.sum() reads only the free tensor

    graph = Shift()
    x = flow.ones(2, 3)
    lin_out = graph.lin(x).numpy()
    np.testing.assert_allclose(graph(x).numpy(), lin_out * 2 + [7.0, 8.0, 9.0], rtol=1e-6)
    offset.add_(10)
    scale.fill_(-1.0)
    np.testing.assert_allclose(graph(x).numpy(), -lin_out + [47.0, 48.0, 49.0], rtol=1e-6)
    np.testing.assert_array_equal(offset.numpy(), [11.0, 12.0, 13.0])


def test_inplace_op_on_free_eager_tensor_in_build_is_a_graph_op():
    """OneFlow (test_graph_return_inplace_free_eager_tensor): the graph computes with the
    in-place result on every call; the eager tensor itself is not changed, not even while tracing."""
    start = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = flow.tensor(start)
    filled = flow.zeros(3)

    class Double(nn.Graph):
        def build(self):
            x.mul_(2)
            filled.fill_(4.0)         # the new value comes from no graph tensor at all
            return x + 1, x, filled

    graph = Double()
    for _ in range(2):
        plus_one, doubled, fours = graph()
        np.testing.assert_array_equal(doubled.numpy(), start * 2)
        np.testing.assert_array_equal(plus_one.numpy(), start * 2 + 1)
        np.testing.assert_array_equal(fours.numpy(), [4.0, 4.0, 4.0])
        np.testing.assert_array_equal(x.numpy(), start)
        np.testing.assert_array_equal(filled.numpy(), [0.0, 0.0, 0.0])
    x.fill_(1.0)
    np.testing.assert_array_equal(graph()[1].numpy(), np.full((2, 3), 2.0))


def test_writes_into_numpy_arrays_of_graph_tensors_reach_the_graph():
    flow.manual_seed(0)
    lin = nn.Linear(3, 2)
    opt = flow.optim.SGD(lin.parameters(), lr=0.1)

    graph = SumLossGraph(lin, opt)
    x = flow.ones(4, 3)
    graph(x)
    weight = lin.weight.numpy()
    weight[...] = 0.0
    lin.bias.numpy()[...] = 0.0
    assert float(graph(x).numpy()) == 0.0            # the graph saw the zeroed parameters
    np.testing.assert_allclose(weight, np.full((2, 3), -0.4), rtol=1e-6)   # and the array its update
    out = graph(x)
    out.numpy()[...] = 5.0
    assert float(out.numpy()) == 5.0


def test_nn_init_in_build_is_a_graph_op_or_refused():
    """OneFlow runs `nn.init.uniform_` inside build() as a random op; flowgen does too (and the
    initialisers built on it), and refuses the ones that would freeze a NumPy draw."""
    free = flow.zeros(3)

    class Init(nn.Graph):
        def build(self, x):
            a, b = x.clone(), x.clone()
            nn.init.uniform_(a, -2.0, 2.0)
            nn.init.kaiming_normal_(b)
            return a, b

    class Frozen(nn.Graph):
        def build(self):
            nn.init.trunc_normal_(free)
            return free

    graph = Init()
    x = flow.zeros(4, 6)
    (a0, b0), (a1, b1) = graph(x), graph(x)
    assert not np.array_equal(a0.numpy(), a1.numpy()) and not np.array_equal(b0.numpy(), b1.numpy())
    assert np.all(np.abs(a0.numpy()) <= 2.0) and np.abs(b0.numpy()).max() > 0
    with pytest.raises(TraceError, match=r"nn\.init\.trunc_normal_ cannot run inside nn\.Graph\.build\(\)"):
        Frozen()()
    np.testing.assert_array_equal(free.numpy(), [0.0, 0.0, 0.0])


def _oneflow_functional_draws(x):
    """OneFlow's `flow._C` random functions and the keyword spellings of rand/randn."""
    return (flow._C.rrelu(x, training=True),
            flow._C.exponential_(flow.zeros(3, 4), 2.0),
            flow._C.dropout(x, 0.5, addend=flow.ones(3, 4)),
            flow.multinomial(flow.sigmoid(x), 6, replacement=True),
            flow.rand(size=(2, 3)),
            flow.randn(size=(2,)))


class OneflowFunctionalDrawGraph(nn.Graph):
    def build(self, x):
        return _oneflow_functional_draws(x)


def test_oneflow_functional_random_ops_in_build_draw_the_eager_numbers():
    x = flow.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    flow.manual_seed(3)
    compiled = OneflowFunctionalDrawGraph()(x)
    flow.manual_seed(3)
    eager = _oneflow_functional_draws(x)
    for k, (g, w) in enumerate(zip(compiled, eager)):
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), k
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6, err_msg=str(k))
    rrelu, expo, dropped, draws = (t.numpy() for t in eager[:4])
    xs = x.numpy()
    slope = rrelu[xs < 0] / xs[xs < 0]
    assert np.array_equal(rrelu[xs >= 0], xs[xs >= 0]) and (slope >= 1 / 8).all() and (slope <= 1 / 3).all()
    assert (expo >= 0).all()
    assert set(np.unique(dropped)) <= set(np.unique(np.concatenate([[1.0], 1 + 2 * xs.ravel()])))
    assert draws.dtype == np.int64 and draws.shape == (3, 6) and ((draws >= 0) & (draws < 4)).all()


def test_multinomial_with_replacement_follows_the_weights():
    flow.manual_seed(0)
    weights = flow.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]])
    draws = flow.multinomial(weights, 4000, replacement=True).numpy()
    np.testing.assert_allclose(np.bincount(draws[0], minlength=3) / 4000, [0.0, 0.25, 0.75], atol=0.03)
    assert (draws[1] == 0).all()
    assert tuple(flow.multinomial(flow.tensor([1.0, 1.0]), 5, True).shape) == (5,)


def test_multinomial_without_replacement_in_build_draws_anew_each_call():
    class Sample(nn.Graph):
        def build(self, w):
            return flow.multinomial(w, 2)

    graph, weights = Sample(), flow.ones(2, 50)
    draws = [graph(weights).numpy() for _ in range(3)]
    assert all(len(set(row)) == 2 for d in draws for row in d.tolist())   # without replacement
    assert not np.array_equal(draws[0], draws[1]) or not np.array_equal(draws[1], draws[2])
