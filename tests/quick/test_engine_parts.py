"""One declaration per fact (issue 57, point 3): the engine's parts are declared once, the
modules that assign them after set-up are the ones ``engine/parts.py`` lists, and a built
engine holds exactly the declared parts (its methods against ``EngineView``'s:
tests/quick/test_import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import zero_strategy
from tests.support.harness import check, run_world
from zero_strategy.engine.parts import MOVED_BY, EngineParts
from zero_strategy.engine_view import EngineView, ViewParts

ROOT = Path(zero_strategy.__file__).parent
RECEIVERS = {"parts", "engine"}
"""The names the package gives an engine's parts (``step.py``'s functions, the checkpoint
layer); ``self`` counts in ``engine/facade.py`` alone, and ``x.engine`` anywhere."""


def _declared() -> set[str]:
    return {name for cls in EngineParts.__mro__ for name in vars(cls).get("__annotations__", {})}


def test_the_parts_the_view_reads_are_declared_once() -> None:
    """``EngineParts`` inherits the parts ``EngineView`` reads and declares none of them
    again (two declarations drift apart: their docstrings once did), and the view adds
    methods only."""
    assert ViewParts in EngineParts.__mro__ and ViewParts in EngineView.__mro__
    again = set(vars(EngineParts)["__annotations__"]) & set(ViewParts.__annotations__)
    assert not again, sorted(again)
    assert not vars(EngineView).get("__annotations__"), "declare attributes in ViewParts"
    assert set(MOVED_BY) <= _declared(), sorted(set(MOVED_BY) - _declared())


def _receiver(node: ast.expr, module: str) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECEIVERS or (node.id == "self" and module == "engine/facade.py")
    return isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")


def _assigned(target: ast.expr, module: str) -> list[str]:
    """The parts ``target`` assigns: ``parts.x = ``, ``parts.x[k] = ``, tuples of them."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for t in target.elts for name in _assigned(t, module)]
    if isinstance(target, ast.Starred):
        return _assigned(target.value, module)
    if isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and _receiver(target.value, module):
        return [target.attr]
    return []


def _assignments() -> dict[str, set[str]]:
    """Part -> the modules of the package that assign it (``setattr`` included)."""
    out: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "setattr" and len(node.args) == 3
                  and _receiver(node.args[0], module)
                  and isinstance(node.args[1], ast.Constant)):
                out.setdefault(str(node.args[1].value), set()).add(module)
            for target in targets:
                for name in _assigned(target, module):
                    out.setdefault(name, set()).add(module)
    return out


def test_parts_are_assigned_only_by_the_modules_parts_py_names() -> None:
    """``setup.py`` builds every part; after it, only ``MOVED_BY``'s modules assign one."""
    declared, found = _declared(), _assignments()
    wrong = {f"{module} assigns {name}" for name, modules in found.items() if name in declared
             for module in modules - {"engine/setup.py", *MOVED_BY.get(name, ())}}
    assert not wrong, sorted(wrong)
    # The scan sees what it must (a write it stopped seeing would pass silently).
    assert {"engine/step.py", "checkpoint/read.py"} <= found["global_step"]
    assert "engine/step.py" in found["param_names"] and "engine/state.py" in found["_closed"]


def test_a_built_engine_holds_exactly_the_declared_parts() -> None:
    """Every declared part is set by ``setup.build``, and nothing undeclared is: a part added
    without a declaration (or a declaration left for a part gone) fails here."""
    built = check(run_world("tests/worlds/scenarios_parts.py", 1)["built"])[0]
    assert set(built) == _declared(), sorted(set(built) ^ _declared())
