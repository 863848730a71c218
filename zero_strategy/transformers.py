"""Hugging Face transformers on ZeRO: ``ZeroTrainer`` and ``with_zero(TrainerClass)`` for
``transformers.Trainer`` and its subclasses (TRL's trainers, ``Seq2SeqTrainer``), configured
by ``ZeroPlugin`` or a plugin YAML file (``$ZERO_STRATEGY_CONFIG``). Needs the ``transformers``
extra; the adapter is ``zero_strategy/integrations/transformers.py``."""

from .integrations import require

require("transformers", "zero_strategy.transformers")
require("accelerate", "zero_strategy.transformers")

from .integrations.accelerate import ZeroPlugin  # noqa: E402
from .integrations.transformers import ZeroTrainer, ZeroTrainerMixin, with_zero  # noqa: E402

__all__ = ["ZeroPlugin", "ZeroTrainer", "ZeroTrainerMixin", "with_zero"]
