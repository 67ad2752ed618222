"""A PyTorch graph imported into flowgen, as plain Python data, and the Module that runs it.

The importers (`torch_export.py`, `dynamo_backend.py`) turn an FX graph of ATen ops into an
`ImportedGraph`: its inputs, a list of `Call`s (an ATen overload by name, arguments that refer to
earlier values by `Ref`) and its outputs; `onnx_import.py` does the same for an ONNX graph.
Nothing here refers to torch or onnx: the graph runs through its op table (`aten_table.ATEN_OPS`
or `onnx_table.ONNX_OPS`) on flowgen tensors, eagerly or traced inside `nn.Graph` alike (an
interpreter over the calls, as torch.fx's).

`ImportedModule` is what `flow.from_torch` returns: the exported parameters and buffers under their
PyTorch `state_dict()` names, and the `ImportedProgram` (graph + signature) for the training mode
the module is in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flowgen import nn
from flowgen.autograd import no_grad
from flowgen.frontends.aten_table import ATEN_OPS
from flowgen.frontends.onnx_table import ONNX_OPS
from flowgen.tensor import Tensor


@dataclass(frozen=True)
class Ref:
    """An earlier value of the graph (an input or a call's result), by name."""
    name: str


class _RunDevice:
    """A `torch.device` argument (of arange, full, ...): the device the graph runs on."""

    def __repr__(self):
        return "RUN_DEVICE"


RUN_DEVICE = _RunDevice()
OP_TABLES = {"aten": ATEN_OPS, "onnx": ONNX_OPS}


@dataclass
class Call:
    name: str            # the FX node's name (ONNX: its output's)
    op: str              # a key of the graph's op table ("aten.linear.default", "Conv")
    args: tuple
    kwargs: dict
    source: str = ""     # the user's source line, from the export's stack trace (ONNX: the node's name)


@dataclass
class ImportedGraph:
    inputs: list         # names, in the order run() takes their values
    calls: list          # Calls in execution order
    outputs: list        # Refs (or constants, as FX allows)
    ops: str = "aten"    # the op table, a key of OP_TABLES

    def run(self, values: list, device) -> list:
        env = dict(zip(self.inputs, values))
        table = OP_TABLES[self.ops]

        def resolve(arg):
            if isinstance(arg, Ref):
                return env[arg.name]
            if arg is RUN_DEVICE:
                return device
            if isinstance(arg, (list, tuple)):
                return type(arg)(resolve(a) for a in arg)
            if isinstance(arg, dict):
                return {k: resolve(v) for k, v in arg.items()}
            return arg

        for call in self.calls:
            try:
                env[call.name] = table[call.op](*resolve(call.args), **resolve(call.kwargs))
            except Exception as e:
                if hasattr(e, "add_note"):   # Python 3.11+: the traceback names the imported op
                    e.add_note(f"while running {call.op} ({call.name}) of an imported graph, made at "
                               f"{call.source or 'an unknown place'}")
                raise
        return [resolve(out) for out in self.outputs]


@dataclass
class ImportedProgram:
    """An exported program's graph and how its inputs and outputs meet the module.

    `input_kinds[i]` says what feeds graph input i: ("param" | "buffer" | "constant", state name)
    or ("user", index into the flattened user arguments). `output_kinds[i]` says where graph output
    i goes: ("user", None) or ("buffer", name) for a buffer the program mutates (its new value).
    `arguments` lists the user arguments in flattened order: an int (a positional argument) or a
    str (a keyword), and `signature` their (shape, dtype) as exported (flowgen's shapes are
    static: a graph is imported for its example inputs' shapes). `output_structure` is the user
    outputs' nesting with leaf i as the int i. `training` is the mode the graph computes (True,
    False, or None where no op depends on it).
    """
    graph: ImportedGraph
    input_kinds: list
    output_kinds: list
    arguments: list
    signature: list
    output_structure: object
    training: bool | None
    constants: dict = field(default_factory=dict)   # lifted tensor constants, flowgen tensors

    def user_arguments(self, args: tuple, kwargs: dict) -> list:
        positional = sum(isinstance(a, int) for a in self.arguments)
        keywords = sorted(a for a in self.arguments if isinstance(a, str))
        if len(args) != positional or sorted(kwargs) != keywords:
            raise TypeError(f"from_torch module: called with {len(args)} positional argument(s) and keywords "
                            f"{sorted(kwargs)}; it was exported with {positional} and {keywords}")
        values = [args[a] if isinstance(a, int) else kwargs[a] for a in self.arguments]
        for a, v, (shape, dtype) in zip(self.arguments, values, self.signature):
            if not isinstance(v, Tensor):
                raise TypeError(f"from_torch module: argument {a!r} is a {type(v).__name__}; the module takes "
                                f"flowgen tensors where the export took tensors")
            if tuple(v.shape) != tuple(shape) or v.dtype != dtype:
                raise ValueError(f"from_torch module: argument {a!r} is {v.dtype.name}{list(v.shape)}; the graph "
                                 f"was exported for {dtype.name}{list(shape)} (static shapes: import the model "
                                 f"again with example inputs of the new shape)")
        return values

    def structure(self, outputs: list):
        def build(node):
            if node is None:
                return None
            if isinstance(node, int):
                return outputs[node]
            if isinstance(node, dict):
                return {k: build(v) for k, v in node.items()}
            return type(node)(build(v) for v in node)
        return build(self.output_structure)


def _owner(root: nn.Module, name: str):
    """The submodule that holds state `name` ("net.0.weight" -> root.net.0), made empty where missing."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    return module, leaf


class ImportedModule(nn.Module):
    """A PyTorch model imported by `flow.from_torch`: runs its exported ATen graph with flowgen ops.

    Parameters and buffers have the PyTorch `state_dict()` names. The graph of a torch.export
    program is specific to the training mode it was exported in (BatchNorm's batch or running
    statistics, dropout): the module runs the program made for the mode it is in. `.train()` and
    `.eval()` switch programs; a module imported from a `torch.nn.Module` exports the other mode
    the first time it runs in it (`reexport`), one imported from an `ExportedProgram` has only
    the exported mode and refuses to run in the other (unless no op of its graph depends on it).
    An ONNX model (onnx_import.py) is an evaluation-mode graph.
    """

    def __init__(self, program: ImportedProgram, parameters: dict, buffers: dict, reexport=None):
        super().__init__()
        for name, param in parameters.items():
            module, leaf = _owner(self, name)
            module.register_parameter(leaf, param)
        for name, (tensor, persistent) in buffers.items():
            module, leaf = _owner(self, name)
            module.register_buffer(leaf, tensor, persistent=persistent)
        self._programs = [program]
        self._reexport = reexport
        self.train(True if program.training is None else program.training)

    def _program_for_mode(self) -> ImportedProgram:
        """The program for the mode the module is in (exporting it first if need be)."""
        for program in self._programs:
            if program.training in (None, self.training):
                return program
        mode, exported = ("training", "evaluation") if self.training else ("evaluation", "training")
        if self._reexport is None:
            raise RuntimeError(f"from_torch: this module is in {mode} mode, but its graph was exported in "
                               f"{exported} mode (a torch.export.ExportedProgram, or an ONNX model: evaluation) "
                               f"and computes only that mode; call .{'eval' if self.training else 'train'}() on "
                               f"it, or import the torch.nn.Module itself (flow.from_torch(model, args)) so that "
                               f"flowgen can export the other mode")
        program = self._reexport(self.training)
        self._programs.append(program)
        return program

    def forward(self, *args, **kwargs):
        program = self._program_for_mode()
        user = program.user_arguments(args, kwargs)
        state = dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers(remove_duplicate=False))
        values = []
        for kind, key in program.input_kinds:
            values.append(user[key] if kind == "user" else program.constants[key] if kind == "constant" else state[key])
        device = user[0].device if user else next(iter(state.values())).device if state else None
        outputs = []
        for (kind, key), value in zip(program.output_kinds, program.graph.run(values, device)):
            if kind == "buffer":
                with no_grad():
                    state[key].copy_(value)
            else:
                outputs.append(value)
        return program.structure(outputs)
