"""Imports follow the layering (ARCHITECTURE.md, "The op contract"): a lower module never imports a
higher one inside a function to dodge a cycle; the higher layer installs what the lower one needs.
A function-local import stays only where the module is costly to load and rarely needed, and says so.
`import flowgen` loads neither cuda-python's bindings nor Jinja2 (they wait for a GPU or a render)."""
import ast
import subprocess
import sys
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
