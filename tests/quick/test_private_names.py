"""Every private name of torch, Lightning, Accelerate, transformers, PEFT and Hydra that
``zero_strategy/`` touches is in the registry (``zero_strategy/compat.py`` and
``zero_strategy/integrations/hf/compat.py``), and every name the registry lists exists in the
installed versions. A private name can be renamed in any release: the first test makes each
one we rely on visible, the second fails naming it when a release drops it (``.ci/versions``
runs this file at the oldest and the newest releases allowed).

The code is read with ``ast`` (tests/support/private_access.py says what counts); the
objects a name might belong to are probed in this process. Nothing is spawned."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

for _framework in ("lightning", "accelerate", "transformers", "peft"):
    pytest.importorskip(_framework)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zero_strategy  # noqa: E402
from tests.support.private_access import Found, is_private, scan, watched  # noqa: E402
from zero_strategy import compat  # noqa: E402
from zero_strategy.integrations.hf import compat as hf_compat  # noqa: E402

ROOT = Path(zero_strategy.__file__).parent
REGISTRY: tuple[compat.Entry, ...] = (*compat.ALL, *hf_compat.ALL)


@functools.cache
def _found() -> Found:
    return scan(ROOT)


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj if inspect.ismodule(obj) or isinstance(obj, type)
                                 else inspect.getmodule(obj))
    except (OSError, TypeError):  # a class from C: its names are its attributes
        return ""


@functools.cache
def _probes() -> tuple[object, ...]:
    """The framework objects ``zero_strategy`` handles most, as instances (attributes set in
    ``__init__`` included), and every class the registry names."""
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    instances = (nn.Linear(1, 1), torch.zeros(1), param, optimizer, torch.UntypedStorage(1),
                 torch.optim.lr_scheduler.StepLR(optimizer, 1))
    classes = set()
    for entry in REGISTRY:
        try:
            owner = compat.owner_of(entry)
        except (ImportError, AttributeError):
            continue
        if isinstance(owner, type):
            classes.add(owner)
    return (*instances, *sorted(classes, key=lambda c: c.__qualname__))


def _on_a_probe(name: str) -> bool:
    return any(hasattr(probe, name) for probe in _probes())


def _watched_bases(module: str, qualname: str) -> list[type]:
    """The framework classes in the MRO of our class, and of each of our classes deriving
    from it (a mixin's ``self`` is then theirs too)."""
    cls = _class(module, qualname)
    if cls is None:
        return []
    bases = []
    for ours in _our_classes():
        if cls in ours.__mro__:
            bases += [b for b in ours.__mro__ if watched(b.__module__) and b is not object]
    return list(dict.fromkeys(bases))


def _class(module: str, qualname: str) -> type | None:
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


@functools.cache
def _our_classes() -> tuple[type, ...]:
    found = [_class(module, qualname) for module, qualname in _found().class_names]
    return tuple(c for c in found if c is not None)


def _theirs_in_class(base: type, name: str) -> bool:
    """``base`` (a framework class) has ``name``: as an attribute, or set on ``self`` by its
    code or a framework class it derives from."""
    if hasattr(base, name):
        return True
    pattern = rf"\bself\.{re.escape(name)}\b"
    return any(re.search(pattern, _source(b)) for b in base.__mro__ if watched(b.__module__))


def _unlisted(found: Found) -> list[str]:
    paths = {e.path for e in REGISTRY}
    names = {e.name for e in REGISTRY} | set(compat.OWN_MARKERS)
    unlisted = [f"{path} ({where[0]})" for path, where in found.paths.items()
                if path not in paths]
    for name, where in found.names.items():  # on an object of unknown type
        ours = name in found.defined and not _on_a_probe(name)
        if name not in names and not ours:
            unlisted.append(f"{name} ({where[0]})")
    unlisted += [f"self.{name} ({where[0]}): defined nowhere in zero_strategy"
                 for name, where in found.self_names.items() if name not in names]
    for (module, qualname), class_names in found.class_names.items():
        bases = _watched_bases(module, qualname)
        unlisted += [f"{module}.{qualname}.{name}: also {base.__qualname__}'s"
                     for name in sorted(class_names - names)
                     for base in bases[:1] if any(_theirs_in_class(b, name) for b in bases)]
    return sorted(set(unlisted))


def test_every_private_access_of_theirs_is_listed() -> None:
    unlisted = _unlisted(_found())
    assert not unlisted, ("private names of torch/Lightning/Accelerate/transformers/PEFT/Hydra "
                          "used in zero_strategy/ but listed in neither zero_strategy/compat.py "
                          f"nor integrations/hf/compat.py: {unlisted}")


def test_the_scan_finds_each_kind_of_access() -> None:
    """Each way of touching a private name, as the library writes it today, is found: the
    scan cannot pass by seeing nothing."""
    found = _found()
    assert "torch.distributed.distributed_c10d._get_default_store" in found.paths  # chain
    assert "torch.utils._pytree.tree_map" in found.paths  # from-import
    assert "torch._dynamo" in found.paths  # import of a private module
    assert "torch._C._storage_Use_Count" in found.paths  # getattr on an import
    assert {"_reduce_scatter_base", "_opt_called", "_parameters"} <= set(found.names)
    strategy = ("zero_strategy.optim.combined", "CombinedOptimizer")
    assert "_optimizer_step_pre_hooks" in found.class_names[strategy]


def _exists(entry: compat.Entry) -> bool:
    owner = compat.owner_of(entry)
    if isinstance(entry, compat.Attribute) and not entry.on_class:
        # set or read on instances: their code must still name it
        return re.search(rf"\b{re.escape(entry.name)}\b", _source(owner)) is not None
    return hasattr(owner, entry.name)


@pytest.mark.parametrize("entry", compat.ALL, ids=lambda e: e.path)
def test_each_listed_name_exists_in_the_installed_versions(entry: compat.Entry) -> None:
    """transformers' and Accelerate's entries: tests/quick/test_hf_compat.py, signatures too."""
    try:
        present = _exists(entry)
    except (ImportError, AttributeError) as e:
        present, error = False, e
    else:
        error = None
    if not present and entry.optional:
        pytest.skip(f"{entry.path} is not in this release; the code falls back: {entry.why}")
    assert present, f"{entry.path} is gone or renamed ({error or 'not found'}): {entry.why}"


def test_every_entry_says_why_and_where_it_was_checked() -> None:
    for entry in REGISTRY:
        assert len(entry.why) > 20, entry.path
        assert entry.checked or compat.package_of(entry) in compat.CHECKED_ON, entry.path
        assert entry.checked_on, entry.path
    markers = {n for n in compat.OWN_MARKERS if is_private(n)}
    assert markers == set(compat.OWN_MARKERS) and markers <= _found().defined | set(
        _found().names), "an own marker zero_strategy no longer sets"
