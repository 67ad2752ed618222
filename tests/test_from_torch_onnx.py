"""ONNX models in flowgen: onnx_import runs the standard operators with the numbers of onnx's own
reference evaluator and of the PyTorch models exported to ONNX; `flowgen inspect / build MODEL.onnx`."""
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

import flowgen as flow

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from flowgen.frontends.onnx_import import import_onnx  # noqa: E402

try:
    from flowgen_cli.main import cli
except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
    from cli.main import cli


def _hand_built(path):
    """Conv -> BatchNormalization -> Relu -> MaxPool -> GlobalAveragePool -> Flatten -> Gemm ->
    LayerNormalization -> Softmax, and a shape chain (Shape/Gather/Concat/Reshape) on the way."""
    rng = np.random.default_rng(0)

    def init(name, shape, kind="f"):
        a = rng.standard_normal(shape).astype(np.float32) if kind == "f" else np.asarray(shape, np.int64)
        return numpy_helper.from_array(a, name)

    var = numpy_helper.from_array(rng.uniform(0.5, 2.0, 4).astype(np.float32), "var")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"], epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Shape", ["g"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["g", "flat_shape"], ["f"]),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], transB=1, alpha=0.5),
        helper.make_node("LayerNormalization", ["y", "ln_w", "ln_b"], ["l"], axis=-1, epsilon=1e-5),
        helper.make_node("Softmax", ["l"], ["out"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "hand_built", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 5])],
        [init("w", (4, 3, 3, 3)), init("b", (4,)), init("gamma", (4,)), init("beta", (4,)), init("mean", (4,)),
         var, numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus_one"), init("fc_w", (5, 4)), init("fc_b", (5,)),
         init("ln_w", (5,)), init("ln_b", (5,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return model


def test_standard_operators_match_onnx_reference_evaluator(tmp_path):
    model = _hand_built(tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    module, inputs = import_onnx(tmp_path / "m.onnx")
    assert inputs == [("x", (2, 3, 6, 6), flow.float32)]
    assert not module.training
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(module(flow.tensor(x)).numpy(), expected, atol=1e-6, rtol=1e-5)


def test_unsupported_operators_and_symbolic_shapes_are_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["d"]), helper.make_node("Einsum", ["x", "x"], ["e"], equation="ij,jk->ik"),
         helper.make_node("Det", ["e"], ["out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "u.onnx"))
    with pytest.raises(NotImplementedError, match=r"2 ONNX operator\(s\)") as info:
        import_onnx(tmp_path / "u.onnx")
    assert "Det  (nodes d, out)" in str(info.value) and "Einsum  (nodes e)" in str(info.value)

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["out"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "s.onnx"))
    with pytest.raises(NotImplementedError, match="dimension 0 is symbolic"):
        import_onnx(tmp_path / "s.onnx")


def _torch_export(model, x, path):
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the TorchScript-based exporter's deprecation notice
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17)


def test_torch_models_exported_to_onnx_match_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from from_torch_models import SmallCNN, TinyGPT

    torch.manual_seed(0)
    for make, x in ((SmallCNN, torch.randn(2, 3, 8, 8)), (TinyGPT, torch.randint(0, 32, (2, 8)))):
        model = make().eval()
        _torch_export(model, x, tmp_path / "m.onnx")
        module, _ = import_onnx(tmp_path / "m.onnx")
        np.testing.assert_allclose(module(flow.from_dlpack(x)).numpy(), model(x).detach().numpy(), atol=1e-5,
                                   rtol=1e-5, err_msg=make.__name__)


def test_inspect_an_onnx_model(tmp_path):
    _hand_built(tmp_path / "m.onnx")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "m.onnx")])
    assert result.exit_code == 0, result.output
    assert "input_0: float32[2, 3, 6, 6]" in result.output and "output_0: float32[2, 5]" in result.output


@pytest.mark.slow
def test_build_and_run_an_onnx_model(tmp_path):
    model = _hand_built(tmp_path / "m.onnx")
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)
    result = CliRunner().invoke(cli, ["build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out"),
                                      "--target", "cpu"])
    assert result.exit_code == 0, result.output
    np.save(tmp_path / "x.npy", x)
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "out"), str(tmp_path / "x.npy"), "-o",
                                      str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp_path / "res" / "output_0.npy"),
                               ReferenceEvaluator(model).run(None, {"x": x})[0], atol=1e-5, rtol=1e-5)
