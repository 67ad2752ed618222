"""Imports follow the layering (ARCHITECTURE.md, "Invariants"; docs/op_contract.md): no import cycle
crosses layers (a layer is a folder under flowgen/, e.g. ir/, codegen/, nn/; flowgen's own modules
such as tensor.py are the tensor core; the package root flowgen/__init__.py is a layer of its own);
a lower module never imports a higher one inside a function to dodge a cycle; the higher layer
installs what the lower one needs. A function-local import stays only where the module is costly to
load and rarely needed, and says so. `import flowgen` loads neither cuda-python's bindings nor
Jinja2 (they wait for a GPU or a render)."""
import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import flowgen as flow

PACKAGE = Path(flow.__file__).resolve().parent
REASON = "Imported here, not at the top:"


def _function_local_imports():
    """(file, line number, source line, the line above its block of imports) of
    every flowgen import inside a function."""
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                modules = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                           [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any(m == "flowgen" or m.startswith("flowgen.") for m in modules):
                    above = node.lineno - 2   # the comment may head a block of imports
                    while lines[above].lstrip().startswith(("from ", "import ")):
                        above -= 1
                    yield (path.relative_to(PACKAGE).as_posix(), node.lineno,
                           lines[node.lineno - 1], lines[above])


def module_files(package: Path) -> dict:
    """{module name: its file} for every module under `package` (a folder holding an __init__.py)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(package: Path) -> dict:
    """{module: the modules of the package it imports} for every module under `package`, from its
    import statements, those inside functions included. `from a.b import c` imports module
    a.b.c where there is one, else a.b; a package's parent __init__ that Python runs first is
    not counted (it would put every subpackage in a cycle)."""
    root = package.name
    files = module_files(package)
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: from the module's package, `level` - 1 packages up
                    anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                               for alias in node.names)
        graph[module] = {m for m in targets if m in files and m != module and m.split(".")[0] == root}
    return graph


def layer(module: str, package: Path) -> str:
    """The layer of a module of `package`: its folder (ir, codegen, nn, ...), "core" for the
    package's own modules (tensor.py, autograd.py, ...), "root" for the package's __init__.py."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1] if (package / parts[1]).is_dir() else "core"


def strongly_connected(graph: dict) -> list:
    """Tarjan's strongly connected components of `graph` (iteratively: no recursion limit)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def shortest_path(graph: dict, start: str, end: str, within: set) -> list:
    """A shortest import path from `start` to `end` through modules of `within` (breadth first)."""
    parent, queue = {start: None}, deque([start])
    while queue:
        node = queue.popleft()
        if node == end:
            path = [node]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])
            return path[::-1]
        for child in sorted(graph[node] & within):
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no path from {start} to {end}")


def cycles_across_layers(package: Path) -> list:
    """One line per strongly connected component of the import graph whose modules lie in more
    than one layer: a shortest cycle through an import that crosses layers (its files, one arrow
    per import) and every module of the component."""
    graph, files = import_graph(package), module_files(package)
    report = []
    for component in strongly_connected(graph):
        layers = sorted({layer(m, package) for m in component})
        if len(layers) < 2:
            continue
        crossing = [(a, b) for a in sorted(component) for b in sorted(graph[a] & component)
                    if layer(a, package) != layer(b, package)]
        cycle = min(([a, *shortest_path(graph, b, a, component)] for a, b in crossing), key=len)
        shown = " -> ".join(files[m].relative_to(package.parent).as_posix() for m in cycle)
        report.append(f"layers {', '.join(layers)}: {shown} (all {len(component)} modules in the circle: "
                      f"{', '.join(sorted(component))})")
    return report


def test_no_import_cycle_crosses_layers():
    cycles = cycles_across_layers(PACKAGE)
    assert not cycles, "import cycles across layers (a lower layer must not import a higher one; let the " \
                       "higher one install what the lower one needs):\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_cycle_through_function_local_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    for folder in ("low", "high"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "base.py").write_text("def f():\n    from pkg.high import user\n")
    (package / "high" / "user.py").write_text("from ..low import base\n")
    (package / "high" / "other.py").write_text("from . import user\nimport pkg.low.base\n")
    assert import_graph(package)["pkg.high.other"] == {"pkg.high.user", "pkg.low.base"}
    (package / "helpers.py").write_text("from pkg.low import base\n")   # core -> low: no cycle
    cycles = cycles_across_layers(package)
    assert cycles == ["layers high, low: pkg/high/user.py -> pkg/low/base.py -> pkg/high/user.py (all 2 modules in "
                      "the circle: pkg.high.user, pkg.low.base)"]


def test_every_function_local_import_says_why_it_is_not_at_the_top():
    unexplained = [f"{name}:{number}: {line.strip()}"
                   for name, number, line, above in _function_local_imports()
                   if REASON not in above and REASON not in line]
    assert not unexplained, "function-local imports without a reason:\n" + "\n".join(unexplained)


def test_import_flowgen_leaves_cuda_bindings_and_jinja2_unloaded():
    probe = "import sys, flowgen; print(sorted(m for m in ('jinja2', 'cuda.bindings.driver', " \
            "'cuda.bindings.nvrtc', 'flowgen.codegen.kernels') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_registry_reaches_the_layers_above_through_what_they_install():
    from flowgen.ops import registry

    assert registry._eager.tensor_type is flow.Tensor
    placement = flow.placement("cpu", [0])
    g = flow.ones(3).to_global(placement=placement, sbp=flow.sbp.broadcast)
    assert (g * 2 + 1).to_local().numpy().tolist() == [3.0, 3.0, 3.0]   # a global op with Python scalars
