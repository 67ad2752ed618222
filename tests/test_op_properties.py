"""What the passes ask of an op is a property declared with its defop (flowgen/ops/registry.py
PROPERTIES): every op's are valid, a typo raises, and an op defined here is fused by what it
declares, with no name listed anywhere else."""
import numpy as np
import pytest

import flowgen as flow
from flowgen.ops import registry
from flowgen.ops.lowering import Elementwise, Reduction, Template, View
from flowgen.ops.registry import FUSION_LOWERING, PROPERTIES, REGISTRY, TensorMeta


def _same(a):
    return TensorMeta(a.shape, a.dtype)


def _broadcast(a, b):
    return TensorMeta(registry.broadcast_shapes(a.shape, b.shape), a.dtype)


# softsign(x) = x / (1 + |x|), declared an elementwise fusion role; plus(a, b) = a + b, declared a residual add.
registry.defop("test_op_properties_softsign", infer=_same, ref=lambda a: a / (1 + np.abs(a)),
               lowering=Elementwise("(({0}) / (1.0f + fabsf({0})))"), fusion="elementwise")
registry.defop("test_op_properties_plus", infer=_broadcast, ref=lambda a, b: a + b,
               lowering=Elementwise("(({0}) + ({1}))"), residual_add=True)


def test_every_registered_op_answers_every_property_with_a_valid_value():
    assert len(REGISTRY) > 100
    for name, op in REGISTRY.items():
        assert op.extra.keys() == PROPERTIES.keys(), name
        for key, value in op.extra.items():
            assert PROPERTIES[key].valid(value), (name, key, value)
        role = op.extra["fusion"]
        if role is not None:
            assert isinstance(op.lowering, FUSION_LOWERING[role]), name
        assert (op.extra["sbp"] == "rows") == (op.extra["row_dim"] is not None), name
        if op.extra["sbp"] == "reduction":
            assert isinstance(op.lowering, Reduction), name


def test_roles_follow_the_lowering_unless_declared():
    assert REGISTRY["relu"].extra["fusion"] == "elementwise" and REGISTRY["sum"].extra["fusion"] == "reduction"
    assert REGISTRY["reshape"].extra["fusion"] == "view"
    assert REGISTRY["depend"].extra["fusion"] is None        # a View that joins no kernel
    assert REGISTRY["matmul"].extra["fusion"] == "gemm" and REGISTRY["conv2d"].extra["fusion"] == "conv"
    assert REGISTRY["conv2d_grad_weight"].extra["fusion"] is None
    assert REGISTRY["softmax"].extra["row_dim"]({"dim": 2}) == 2 and REGISTRY["softmax"].extra["sbp"] == "rows"
    assert REGISTRY["cast"].extra["linear_in"]({"dtype": flow.float64}) == (0,)
    assert REGISTRY["cast"].extra["linear_in"]({"dtype": flow.int32}) == ()
    permute_strides = REGISTRY["permute"].extra["view"].strides
    assert permute_strides((2, 3, 4), (12, 4, 1), {"dims": (2, 0, 1)}, (4, 2, 3)) == (1, 12, 4)


def _define(name, **kwargs):
    kwargs.setdefault("lowering", Elementwise("({0})"))
    return registry.defop(name, infer=_same, ref=lambda a: a, **kwargs)


def test_a_misspelt_property_or_a_value_outside_its_set_raises_and_registers_nothing():
    with pytest.raises(ValueError, match="unknown property fuson"):
        _define("test_op_properties_typo", fuson="elementwise")
    with pytest.raises(ValueError, match="autocast='fp16' is not a value of autocast"):
        _define("test_op_properties_typo", autocast="fp16")
    with pytest.raises(ValueError, match="random=1 is not a value of random"):
        _define("test_op_properties_typo", random=1)
    with pytest.raises(ValueError, match="view=True is not a value of view"):   # a view declares its strides
        _define("test_op_properties_typo", view=True)
    with pytest.raises(ValueError, match="linear_in"):
        _define("test_op_properties_typo", linear_in=[0])
    with pytest.raises(ValueError, match="fusion='gemm' does not go with its lowering"):
        _define("test_op_properties_typo", fusion="gemm")
    with pytest.raises(ValueError, match="fusion=None does not go with its lowering"):
        _define("test_op_properties_typo", fusion=None)
    with pytest.raises(ValueError, match="fusion='view' does not go with its lowering"):
        _define("test_op_properties_typo", lowering=Template("copy"), fusion="view")
    with pytest.raises(ValueError, match="sbp='rows' and row_dim go together"):
        _define("test_op_properties_typo", lowering=Template("softmax"), sbp="rows")
    assert "test_op_properties_typo" not in REGISTRY
    assert _define("test_op_properties_view", lowering=View(), fusion=None).extra["fusion"] is None


def _fused_bodies(graph):
    return [[n.op for n in node.attrs["body"]] for node in graph.compiled.ir.nodes if node.op == "fused"]


def test_an_op_declared_elementwise_joins_the_gemm_epilogue_and_the_chain_after_it():
    x, w = flow.randn(6, 5), flow.randn(5, 7)

    def step(x, w):
        return registry.apply("test_op_properties_softsign", (x @ w) * 2.0) - 1.0

    graph = flow.nn.Graph.trace(step)
    got = graph(x, w).numpy()
    np.testing.assert_allclose(got, step(x, w).numpy(), rtol=1e-6, atol=1e-6)
    assert _fused_bodies(graph) == [["matmul", "mul", "test_op_properties_softsign", "sub"]]
    assert graph.compiled.num_launches == 1


@pytest.mark.parametrize("add_to_output", [True, False])
def test_an_op_declared_a_residual_add_follows_allow_fuse_add_to_output(add_to_output):
    x, w, r = flow.randn(4, 3), flow.randn(3, 8), flow.randn(4, 8)

    class Residual(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.config.allow_fuse_add_to_output(add_to_output)

        def build(self, x, w, r):
            return registry.apply("test_op_properties_plus", x @ w, r)

    graph = Residual()
    got = graph(x, w, r).numpy()
    np.testing.assert_allclose(got, (x @ w + r).numpy(), rtol=1e-6, atol=1e-6)
    if add_to_output:
        assert _fused_bodies(graph) == [["matmul", "test_op_properties_plus"]]
    else:
        assert _fused_bodies(graph) == [["matmul"], ["test_op_properties_plus"]]
