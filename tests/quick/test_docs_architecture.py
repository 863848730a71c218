"""docs/architecture.md cannot drift from the package silently: every module of
``zero_strategy/`` (and every subpackage) is named on it by its path below ``zero_strategy/``,
and every path it names (a ``.py`` file, or a folder written with its trailing slash) exists,
below ``zero_strategy/``, the repository root or ``docs/``. A module added, renamed or
removed fails here until the page says so."""

from __future__ import annotations

import re
from pathlib import Path

import zero_strategy

PACKAGE = Path(zero_strategy.__file__).parent
ROOT = PACKAGE.parent
PAGE = ROOT / "docs" / "architecture.md"
BASES = (PACKAGE, ROOT, ROOT / "docs")

# A path token: not glued to a longer word or path on its left (``integrations/hf/compat.py``
# is one token, not also ``compat.py``), dotted Python names left out.
PY = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)(?![\w/])")
FOLDER = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)+)(?![\w.-])")


def _names(text: str) -> tuple[set[str], set[str]]:
    return set(PY.findall(text)), set(FOLDER.findall(text))


def _modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py"}


def _packages() -> set[str]:
    return {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py")
            if p.parent != PACKAGE}


def _missing(names: set[str]) -> list[str]:
    return sorted(n for n in names if not any((base / n).exists() for base in BASES))


def test_every_module_and_package_is_named() -> None:
    files, folders = _names(PAGE.read_text())
    assert not sorted(_modules() - files), (
        f"modules of zero_strategy/ not named in {PAGE.name} by their path below "
        f"zero_strategy/: {sorted(_modules() - files)}")
    assert not sorted(_packages() - folders), (
        f"packages of zero_strategy/ not named in {PAGE.name}: {sorted(_packages() - folders)}")


def test_every_path_named_exists() -> None:
    files, folders = _names(PAGE.read_text())
    assert not _missing(files | folders), (
        f"{PAGE.name} names paths that do not exist: {_missing(files | folders)}")


def test_the_check_sees_what_it_must() -> None:
    """The patterns themselves: a nested path is one name, a dotted module name is none, a
    missing file is reported and an unnamed module is found."""
    files, folders = _names("`integrations/hf/compat.py` and zero_strategy.lightning, "
                            "`core/` (`tests/quick/`), https://example.org/a/")
    assert files == {"integrations/hf/compat.py"}
    assert folders == {"core/", "tests/quick/"}
    assert _missing({"core/nothing_here.py", "core/params.py"}) == ["core/nothing_here.py"]
    assert "core/params.py" in _modules() and "integrations/hf/" in _packages()
