"""Hugging Face Accelerate on ZeRO: ``ZeroAccelerator`` in an ordinary ``accelerate launch``
loop, configured by ``ZeroPlugin`` or a plugin YAML file (``$ZERO_STRATEGY_CONFIG``). Needs
the ``accelerate`` extra; the adapter is the package ``zero_strategy/integrations/accelerate/``."""

from .integrations import require

require("accelerate", "zero_strategy.accelerate")

from .integrations.accelerate import (  # noqa: E402
    CONFIG_ENV,
    ZeroAccelerator,
    ZeroPlugin,
    read_plugin_file,
)

__all__ = ["CONFIG_ENV", "ZeroAccelerator", "ZeroPlugin", "read_plugin_file"]
