"""`flow.from_torch`: a PyTorch model as a flowgen Module, through `torch.export`.

    model = flow.from_torch(torch_model, (torch.randn(8, 3, 32, 32),))
    y = model(flow.randn(8, 3, 32, 32))          # eager, or inside an nn.Graph (inference or training)

The model is exported with `torch.export.export` in the mode it is in and decomposed to the core
ATen opset, except the composite ops flowgen runs as ops of its own (`aten_table.KEEP_COMPOSITE`).
Every ATen op of the graph must be in `aten_table.ATEN_OPS`: the ones that are not are refused
together in one `UnsupportedTorchOpsError`, each with the user's source line. Parameters and
buffers become flowgen parameters and buffers sharing memory with the PyTorch tensors (DLPack),
under the same `state_dict()` names; the buffers the graph mutates (BatchNorm's running
statistics) are written back after each run, as PyTorch does in place. Dropout draws from
flowgen's random stream (`flow.manual_seed`), not torch's: the masks differ from PyTorch's.

This module imports torch; `import flowgen` never imports it (flowgen/frontends/__init__.py loads
this module when `from_torch` is first called).
"""
from __future__ import annotations

import operator

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from flowgen import dtype as dt
from flowgen.creation import from_numpy
from flowgen.frontends.aten_table import ATEN_OPS, KEEP_COMPOSITE
from flowgen.frontends.imported_graph import RUN_DEVICE, Call, ImportedGraph, ImportedModule, ImportedProgram, Ref
from flowgen.nn.parameter import Parameter


class UnsupportedTorchOpsError(NotImplementedError):
    """ATen ops of an imported PyTorch graph that flowgen has no mapping for (aten_table.ATEN_OPS)."""


# ATen ops whose result depends on the training mode: the position of the argument that says which
# mode, or the mode itself where the op belongs to one.
_MODE_OPS = {
    "aten._native_batch_norm_legit_functional.default": 5,
    "aten._native_batch_norm_legit.no_stats": 3,
    "aten._native_batch_norm_legit_no_training.default": False,
    "aten.dropout.default": 2,
    "aten.native_dropout.default": 2,
}


def torch_to_flowgen_dtype(torch_dtype) -> dt.DType:
    name = str(torch_dtype).removeprefix("torch.")
    try:
        return dt.get(name)
    except (KeyError, ValueError, TypeError) as e:
        raise UnsupportedTorchOpsError(f"from_torch: flowgen has no dtype for {torch_dtype}") from e


def tensor_from_torch(t: "torch.Tensor"):
    """A flowgen tensor sharing `t`'s memory (DLPack) where NumPy can hold its dtype; bfloat16 is
    shared through its bits (ml_dtypes' bfloat16 has the same layout). A tensor on another device
    than the CPU is copied to the host (flowgen's eager tensors live there)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return from_numpy(t.view(torch.int16).numpy().view(dt.bfloat16.np_dtype))
    return from_numpy(np.from_dlpack(t))


def _source_line(node) -> str:
    """The user's line that made `node`: the last frame outside torch of its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines()]
    pairs = [(frames[i], frames[i + 1] if i + 1 < len(frames) else "") for i, f in enumerate(frames)
             if f.startswith("File ")]
    user = [(where, code) for where, code in pairs if "/torch/" not in where]
    if not user:
        return ""
    where, code = user[-1]
    return f"{where}: {code}" if code and not code.startswith("File ") else where


def _op_name(node) -> str:
    return "<built-in function getitem>" if node.target is operator.getitem else str(node.target)


def _convert_arg(arg, node):
    if isinstance(arg, torch.fx.Node):
        return Ref(arg.name)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_convert_arg(a, node) for a in arg)
    if isinstance(arg, dict):
        return {k: _convert_arg(v, node) for k, v in arg.items()}
    if isinstance(arg, torch.dtype):
        return torch_to_flowgen_dtype(arg)
    if isinstance(arg, torch.device):
        return RUN_DEVICE
    if isinstance(arg, torch.memory_format):
        return None          # flowgen tensors are row-major; a layout changes no number
    if isinstance(arg, torch.layout):
        if arg != torch.strided:
            raise UnsupportedTorchOpsError(f"from_torch: {_op_name(node)} asks for layout {arg}; flowgen has "
                                           f"dense (strided) tensors only")
        return None
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise UnsupportedTorchOpsError(f"from_torch: {_op_name(node)} ({node.name}) has an argument of type "
                                   f"{type(arg).__name__} ({arg!r}) that flowgen cannot take")


