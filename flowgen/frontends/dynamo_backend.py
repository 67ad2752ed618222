"""`torch.compile(model, backend="flowgen")`: Dynamo's graphs compiled and run by flowgen.

AOTAutograd (`torch._dynamo.backends.common.aot_autograd`) turns each graph Dynamo captures into
ATen-level graphs decomposed to the core ATen opset (but for `KEEP_WHOLE`, ops flowgen runs as
one op of its own): one inference graph when no gradient is
needed, else a forward graph and a backward graph (AOTAutograd's own differentiation). Each is
imported through the one ATen table (aten_table.py; refused at once if an op is missing) and
becomes a flowgen `nn.Graph` whose inputs are the ATen graph's inputs, parameters included (so a
torch optimizer's updates reach the next call): compiled to C++/CUDA on its first call per input
signature, then run as a program on the CPU emulator. Tensors cross by DLPack, without copies; the
backend takes CPU tensors (others are refused). `loss.backward()` runs the backward graph, and a torch optimizer steps
the torch parameters as with any backend; buffer mutations (BatchNorm's running statistics) are
applied by AOTAutograd from the forward graph's outputs.

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
from flowgen.frontends.imported_graph import ImportedGraph
from flowgen.frontends.torch_export import import_fx_graph, tensor_from_torch
from flowgen.tensor import Tensor


def _to_flowgen(value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        raise NotImplementedError(f"torch.compile backend 'flowgen': a tensor on {value.device}; the backend takes "
                                  f"CPU tensors (they cross to flowgen by DLPack in host memory, and its graphs run "
                                  f"on the CPU emulator)")
    return tensor_from_torch(value)


def _to_torch(value):
    return torch.from_dlpack(value) if isinstance(value, Tensor) else value


def _device(values):
    return next((v.device for v in values if isinstance(v, Tensor)), None)


class TorchCompileGraph(nn.Graph):
    """One ATen graph from AOTAutograd as a flowgen nn.Graph (every input a graph input)."""

    def __init__(self, graph: ImportedGraph):
        super().__init__()
        self.imported = graph

    def build(self, *inputs):
        return tuple(self.imported.run(list(inputs), _device(inputs)))


def _compiler(what: str):
    def compile_graph(gm, example_inputs):
        step = TorchCompileGraph(import_fx_graph(gm.graph, f"the {what} graph from torch.compile"))

        def run(*args):
            return tuple(_to_torch(o) for o in step(*[_to_flowgen(a) for a in args]))
        return make_boxed_func(run)
    return compile_graph


# Core-ATen decompositions flowgen does without: ATen's CPU flash attention decomposes into
# matmul/softmax (the [L, S] scores in memory); kept, it is flowgen's one attention op, as its
# backward (never decomposed) is attention_backward.
KEEP_WHOLE = ("aten._scaled_dot_product_flash_attention_for_cpu.default",)


def _decompositions():
    table = core_aten_decompositions()
    for op in [op for op in table if str(op) in KEEP_WHOLE]:
        del table[op]
    return table


flowgen_backend = aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                               inference_compiler=_compiler("inference"), decompositions=_decompositions)


def register() -> None:
    """Make `torch.compile(..., backend="flowgen")` find this backend (once)."""
    if "flowgen" not in _COMPILER_FNS:
        register_backend(flowgen_backend, name="flowgen")
