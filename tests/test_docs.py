"""The code in the README and the docs site cannot rot: complete examples run, fragments are
compiled and every ``zero_strategy`` name they use must exist.

A Python block preceded by ``<!-- test: python -->`` runs as a script in a fresh directory,
``<!-- test: torchrun N -->`` under ``torch.distributed.run`` with N processes (gloo on CPU).
Every other Python block is a fragment: it must compile, and each ``zs.X``,
``zero_strategy.X.Y`` and ``from zero_strategy... import X`` in it must resolve. The
complete examples run side by side (they are mostly interpreter start-up)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- test: (?P<how>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[str, str | None, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", m.group("how"),
                          textwrap.dedent(m.group("code"))))
    return found


BLOCKS = _blocks()
RUNNABLE = [(where, how, code) for where, how, code in BLOCKS if how]
FRAGMENTS = [(where, code) for where, how, code in BLOCKS if not how]


def _command(how: str, script: Path) -> list[str]:
    if how == "python":
        return [sys.executable, str(script)]
    match = re.fullmatch(r"torchrun (\d+)", how)
    if match is None:
        raise ValueError(f"unknown docs test marker {how!r} (python | torchrun N)")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", match.group(1), str(script)]


def _run(how: str, code: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="zs-docs-") as tmp:
        script = Path(tmp, "example.py")
        script.write_text(code)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        return subprocess.run(_command(how, script), cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=420)


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=len(RUNNABLE) or 1) as pool:
        done = {where: pool.submit(_run, how, code) for where, how, code in RUNNABLE}
        return {where: future.result() for where, future in done.items()}


def test_there_are_complete_examples() -> None:
    assert {w.split(":")[0] for w, _, _ in RUNNABLE} >= {
        "README.md", "docs/lightning.md", "docs/accelerate.md"}


@pytest.mark.parametrize("where", [w for w, _, _ in RUNNABLE])
def test_complete_example_runs(runs: dict, where: str) -> None:
    result = runs[where]
    assert result.returncode == 0, f"{where}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def test_the_engine_example_trains(runs: dict) -> None:
    """The README's engine example prints its first and last loss: training lowered it."""
    where = next(w for w, how, _ in RUNNABLE if w.startswith("README.md") and "torchrun" in how)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", runs[where].stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] / 2, runs[where].stdout


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
