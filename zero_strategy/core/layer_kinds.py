"""Layers that checkpoint themselves: a framework's own switch for activation checkpointing,
which the engine drives instead of wrapping the layer's ``forward``.

Some frameworks' layers carry a checkpointing switch their model also reads for other
decisions (transformers' models pass their layers no KV cache while it is on, since a
recomputed layer would append to the cache twice). Wrapping such a layer's ``forward`` would
checkpoint it without the model knowing; turning the framework's switch on, with the engine's
checkpoint function, keeps the two in agreement. The core knows no framework: an integration
registers a ``LayerKind`` describing its layers, and ``activations.py`` asks the registered
kinds. A kind must not import its framework: a model holding its layers means the framework is
loaded already, so a kind looks for it among the loaded modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

CheckpointFunction = Callable[..., Any]
"""``checkpoint(function, *args, **kwargs)``: what a switched-on layer runs its forward with."""

Undo = Callable[[], None]


class LayerKind(Protocol):
    """One framework's checkpointable layers, as the activation policy drives them."""

    description: str
    """The layers' name in the error ``activation_checkpointing=True`` raises when it finds
    nothing to checkpoint (e.g. ``"transformers GradientCheckpointingLayer"``)."""

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of this kind's layers (False whenever the framework is
        not loaded)."""
        ...

    def switch_on(self, module: nn.Module, checkpoint: CheckpointFunction) -> Undo:
        """Turn the layer's own checkpointing on, running ``checkpoint``; refuse by name a
        layer the framework checkpoints already. Returns what switches it back."""
        ...

    def switch_model(self, model: nn.Module) -> list[Undo]:
        """Once any layer of this kind is switched on: what the rest of ``model`` must know
        (its own flags), and what undoes it."""
        ...


_KINDS: dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind) -> None:
    """Make ``kind`` known to the activation policy; a kind of the same description is
    replaced (registering twice is harmless)."""
    _KINDS[kind.description] = kind


def layer_kinds() -> tuple[LayerKind, ...]:
    return tuple(_KINDS.values())


def kind_of(module: nn.Module) -> LayerKind | None:
    """The registered kind ``module`` is a layer of, if any."""
    for kind in _KINDS.values():
        if kind.owns(module):
            return kind
    return None
