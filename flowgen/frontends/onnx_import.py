"""An ONNX model (read with the onnx package, an optional dependency) as a flowgen Module.

`import_onnx(path)` returns an `ImportedModule` for inference (its mode is evaluation: ONNX
inference graphs carry BatchNorm's running statistics and no dropout) and the graph's inputs as
(name, shape, dtype). Every node runs through `onnx_table.ONNX_OPS`; the operators missing there
(or outside the default ONNX domain) are refused together, each with its node names. Floating
initializers become parameters under their ONNX names, the others (shapes, indices) constants of
the graph. Input shapes must be static (flowgen compiles one program per shape): a symbolic dimension
("batch") is refused, naming the input.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from flowgen.creation import from_numpy
from flowgen.frontends.imported_graph import Call, ImportedGraph, ImportedModule, ImportedProgram, Ref
from flowgen.frontends.onnx_table import MULTI_OUTPUT, ONNX_OPS, onnx_dtype
from flowgen.nn.parameter import Parameter

_DEFAULT_DOMAINS = ("", "ai.onnx")


class UnsupportedOnnxOpsError(NotImplementedError):
    """ONNX operators of a model that flowgen has no mapping for (onnx_table.ONNX_OPS)."""


def _attribute(attr):
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    if isinstance(value, (onnx.GraphProto, onnx.SparseTensorProto)) or (
            isinstance(value, list) and value and not isinstance(value[0], (int, float))):
        raise UnsupportedOnnxOpsError(f"ONNX attribute {attr.name}: graphs, sparse tensors and lists of tensors "
                                      f"are not supported by flowgen")
    return value


def _input_spec(value_info) -> tuple:
    tensor_type = value_info.type.tensor_type
    shape = []
    for i, d in enumerate(tensor_type.shape.dim):
        if not d.HasField("dim_value"):
            raise UnsupportedOnnxOpsError(f"ONNX input {value_info.name!r}: dimension {i} is symbolic "
                                          f"({d.dim_param or '?'}); flowgen compiles static shapes: export the "
                                          f"model with fixed input shapes")
        shape.append(d.dim_value)
    return value_info.name, tuple(shape), onnx_dtype(tensor_type.elem_type, f"input {value_info.name}")


def import_onnx(path) -> tuple:
    """(ImportedModule, [(input name, shape, dtype), ...]) for the ONNX model file `path`."""
    model = onnx.load(str(path))
    graph = model.graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    inputs = [_input_spec(i) for i in graph.input if i.name not in initializers]
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    # Shapes and indices stay values of the graph (Constant calls), not state: inside nn.Graph a
    # tensor made in build() is a constant, so shape operands computed from them are known.
    calls = [Call(name, "Constant", (), {"value": np.array(a)}, name) for name, a in initializers.items()
             if a.dtype.kind != "f"]
    missing = {}
    for node in graph.node:
        where = node.name or node.output[0]
        if node.domain not in _DEFAULT_DOMAINS or node.op_type not in ONNX_OPS:
            missing.setdefault(f"{node.domain + '.' if node.domain else ''}{node.op_type}", []).append(where)
            continue
        args = tuple(Ref(name) if name else None for name in node.input)
        kwargs = {a.name: _attribute(a) for a in node.attribute}
        if node.op_type in MULTI_OUTPUT:
            whole = f"{node.output[0]}:outputs"
            calls.append(Call(whole, node.op_type, args, kwargs, where))
            calls += [Call(out, "getitem", (Ref(whole), i), {}, where) for i, out in enumerate(node.output) if out]
            continue
        extra = [out for out in node.output[1:] if out and out in used]
        if extra:
            missing.setdefault(f"{node.op_type} with its optional outputs", []).append(where)
            continue
        calls.append(Call(node.output[0], node.op_type, args, kwargs, where))
    if missing:
        lines = [f"  {op}  (nodes {', '.join(dict.fromkeys(where))})" for op, where in missing.items()]
        raise UnsupportedOnnxOpsError(f"{path}: {len(missing)} ONNX operator(s) have no flowgen mapping "
                                      f"(flowgen/frontends/onnx_table.py):\n" + "\n".join(lines))

    # copies: onnx gives read-only views of the protobuf bytes, flowgen state is written in place
    parameters = {name: Parameter(from_numpy(np.array(a))) for name, a in initializers.items()
                  if a.dtype.kind == "f"}
    input_kinds = [("user", i) for i in range(len(inputs))] + [("param", name) for name in parameters]
    imported = ImportedGraph([name for name, _, _ in inputs] + list(parameters), calls,
                             [Ref(o.name) for o in graph.output], ops="onnx")
    outputs = len(graph.output)
    program = ImportedProgram(imported, input_kinds, [("user", None)] * outputs, list(range(len(inputs))),
                              [(shape, dtype) for _, shape, dtype in inputs], 0 if outputs == 1 else tuple(range(outputs)), training=False)
    return ImportedModule(program, parameters, {}), inputs
