"""transformers' checkpointable layers (``GradientCheckpointingLayer``) for the engine's
activation checkpointing: a ``LayerKind`` (``core/layer_kinds.py``) registered for every user
by ``zero_strategy/__init__``.

Such a layer is checkpointed through its own switch, with the engine's checkpoint function,
instead of a wrapped ``forward``: transformers' models read the same switch to pass their
layers no KV cache while training (a recomputed layer would append to it twice), so the
model-wide flags go on too. transformers is never imported here: a model made of its layers
means it is loaded already, so the layer class is looked up among the loaded modules.
"""

from __future__ import annotations

import functools

from torch import nn

from ... import compat
from ...core.layer_kinds import CheckpointFunction, Undo, register_layer_kind

SWITCH = "gradient_checkpointing"
"""The public flag of transformers' layers and models (``model.gradient_checkpointing_enable``
sets it)."""


class TransformersLayers:
    """The ``LayerKind`` of transformers' ``GradientCheckpointingLayer``."""

    description = "transformers GradientCheckpointingLayer"

    def owns(self, module: nn.Module) -> bool:
        base = compat.loaded(compat.CHECKPOINTING_LAYER)
        return base is not None and isinstance(module, base)

    def switch_on(self, module: nn.Module, checkpoint: CheckpointFunction) -> Undo:
        if getattr(module, SWITCH):
            raise ValueError(
                f"activation_checkpointing: {type(module).__name__} is checkpointed by "
                "transformers already (model.gradient_checkpointing_enable(), or "
                "TrainingArguments(gradient_checkpointing=True)); it would be "
                "recomputed twice: use one of the two")
        setattr(module, SWITCH, True)
        setattr(module, compat.CHECKPOINTING_FUNCTION.name, checkpoint)
        return functools.partial(_switch_layer_off, module)

    def switch_model(self, model: nn.Module) -> list[Undo]:
        """The flag on every module that has one besides the layers (the models, which read
        it to drop the KV cache while training), unless it is on already."""
        undo: list[Undo] = []
        for module in model.modules():
            if (hasattr(module, SWITCH) and not self.owns(module)
                    and not getattr(module, SWITCH)):
                setattr(module, SWITCH, True)
                undo.append(functools.partial(setattr, module, SWITCH, False))
        return undo


def _switch_layer_off(module: nn.Module) -> None:
    setattr(module, SWITCH, False)
    module.__dict__.pop(compat.CHECKPOINTING_FUNCTION.name, None)


def register() -> None:
    """Make transformers' layers known to the engine's activation checkpointing (harmless
    twice; imports nothing of transformers)."""
    register_layer_kind(TransformersLayers())
