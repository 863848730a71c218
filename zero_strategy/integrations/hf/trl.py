"""What TRL's trainers do to their models beyond ``Trainer`` that a ZeRO trainer must take over.

Their reference and reward models are prepared with ``accelerator.prepare_model(...,
evaluation_mode=True)``, which ``ZeroAccelerator`` answers (frozen engines at stage 3,
``integrations/accelerate/frozen.py``). Two things are left.

GRPO, RLOO and DPO load a reference model from a folder with TRL's
``create_model_from_path`` (plain ``from_pretrained``: the whole model on every rank until
it is prepared). At stage 3, once the trainer's accelerator exists (the policy passed by
name is loaded before it, as TRL does), the reference is built with
``zero_strategy.transformers.from_pretrained`` instead: on the meta device, its weights
streamed into the frozen engine's shards, each rank reading its own ranges
(docs/pretrained.md). Options that streaming cannot honour (quantization, a Hub id) keep
TRL's loading.

The other is TRL's ``sync_ref_model``: its
``SyncRefModelCallback`` mixes the policy into the reference in place through ``.data``
(``ref = (1 - alpha) ref + alpha policy``), which at stage 3 would read and write the
placeholders both models hold between gathers. Under DeepSpeed ZeRO-3 TRL gathers both whole
models at once; here each pair of parameters is gathered alone (the policy's read-only, the
reference's writable, so the edit reaches its shards and masters), so a sync holds two
parameters whole at a time, never a model.

Importing this module imports no framework; TRL is looked for among the loaded modules only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# TRL's callback (trl.trainer.callbacks) and the method of it that does the mixing.
SYNC_CALLBACK = ("trl.trainer.callbacks", "SyncRefModelCallback")
SYNC_METHOD = "sync_target_model"


# TRL's loader of models named by a path, as each trainer module imports it.
LOADER = "create_model_from_path"


@contextlib.contextmanager
def streamed_references(trainer: Any) -> Iterator[None]:
    """While ``trainer`` (a ZeRO trainer subclassing one of TRL's) is constructed, the TRL
    modules its classes come from load a model named by a local folder streamed (see the
    module docstring) once its accelerator exists at stage 3."""
    modules = {sys.modules.get(c.__module__) for c in type(trainer).__mro__
               if c.__module__.split(".")[0] == "trl"}
    patched = [(m, getattr(m, LOADER)) for m in modules
               if m is not None and callable(getattr(m, LOADER, None))]
    for module, original in patched:
        setattr(module, LOADER, functools.partial(_load, trainer, original))
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, LOADER, original)


def _load(trainer: Any, original: Any, model_id: str, architecture: Any = None,
          **kwargs: Any) -> Any:
    accelerator = getattr(trainer, "accelerator", None)
    config = getattr(accelerator, "zero_config", None)
    if config is None or config.stage != 3 or not os.path.isdir(str(model_id)):
        return original(model_id, architecture, **kwargs)
    from .pretrained import from_pretrained  # imports transformers: only here

    cls = architecture if architecture is not None else _architecture(model_id, kwargs)
    try:
        return from_pretrained(cls, model_id, **kwargs)
    except ValueError as err:  # an option streaming refuses by name: TRL's own loading
        warnings.warn(f"the reference model {model_id} is loaded whole on every rank before "
                      f"it is sharded: {err}", stacklevel=2)
        return original(model_id, architecture, **kwargs)


def _architecture(model_id: str, kwargs: dict[str, Any]) -> Any:
    """The model class the folder's config names (as TRL picks it), else the causal-LM
    auto class."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        model_id, trust_remote_code=kwargs.get("trust_remote_code", False))
    names = getattr(config, "architectures", None) or []
    found = getattr(transformers, names[0], None) if names else None
    return found if found is not None else transformers.AutoModelForCausalLM


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


__all__ = ["adapt_callbacks", "streamed_references"]
