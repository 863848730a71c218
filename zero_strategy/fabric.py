"""Lightning Fabric on ZeRO: ``Fabric(strategy="zero3")``, or ``ZeroFabricStrategy(...)``.
Needs the ``lightning`` extra; the adapter is ``zero_strategy/integrations/fabric.py``."""

from .integrations import require

require("lightning", "zero_strategy.fabric")

from .integrations.registration import register_strategies  # noqa: E402

register_strategies()  # Trainer and Fabric names: this entry point means Lightning is in use

from .integrations.fabric import ZeroFabricPrecision, ZeroFabricStrategy  # noqa: E402
from .integrations.shared import PRESET_DESCRIPTIONS, PRESETS  # noqa: E402

__all__ = ["PRESETS", "PRESET_DESCRIPTIONS", "ZeroFabricPrecision", "ZeroFabricStrategy"]
