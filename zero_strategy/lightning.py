"""Lightning's Trainer on ZeRO: ``Trainer(strategy="zero3")``, or ``ZeroStrategy(config=...)``
for full control. Needs the ``lightning`` extra; the adapter is
``zero_strategy/integrations/lightning.py``."""

from .integrations import require

require("lightning", "zero_strategy.lightning")

from .integrations.registration import register_strategies  # noqa: E402

register_strategies()  # Trainer and Fabric names: this entry point means Lightning is in use

from .integrations.lightning import (  # noqa: E402
    ZeroPrecision,
    ZeroStrategy,
    consolidate_checkpoint,
    is_zero_checkpoint,
    load_zero_checkpoint,
)

__all__ = ["ZeroPrecision", "ZeroStrategy", "consolidate_checkpoint", "is_zero_checkpoint",
           "load_zero_checkpoint"]
