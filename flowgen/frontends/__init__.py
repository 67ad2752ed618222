"""Importers of models written for other frameworks: `flow.from_torch` (PyTorch, via torch.export)
and the `torch.compile(model, backend="flowgen")` backend.

torch is optional and heavy to load: `import flowgen` never imports it. The importers that need it
are loaded when first called. `torch.compile(..., backend="flowgen")` finds the backend through the
`torch_dynamo_backends` entry point of an installed flowgen (torch loads it on first lookup); when
flowgen is imported after torch._dynamo it also registers itself at once (that costs nothing more),
and a source checkout that is not installed calls `register_torch_compile_backend()`. Importing
torch._dynamo ourselves would add seconds to `import flowgen` for every torch user.
"""
from __future__ import annotations

import sys


def from_torch(model, example_args, example_kwargs=None, dynamic_shapes=None):
    """A flowgen Module running a PyTorch model (a torch.nn.Module or a torch.export.ExportedProgram)
    with flowgen ops: eagerly, and inside nn.Graph for inference and training.
    flowgen/frontends/torch_export.py says how."""
    # Imported here, not at the top: torch_export imports torch, which `import flowgen` must not load.
    from flowgen.frontends import torch_export

    return torch_export.from_torch(model, example_args, example_kwargs, dynamic_shapes)


def register_torch_compile_backend() -> None:
    """Register `torch.compile(..., backend="flowgen")` (flowgen/frontends/dynamo_backend.py)."""
    # Imported here, not at the top: dynamo_backend imports torch._dynamo, which flowgen never loads unasked.
    from flowgen.frontends import dynamo_backend

    dynamo_backend.register()


if "torch._dynamo" in sys.modules:
    register_torch_compile_backend()
