"""Hugging Face transformers on ZeRO: ``ZeroTrainer`` and ``with_zero(TrainerClass)`` for
``transformers.Trainer`` and its subclasses (TRL's trainers, ``Seq2SeqTrainer``), configured
by ``ZeroPlugin`` or a plugin YAML file (``$ZERO_STRATEGY_CONFIG``); and ``from_pretrained``,
which builds a model on the meta device so that the engine streams each rank's part of the
folder's weights straight into its shards. Needs the ``transformers`` extra; the adapters are
``zero_strategy/integrations/hf/`` (``trainer.py``, ``pretrained.py``)."""

from .integrations import require

require("transformers", "zero_strategy.transformers")
require("accelerate", "zero_strategy.transformers")

from .integrations.accelerate import ZeroPlugin  # noqa: E402
from .integrations.hf.pretrained import from_pretrained, loading_info  # noqa: E402
from .integrations.hf.trainer import ZeroTrainer, ZeroTrainerMixin, with_zero  # noqa: E402

__all__ = ["ZeroPlugin", "ZeroTrainer", "ZeroTrainerMixin", "from_pretrained", "loading_info",
           "with_zero"]
