"""Model files of other frameworks as saved flowgen graphs, for `flowgen build` / `flowgen inspect`.

`save_model_file(path, dir)` imports the model, runs it once as an inference `nn.Graph` (which
compiles it for those input shapes) and writes the graph with `flow.save(graph, dir)`: the
directory `flowgen build` turns into a program.

* `model.pt2`, written by `torch.export.save`: imported with `flow.from_torch` (in the mode it was
  exported in), run on the example inputs the file stores (needs torch);
* `model.onnx`: imported by onnx_import.py (needs the onnx package: the `onnx` extra), run on
  zeros of its inputs' static shapes.
"""
from __future__ import annotations

from pathlib import Path

from flowgen import nn
from flowgen.creation import zeros
from flowgen.serialization import save

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


def _onnx_graph(path: Path) -> ImportedInference:
    # Imported here, not at the top: onnx_import imports the onnx package (optional), for .onnx files only.
    from flowgen.frontends import onnx_import

    module, inputs = onnx_import.import_onnx(path)
    graph = ImportedInference(module)
    graph(*[zeros(*shape, dtype=dtype) for _, shape, dtype in inputs])
    return graph


_READERS = {".pt2": _pt2_graph, ".onnx": _onnx_graph}
MODEL_FILE_SUFFIXES = tuple(_READERS)


def save_model_file(path, directory) -> None:
    """Import the model file `path` (.pt2 or .onnx) and write it as a saved graph to `directory`."""
    path = Path(path)
    if path.suffix not in _READERS:
        raise ValueError(f"{path}: flowgen imports model files ending in {', '.join(MODEL_FILE_SUFFIXES)}")
    save(_READERS[path.suffix](path), directory)
