"""What TRL's trainers do to their models beyond ``Trainer`` that a ZeRO trainer must take over.

Their reference and reward models are prepared with ``accelerator.prepare_model(...,
evaluation_mode=True)``, which ``ZeroAccelerator`` answers (frozen engines at stage 3,
``integrations/accelerate/frozen.py``). What is left is TRL's ``sync_ref_model``: its
``SyncRefModelCallback`` mixes the policy into the reference in place through ``.data``
(``ref = (1 - alpha) ref + alpha policy``), which at stage 3 would read and write the
placeholders both models hold between gathers. Under DeepSpeed ZeRO-3 TRL gathers both whole
models at once; here each pair of parameters is gathered alone (the policy's read-only, the
reference's writable, so the edit reaches its shards and masters), so a sync holds two
parameters whole at a time, never a model.

Importing this module imports no framework; TRL is looked for among the loaded modules only.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

# TRL's callback (trl.trainer.callbacks) and the method of it that does the mixing.
SYNC_CALLBACK = ("trl.trainer.callbacks", "SyncRefModelCallback")
SYNC_METHOD = "sync_target_model"


def adapt_callbacks(trainer: Any) -> None:
    """Route TRL's reference-model sync of ``trainer`` through the engines (stage 3; at stages
    0-2 every parameter is whole and TRL's own update is exact)."""
    module = sys.modules.get(SYNC_CALLBACK[0])
    cls = getattr(module, SYNC_CALLBACK[1], None) if module is not None else None
    engine_of = getattr(trainer.accelerator, "zero_config", None)
    if cls is None or engine_of is None or engine_of.stage != 3:
        return
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, cls):
            # An instance attribute shadows TRL's staticmethod, called as self.sync_target_model
            setattr(callback, SYNC_METHOD, functools.partial(_sync_sharded, trainer.accelerator))


def _sync_sharded(accelerator: Any, model: nn.Module, target: nn.Module, alpha: float) -> None:
    """``target = (1 - alpha) target + alpha model``, parameter by parameter, each pair gathered
    whole on every rank (collectives: every rank runs it, as TRL's callback does)."""
    frozen = getattr(target, "engine", None)
    if frozen is None:
        raise TypeError(f"sync_ref_model: the reference model is a {type(target).__name__}, "
                        "not one prepared by the ZeRO accelerator (prepare_model(..., "
                        "evaluation_mode=True))")
    policy = accelerator.engine
    pairs = list(zip(target.module.parameters(), model.parameters(), strict=True))
    with torch.no_grad():
        for target_param, copy_param in pairs:
            with policy.gathered_parameters([copy_param]), \
                    frozen.gathered_parameters([target_param], writable=True):
                target_param.mul_(1.0 - alpha).add_(copy_param, alpha=alpha)


__all__ = ["adapt_callbacks"]
