"""The seeds' GRAPH / CONFIG / MODULE / PARAMETER / BUFFER / INPUT / OUTPUT lines, for
`print(graph)` and `graph.debug(1)`.

A tensor prints as OneFlow's meta repr: `tensor(..., device='cuda:0', is_lazy='True',
size=(20, 3), dtype=...)`, without the device on the CPU, a suffix that would pass 80
columns going to the next line under `tensor(` (as OneFlow wraps it).
"""
from __future__ import annotations

from flowgen.nn.graph.io import leaf_names

LINE_WIDTH = 80
PREFIX = "tensor("


def meta_repr(t, lazy: bool, requires_grad: bool = False) -> str:
    suffixes = []
    if t.device.type != "cpu":
        suffixes.append(f"device='{t.device}'")
    if lazy:
        suffixes.append("is_lazy='True'")
    suffixes.append(f"size={tuple(t.shape)}")
    suffixes.append(f"dtype={t.dtype!r}")
    if requires_grad:
        suffixes.append("requires_grad=True")
    text = PREFIX + "..."
    line = len(text) + 2   # OneFlow's count (tensor_str._add_suffixes), kept so lines break where its do
    for suffix in suffixes:
        if line + len(suffix) + 2 > LINE_WIDTH:
            text += ",\n" + " " * len(PREFIX) + suffix
            line = len(PREFIX) + len(suffix)
        else:
            text += ", " + suffix
            line += len(suffix) + 2
    return text + ")"


def module_header(module) -> str:
    extra = module.extra_repr() if hasattr(module, "extra_repr") else ""
    return f"{type(module).__name__}({extra})"


def io_lines(kind: str, owner: str, args, kwargs: dict) -> list:
    """`(INPUT:_model-input_0:tensor(...))` for each leaf; a non-tensor leaf is flagged the way
    OneFlow flags it: `[WARNING](INPUT:_model-input_1:<class 'int'>)`."""
    lines = []
    for name, leaf in leaf_names(args, kwargs, f"_{owner}-{kind.lower()}"):
        if hasattr(leaf, "is_lazy"):
            lines.append(f"({kind}:{name}:{meta_repr(leaf, lazy=leaf.is_lazy)})")
        else:
            lines.append(f"[WARNING]({kind}:{name}:{type(leaf)})")
    return lines


def state_lines(module, path: str) -> list:
    """PARAMETER and BUFFER lines of `module`'s own tensors (not its children's)."""
    lines = [f"(PARAMETER:{path}.{name}:{meta_repr(p, False, p.requires_grad)})"
             for name, p in module.named_parameters(recurse=False)]
    lines += [f"(BUFFER:{path}.{name}:{meta_repr(b, False)})"
              for name, b in module.named_buffers(recurse=False) if b is not None]
    return lines


def _indented(indent: str, line: str) -> str:
    return indent + line.replace("\n", "\n" + indent)


def _module_lines(module, path: str, io: dict | None, indent: str) -> list:
    calls = io.get(path, {}) if io is not None else {}
    inner = [_indented(indent + "  ", line) for line in calls.get("inputs", [])]
    inner += [_indented(indent + "  ", line) + ": ()" for line in state_lines(module, path)]
    for name, child in module.named_children():
        inner.extend(_module_lines(child, f"{path}.{name}", io, indent + "  "))
    inner += [_indented(indent + "  ", line) for line in calls.get("outputs", [])]
    head = f"{indent}(MODULE:{path}:{module_header(module)}): "
    if not inner:
        return [head + "()"]
    return [head + "("] + inner + [f"{indent})"]


def format_graph_repr(graph) -> str:
    io = graph._io
    calls = io.get("", {}) if io is not None else {}
    lines = [f"(GRAPH:{graph.name}:{type(graph).__name__}): ("]
    lines.append(f"  (CONFIG:config:{graph.config!r})")
    lines += [_indented("  ", line) for line in calls.get("inputs", [])]
    for name, module in graph._modules.items():
        lines.extend(_module_lines(module, name, io, "  "))
    lines += [_indented("  ", line) for line in calls.get("outputs", [])]
    lines.append(")")
    return "\n".join(lines)
