"""Where the Jinja2 kernel templates live, and one shared Environment to load them.

An installed wheel ships them as ``flowgen/_data/templates``; a source checkout
keeps them in ``<repo>/templates``. Rendering is strict (an undefined variable
is an error) so a template never silently emits half a kernel.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

import flowgen


def templates_dir() -> Path:
    installed = Path(flowgen.__file__).parent / "_data" / "templates"
    if installed.is_dir():
        return installed
    return Path(flowgen.__file__).resolve().parent.parent / "templates"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def get_template(name: str) -> jinja2.Template:
    """`get_template("gemm.cu.j2")`; the ``.cu.j2`` suffix may be left out."""
    if not name.endswith(".j2"):
        name = f"{name}.cu.j2"
    return environment().get_template(name)
