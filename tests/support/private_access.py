"""The private names of other packages that ``zero_strategy/`` touches, found by reading its
source (``ast``), for tests/quick/test_private_names.py.

A private name starts with a single underscore. Three kinds of access are collected:

- ``paths``: through a name bound to an import of a watched package (torch, Lightning,
  Accelerate, transformers, PEFT, TRL, Hydra), the whole dotted path where any part is
  private: ``import torch._dynamo``, ``from torch.utils._pytree import tree_map``,
  ``torch.serialization._get_layout``, ``getattr(torch._C, "_storage_Use_Count")``;
- ``names``: a private attribute of some other object, whose type is not known statically
  (``group._reduce_scatter_base``, ``optimizer._opt_called = True``), written as ``x._name``
  or given as a string to getattr, setattr, hasattr or delattr;
- ``class_names``: per class of ours, the private names it defines or touches on ``self``
  (methods, class attributes, ``self._x``): in a subclass of a framework class they are the
  framework's where its classes have them (an override, or its state written).

``defined`` is every private name ``zero_strategy`` defines itself (functions, methods,
assignments, ``self._x = ...``): a name in ``names`` that is also defined here is taken to be
ours, unless a framework object has it too (the test probes them).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

WATCHED = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "accelerate",
           "transformers", "peft", "trl", "hydra")
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def watched(module: str) -> bool:
    return module.split(".")[0] in WATCHED


@dataclass
class Found:
    """Where each access was seen: {path or name: ["file:line", ...]}."""

    paths: dict[str, list[str]] = field(default_factory=dict)
    names: dict[str, list[str]] = field(default_factory=dict)
    self_names: dict[str, list[str]] = field(default_factory=dict)
    """``self._x`` in a class of ours where ``_x`` is not defined by zero_strategy at all."""
    class_names: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(module, class qualname) -> private names it defines or touches on self."""
    defined: set[str] = field(default_factory=set)


def _add(table: dict[str, list[str]], key: str, where: str) -> None:
    table.setdefault(key, []).append(where)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted path of the watched module or object it is bound to, for every
    import in the file (inside functions too: a file rarely binds one name two ways)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if watched(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if watched(node.module):
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"] when it is names and attributes only."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _resolved(parts: list[str] | None, bound: dict[str, str]) -> str | None:
    """The dotted path of a chain on a watched import, when a part of it is private."""
    if not parts or parts[0] not in bound:
        return None
    full = [*bound[parts[0]].split("."), *parts[1:]]
    return ".".join(full) if any(is_private(p) for p in full) else None


def _defined_in(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                      and leaf.value.id in ("self", "cls")):
                    names.add(leaf.attr)
    return {n for n in names if is_private(n)}


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Private names a class body defines, and those its methods touch on ``self``/``cls``
    (nested classes apart: they are classes of their own)."""
    names = set()
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
            for node in ast.walk(item):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in ("self", "cls")):
                    names.add(node.attr)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if is_private(n)}


def _classes(tree: ast.Module, module: str, found: Found) -> None:
    def visit(body: list[ast.stmt], prefix: str) -> None:
        for item in body:
            if isinstance(item, ast.ClassDef):
                qualname = f"{prefix}{item.name}"
                found.class_names[(module, qualname)] = _class_names(item)
                visit(item.body, f"{qualname}.")
    visit(tree.body, "")


def _imports(tree: ast.AST, where: str, found: Found) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if watched(alias.name) and any(map(is_private, alias.name.split("."))):
                    _add(found.paths, alias.name, where + str(node.lineno))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if watched(node.module) and any(map(is_private, path.split("."))):
                    _add(found.paths, path, where + str(node.lineno))


def _accessor_target(node: ast.Call) -> tuple[ast.expr, str] | None:
    """(object, name) of ``getattr(obj, "_name", ...)`` and its kin."""
    if (isinstance(node.func, ast.Name) and node.func.id in ACCESSORS and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)):
        return node.args[0], node.args[1].value
    return None


def _uses(tree: ast.AST, where: str, bound: dict[str, str], found: Found) -> None:
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # getattr(torch._C, "_x"): the object is part of the path the accessor names
    inner |= {id(t[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
              and (t := _accessor_target(n)) is not None}
    for node in ast.walk(tree):
        at = where + str(getattr(node, "lineno", 0))
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            # the outermost attribute of a chain: the whole path is the thing used
            path = _resolved(_chain(node), bound)
            if path:
                _add(found.paths, path, at)
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if _resolved(_chain(node.value), bound) is not None or (
                    (_chain(node.value) or [""])[0] in bound):
                continue  # on an import: counted as a path above
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                _add(found.self_names, node.attr, at)
            else:
                _add(found.names, node.attr, at)
        elif isinstance(node, ast.Call) and (target := _accessor_target(node)):
            obj, name = target
            parts = _chain(obj)
            if parts and parts[0] in bound:
                _add(found.paths, ".".join([*bound[parts[0]].split("."), *parts[1:], name]), at)
            elif isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                _add(found.self_names, name, at)
            else:
                _add(found.names, name, at)


def scan(root: Path) -> Found:
    """Every private access of another package's name in the ``.py`` files under ``root`` (a
    package directory: module names are taken relative to its parent)."""
    found = Found()
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}
    for path, tree in trees.items():
        found.defined |= _defined_in(tree)
        rel = path.relative_to(root.parent)
        parts = rel.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        where = f"{rel}:"
        _imports(tree, where, found)
        _uses(tree, where, _aliases(tree), found)
        _classes(tree, module, found)
    found.self_names = {n: w for n, w in found.self_names.items() if n not in found.defined}
    return found
