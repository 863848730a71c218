"""The inner optimizer: the user's optimizer class rebuilt over tensors the engine owns
(shard pieces, or whole parameters on their owning rank), fed the user's hyperparameters."""

from __future__ import annotations

import inspect
from typing import Any

import torch

# Group keys that choose a kernel rather than the math; the inner optimizer keeps its own.
IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


def rebuild(cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
             groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The same optimizer class over ``groups``; torch's fused kernel when the user left the
    implementation unset and the kernel computes what the per-tensor loop does (on CPU it is
    ~6x faster, and the shard is a handful of large tensors, its best case)."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    wants_default = kwargs.get("fused") is None and kwargs.get("foreach") is None
    if ("fused" in accepted and wants_default and not kwargs.get("differentiable")
            and _fused_is_exact(cls, kwargs, groups)):
        fused_groups = [{**g, "fused": True, "foreach": None} for g in groups]
        try:
            return cls(fused_groups, **{**kwargs, "fused": True})
        except (RuntimeError, ValueError):  # dtype/device without a fused kernel
            pass
    return cls(groups, **kwargs)


def _fused_is_exact(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                    groups: list[dict[str, Any]]) -> bool:
    """Where torch's fused kernel is known to differ from the loop, the loop is kept.

    - SGD with momentum: the fused step creates momentum buffers only on the optimizer's
      first call, so a parameter whose first gradient comes later (a module unused in the
      first step, an expert no token picked) crashes it (torch 2.13: "expected Tensor as
      element 0 in argument 2, but got NoneType").
    - 16-bit tensors on the CPU: fused SGD updates some vector lanes wrongly (values of 1e38
      in its momentum, 0.8 off without it), and the other fused kernels round differently
      from the loop that one-process training runs (up to 2^-7 relative in bf16); fp32 agrees
      to the last bit or two. Measured in tests/quick/test_space.py's regression cases.
    """
    momentum = any(g.get("momentum", kwargs.get("momentum", 0)) for g in groups)
    if issubclass(cls, torch.optim.SGD) and momentum:
        return False
    return all(t.device.type != "cpu" or t.dtype == torch.float32
               for g in groups for t in g["params"])


def inner_groups(user: torch.optim.Optimizer, params: list[list[torch.Tensor]]
                 ) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": p}
            for g, p in zip(user.param_groups, params)]


def sync_hyperparameters(user: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """The user's groups (what LR schedulers change) onto the inner optimizer's."""
    for user_group, inner_group in zip(user.param_groups, inner.param_groups):
        for key, value in user_group.items():
            if key not in IMPLEMENTATION_KEYS:
                inner_group[key] = value


def state_record(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state as a record: numbers as scalars, tensors by key."""
    record: dict[str, Any] = {"scalars": {}, "tensors": []}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            record["tensors"].append(key)
        elif isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
            record["scalars"][key] = float(value)
    return record


