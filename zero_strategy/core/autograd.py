"""The two ways the runtime follows autograd: a hook where gradients start flowing back into
a unit's output, and a callback when the whole backward pass has finished.

Below ``hooks.py`` (which installs the runtime's hooks on the model and so names
``Runtime``): the runtime registers these per forward itself, and importing them from
``hooks.py`` tied the two modules in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


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
