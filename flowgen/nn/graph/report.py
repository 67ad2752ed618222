"""`print(graph)` in the seeds' format: GRAPH / CONFIG / MODULE / PARAMETER / BUFFER / INPUT / OUTPUT."""
from __future__ import annotations


def meta_repr(t, lazy: bool, requires_grad: bool = False) -> str:
    parts = ["..."]
    parts.append(f"device='{t.device}'")
    if lazy:
        parts.append("is_lazy='True'")
    parts.append(f"size={tuple(t.shape)}")
    parts.append(f"dtype={t.dtype!r}")
    if requires_grad:
        parts.append("requires_grad=True")
    return f"tensor({', '.join(parts)})"


def _module_header(module) -> str:
    extra = module.extra_repr() if hasattr(module, "extra_repr") else ""
    return f"{type(module).__name__}({extra})"


def _module_lines(module, path: str, io: dict | None, indent: str) -> list:
    inner = []
    if io is not None:
        for k, meta in enumerate(io.get(path, {}).get("inputs", [])):
            inner.append(f"{indent}  (INPUT:_{path}-input_{k}:{meta})")
    for name, child in module.named_children():
        inner.extend(_module_lines(child, f"{path}.{name}", io, indent + "  "))
    for name, p in module.named_parameters(recurse=False) if _accepts_recurse(module) else []:
        inner.append(f"{indent}  (PARAMETER:{path}.{name}:{meta_repr(p, False, p.requires_grad)}): ()")
    for name, b in module.named_buffers(recurse=False) if _accepts_recurse(module) else []:
        if b is not None:
            inner.append(f"{indent}  (BUFFER:{path}.{name}:{meta_repr(b, False)}): ()")
    if io is not None:
        for k, meta in enumerate(io.get(path, {}).get("outputs", [])):
            inner.append(f"{indent}  (OUTPUT:_{path}-output_{k}:{meta})")
    head = f"{indent}(MODULE:{path}:{_module_header(module)}): "
    if not inner:
        return [head + "()"]
    return [head + "("] + inner + [f"{indent})"]


def _accepts_recurse(module) -> bool:
    return hasattr(module, "named_parameters")


def format_graph_repr(graph) -> str:
    io = graph._io
    lines = [f"(GRAPH:{graph.name}:{type(graph).__name__}): ("]
    lines.append(f"  (CONFIG:config:{graph.config!r})")
    if io is not None:
        for k, meta in enumerate(io.get("", {}).get("inputs", [])):
            lines.append(f"  (INPUT:_{graph.name}-input_{k}:{meta})")
    for name, module in graph._modules.items():
        lines.extend(_module_lines(module, name, io, "  "))
    if io is not None:
        for k, meta in enumerate(io.get("", {}).get("outputs", [])):
            lines.append(f"  (OUTPUT:_{graph.name}-output_{k}:{meta})")
    lines.append(")")
    return "\n".join(lines)
