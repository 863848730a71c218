"""Sharded initialisation: a model built on the meta device is materialised module by module,
just before the unit holding its parameters is flattened and sharded, so no rank ever holds
the whole model (the largest unit plus the shards built so far is the peak).

Parameters keep their identity (``torch.utils.swap_tensors`` replaces what the
``nn.Parameter`` object holds, not the object), so tied weights stay tied and an optimizer
built on the meta parameters stays valid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``; modules without one cannot be initialised implicitly."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device and no "
            "reset_parameters(): pass param_init_fn= to ZeroEngine (for a transformers model, "
            "param_init_fn=model._init_weights) so its values are defined"
        )
    reset()


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model, recurse=True))


def _tensors(module: nn.Module, recurse: bool) -> Iterable[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


class Materializer:
    """Turns meta tensors into real ones on ``device``, one owning module at a time."""

    def __init__(self, model: nn.Module, device: torch.device, init_fn: InitFn | None) -> None:
        self.device = device
        self.init_fn = init_fn or default_init
        self.owners: dict[int, list[nn.Module]] = {}
        self.modules = [m for m in model.modules()]
        for module in self.modules:
            for p in module.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(module)
        self.done: set[int] = set()

    def _materialize(self, module: nn.Module) -> None:
        if id(module) in self.done:
            return
        self.done.add(id(module))
        metas = [t for t in _tensors(module, recurse=False) if t.is_meta]
        if not metas:
            return
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                if p.is_meta:  # swap keeps the Parameter object: ties and optimizer refs hold
                    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                        requires_grad=p.requires_grad)
                    torch.utils.swap_tensors(p, real)
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device=self.device)
            self.init_fn(module)

    def ensure(self, params: Iterable[nn.Parameter]) -> None:
        """Make ``params`` real, initialising every module that owns one of them."""
        for p in params:
            if p.is_meta:
                for module in self.owners.get(id(p), []):
                    self._materialize(module)

    def finish(self) -> None:
        """Whatever is still on meta (frozen parameters, buffers)."""
        for module in self.modules:
            if any(t.is_meta for t in _tensors(module, recurse=False)):
                self._materialize(module)
