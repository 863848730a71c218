"""Optimizer state per parameter, between the inner optimizer's shard pieces and whole
parameters: the records checkpoints store, torch's own ``state_dict`` format for the user's
optimizer, and loading either back into the pieces this rank owns.

A record is ``{"scalars": {"step": 3.0}, "tensors": ["exp_avg", "exp_avg_sq"]}`` per parameter
name; tensor states are read through a ``Reader`` (parameter name, key, start, end) -> the flat
elements [start, end) of that parameter's state, so a checkpoint streams them from its shard
files and a full state dict slices its tensors, with one loading path for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .collectives import Communicator
    from .optimizer import Segment, ShardedOptimizer

Reader = Callable[[str, str, int, int], torch.Tensor]
Records = dict[str, dict[str, Any]]


def _name(seg: Segment) -> str:
    return seg.unit.layout.slots[seg.index].name


def local_records(opt: ShardedOptimizer) -> Records:
    """Records of the parameters whose pieces on this rank have optimizer state."""
    records: Records = {}
    for seg in opt.segments:
        state = opt.inner.state.get(seg.view, {})
        if not state:
            continue  # never stepped (frozen since construction, or never used)
        record = records.setdefault(_name(seg), {"scalars": {}, "tensors": []})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                record["scalars"][key] = float(value)
            elif isinstance(value, torch.Tensor) and key not in record["tensors"]:
                record["tensors"].append(key)
    return records


def piece_ranges(opt: ShardedOptimizer, records: Records
                 ) -> Iterator[tuple[Segment, str, int, int]]:
    """For each piece this rank owns whose parameter has a record: (segment, parameter name,
    start, end) of the piece inside the parameter (flattened)."""
    for seg in opt.segments:
        slot = seg.unit.layout.slots[seg.index]
        if slot.name not in records:
            continue
        lo, _ = seg.unit.layout.shard_bounds(opt.rank)
        start = seg.start + lo - slot.offset
        yield seg, slot.name, start, start + seg.end - seg.start


def load_records(opt: ShardedOptimizer, records: Records, read: Reader) -> None:
    """Replace the inner optimizer's state with the records' (a parameter without a record has
    no state afterwards, as if it had never been stepped)."""
    inner = opt.inner
    state_dict = inner.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    new_state: dict[int, dict[str, Any]] = {}
    for seg, name, start, end in piece_ranges(opt, records):
        record = records[name]
        # clone: the source may be live tensors (another optimizer's state_dict()), which
        # torch's load_state_dict would otherwise alias
        entry: dict[str, Any] = {key: read(name, key, start, end).clone()
                                 for key in record["tensors"]}
        for key, value in record["scalars"].items():
            entry[key] = torch.tensor(value, dtype=torch.float32)
        new_state[index[id(seg.view)]] = entry
    state_dict["state"] = new_state
    inner.load_state_dict(state_dict)  # torch casts each state to its piece's dtype/device


# ------------------------------------------------------------------ torch's format
def _user_params(opt: ShardedOptimizer) -> list[torch.Tensor]:
    return [p for g in opt.user.param_groups for p in g["params"]]


def full_state_dict(opt: ShardedOptimizer, names: dict[int, str],
                    comm: Communicator) -> dict[str, Any]:
    """What ``opt.user.state_dict()`` would return without ZeRO: every parameter's whole state
    under its index in the user's param groups. A collective; materialises the full state."""
    records: Records = {}
    for part in comm.all_gather_object(local_records(opt)):
        records.update(part)  # type: ignore[arg-type]
    whole = _gather_tensor_states(opt, records, comm)
    state: dict[int, dict[str, Any]] = {}
    for index, p in enumerate(_user_params(opt)):
        record = records.get(names[id(p)])
        if record is None:
            continue
        entry: dict[str, Any] = {k: torch.tensor(v, dtype=torch.float32)
                                 for k, v in record["scalars"].items()}
        for key in record["tensors"]:
            entry[key] = whole[(names[id(p)], key)]
        state[index] = entry
    groups, start = [], 0
    for group in opt.user.param_groups:
        ids = list(range(start, start + len(group["params"])))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        start += len(ids)
    return {"state": state, "param_groups": groups}


