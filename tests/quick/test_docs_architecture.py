"""docs/architecture.md cannot drift from the package in silence.

- Every module of ``zero_strategy/`` is named on the page by its path in the package
  (``core/plan.py``, or ``zero_strategy/core/plan.py``). Packages count by their files: naming
  ``core/`` names none of them. An ``__init__.py`` holding only a docstring, imports and
  ``__all__`` is left out (it is its folder's table of contents); one that defines or runs
  anything is a module like the others.
- Every file or folder the page names exists: paths in the package (``core/plan.py``), in the
  repository (``tests/...``, ``bench/...``), and in the picture of the layers the bare names
  listed beside their folder (``plan.py`` on the line of ``core/``, or a line below it); a
  bare name elsewhere is looked up beside the last path of its line.
- Every ``tests/``, ``bench/`` or package path a module of ``zero_strategy/`` or ``tests/``
  cites in its text exists (a docstring that sends a reader to a file no longer there).
- The modules that import ``torch.distributed`` are the three the page says they are.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero_strategy"
DOC = ROOT / "docs" / "architecture.md"
REPO_DIRS = ("tests", "bench", "recipes", "conf", "docs")
"""First folders of a path that lies in the repository, not in the package."""

_FILE = r"[\w.-]*\w\.(?:py|sh|yaml)"
_PATH = re.compile(rf"(?<![\w./-])((?:[\w-]+/)*(?:{_FILE}|[\w-]+/))(?![\w/])")
"""A file (``x.py``, ``a/b/x.py``) or a folder written with its slash (``core/``)."""


def _package_modules() -> list[str]:
    """Every module's path in the package, except ``__init__.py`` files that only list
    (docstring, imports, ``__all__``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and _only_lists(path):
            continue
        found.append(rel)
    return found


def _only_lists(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def _named(text: str, rel: str) -> bool:
    return re.search(rf"(?<![\w./-])(?:zero_strategy/)?{re.escape(rel)}(?![\w/])", text) is not None


def _resolve(token: str, near: list[Path]) -> Path | None:
    """Where a path lies: in the repository or the package when it has a folder in it, else
    beside the first of ``near`` (the folders its context gives) that holds it; None when it
    lies nowhere."""
    token = token.removeprefix("zero_strategy/")
    if "/" in token.rstrip("/"):
        base = ROOT if token.split("/")[0] in REPO_DIRS else PACKAGE
        candidates = [base / token]
    else:
        candidates = [folder / token for folder in near]
    return next((path for path in candidates if path.exists()), None)


def _picture_and_prose() -> tuple[list[str], list[str]]:
    """The page's layer picture (its ```text block) and every other line."""
    text = DOC.read_text()
    start = text.index("```text\n")
    end = text.index("```\n", start + 8)
    return text[start + 8:end].splitlines(), (text[:start] + text[end:]).splitlines()


def _missing_in_picture(lines: list[str]) -> list[str]:
    """Bare names of the picture looked up under the folder its block of lines starts with
    (``core/`` ... until the next line that starts at the margin), at any depth."""
    missing, block = [], PACKAGE
    for line in lines:
        head = line[1:2] != " " and line.split()[0] if line.strip() else ""
        if head:
            block = PACKAGE / head if head.endswith("/") else PACKAGE
        for token in _PATH.findall(line):
            name = token.rstrip("/")
            nested = block != PACKAGE and any(block.rglob(name))
            if _resolve(token, [PACKAGE]) is None and not ("/" not in name and nested):
                missing.append(f"{token!r} (picture, under {block.relative_to(ROOT)})")
    return missing


def _missing_in_prose(lines: list[str]) -> list[str]:
    missing = []
    for line in lines:
        near = [PACKAGE, ROOT]
        for token in _PATH.findall(line):
            path = _resolve(token, near)
            if path is None:
                missing.append(f"{token!r} in: {line.strip()[:80]}")
            else:  # the names after it on the line are looked up beside it too
                near = [path if path.is_dir() else path.parent, PACKAGE, ROOT]
    return missing


def test_every_module_is_named_on_the_page() -> None:
    text = DOC.read_text()
    unnamed = [rel for rel in _package_modules() if not _named(text, rel)]
    assert not unnamed, (f"{DOC.relative_to(ROOT)} never names these modules of "
                         f"zero_strategy/ by their path: {unnamed}")


def test_every_path_the_page_names_exists() -> None:
    picture, prose = _picture_and_prose()
    missing = _missing_in_picture(picture) + _missing_in_prose(prose)
    assert not missing, f"{DOC.relative_to(ROOT)} names files that do not exist: {missing}"


_CITED = re.compile(
    r"(?<![\w./-])((?:tests|bench)/[\w./-]*\w\.(?:py|md|sh)|"
    r"(?:zero_strategy/)?(?:core|comm|engine|optim|offload|checkpoint|memory|perf|integrations)"
    r"/[\w/-]*\w\.py)(?![\w/])")


def test_every_path_the_code_cites_exists() -> None:
    missing = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for token in _CITED.findall(line):
                if _resolve(token, []) is None:
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {token}")
    assert not missing, f"files cited that do not exist: {missing}"


def _imports_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and \
                any(a.name == "distributed" for a in node.names):
            return True
    return False


def test_the_importers_of_torch_distributed_are_the_ones_the_page_names() -> None:
    importers = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                 if _imports_torch_distributed(p)}
    named = {"comm/collectives.py", "comm/groups.py", "checkpoint/pickles.py",
             "checkpoint/convert.py"}
    assert importers == named, (f"modules importing torch.distributed: {sorted(importers)}; "
                                f"docs/architecture.md says {sorted(named)}")
    row = next(line for line in DOC.read_text().splitlines()
               if line.startswith("| `comm/collectives.py` |"))
    assert "`checkpoint/pickles.py`" in row and "`checkpoint/convert.py`" in row, row
