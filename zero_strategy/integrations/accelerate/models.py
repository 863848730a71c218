"""What ``prepare`` hands back for a model: the trained one (``ZeroModel``) and the frozen ones
prepared for evaluation beside it at stage 3 (``ZeroFrozenModel``: TRL's reference and reward
models). Both call through an engine and hand outputs back as Accelerate does."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.utils import convert_to_fp32
from torch import nn

from ...engine import ZeroEngine


class _EngineModule(nn.Module):
    """A module whose calls go through ``engine``; ``module`` is the user's model."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine  # not an nn.Module: a plain attribute
        # Accelerate hands mixed-precision outputs back in fp32 (so the loss is fp32); do the same.
        self._fp32_outputs = engine.config.precision.endswith(("-mixed", "-autocast"))

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        output = self.engine(*args, **kwargs)
        return convert_to_fp32(output) if self._fp32_outputs else output

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated weights (a collective: every rank must call it; the whole model on
        every rank), ``module.`` keys."""
        full = self.engine.full_state_dict()
        return {f"{prefix}module.{key}": value for key, value in full.items()}


class ZeroModel(_EngineModule):
    """What ``prepare`` returns for the trained model: calls go through the engine.

    ``module`` is the user's model (``named_parameters`` carry a ``module.`` prefix, as with
    DDP); at stage 3 its parameter storage is freed between uses, so read weights through
    ``accelerator.get_state_dict(model)`` rather than the module.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """A full state dict (``module.`` keys as ``state_dict()`` writes them, or the user
        model's own keys) into the shards; checked before anything is written."""
        if assign:
            raise ValueError("assign=True would replace tensors the ZeRO engine owns; load "
                             "with assign=False")
        prefix = "module."
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
        return self.engine.load_state_dict(state_dict, strict=strict)


class ZeroFrozenModel(_EngineModule):
    """What ``prepare_model(model, evaluation_mode=True)`` returns at stage 3: calls go through
    a frozen engine, under ``torch.no_grad()``. Attributes it lacks (``config``, ``generate``,
    ``get_output_embeddings``) are the model's, as a DeepSpeed engine forwards them."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Nothing is trained through it: no graph is kept, and the engine's runtime goes back
        # to idle after the forward instead of waiting for a backward.
        with torch.no_grad():
            return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "engine"):
                raise
            return getattr(self.module, name)