def _gather_tensor_states(opt: ShardedOptimizer, records: Records,
                          comm: Communicator) -> dict[tuple[str, str], torch.Tensor]:
    """(parameter name, key) -> the whole state tensor, one unit and key at a time."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    keys = sorted({k for r in records.values() for k in r["tensors"]})
    for unit in opt.units:
        layout = unit.layout
        device = unit.param_store.full.device
        for key in keys:
            shard = torch.zeros(layout.shard_numel, dtype=unit.param_store.master.dtype,
                                device=device)
            for seg in (s for s in opt.segments if s.unit is unit):
                value = opt.inner.state.get(seg.view, {}).get(key)
                if value is not None:
                    shard[seg.start : seg.end].copy_(value)
            full = shard
            if layout.num_shards > 1:
                full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=device)
                comm.all_gather(full, shard)
            for slot in layout.slots:
                if key in records.get(slot.name, {}).get("tensors", []):
                    out[(slot.name, key)] = full[slot.offset : slot.end].view(slot.shape).clone()
    return out


def load_full_state_dict(opt: ShardedOptimizer, names: dict[int, str],
                         state_dict: dict[str, Any]) -> None:
    """Load what ``full_state_dict`` (or an unsharded run's ``optimizer.state_dict()``)
    returned: hyperparameters into the user's groups, each parameter's state into the pieces
    this rank owns. Everything is checked before anything changes."""
    params = _user_params(opt)
    groups = _check_torch_format(opt, params, state_dict)
    records: Records = {}
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        name = names[id(p)]
        record = records.setdefault(name, {"scalars": {}, "tensors": []})
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                record["scalars"][key] = float(value)
            elif tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key!r} of parameter {name!r} (index "
                                 f"{index}) has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(p.shape)}; nothing was loaded")
            else:
                record["tensors"].append(key)
                tensors[(name, key)] = value.detach().reshape(-1)
    for group, saved in zip(opt.user.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    load_records(opt, records, lambda name, key, lo, hi: tensors[(name, key)][lo:hi])


def _check_torch_format(opt: ShardedOptimizer, params: list[torch.Tensor],
                        state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("optimizer.load_state_dict: expected torch's format, a dict with "
                         "'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    ours = [len(g["params"]) for g in opt.user.param_groups]
    if sizes != ours:
        raise ValueError(f"optimizer.load_state_dict: the saved param groups hold {sizes} "
                         f"parameters, this optimizer's {ours}; nothing was loaded")
    bad = [i for i in state_dict["state"] if not 0 <= int(i) < len(params)]
    if bad:
        raise ValueError(f"optimizer.load_state_dict: state for parameter indices {bad[:5]} "
                         f"that do not exist (0..{len(params) - 1}); nothing was loaded")
    return groups


# ------------------------------------------------------------------ the user's optimizer object
class UserOptimizerPatch:
    """Swaps the user's optimizer class for a subclass whose ``state_dict`` /
    ``load_state_dict`` go through the engine: the object the user holds then saves and
    restores the whole state in torch's format (its own ``state`` stays empty: the pieces live
    in the inner optimizer). ``remove()`` puts the original class back."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 save: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None]) -> None:
        self.optimizer = optimizer
        self.original = type(optimizer)

        def state_dict(self: Any) -> dict[str, Any]:
            return save()

        def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
            load(state_dict)

        cls = self.original
        optimizer.__class__ = type(cls.__name__, (cls,), {
            "state_dict": state_dict, "load_state_dict": load_state_dict,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        })

    def remove(self) -> None:
        self.optimizer.__class__ = self.original


# ------------------------------------------------------------------ hyperparameters in JSON
def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (lr, initial_lr, betas, ...) as JSON values, for the
    checkpoint manifest: a resume must continue from the scheduled values, not the initial."""
    out = []
    for group in optimizer.param_groups:
        saved = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            if value is None or isinstance(value, (bool, int, float, str, list)):
                saved[key] = value
        out.append(saved)
    return out


def restore_hyperparameters(optimizer: torch.optim.Optimizer,
                            saved: list[dict[str, Any]]) -> None:
    """Put saved hyperparameters back in the user's groups, in each value's current type."""
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value
