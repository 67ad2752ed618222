"""Importers of models written for other frameworks: `flow.from_torch` (PyTorch, via torch.export).

torch is optional and heavy to load (about a second): `import flowgen` never imports it. The
importers that need it are loaded when first called.
"""
from __future__ import annotations


def from_torch(model, example_args, example_kwargs=None, dynamic_shapes=None):
    """A flowgen Module running a PyTorch model (a torch.nn.Module or a torch.export.ExportedProgram)
    with flowgen ops: eagerly, and inside nn.Graph for inference and training.
    flowgen/frontends/torch_export.py says how."""
    # Imported here, not at the top: torch_export imports torch, which `import flowgen` must not load.
    from flowgen.frontends import torch_export

    return torch_export.from_torch(model, example_args, example_kwargs, dynamic_shapes)
