"""The one place where the engine attaches hooks to the user's model, and removes them.

Persistent hooks (per-parameter gradient hooks, per-unit forward hooks) are kept as handles
so ``HookSet.remove()`` leaves the model as it was found. Per-forward tensor hooks on module
outputs live only as long as the autograd graph they belong to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from .runtime import Runtime
    from .units import Unit


class HookSet:
    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def install(self, units: list[Unit], runtime: Runtime) -> None:
        for unit in units:
            for index, param in enumerate(unit.params):
                self._handles.append(
                    param.register_post_accumulate_grad_hook(_grad_hook(runtime, unit, index))
                )
            if unit.module is not None and unit.param_store.gathers:
                self._install_forward(unit, runtime)

    def _install_forward(self, unit: Unit, runtime: Runtime) -> None:
        assert unit.module is not None

        def pre(module: torch.nn.Module, args: Any) -> None:
            runtime.pre_forward(unit)

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            runtime.post_forward(unit, output)

        # prepend: gather before any user pre-hook may touch the parameters.
        self._handles.append(unit.module.register_forward_pre_hook(pre, prepend=True))
        self._handles.append(unit.module.register_forward_hook(post))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _grad_hook(runtime: Runtime, unit: Unit, index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        runtime.on_grad(unit, index, param)

    return hook


def register_pre_backward(output: Any, fn: Callable[[], None]) -> bool:
    """Call ``fn`` when the gradient of any tensor in ``output`` is about to flow backward.

    Returns False when the output holds no tensor that requires grad (nothing to hook).
    """
    leaves, _ = tree_flatten(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]

    def hook(grad: torch.Tensor) -> None:
        fn()

    for t in tensors:
        t.register_hook(hook)
    return bool(tensors)


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (autograd's final callbacks)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
