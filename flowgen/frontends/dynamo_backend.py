"""`torch.compile(model, backend="flowgen")`: Dynamo's graphs run by flowgen.

AOTAutograd (`torch._dynamo.backends.common.aot_autograd`) turns each graph Dynamo captures into
ATen-level graphs, decomposed to the core ATen opset; each is imported through the one ATen table
(aten_table.py, refused at once if an op is missing) and run by flowgen, tensors crossing by DLPack
(no copies on the CPU):

* inference (no gradient needed): one flowgen `nn.Graph` whose inputs are the graph's inputs,
  parameters included: compiled to C++/CUDA and run as a program (on the CPU emulator for CPU
  tensors), one compile per input signature;
* training: AOTAutograd's forward and backward graphs run with flowgen's eager ops (NumPy), not
  compiled: the backward graph's convolution/pooling backward ops are the gradients of flowgen's
  forward ops, which only eager autograd gives one op at a time. `loss.backward()` and a torch
  optimizer then work as with any backend; buffer mutations (BatchNorm's running statistics)
  are applied by AOTAutograd.

Registered under the name "flowgen" by the `torch_dynamo_backends` entry point (pyproject.toml),
and when flowgen is imported after torch (flowgen/frontends/__init__.py).
"""
from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
from torch._functorch.aot_autograd import make_boxed_func

from flowgen import nn
from flowgen.autograd import no_grad
from flowgen.frontends.imported_graph import ImportedGraph
from flowgen.frontends.torch_export import import_fx_graph, tensor_from_torch
from flowgen.tensor import Tensor


def _to_flowgen(value):
    return tensor_from_torch(value) if isinstance(value, torch.Tensor) else value


def _to_torch(value):
    return torch.from_dlpack(value) if isinstance(value, Tensor) else value


def _device(values):
    return next((v.device for v in values if isinstance(v, Tensor)), None)


class _ImportedGraphStep(nn.Graph):
    """An inference graph from torch.compile as a flowgen nn.Graph (every input a graph input)."""

    def __init__(self, graph: ImportedGraph):
        super().__init__()
        self.imported = graph

    def build(self, *inputs):
        return tuple(self.imported.run(list(inputs), _device(inputs)))


def _eager(gm, example_inputs, what: str):
    graph = import_fx_graph(gm.graph, what)

    def run(*args):
        inputs = [_to_flowgen(a) for a in args]
        with no_grad():
            outputs = graph.run(inputs, _device(inputs))
        return tuple(_to_torch(o) for o in outputs)
    return make_boxed_func(run)


def _compile_inference(gm, example_inputs):
    graph = import_fx_graph(gm.graph, "the inference graph from torch.compile")
    step = _ImportedGraphStep(graph)

    def run(*args):
        return tuple(_to_torch(o) for o in step(*[_to_flowgen(a) for a in args]))
    return make_boxed_func(run)


flowgen_backend = aot_autograd(
    fw_compiler=lambda gm, example_inputs: _eager(gm, example_inputs, "the forward graph from torch.compile"),
    bw_compiler=lambda gm, example_inputs: _eager(gm, example_inputs, "the backward graph from torch.compile"),
    inference_compiler=_compile_inference,
    decompositions=core_aten_decompositions,
)


def register() -> None:
    """Make `torch.compile(..., backend="flowgen")` find this backend (once)."""
    if "flowgen" not in _COMPILER_FNS:
        register_backend(flowgen_backend, name="flowgen")