def import_fx_graph(graph: "torch.fx.Graph", what: str) -> ImportedGraph:
    """The FX graph of ATen ops as an ImportedGraph; every op missing from ATEN_OPS is refused at
    once, in one UnsupportedTorchOpsError naming each with its source line."""
    inputs, calls, outputs, missing = [], [], [], {}
    for node in graph.nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
        elif node.op == "call_function":
            name = _op_name(node)
            if name not in ATEN_OPS:
                missing.setdefault(name, []).append(_source_line(node) or f"(node {node.name}, no stack trace)")
                continue
            calls.append(Call(node.name, name, _convert_arg(tuple(node.args), node),
                              _convert_arg(dict(node.kwargs), node), _source_line(node)))
        elif node.op == "output":
            result = node.args[0]
            outputs = list(_convert_arg(result if isinstance(result, (list, tuple)) else (result,), node))
        else:
            raise UnsupportedTorchOpsError(f"from_torch: {what} has a {node.op} node ({node.name}, "
                                           f"{node.target}); flowgen imports graphs of ATen calls only")
    if missing:
        lines = [f"  {op}  ({len(where)} use{'s' if len(where) > 1 else ''})\n" +
                 "\n".join(f"      at {w}" for w in dict.fromkeys(where)) for op, where in missing.items()]
        raise UnsupportedTorchOpsError(f"flowgen: {len(missing)} ATen op(s) of {what} have no flowgen mapping "
                                       f"(flowgen/frontends/aten_table.py):\n" + "\n".join(lines))
    return ImportedGraph(inputs, calls, outputs)


def _graph_mode(graph: ImportedGraph) -> bool | None:
    """The training mode the graph computes (None: no op depends on it); both at once is an error."""
    modes = set()
    for call in graph.calls:
        if call.op in _MODE_OPS:
            where = _MODE_OPS[call.op]
            modes.add(where if isinstance(where, bool) else bool(call.args[where]))
    if len(modes) > 1:
        raise UnsupportedTorchOpsError("from_torch: the exported graph mixes training- and evaluation-mode ops "
                                       "(BatchNorm/dropout); flowgen runs a module in one mode at a time")
    return modes.pop() if modes else None


def _decomposed(ep):
    table = torch.export.default_decompositions()
    for name in KEEP_COMPOSITE:
        namespace, op, overload = name.split(".")
        table.pop(getattr(getattr(getattr(torch.ops, namespace), op), overload), None)
    return ep.run_decompositions(table)


def _flat_arguments(args: tuple, kwargs: dict) -> list:
    """The user arguments in torch.export's flattened order: positions, then keyword names."""
    arguments = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"from_torch: example argument {i} is a {type(a).__name__}; flowgen imports models "
                            f"called with tensors (a tuple of torch.Tensor, and keyword tensors)")
        arguments.append(i)
    leaves, _ = pytree.tree_flatten_with_path(({}, kwargs))
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or len(path) != 2:
            raise TypeError(f"from_torch: example keyword argument {pytree.keystr(path)} is not a tensor; flowgen "
                            f"imports models called with tensors")
        arguments.append(path[1].key)
    return arguments


