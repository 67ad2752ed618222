"""torch.compile(model, backend="flowgen"): AOTAutograd's ATen graphs (inference, or forward and
backward) compiled as flowgen nn.Graphs give PyTorch's outputs, gradients and optimizer steps."""
import copy
import importlib

import pytest

import flowgen as flow

torch = pytest.importorskip("torch")
from from_torch_models import MLP, SmallCNN, TinyGPT, Upsampler  # noqa: E402

flow.frontends.register_torch_compile_backend()   # flowgen was imported before torch here
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


@pytest.mark.parametrize("make, example", [
    (MLP, lambda: torch.randn(4, 8)), (SmallCNN, lambda: torch.randn(4, 3, 8, 8)),
    # a transposed convolution's backward; nearest and bilinear upsampling, which AOTAutograd
    # decomposes to indexing, whose backward is an index_put accumulating over two index tensors
    (Upsampler, lambda: torch.randn(2, 3, 5, 6)),
    # SDPA's backward and the embeddings' index_put: two more graphs to compile
    pytest.param(TinyGPT, lambda: torch.randint(0, 32, (2, 8)), marks=pytest.mark.slow)],
    ids=["mlp", "cnn", "upsampler", "gpt"])
def test_training_steps_and_inference_match_torch_eager(make, example):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="flowgen")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        x = example()
        loss = compiled(x).square().mean()
        expected = reference(x).square().mean()
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)

    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-6)


def test_importing_flowgen_after_torch_registers_the_backend():
    """flowgen/frontends/__init__.py registers the backend when it runs with torch loaded (a fresh
    `import torch, flowgen` would show the same, in a process that takes seconds to start)."""
    from torch._dynamo.backends import registry

    del registry._COMPILER_FNS["flowgen"], registry._BACKENDS["flowgen"]
    assert "flowgen" not in registry.list_backends()
    importlib.reload(flow.frontends)
    assert "flowgen" in registry.list_backends()
