"""What a job prints on the console, beyond its own summary.

- The progress bar: Lightning's rich bar, titled for a run limited by steps. A job ends after
  ``trainer.max_steps``; Lightning then sets ``max_epochs`` to -1 and its bar reads
  ``Epoch 0/-2``. Here the title names the epoch and the step budget (``Epoch 0 · 300
  steps``); a run limited by epochs keeps Lightning's ``Epoch 0/4``.
- Lightning's log lines once each: imported before Hydra configured logging (the workers are
  forked from a preloaded process), Lightning keeps a console handler of its own while its
  records also reach Hydra's root handler, so every line came twice. Its advertisement for a
  logging service (a "Tip" on every run) and a deprecation warning its own code raises under
  this torch are dropped: neither is something a user of the recipes can act on.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.callbacks import RichProgressBar

# The handler sits on "lightning" when the unified package is imported, on the others when
# lightning.pytorch or lightning.fabric is imported alone.
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class _NoAdvertisement(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_console() -> None:
    """Lightning's lines once, through the root logger when one is configured; no tips."""
    if logging.getLogger().handlers:
        for name in _LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdvertisement())
    # Raised by Lightning's own pytree helper under torch >= 2.10, once per rank and epoch.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


class StepProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning's own hook for the title; tests/quick/test_recipes.py fails if a Lightning
        # release stops calling it, rather than the old title coming back unnoticed.
        max_epochs, max_steps = self.trainer.max_epochs, self.trainer.max_steps
        if max_epochs is not None and max_epochs >= 0:
            title = f"Epoch {current_epoch}/{max_epochs - 1}"
        elif max_steps is not None and max_steps > 0:
            title = f"Epoch {current_epoch} · {max_steps} steps"
        else:
            title = f"Epoch {current_epoch}"
        return f"{title:{len(self.validation_description)}}"
