"""Adapters of the engine to Lightning's Trainer, Fabric and Accelerate, each routing its
framework's calls to ``ZeroEngine`` and holding no sharding logic; what they share is in
``shared.py`` (presets, config and precision merging, checkpoint helpers), ``hydra_launch.py``
and ``step_turns.py``. Each framework is an optional extra; ``require`` names the extra to
install when one is missing."""

from __future__ import annotations

import importlib.util


def require(module: str, user: str) -> None:
    """Raise ImportError naming the pip extra when ``module`` (a framework) is not installed;
    each framework's extra bears its name."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{user} needs {module!r}, which is not installed: "
            f"pip install \"zero-strategy[{module}]\"")
