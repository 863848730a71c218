"""An engine's state in torch's formats: the module's (whole, loaded or consolidated), the
user's optimizers' (through their own ``state_dict``), and the plain module ``close`` gives
back with the trained weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..offload.disk import DiskFullError
from ..optim.state import UserOptimizerPatch, full_state_dict, load_full_state_dict
from .parts import EngineParts


def settle_tier(parts: EngineParts) -> None:
    if parts.tier is not None:
        parts.tier.drain()


def unmanaged_state(parts: EngineParts) -> dict[str, torch.Tensor]:
    managed = {id(p) for u in parts.units for p in u.params}
    return {k: v for k, v in parts.module.state_dict(keep_vars=True).items()
            if id(v) not in managed}


def full_module_state(parts: EngineParts) -> dict[str, torch.Tensor]:
    values: dict[int, torch.Tensor] = {}
    parts.runtime.settle()
    for unit in parts.units:
        flat = unit.param_store.gather_master(parts.shards).cpu()
        for slot, p in zip(unit.layout.slots, unit.params):
            values[id(p)] = flat[slot.offset : slot.end].view(slot.shape).clone()
    out = {}
    for key, tensor in parts.module.state_dict(keep_vars=True).items():
        if id(tensor) in values:
            out[key] = values[id(tensor)]
        else:
            out[key] = tensor.detach().cpu().clone()
    return out


def load_module_state(parts: EngineParts, state_dict: dict[str, torch.Tensor],
                      strict: bool) -> Any:
    parts.check_open("load_state_dict")
    settle_tier(parts)
    place = parts.access.place
    expected = {k: (place[id(v)][0].layout.slots[place[id(v)][1]].shape if id(v) in place
                    else tuple(v.shape))
                for k, v in parts.module.state_dict(keep_vars=True).items()}
    problems = [f"size mismatch for {k}: {tuple(v.shape)} given, {expected[k]} expected"
                for k, v in state_dict.items()
                if k in expected and tuple(v.shape) != tuple(expected[k])]
    if strict:
        problems += [f"missing key {k!r}" for k in expected if k not in state_dict]
        problems += [f"unexpected key {k!r}" for k in state_dict if k not in expected]
    if problems:
        raise RuntimeError("engine.load_state_dict: nothing was loaded: "
                           + "; ".join(problems[:10]))
    parts.runtime.settle()
    parts.runtime.reshard_all()
    return parts.module.load_state_dict(state_dict, strict=strict)


# ------------------------------------------------------------------ the user's optimizers
def patch_user_optimizers(parts: EngineParts) -> list[UserOptimizerPatch]:
    """Each user optimizer's ``state_dict`` / ``load_state_dict`` through the engine."""
    return [UserOptimizerPatch(part.user, _part_saver(parts, k), _part_loader(parts, k))
            for k, part in enumerate(parts.optimizer.parts)]


def _part_saver(parts: EngineParts, k: int) -> Callable[[], dict[str, Any]]:
    def save() -> dict[str, Any]:
        parts.check_open("optimizer.state_dict")
        return full_state_dict(parts.optimizer.parts[k], parts.param_names, parts.shards)
    return save


def _part_loader(parts: EngineParts, k: int) -> Callable[[dict[str, Any]], None]:
    def load(state_dict: dict[str, Any]) -> None:
        parts.check_open("optimizer.load_state_dict")
        settle_tier(parts)
        load_full_state_dict(parts.optimizer.parts[k], parts.param_names, state_dict)
    return load


# ------------------------------------------------------------------ closing
def close(parts: EngineParts) -> nn.Module:
    if parts._closed:
        return parts.module
    parts.runtime.settle()
    parts.runtime.reshard_all()
    with torch.no_grad():
        for unit in parts.units:
            flat = unit.param_store.gather_master(parts.shards)
            for slot, p in zip(unit.layout.slots, unit.params):
                value = flat[slot.offset : slot.end].view(slot.shape)
                p.data = _closed_copy(parts, value, parts.original_dtypes[id(p)], slot.name)
    parts.hooks.remove()
    parts.patches.remove()
    parts.activations.remove()
    for patch in parts.optimizer_patches:
        patch.remove()
    parts._closed = True
    parts.units = []
    parts.optimizer.segments = []
    if parts.tier is not None:
        parts.tier.close()
    return parts.module


def _closed_copy(parts: EngineParts, value: torch.Tensor, dtype: torch.dtype,
                 name: str) -> torch.Tensor:
    """A parameter's value for the plain module ``close`` gives back. With the disk tier
    the model may not fit in memory, so the value goes into a file of the tier, mapped:
    the mapping outlives the file's directory entry, which ``close`` removes, and its
    pages are read on use and reclaimable, like a checkpoint loaded with ``mmap=True``."""
    if parts.tier is None:
        return value.to(dtype, copy=True)
    try:
        out = parts.tier.empty(value.numel(), dtype, f"closed.{name}").view(value.shape)
    except DiskFullError:  # the weights must come back: in memory, then
        return value.to(dtype, copy=True)
    out.copy_(value)
    parts.tier.release([out], dirty=True)
    return out