def import_program(ep, args: tuple, kwargs: dict, training: bool | None) -> tuple:
    """(ImportedProgram, the decomposed ExportedProgram) for an ExportedProgram called with example
    arguments `args`/`kwargs`; `training`: the mode it was exported in, None if not known."""
    ep = _decomposed(ep)
    graph = import_fx_graph(ep.graph, "the exported program")
    signature = ep.graph_signature
    arguments = _flat_arguments(args, kwargs)
    input_kinds, user = [], 0
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            input_kinds.append(("user", user))
            user += 1
        elif spec.kind == InputKind.PARAMETER:
            input_kinds.append(("param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            input_kinds.append(("buffer", spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            input_kinds.append(("constant", spec.target))
        else:
            raise UnsupportedTorchOpsError(f"from_torch: the exported program has a {spec.kind.name} input "
                                           f"({spec.arg.name}); flowgen imports tensors only")
    if user != len(arguments):
        raise TypeError(f"from_torch: the exported program takes {user} user input(s), the example arguments are "
                        f"{len(arguments)} tensor(s)")
    placeholders = {node.name: node for node in ep.graph.nodes if node.op == "placeholder"}
    input_signature = []
    for spec, argument in zip([s for s in signature.input_specs if s.kind == InputKind.USER_INPUT], arguments):
        exported = placeholders[spec.arg.name].meta["val"]
        example = args[argument] if isinstance(argument, int) else kwargs[argument]
        if tuple(example.shape) != tuple(exported.shape) or example.dtype != exported.dtype:
            raise TypeError(f"from_torch: example argument {argument!r} is {example.dtype}{list(example.shape)}, "
                            f"the exported program takes {exported.dtype}{list(exported.shape)}")
        input_signature.append((tuple(exported.shape), torch_to_flowgen_dtype(exported.dtype)))
    output_kinds, user_outputs = [], 0
    for spec in signature.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            output_kinds.append(("user", None))
            user_outputs += 1
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            output_kinds.append(("buffer", spec.target))
        else:
            raise UnsupportedTorchOpsError(f"from_torch: the exported program has a {spec.kind.name} output "
                                           f"({spec.arg.name}); flowgen imports programs that return tensors "
                                           f"and update buffers")
    structure = pytree.tree_unflatten(list(range(user_outputs)), ep.call_spec.out_spec)
    graph_mode = _graph_mode(graph)
    if training is not None and graph_mode is not None and graph_mode != training:
        raise UnsupportedTorchOpsError(f"from_torch: the model was exported in {'training' if training else 'eval'} "
                                       f"mode, but its graph computes the other mode")
    constants = {name: tensor_from_torch(t) for name, t in ep.constants.items() if isinstance(t, torch.Tensor)}
    # a model exported from a torch.nn.Module has the mode it was exported in, whatever its ops (eval
    # mode drops dropout from the graph); an ExportedProgram has the mode its ops show, if any
    program = ImportedProgram(graph, input_kinds, output_kinds, arguments, input_signature, structure,
                              graph_mode if training is None else training, constants)
    return program, ep


def from_torch(model, example_args, example_kwargs=None, dynamic_shapes=None) -> ImportedModule:
    """A flowgen Module running `model` (a torch.nn.Module or a torch.export.ExportedProgram).

    `example_args` / `example_kwargs` are tensors of the shapes the module will be called with
    (torch tensors; an ExportedProgram was exported with its own, these must match them).
    The module exports in the mode `model` is in; see ImportedModule for `.train()`/`.eval()`.
    """
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(f"from_torch: example_args must be a tuple of tensors (as torch.export takes), got a "
                        f"{type(example_args).__name__}; write (x,) for one input")
    kwargs = dict(example_kwargs or {})
    args = tuple(example_args)
    if isinstance(model, torch.export.ExportedProgram):
        if dynamic_shapes is not None:
            raise TypeError("from_torch: dynamic_shapes applies when flowgen exports a torch.nn.Module; an "
                            "ExportedProgram was exported with its own")
        program, ep = import_program(model, args, kwargs, None)
        state = dict(ep.state_dict)
        names = [spec.target for spec in ep.graph_signature.input_specs
                 if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
        persistent = {spec.target: spec.persistent is not False for spec in ep.graph_signature.input_specs
                      if spec.kind == InputKind.BUFFER}
        parameters = {n: state[n] for n in names if n not in persistent}
        buffers = {n: (ep.constants[n] if n not in state else state[n], persistent[n]) for n in persistent}
        return _module(program, parameters, buffers, None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module or a torch.export.ExportedProgram, got "
                        f"{type(model).__name__}")
    if dynamic_shapes is not None:
        raise NotImplementedError("from_torch: dynamic_shapes is not supported yet: flowgen's IR has static "
                                  "shapes (a graph compiles per input signature). Import with the example "
                                  "shapes; call from_torch again for other shapes")

    def export(training: bool) -> ImportedProgram:
        was_training = model.training
        model.train(training)
        try:
            return import_program(torch.export.export(model, args, kwargs), args, kwargs, training)[0]
        finally:
            model.train(was_training)

    persistent_buffers = set(model.state_dict(keep_vars=True))
    parameters = dict(model.named_parameters(remove_duplicate=False))
    buffers = {name: (b, name in persistent_buffers) for name, b in model.named_buffers(remove_duplicate=False)}
    return _module(export(model.training), parameters, buffers, export)


def _module(program, parameters: dict, buffers: dict, reexport) -> ImportedModule:
    """The ImportedModule holding flowgen tensors that share memory with the torch ones (a torch
    tensor known under several names, as tied weights, is one flowgen tensor under those names)."""
    shared = {}

    def convert(t, make):
        if id(t) not in shared:
            shared[id(t)] = make(tensor_from_torch(t))
        return shared[id(t)]

    flow_parameters = {n: convert(p, lambda t, p=p: Parameter(t, requires_grad=p.requires_grad))
                       for n, p in parameters.items()}
    flow_buffers = {n: (convert(b, lambda t: t), persistent) for n, (b, persistent) in buffers.items()}
    return ImportedModule(program, flow_parameters, flow_buffers, reexport)
