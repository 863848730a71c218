"""Registers the Lightning / Fabric strategy names (zero1 ... zero3_offload) on import of
zero_strategy without making every engine user pay for importing Lightning.

Lightning has no entry point for strategies. If Lightning is already imported, the adapters
register now; otherwise a one-shot import hook registers them right after ``lightning.pytorch``
or ``lightning.fabric`` is first imported, whichever comes first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

_TRIGGERS = ("lightning.pytorch", "lightning.fabric")
_ADAPTERS = {"lightning.pytorch": "zero_strategy.lightning",
             "lightning.fabric": "zero_strategy.fabric"}


def _adapter_initializing(ready: str | None = None) -> bool:
    for name in _ADAPTERS.values():
        module = sys.modules.get(name)
        if name == ready:  # the caller: its names are all defined by now
            continue
        if module is not None and getattr(module.__spec__, "_initializing", False):
            return True
    return False


def _register(trigger: str, ready: str | None = None) -> None:
    # An adapter mid-import (``import zero_strategy.fabric`` pulls in Lightning) cannot be
    # re-entered; it calls install() again once its own names exist.
    if not _adapter_initializing(ready):
        importlib.import_module(_ADAPTERS[trigger])


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps the real loader of a trigger module and registers once it has executed."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name: str, path: object = None, target: object = None):  # noqa: ANN201
        if name not in _TRIGGERS or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):  # noqa: ANN001, ANN202
                return real.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                real.exec_module(module)
                _register(name)

        spec.loader = _Loader()
        return spec


def install(ready: str | None = None) -> None:
    """Register now for every Lightning part already imported, later for the others.
    ``ready``: an adapter calling this at the end of its own import."""
    pending = False
    for trigger in _TRIGGERS:
        if trigger in sys.modules:
            _register(trigger, ready)
        elif importlib.util.find_spec("lightning") is not None:
            pending = True
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
