"""The three ways the runtime follows autograd: a hook where gradients start flowing back into
a unit's output, a node where they have finished flowing out of it into its inputs, and a
callback when the whole backward pass has finished.

Below ``hooks.py`` (which installs the runtime's hooks on the model and so names
``Runtime``): the runtime registers these per forward itself, and importing them from
``hooks.py`` tied the two modules in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


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


class _InputsDone(torch.autograd.Function):
    """The identity on a module's inputs; its backward runs once the gradient of every
    input is complete, that is once the module's own backward is over."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.fn = fn
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.fn()
        return (None, *grads)


Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""A module call's positional and keyword arguments."""


def register_post_backward(args: tuple[Any, ...], kwargs: dict[str, Any],
                           fn: Callable[[], None]) -> Inputs | None:
    """``args`` and ``kwargs`` with each tensor that requires grad passed through one node
    whose backward calls ``fn`` when the module reading them has finished its backward (as
    FSDP2 registers its post-backward); None where no input requires grad (the module's
    backward then ends nowhere observable)."""
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return None
    out = _InputsDone.apply(fn, *(flat[i] for i in where))
    for i, t in zip(where, out if len(where) > 1 else (out,)):
        flat[i] = t
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs
