"""The strategy names ``zero1`` ... ``zero3_offload`` in Lightning's Trainer and Fabric.

Lightning looks a strategy name up in two registries (``lightning.pytorch.strategies.
StrategyRegistry`` for ``Trainer``, ``lightning.fabric.strategies.STRATEGY_REGISTRY`` for
``Fabric``) and offers no entry point through which an installed package could add to them.
So registering means importing Lightning and our two adapters, which is what
``register_strategies()`` does; ``import zero_strategy`` calls it when Lightning is installed
(``pip install "zero-strategy[lightning]"``), so ``Trainer(strategy="zero3")`` works after
``import zero_strategy`` in either import order. Without Lightning installed nothing is
imported and the engine alone costs no more than torch.

Importing Lightning takes several seconds (it imports torchmetrics and, through it,
transformers when installed). A process that only uses the engine or Accelerate in an
environment that also has Lightning can skip it with ``ZERO_STRATEGY_REGISTER=0`` and call
``register_strategies()`` later if it needs the names after all.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

SKIP_ENV = "ZERO_STRATEGY_REGISTER"

_registered = False


def lightning_installed() -> bool:
    return importlib.util.find_spec("lightning") is not None


def register_strategies() -> None:
    """Register the names with both of Lightning's registries (idempotent).

    Also routes ``LightningModule.load_from_checkpoint`` on one of our sharded checkpoint
    directories to the consolidating reader (``integrations.lightning.register``).
    Raises ImportError, naming the extra to install, when Lightning is not installed.
    """
    global _registered
    if _registered:
        return
    from . import fabric, lightning

    fabric.register()
    lightning.register()
    _registered = True


def register_if_installed() -> bool:
    """What ``import zero_strategy`` runs: registers when Lightning is installed, unless
    ``ZERO_STRATEGY_REGISTER=0``. A Lightning that is installed but fails to import is
    reported, not raised: the engine does not need it."""
    setting = os.environ.get(SKIP_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{SKIP_ENV}={setting!r}: use 1 (register the Lightning strategy "
                         "names on import, the default) or 0 (do not import Lightning)")
    if setting == "0" or not lightning_installed():
        return False
    try:
        register_strategies()
    except ImportError as e:
        warnings.warn(f"Lightning is installed but importing it failed ({e}); the strategy "
                      "names zero1 ... zero3_offload are not registered", stacklevel=2)
        return False
    return True
