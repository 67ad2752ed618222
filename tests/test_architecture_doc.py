"""ARCHITECTURE.md and docs/*.md as a newcomer reads them (issue 25, item 7): the page stays one
page, every module path they name in backticks exists, and every link between them lands on a
file and a heading that exist."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PAGES = [ARCHITECTURE, *sorted((ROOT / "docs").glob("*.md"))]
LINKING_PAGES = [*PAGES, ROOT / "README.md"]   # README's backticks also name a user's files (train.py)

# Where a short path is looked up: `passes/autodiff.py` means flowgen/passes/autodiff.py,
# `kernels/gemm.py` flowgen/codegen/kernels/gemm.py, `_mma.j2` templates/_mma.j2.
BASES = [ROOT, ROOT / "flowgen", ROOT / "flowgen" / "codegen", ROOT / "flowgen" / "runtime", ROOT / "templates",
         ROOT / "runtime_cpp", ROOT / "benchmarks"]
SOURCE_SUFFIXES = (".py", ".j2", ".h", ".ld", ".md", ".c", ".toml")
TOP_FOLDERS = {"flowgen", "templates", "runtime_cpp", "tests", "benchmarks", "cli", "docs", "examples"}


def _named_paths(text: str) -> set:
    """Backticked tokens that name a file or folder of the repository (placeholders such as
    `templates/<family>.cu.j2` and generated files such as `program.cu` are not checked)."""
    paths = set()
    diagrams = re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)   # a text diagram's paths count too
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    tokens = re.findall(r"`([^`\s]+)`", prose) + [t for d in diagrams for t in re.findall(r"[\w./<>*-]+", d)]
    for token in tokens:
        if "<" in token or "{" in token or "*" in token:
            continue
        token = token.rstrip(".,:;")
        if not token.strip("/"):
            continue
        first = token.split("/")[0]
        is_folder = token.endswith("/") and (first in TOP_FOLDERS or (ROOT / "flowgen" / first).is_dir())
        if token.endswith(SOURCE_SUFFIXES) or is_folder or (("/" in token) and first in TOP_FOLDERS):
            paths.add(token)
    return paths


def _exists(path: str) -> bool:
    """A bare file name (`registry.py` in the `flowgen/ops/` row of a table) may be anywhere in
    the repository's source folders; a longer path must resolve from one of `BASES`."""
    if "/" not in path:
        return any(any(True for _ in (ROOT / top).rglob(path)) for top in TOP_FOLDERS if (ROOT / top).is_dir())
    return any((base / path).exists() for base in BASES)


def test_architecture_is_one_page():
    assert len(ARCHITECTURE.read_bytes()) < 25_000, "ARCHITECTURE.md is the page read first: move details to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_path_exists(page):
    missing = sorted(p for p in _named_paths(page.read_text()) if not _exists(p))
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", LINKING_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_land_on_files_and_headings(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} has links to missing files or headings: {broken}"
