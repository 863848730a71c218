"""The private names of other packages that a module's source touches, found with ``ast``.

What counts as touching one (an ``Access``):

- importing it: ``import torch._dynamo``, ``from torch.utils._pytree import tree_map``,
  ``from lightning.fabric.utilities.types import _PATH``;
- reaching it through a name bound by an import of another package: ``torch._foreach_norm``,
  ``dist.distributed_c10d._get_default_store()``, an assignment to
  ``lightning_optimizer._validate_optimizers_attached``, ``getattr(torch._C, "_x")``;
- naming it in a string as a dotted path in an installed package: ``"torch._dynamo" in
  sys.modules``;
- any other ``obj._name`` (read, write or call; ``getattr``/``setattr``/``hasattr``/``delattr``
  with the name as a string; or the name as a string anywhere, as a list of names is written)
  whose name the package never defines itself (``ours``): ``group._reduce_scatter_base``,
  ``module._parameters``, ``optimizer._opt_called = True``; or that the package defines but
  a framework object has too (``ours_on_self``: ours on ``self`` only, so ``tensor._version``
  is torch's although ``self._version`` is ours).

The first three are *qualified*: ``key`` is the dotted path through its last private part,
``member`` the name used from it (``torch._dynamo`` and ``disable``). The last are
*unqualified*: their owner is an object the source cannot type. Overrides of a framework's
private members in our subclasses are found where the classes are, at run time
(``framework_members``).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

OURS = "zero_strategy"
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Access:
    where: str
    """``path:line``."""
    name: str
    """The private name itself."""
    key: str | None = None
    """Qualified accesses: the dotted path through the last private part."""
    member: str | None = None
    """Qualified accesses: the name used from ``key``, when there is one."""


def _qualified(where: str, dotted: str) -> Access | None:
    parts = dotted.split(".")
    last = max((i for i, part in enumerate(parts) if private(part)), default=None)
    if last is None:
        return None
    member = parts[last + 1] if last + 1 < len(parts) else None
    return Access(where, parts[last], ".".join(parts[:last + 1]), member)


def _external(dotted: str) -> bool:
    return dotted.split(".")[0] != OURS


def defined_names(trees: Iterable[ast.AST]) -> set[str]:
    """Every name the package defines: functions, classes, arguments, variables, attributes
    assigned on ``self`` or ``cls``, annotated fields, import aliases."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return names


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted path of another package it is bound to."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _external(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _external(node.module):
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """``a.b.c`` as the dotted path of another package, when ``a`` is bound to one."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def accesses(path: Path, where: str, ours: set[str],
             ours_on_self: frozenset[str] = frozenset()) -> Iterator[Access]:
    """Every access of ``path``'s source to a private name of another package.
    ``ours_on_self``: names that are ours read on ``self``/``cls`` only (a framework object
    has them too: on any other object they are taken to be its)."""
    tree = ast.parse(path.read_text(), str(path))
    bound = _imports(tree)
    named_by_call: set[int] = set()
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _qualified(at, alias.name) if _external(alias.name) else None
                yield from [found] if found else []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                found = _qualified(at, dotted) if _external(dotted) else None
                yield from [found] if found else []
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node, bound)
            if dotted is not None:
                found = _qualified(at, dotted)
                yield from [found] if found else []
            elif private(node.attr) and node.attr not in ours and not (
                    node.attr in ours_on_self and _on_self(node)):
                yield Access(at, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTRIBUTE_FUNCTIONS and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value)):
            named_by_call.add(id(node.args[1]))
            dotted = _dotted(node.args[0], bound)
            if dotted is not None:
                yield Access(at, node.args[1].value, f"{dotted}.{node.args[1].value}")
            elif node.args[1].value not in ours:
                yield Access(at, node.args[1].value)
    formatted = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                 for part in node.values}  # pieces of an f-string name nothing
    for node in ast.walk(tree):  # strings, once those given to getattr & co. are known
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or \
                id(node) in named_by_call or id(node) in formatted:
            continue
        at = f"{where}:{node.lineno}"
        if _DOTTED.fullmatch(node.value) and _external(node.value) and \
                importlib.util.find_spec(node.value.split(".")[0]) is not None:
            found = _qualified(at, node.value)
            yield from [found] if found else []
        elif node.value.isidentifier() and private(node.value) and node.value not in ours:
            yield Access(at, node.value)


def _third_party(cls: type) -> bool:
    root = cls.__module__.split(".")[0]
    return root not in (OURS, "builtins") and root not in sys.stdlib_module_names


def _source(module_name: str) -> str:
    try:
        return inspect.getsource(sys.modules[module_name])
    except (OSError, TypeError, KeyError):
        return ""  # a compiled module: attributes are found by hasattr alone


def _names_in_body(node: ast.ClassDef) -> set[str]:
    """Private names a class body defines or reads on ``self``/``cls``."""
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                sub.value.id in ("self", "cls"):
            names.add(sub.attr)
    return {n for n in names if private(n)}


def class_bodies(paths: dict[str, Path]) -> dict[tuple[str, str], ast.ClassDef]:
    """(module name, class name) -> its definition, for the module-level classes."""
    bodies = {}
    for module_name, path in paths.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bodies[(module_name, node.name)] = node
    return bodies


def framework_members(cls: type, bodies: dict[tuple[str, str], ast.ClassDef]
                      ) -> dict[str, type]:
    """The private members of third-party classes above ``cls`` that our classes in its MRO
    define, override or use on ``self``: name -> the class of theirs that has it (as a class
    attribute, or named in its module's source: instance attributes set in ``__init__``)."""
    theirs = [c for c in cls.__mro__ if _third_party(c)]
    ours = [bodies[(c.__module__, c.__name__)] for c in cls.__mro__
            if (c.__module__, c.__name__) in bodies]
    found: dict[str, type] = {}
    for name in sorted(set().union(*(_names_in_body(body) for body in ours))):
        word = re.compile(rf"\b{re.escape(name)}\b")
        owner = next((c for c in theirs if hasattr(c, name)
                      or word.search(_source(c.__module__))), None)
        if owner is not None:
            found[name] = owner
    return found
