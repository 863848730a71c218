"""Ray Train on ZeRO: every entry point runs in a ``TorchTrainer`` training function, and
checkpoints reach Ray a worker's own shard files at a time. ``report`` (any checkpoint folder
of ours), ``save_and_report`` / ``restore`` (the engine), ``RayModelCheckpoint`` (Lightning)
and ``RayCheckpointCallback`` (transformers' Trainer). Needs the ``ray`` extra; the adapter is
the package ``zero_strategy/integrations/ray/`` (docs/ray.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .integrations import require

require("ray", "zero_strategy.ray")

from .integrations.ray import (  # noqa: E402
    Reported,
    owned_files,
    report,
    restore,
    save_and_report,
)

if TYPE_CHECKING:
    from .integrations.ray.hf import RayCheckpointCallback
    from .integrations.ray.lightning import RayModelCheckpoint

_FRAMEWORK_PARTS = {"RayModelCheckpoint": ("lightning", "lightning"),
                    "RayCheckpointCallback": ("hf", "transformers")}


def __getattr__(name: str) -> Any:
    """The Lightning and transformers parts, imported when first named: a Ray job using one
    framework does not import the other."""
    if name not in _FRAMEWORK_PARTS:
        raise AttributeError(f"module 'zero_strategy.ray' has no attribute {name!r}")
    import importlib

    module, framework = _FRAMEWORK_PARTS[name]
    require(framework, f"zero_strategy.ray.{name}")
    return getattr(importlib.import_module(f".integrations.ray.{module}", __package__), name)


__all__ = ["RayCheckpointCallback", "RayModelCheckpoint", "Reported", "owned_files", "report",
           "restore", "save_and_report"]
