"""The code in the README and the docs site cannot rot: every fragment compiles and every
``zero_strategy`` name it uses must exist (``zs.X``, ``zero_strategy.X.Y``, ``from
zero_strategy... import X``). The complete examples run in the integration tier
(tests/integration/test_docs_examples.py): each starts interpreters."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

from tests.support.doc_blocks import FRAGMENTS, ROOT, RUNNABLE


def test_there_are_complete_examples() -> None:
    assert {w.split(":")[0] for w, _, _ in RUNNABLE} >= {
        "README.md", "docs/lightning.md", "docs/accelerate.md"}


def _names(tree: ast.AST) -> set[str]:
    """Dotted zero_strategy names a fragment uses (``zs`` is ``zero_strategy``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "zero_strategy":
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Attribute):
            parts = []
            inner: ast.AST = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in ("zs", "zero_strategy"):
                names.add(".".join(["zero_strategy", *reversed(parts)]))
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("where, code", FRAGMENTS, ids=[w for w, _ in FRAGMENTS])
def test_fragment_compiles_and_its_names_exist(where: str, code: str) -> None:
    tree = ast.parse(code, filename=where)
    missing = sorted(n for n in _names(tree) if not _resolves(n))
    assert not missing, f"{where}: no such name(s) in zero_strategy: {missing}"


def test_the_readme_performance_table_is_generated_from_a_run_file() -> None:
    """The README's table is what ``bench/readme_table.py`` makes of the newest run file in
    docs/performance/runs (a figure typed by hand, or a new run not regenerated, fails)."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "readme_table.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
