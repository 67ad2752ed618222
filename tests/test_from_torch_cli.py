"""`flowgen inspect` / `flowgen build` on a program saved with torch.export.save (MODEL.pt2)."""
import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
from from_torch_models import SmallCNN  # noqa: E402

try:
    from flowgen_cli.main import cli
except ImportError:   # a source checkout that was not `pip install -e .`-ed: cli/ is the package
    from cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


@pytest.fixture(scope="module")
def pt2(tmp_path_factory):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path_factory.mktemp("pt2") / "cnn.pt2"
    torch.export.save(torch.export.export(model, (x,)), str(path))
    return path, x, model(x).detach().numpy()


def test_inspect_summarises_the_program_it_would_build(pt2):
    path, _, _ = pt2
    result = CliRunner().invoke(cli, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "input_0: float32[2, 3, 8, 8]" in result.output and "output_0: float32[2, 5]" in result.output
    assert "6 param, 3 buffer" in result.output and "conv2d 3x3" in result.output


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    result = CliRunner().invoke(cli, ["build", str(path), "-o", str(tmp_path / "out"), "--target", "cpu"])
    assert result.exit_code != 0 and "neither a saved graph directory nor a model file" in result.output


@pytest.mark.slow
def test_build_and_run_give_torch_outputs(pt2, tmp_path):
    path, x, expected = pt2
    result = CliRunner().invoke(cli, ["build", str(path), "-o", str(tmp_path / "out"), "--target", "cpu"])
    assert result.exit_code == 0, result.output
    np.save(tmp_path / "x.npy", x.numpy())
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "out"), str(tmp_path / "x.npy"), "-o",
                                      str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp_path / "res" / "output_0.npy"), expected, atol=1e-5, rtol=1e-5)
