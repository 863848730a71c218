"""The private names of transformers and Accelerate the adapters rely on
(``zero_strategy/integrations/hf/compat.py``) against the installed versions: each exists,
with a signature our calls and overrides fit. An override of a renamed private method is
never called again and nothing fails, so a rename must fail here, naming the name. The list
cannot drift from the code: a private override, or a private name of theirs used in
``integrations/hf/``, missing from it fails too. In process, nothing spawned."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torch import nn  # noqa: E402

from zero_strategy.integrations.accelerate import accelerator as zero_accelerator  # noqa: E402
from zero_strategy.integrations.accelerate import plugin as zero_plugin  # noqa: E402
from zero_strategy import compat  # noqa: E402
from zero_strategy.integrations.hf import trainer as zero_trainer  # noqa: E402

HF = Path(compat.__file__).parent
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _id(entry: compat.Function | compat.Attribute) -> str:
    return f"{entry.owner}.{entry.name}"


def _resolve(entry: compat.Function | compat.Attribute) -> object:
    try:
        owner = compat.owner_of(entry)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{entry.owner} (owner of {entry.name}, {entry.why}) is gone: {e}")
    return owner


def _source_of(owner: object) -> str:
    return inspect.getsource(sys.modules[owner.__module__] if isinstance(owner, type)
                             else owner)


@pytest.mark.parametrize("entry", compat.ALL, ids=_id)
def test_each_name_exists_in_the_installed_versions(
        entry: compat.Function | compat.Attribute) -> None:
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


def _framework_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__[1:]
            if c.__module__.split(".")[0] in ("transformers", "accelerate")]


def _our_subclasses() -> list[type]:
    found = []
    # Accelerate's adapter is a package: each module that defines classes is scanned.
    for module in (zero_trainer, zero_accelerator, zero_plugin):
        for value in vars(module).values():
            if (isinstance(value, type) and value.__module__ == module.__name__
                    and _framework_classes(value)):
                found.append(value)
    return found


def test_every_private_override_is_listed() -> None:
    listed = {e.name for e in compat.ALL}
    unlisted = []
    for cls in [*_our_subclasses(), zero_trainer.ZeroTrainerMixin]:
        bases = _framework_classes(cls) or [zero_trainer.Trainer]
        for name in vars(cls):
            private = name.startswith("_") and not name.startswith("__")
            if private and any(hasattr(b, name) for b in bases) and name not in listed:
                unlisted.append(f"{cls.__qualname__}.{name}")
    assert not unlisted, f"private overrides missing from compat.py: {unlisted}"


def test_every_listed_override_is_ours() -> None:
    mixin = vars(zero_trainer.ZeroTrainerMixin)
    stale = [e.name for e in (*compat.TRAINER_OVERRIDES, *compat.TRAINER_HOOKS)
             if e.name not in mixin]
    assert not stale, f"compat.py lists overrides ZeroTrainerMixin no longer has: {stale}"


def _private_names_used(path: Path) -> set[str]:
    """Private attribute names ``path`` reads or writes: ``x._name`` and the names given to
    getattr/setattr/hasattr as strings."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_private_names_of_theirs_used_in_hf_are_listed() -> None:
    """A private name one of the listed framework modules also names, used in
    ``integrations/hf/``, is one of theirs (torch's own, as ``nn.Module._parameters``,
    aside): it must be listed."""
    theirs = "\n".join({_source_of(_resolve(e)) for e in compat.ALL})
    torch_module = inspect.getsource(sys.modules[nn.Module.__module__])
    listed = {e.name for e in compat.ALL}
    unlisted = []
    for path in sorted(HF.glob("*.py")):
        if path.name == "compat.py":
            continue
        for name in sorted(_private_names_used(path)):
            word = rf"\b{re.escape(name)}\b"
            if name not in listed and re.search(word, theirs) and not re.search(word,
                                                                              torch_module):
                unlisted.append(f"{path.name}: {name}")
    assert not unlisted, f"private names of transformers/Accelerate not in compat.py: {unlisted}"


def test_a_missing_name_fails_naming_it() -> None:
    """What a rename looks like here: the entry's test fails with the name in its message."""
    renamed = compat.Function(owner=compat.TRAINER, name="_load_best_model_renamed",
                              why="a rename")
    with pytest.raises(AssertionError, match="_load_best_model_renamed"):
        test_each_callable_takes_what_we_pass(renamed)
