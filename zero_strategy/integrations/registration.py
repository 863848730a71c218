"""The strategy names ``zero1`` ... ``zero3_offload`` in Lightning's Trainer and Fabric.

Lightning looks a strategy name up in two registries (``lightning.pytorch.strategies.
StrategyRegistry`` for ``Trainer``, ``lightning.fabric.strategies.STRATEGY_REGISTRY`` for
``Fabric``) and offers no entry point through which an installed package could add to them,
so registering means importing Lightning and our two adapters. That costs about 9 s and
110 MiB of resident memory in every process (Lightning imports torchmetrics and, through it,
transformers), which a process using only the engine or Accelerate must not pay because
Lightning happens to be installed. So the names are registered, explicitly, by:

- ``import zero_strategy`` when Lightning is already imported (``import lightning`` before
  ``import zero_strategy``, as sorted imports put it): nothing more to import;
- importing a Lightning entry point, ``zero_strategy.lightning`` or ``zero_strategy.fabric``;
- calling ``zero_strategy.register_strategies()``.

Nothing is installed into the import system: a process that imports Lightning only after
``zero_strategy`` and none of the above gets Lightning's own "unknown strategy" error.
"""

from __future__ import annotations

import sys

_registered = False


def register_strategies() -> None:
    """Register the presets with both of Lightning's registries (imports Lightning;
    idempotent). Also routes ``LightningModule.load_from_checkpoint`` on one of our sharded
    checkpoint directories to the consolidating reader (``integrations.lightning.register``).
    Raises ImportError naming the extra to install when Lightning is not installed."""
    global _registered
    if _registered:
        return
    from . import require

    require("lightning", "zero_strategy.register_strategies()")
    from . import fabric, lightning

    fabric.register()
    lightning.register()
    _registered = True


def register_if_lightning_imported() -> bool:
    """What ``import zero_strategy`` runs: registers when this process has already imported
    Lightning (so registering imports nothing new)."""
    if not any(name in sys.modules for name in ("lightning.pytorch", "lightning.fabric")):
        return False
    register_strategies()
    return True
