"""The package's imports form no cycle, counting those under ``TYPE_CHECKING`` and inside
functions (a cycle closed there still ties the layers together), and the layers below the
engine (``checkpoint/``, ``memory/``, ``perf/``, the ``EngineView`` protocol) never import
it."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import zero_strategy

ROOT = Path(zero_strategy.__file__).parent
PACKAGE = "zero_strategy"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its source: ``from pkg import
    name`` counts as the submodule ``pkg.name`` when there is one, else as ``pkg``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, set(modules)) for name, path in modules.items()}


def test_the_graph_sees_relative_and_type_checking_imports() -> None:
    graph = _graph()
    assert "zero_strategy.engine.facade" in graph["zero_strategy.engine"]
    assert "zero_strategy.engine_view" in graph["zero_strategy.checkpoint.read"]  # TYPE_CHECKING
    assert "zero_strategy.checkpoint.errors" in graph["zero_strategy.checkpoint.write"]


def test_the_package_has_no_import_cycle() -> None:
    try:
        graphlib.TopologicalSorter(_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


@pytest.mark.parametrize("below", ["zero_strategy.checkpoint", "zero_strategy.memory",
                                   "zero_strategy.perf", "zero_strategy.engine_view"])
def test_the_layers_below_the_engine_never_import_it(below: str) -> None:
    offenders = {f"{name} imports {target}" for name, targets in _graph().items()
                 if name == below or name.startswith(below + ".")
                 for target in targets
                 if target == "zero_strategy.engine" or target.startswith("zero_strategy.engine.")}
    assert not offenders, sorted(offenders)


def test_zero_engine_declares_every_member_of_the_view() -> None:
    """``EngineView`` is structural: a member ``ZeroEngine`` lost or renamed would only fail
    where checkpoints or the memory report read it, so the names are compared here."""
    from zero_strategy.engine import ZeroEngine
    from zero_strategy.engine_view import EngineView

    wanted = {name for cls in EngineView.__mro__ for name in vars(cls).get("__annotations__", {})
              } | {name for name in vars(EngineView) if not name.startswith("_")}
    declared = {name for cls in ZeroEngine.__mro__ for name in vars(cls).get("__annotations__", {})}
    missing = {name for name in wanted if name not in declared and not hasattr(ZeroEngine, name)}
    assert not missing, sorted(missing)


# ------------------------------------------------------------------------------ Ray
RAY_MODULES = ("zero_strategy/integrations/ray/", "recipes/ray_job.py")
"""The only files that import Ray (the optional ``ray`` extra): the engine, the other
extras and the recipes' torchrun jobs install and import without it."""


def _imports_ray(path: Path) -> list[int]:
    """Lines of ``path`` importing ``ray`` or a submodule of it (absolute imports only: a
    relative ``from . import ray`` is one of ours)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(n == "ray" or n.startswith("ray.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_ray_modules_import_ray() -> None:
    checkout = ROOT.parent
    sources = sorted([*ROOT.rglob("*.py"), *(checkout / "recipes").rglob("*.py")])
    offenders = {str(p.relative_to(checkout)): lines for p in sources
                 if (lines := _imports_ray(p))
                 and not str(p.relative_to(checkout)).startswith(RAY_MODULES)}
    assert not offenders, f"Ray imported outside {RAY_MODULES}: {offenders}"
    assert _imports_ray(ROOT / "integrations" / "ray" / "report.py"), "the scan sees no import"


def test_only_the_ray_entry_point_reaches_the_ray_adapter() -> None:
    """``zero_strategy.ray`` alone imports ``zero_strategy.integrations.ray``: nothing else of
    the package pulls Ray in through it."""
    adapter = "zero_strategy.integrations.ray"
    offenders = sorted(name for name, targets in _graph().items()
                       if not (name == "zero_strategy.ray" or name.startswith(adapter))
                       and any(t == adapter or t.startswith(adapter + ".") for t in targets))
    assert not offenders, offenders
