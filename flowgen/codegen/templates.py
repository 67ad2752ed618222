"""Where the Jinja2 kernel templates live, and one shared Environment to load them.

An installed wheel ships them as ``flowgen/_data/templates``; a source checkout
keeps them in ``<repo>/templates``. Rendering is strict (an undefined variable
is an error) so a template never silently emits half a kernel. Compiled templates are cached
under ``<cache>/jinja`` (Jinja2's bytecode cache), so a new process does not compile them again.
"""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

from flowgen.runtime.toolchain import cache_dir


def templates_dir() -> Path:
    package = Path(__file__).resolve().parent.parent   # flowgen/
    installed = package / "_data" / "templates"
    if installed.is_dir():
        return installed
    return package.parent / "templates"


# Strict undefined variables (jinja2.StrictUndefined) and these layout options.
_OPTIONS = dict(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    # Imported here, not at the top: Jinja2 takes ~0.15 s to load; `import flowgen` renders nothing.
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             bytecode_cache=jinja2.FileSystemBytecodeCache(str(_bytecode_dir(jinja2.__version__))),
                             undefined=jinja2.StrictUndefined, **_OPTIONS)
    env.tests["reads"] = reads
    return env


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def reads(code: str, name: str) -> bool:
    """`{% if body is reads("r") %}`: does the C++ text `code` use the identifier `name` (outside
    comments: a comment's `C(m, n)` reads no `C`)? A template declares a variable only for the
    bodies that read it (no unused variables)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", _COMMENT.sub("", str(code))) is not None


def _bytecode_dir(jinja2_version: str) -> Path:
    """Where compiled templates are kept between processes: one directory per Jinja2 version
    and environment options (they shape the compiled code). Jinja2 itself checks each entry
    against its template's source (SHA-1) and the Python version, and writes it atomically."""
    options = f"{jinja2_version}\0StrictUndefined\0{sorted((k, repr(v)) for k, v in _OPTIONS.items())!r}"
    path = cache_dir() / "jinja" / hashlib.sha256(options.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def get_template(name: str) -> jinja2.Template:
    """`get_template("gemm.cu.j2")`; the ``.cu.j2`` suffix may be left out."""
    if not name.endswith(".j2"):
        name = f"{name}.cu.j2"
    return environment().get_template(name)
