"""``ZeroPlugin``: the ZeRO options of a ``ZeroAccelerator`` (and of ``ZeroTrainer``), from
keyword arguments in code and/or a plugin YAML file. Keys, types and values are checked by
``ZeroConfig``'s own ``check_options`` / ``from_options``, so a wrong one reads as it does from
every other entry point, after the file (or the arguments) it came from; precision is settled
against Accelerate's ``mixed_precision`` by ``reconcile_precision``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ...config import (
    PRECISIONS,
    ConfigError,
    PrecisionFlag,
    ZeroConfig,
    check_options,
    reconcile_precision,
)

CONFIG_ENV = "ZERO_STRATEGY_CONFIG"
"""Environment variable naming the plugin config file (a YAML mapping of ZeroConfig fields)."""
CODE_SOURCE = "ZeroPlugin(...) arguments"
"""How errors name options given in code."""

# Accelerate's mixed_precision names and the engine precision each one means by default:
# what Accelerate itself runs (and transformers' Trainer through it), autocast over fp32
# weights. The compute copies ("-mixed") are a choice made in the plugin.
_FROM_ACCELERATE = {"no": "32-true", "bf16": "bf16-autocast", "fp16": "16-autocast"}
# Explicit engine precisions that agree with each Accelerate setting ("no" leaves it to us).
COMPATIBLE_PRECISIONS = {"no": set(PRECISIONS),
                         "bf16": {"bf16-autocast", "bf16-mixed", "bf16-true"},
                         "fp16": {"16-autocast", "16-mixed"}}
# Accelerate's fp16 scales the loss with torch's GradScaler: its default knobs (halve at every
# overflow, double after 2000 clean steps) in LossScaleConfig's words, used when the precision
# comes from mixed_precision and the plugin sets no loss_scale of its own.
GRAD_SCALER_LOSS_SCALE = {"initial_scale": 2.0**16, "growth_interval": 2000, "hysteresis": 1}


class ZeroPlugin:
    """ZeRO options for ``ZeroAccelerator``: a plugin config file and/or keyword arguments.

    ``ZeroPlugin(**options)`` takes ``ZeroConfig`` fields from code only;
    ``ZeroPlugin.from_config(path=None, **overrides)`` reads the file (``path``, else
    ``$ZERO_STRATEGY_CONFIG``, else none) and lets keyword arguments override it. Values are
    checked here, so a bad config fails before training starts.
    """

    def __init__(self, config_file: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self.config_file = None if config_file is None else str(config_file)
        self.file_options = {} if config_file is None else read_plugin_file(config_file)
        check_options(options, source=CODE_SOURCE)
        self.code_options = dict(options)
        self.options = {**self.file_options, **self.code_options}
        self.resolve(None)  # validate now; precision is settled once Accelerate's is known

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None,
                    **overrides: Any) -> ZeroPlugin:
        """Options from ``path`` (else ``$ZERO_STRATEGY_CONFIG``), overridden by ``overrides``."""
        if path is None:
            path = os.environ.get(CONFIG_ENV) or None
        return cls(path, **overrides)

    @property
    def source(self) -> str:
        """Where the options came from, for error messages."""
        if self.config_file is None:
            return CODE_SOURCE
        overridden = sorted(self.code_options)
        suffix = f" (with code overrides {overridden})" if overridden else ""
        return f"zero plugin config {self.config_file}{suffix}"

    def resolve(self, mixed_precision: str | None) -> ZeroConfig:
        """The ``ZeroConfig``, with precision settled against Accelerate's ``mixed_precision``
        (None: validate only)."""
        values = dict(self.options)
        if mixed_precision is not None:
            values["precision"] = self.settle_precision(mixed_precision)
            if "precision" not in self.options and "loss_scale" not in values \
                    and values["precision"] == _FROM_ACCELERATE["fp16"]:
                values["loss_scale"] = dict(GRAD_SCALER_LOSS_SCALE)
        elif "precision" not in values and "loss_scale" in values:
            values["precision"] = "16-mixed"  # validation only: loss scaling implies fp16 will come
        return ZeroConfig.from_options(values, source=self.source)

    def settle_precision(self, mixed_precision: str, setting: str | None = None) -> str:
        """The engine precision beside Accelerate's ``mixed_precision`` ("no", "bf16", "fp16"):
        the plugin's own if it sets one that agrees, else what ``mixed_precision`` means.
        ``setting`` names the flag as the user set it (default: Accelerate's name for it)."""
        return reconcile_precision(self.options.get("precision"),
                                   accelerate_flag(mixed_precision, setting), source=self.source)

    def __repr__(self) -> str:
        return f"ZeroPlugin(source={self.source!r}, options={self.options!r})"


def accelerate_flag(mixed_precision: str, setting: str | None = None) -> PrecisionFlag:
    """Accelerate's ``mixed_precision`` as ``reconcile_precision`` reads it."""
    if mixed_precision not in _FROM_ACCELERATE:
        raise ConfigError(
            f"Accelerate mixed_precision={mixed_precision!r} is not supported by "
            f"ZeroAccelerator; use one of {sorted(_FROM_ACCELERATE)}")
    agrees = tuple(p for p in PRECISIONS if p in COMPATIBLE_PRECISIONS[mixed_precision])
    return PrecisionFlag(setting or f"Accelerate's mixed_precision={mixed_precision!r}",
                         _FROM_ACCELERATE[mixed_precision], agrees)


def read_plugin_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plugin config file as a dict of ZeroConfig fields, keys and types checked."""
    named_by = f" (named by ${CONFIG_ENV})" if os.environ.get(CONFIG_ENV) == str(path) else ""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"zero plugin config {path}{named_by} does not exist") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"zero plugin config {path}: not valid YAML: {err}") from None
    data = {} if data is None else data
    check_options(data, source=f"zero plugin config {path}")
    return data
