"""The private names of torch, Lightning, Accelerate, transformers and PEFT the package
touches (``zero_strategy/compat.py``) against the installed versions: each exists, with a
signature our calls and overrides fit. An override of a renamed private method is never
called again and nothing fails, so a rename must fail here, naming the name.

The list cannot drift from the code: every module of ``zero_strategy/`` is scanned with
``ast`` (``tests/support/private_names.py``) for private names of other packages (imports,
attributes reached through their modules and objects, names given to ``getattr`` & co. as
strings, private names the package never defines or that torch's objects have too off
``self``, and, at run time, the private members of their classes that our subclasses override
or use), and one missing from the list fails. In
process, nothing spawned."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support import private_names
from zero_strategy import compat

PACKAGE = Path(compat.__file__).parent
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
Entry = compat.Function | compat.Attribute | compat.Module


def _id(entry: Entry) -> str:
    return f"{entry.owner}.{entry.name}"


def _installed(entry: Entry) -> None:
    """Skip ``entry`` where its package is not installed, or is a release outside the ones
    that have it (``since``/``until``: the code does not meet it there)."""
    package = entry.owner.split(".")[0].split(":")[0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (an optional extra)")
    since, until = getattr(entry, "since", ""), getattr(entry, "until", "")
    installed = Version(importlib.metadata.version(package))
    if since and installed < Version(since) or until and installed >= Version(until):
        pytest.skip(f"{package} {installed} has no {entry.name} here "
                    f"(releases {since or '...'} to {until or '...'})")


def _resolve(entry: Entry) -> object:
    _installed(entry)
    try:
        return compat.owner_of(entry)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{entry.owner} (owner of {entry.name}, {entry.why}) is gone: {e}")


def _source_of(owner: object) -> str:
    return inspect.getsource(sys.modules[owner.__module__] if isinstance(owner, type)
                             else owner)


def _module_has(module_name: str, member: str) -> bool:
    """``member`` in a module, read from its source when it is not imported yet (importing
    torch._dynamo would change what this process's compiled-graph guards do)."""
    if module_name in sys.modules:
        return hasattr(sys.modules[module_name], member)
    origin = importlib.util.find_spec(module_name).origin  # type: ignore[union-attr]
    return re.search(rf"\b{re.escape(member)}\b", Path(origin).read_text()) is not None


@pytest.mark.parametrize("entry", compat.ALL, ids=_id)
def test_each_name_exists_in_the_installed_versions(entry: Entry) -> None:
    if isinstance(entry, compat.Module):
        _installed(entry)
        full = f"{entry.owner}.{entry.name}"
        assert importlib.util.find_spec(full) is not None, f"{full} is gone ({entry.why})"
        gone = [m for m in entry.uses if not _module_has(full, m)]
        assert not gone, f"{full} no longer has {gone} ({entry.why})"
        return
    owner = _resolve(entry)
    if isinstance(entry, compat.Attribute) and not entry.on_class:
        # set or read on instances: their code must still name it
        assert re.search(rf"\b{re.escape(entry.name)}\b", _source_of(owner)), (
            f"{_id(entry)} is no longer named by {entry.owner}'s source: renamed or gone "
            f"({entry.why})")
        return
    assert hasattr(owner, entry.name), f"{_id(entry)} is gone or renamed ({entry.why})"


def _parameters(entry: compat.Function) -> list[inspect.Parameter]:
    owner = _resolve(entry)
    function = getattr(owner, entry.name, None)
    assert callable(function), f"{_id(entry)} is gone, renamed or not callable ({entry.why})"
    params = list(inspect.signature(function).parameters.values())
    static = inspect.getattr_static(owner, entry.name) if isinstance(owner, type) else None
    if inspect.isfunction(static):  # a plain method: its self
        params = params[1:]
    return params


@pytest.mark.parametrize("entry", [e for e in compat.ALL if isinstance(e, compat.Function)],
                         ids=_id)
def test_each_callable_takes_what_we_pass(entry: compat.Function) -> None:
    params = _parameters(entry)
    positional = [p for p in params if p.kind in POSITIONAL]
    names = [p.name for p in positional[:len(entry.params)]]
    assert names == list(entry.params), (
        f"{_id(entry)}: we pass or receive {list(entry.params)} in this order, it now takes "
        f"{[p.name for p in params]}")
    by_name = {p.name: p for p in params}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    for keyword in entry.keywords:
        found = by_name.get(keyword)
        assert (found is not None and found.kind != inspect.Parameter.POSITIONAL_ONLY) or \
            takes_any, f"{_id(entry)}: no parameter {keyword!r} any more, which we pass by name"
    ours = {*entry.params, *entry.keywords}
    required = [p.name for p in params if p.name not in ours and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert entry.passes_through or not required, (
        f"{_id(entry)}: now also requires {required}, which our call or override does not "
        "pass on")


@pytest.mark.parametrize("entry", [*compat.TRAINER_OVERRIDES, *compat.TRAINER_HOOKS], ids=_id)
def test_trainer_still_calls_each_override(entry: compat.Function) -> None:
    """A method kept but no longer called is a rename too: our override would be skipped."""
    source = _source_of(_resolve(entry))
    assert re.search(rf"\bself\.{re.escape(entry.name)}\(", source), (
        f"{entry.owner} no longer calls self.{entry.name}(...): our override would never "
        f"run ({entry.why})")


def test_every_listed_override_is_ours() -> None:
    pytest.importorskip("transformers")
    from zero_strategy.integrations.hf import trainer as zero_trainer

    mixin = vars(zero_trainer.ZeroTrainerMixin)
    stale = [e.name for e in (*compat.TRAINER_OVERRIDES, *compat.TRAINER_HOOKS)
             if e.name not in mixin]
    assert not stale, f"compat.py lists overrides ZeroTrainerMixin no longer has: {stale}"


# ------------------------------------------------------------------ the package-wide scan
def _module_paths() -> dict[str, Path]:
    paths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return paths


MODULES = _module_paths()
LISTED = {e.name for e in compat.ALL if not isinstance(e, compat.Module)}
NOT_THEIRS = {e.name for e in compat.NOT_THEIRS}


def _full(entry: Entry) -> str:
    return f"{entry.owner.replace(':', '.')}.{entry.name}"


BY_KEY = {_full(e): e for e in compat.ALL}


def _importable(module_name: str) -> object | None:
    """The module, or None when an optional framework it needs is not installed."""
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        if (e.name or "").split(".")[0] == private_names.OURS:
            raise
        return None


def _framework_members() -> dict[str, tuple[str, str]]:
    """Private members of their classes our classes touch: name -> (our class, theirs)."""
    bodies = private_names.class_bodies(MODULES)
    found: dict[str, tuple[str, str]] = {}
    for module_name, class_name in bodies:
        module = _importable(module_name)
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            continue
        for name, owner in private_names.framework_members(cls, bodies).items():
            found[name] = (f"{module_name}.{class_name}", f"{owner.__module__}:{owner.__name__}")
    return found


def _unlisted(access: private_names.Access) -> str | None:
    """Why ``access`` is not covered by the registry, or None when it is."""
    if access.key is None:
        if access.name in LISTED or access.name in NOT_THEIRS:
            return None
        return f"{access.where}: {access.name} (on an object of theirs)"
    entry = BY_KEY.get(access.key)
    if entry is None:
        return f"{access.where}: {access.key}"
    if isinstance(entry, compat.Module) and access.member and not private_names.private(
            access.member) and access.member not in entry.uses:
        return f"{access.where}: {access.key}.{access.member} (not in its uses)"
    return None


Scan = tuple[list[private_names.Access], dict[str, tuple[str, str]]]


def _framework_objects() -> tuple[object, ...]:
    """torch's objects the package handles most, as instances (attributes set in their
    ``__init__`` included): a private name of theirs the package also happens to define
    for itself (``EngineParts._buffers``, ``self._version``) is theirs where they have it."""
    import torch

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    return (torch.nn.Linear(1, 1), torch.zeros(1), param, optimizer, torch.UntypedStorage(1),
            torch.optim.lr_scheduler.StepLR(optimizer, 1))


def _scan() -> Scan:
    members = _framework_members()
    trees = [ast.parse(p.read_text()) for p in MODULES.values()]
    defined = private_names.defined_names(trees)
    objects = _framework_objects()
    also_theirs = {n for n in defined if private_names.private(n)
                   and any(hasattr(o, n) for o in objects)}
    ours = defined - set(members) - LISTED - also_theirs
    ours_on_self = frozenset(also_theirs - set(members) - LISTED)
    found = []
    for path in MODULES.values():
        if path == Path(compat.__file__):
            continue  # the registry itself: its strings are the names
        where = path.relative_to(PACKAGE.parent).as_posix()
        found += list(private_names.accesses(path, where, ours, ours_on_self))
    return found, members


@pytest.fixture(scope="module")
def scan() -> Scan:
    return _scan()


def test_every_private_name_of_theirs_the_package_touches_is_listed(scan: Scan) -> None:
    found, members = scan
    unlisted = sorted({why for why in map(_unlisted, found) if why})
    unlisted += [f"{ours} uses {theirs}.{name}" for name, (ours, theirs) in sorted(members.items())
                 if name not in LISTED]
    assert not unlisted, f"private names of other packages missing from compat.py: {unlisted}"


def test_every_torch_lightning_and_peft_entry_is_still_used(scan: Scan) -> None:
    """The adapters of transformers and Accelerate read their names from the registry, so
    those are found by use there; torch's, Lightning's and PEFT's are written in the code,
    and a listed name the code no longer touches is stale."""
    found, members = scan
    keys = {a.key for a in found if a.key} | {a.key.rpartition(".")[0] for a in found if a.key}
    names = {a.name for a in found} | set(members)
    stale = [_id(e) for e in (*compat.TORCH, *compat.LIGHTNING, *compat.PEFT)
             if _full(e) not in keys and e.name not in names]
    stale += [e.name for e in compat.NOT_THEIRS if e.name not in names]
    assert not stale, f"compat.py lists names the package no longer touches: {stale}"


def test_the_scan_sees_each_way_of_touching_a_name(tmp_path: Path) -> None:
    """Each form the scan reads, and what it leaves alone: our own private names, public
    names of theirs, private names of ours reached through our own modules."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nimport torch\nimport torch._dynamo\nimport torch.distributed as dist\n"
        "from torch.utils._pytree import tree_map\nfrom ..core import params\n"
        "from lightning.fabric.utilities.types import _PATH\n"
        "class Ours:\n    def __init__(self):\n        self._mine = 1\n"
        "    def run(self, group, opt):\n"
        "        torch._foreach_norm([]); dist.distributed_c10d._get_default_store()\n"
        "        group._reduce_scatter_base(); opt._opt_called = True\n"
        "        hasattr(torch.UntypedStorage, '_swap_data_ptr_'); getattr(opt, '_gone')\n"
        "        torch.nn.Linear(1, 1); params._internal; self._mine\n"
        "        return 'torch._C' in sys.modules, ('_listed_as_a_name',)\n")
    ours = {"_mine", "_internal"}
    found = {(a.name, a.key, a.member)
             for a in private_names.accesses(probe, "probe.py", ours)}
    assert found == {
        ("_dynamo", "torch._dynamo", None),
        ("_pytree", "torch.utils._pytree", "tree_map"),
        ("_PATH", "lightning.fabric.utilities.types._PATH", None),
        ("_foreach_norm", "torch._foreach_norm", None),
        ("_get_default_store", "torch.distributed.distributed_c10d._get_default_store", None),
        ("_reduce_scatter_base", None, None), ("_opt_called", None, None),
        ("_swap_data_ptr_", "torch.UntypedStorage._swap_data_ptr_", None),
        ("_gone", None, None), ("_C", "torch._C", None), ("_listed_as_a_name", None, None),
    }


def test_a_name_of_ours_a_framework_object_also_has_is_theirs_off_self(
        tmp_path: Path) -> None:
    """``self._version`` is ours where the package defines it; ``tensor._version`` is
    torch's all the same (a framework object has it), and so is an override reached
    through ``super()``."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class Saved:\n    def __init__(self, tensor):\n"
        "        self._version = tensor._version\n"
        "    def _apply(self, fn):\n        return super()._apply(fn)\n")
    found = {(a.name, a.where) for a in private_names.accesses(
        probe, "probe.py", ours=set(), ours_on_self=frozenset({"_version", "_apply"}))}
    assert found == {("_version", "probe.py:3"), ("_apply", "probe.py:5")}
    assert "_version" in {n for n in private_names.defined_names([ast.parse(
        probe.read_text())]) if any(hasattr(o, n) for o in _framework_objects())}


def test_a_missing_name_fails_naming_it() -> None:
    """What a rename looks like here: the entry's test fails with the name in its message."""
    pytest.importorskip("transformers")
    renamed = compat.Function(owner=compat.TRAINER, name="_load_best_model_renamed",
                              why="a rename")
    with pytest.raises(AssertionError, match="_load_best_model_renamed"):
        test_each_callable_takes_what_we_pass(renamed)
