"""Model files of other frameworks as saved flowgen graphs, for `flowgen build` / `flowgen inspect`.

`save_model_file("model.pt2", dir)` reads a program written by `torch.export.save`, imports it with
`flow.from_torch` (in the mode it was exported in), runs it once as an inference `nn.Graph` on its
example inputs (which torch.export.save stores; the program is compiled for their shapes) and
writes the graph with `flow.save(graph, dir)`: the directory `flowgen build` turns into a program.
"""
from __future__ import annotations

from pathlib import Path

from flowgen import nn
from flowgen.serialization import save

MODEL_FILE_SUFFIXES = (".pt2",)


class ImportedInference(nn.Graph):
    """An imported model's forward as an inference graph."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, *inputs):
        return self.model(*inputs)


def _pt2_graph(path: Path) -> ImportedInference:
    # Imported here, not at the top: torch (optional, slow to load; torch_export imports it) is for .pt2 only.
    import torch
    from flowgen.frontends import torch_export

    program = torch.export.load(str(path))
    if program.example_inputs is None:
        raise ValueError(f"{path}: the exported program has no example inputs, which give flowgen the input "
                         f"shapes; export with torch.export.export(model, args) and save that program")
    args, kwargs = program.example_inputs
    if kwargs:
        raise ValueError(f"{path}: the program takes keyword inputs {sorted(kwargs)}; flowgen builds programs "
                         f"whose inputs are positional tensors")
    graph = ImportedInference(torch_export.from_torch(program, args))
    graph(*[torch_export.tensor_from_torch(a) for a in args])
    return graph


def save_model_file(path, directory) -> None:
    """Import the model file `path` (.pt2) and write it as a saved graph to `directory`."""
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"{path}: flowgen imports model files ending in {', '.join(MODEL_FILE_SUFFIXES)}")
    save(_pt2_graph(path), directory)
