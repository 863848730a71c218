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

from .owner import OwnerPart

if TYPE_CHECKING:
    from ..comm.collectives import Communicator
    from .sharded import Segment, ShardedOptimizer, ShardPart

Reader = Callable[[str, str, "int | None", "int | None"], torch.Tensor]
Records = dict[str, dict[str, Any]]


def local_records(opt: ShardedOptimizer) -> Records:
    """Records of the parameters whose state (pieces or whole) this rank holds."""
    records: Records = {}
    for part in opt.parts:
        for name, record in part.records().items():
            known = records.setdefault(name, record)
            known["tensors"] += [k for k in record["tensors"] if k not in known["tensors"]]
    return records


def state_keys(record: dict[str, Any]) -> list[str]:
    """Every tensor state of a record: flat (laid out like the master) and whole."""
    return list(record.get("tensors", [])) + list(record.get("whole", {}))


def _piece_ranges(part: ShardPart, records: Records
                  ) -> Iterator[tuple[Segment, str, int, int]]:
    """For each piece of ``part`` on this rank whose parameter has a record: (segment,
    parameter name, start, end) of the piece inside the parameter (flattened)."""
    for seg in part.segments:
        slot = seg.unit.layout.slots[seg.index]
        if slot.name not in records:
            continue
        lo, _ = seg.unit.layout.shard_bounds(seg.unit.param_store.rank)
        start = seg.start + lo - slot.offset
        yield seg, slot.name, start, start + seg.end - seg.start


def requests(opt: ShardedOptimizer, records: Records
             ) -> Iterator[tuple[str, str, int | None, int | None]]:
    """The (parameter, key, start, end) reads ``load_records`` will make; start and end are
    None for a whole state tensor in its own shape."""
    for part in opt.parts:
        if isinstance(part, OwnerPart):
            yield from part.requests(records)
            continue
        for _, name, start, end in _piece_ranges(part, records):
            for key in state_keys(records[name]):
                yield name, key, start, end


def load_records(opt: ShardedOptimizer, records: Records, read: Reader) -> None:
    """Replace every part's state with the records' (a parameter without a record has no
    state afterwards, as if it had never been stepped)."""
    for part in opt.parts:
        load_records_part(part, records, read)


def _load_pieces(part: ShardPart, records: Records, read: Reader) -> None:
    inner = part.inner
    state_dict = inner.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    new_state: dict[int, dict[str, Any]] = {}
    for seg, name, start, end in _piece_ranges(part, records):
        record = records[name]
        # clone: the source may be live tensors (another optimizer's state_dict()), which
        # torch's load_state_dict would otherwise alias
        entry: dict[str, Any] = {key: read(name, key, start, end).clone()
                                 for key in state_keys(record)}
        for key, value in record["scalars"].items():
            entry[key] = torch.tensor(value, dtype=torch.float32)
        new_state[index[id(seg.view)]] = entry
    state_dict["state"] = new_state
    inner.load_state_dict(state_dict)  # torch casts each state to its piece's dtype/device


# ------------------------------------------------------------------ torch's format
def _user_params(part: ShardPart | OwnerPart) -> list[torch.Tensor]:
    return [p for g in part.user.param_groups for p in g["params"]]


def full_state_dict(part: ShardPart | OwnerPart, names: dict[int, str],
                    comm: Communicator) -> dict[str, Any]:
    """What ``part.user.state_dict()`` would return without ZeRO: every parameter's whole
    state under its index in the user's param groups. A collective; materialises the full
    state of this optimizer."""
    records: Records = {}
    for rank_records in comm.all_gather_object(part.records()):
        for name, record in rank_records.items():  # type: ignore[attr-defined]
            known = records.setdefault(name, record)
            known["tensors"] += [k for k in record["tensors"] if k not in known["tensors"]]
    if isinstance(part, OwnerPart):
        whole = _broadcast_owned(part, records, comm)
    else:
        whole = _gather_tensor_states(part, records, comm)
    state: dict[int, dict[str, Any]] = {}
    for index, p in enumerate(_user_params(part)):
        record = records.get(names[id(p)])
        if record is None:
            continue
        entry: dict[str, Any] = {k: torch.tensor(v, dtype=torch.float32)
                                 for k, v in record["scalars"].items()}
        for key in state_keys(record):
            entry[key] = whole[(names[id(p)], key)]
        state[index] = entry
    groups, start = [], 0
    for group in part.user.param_groups:
        ids = list(range(start, start + len(group["params"])))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        start += len(ids)
    return {"state": state, "param_groups": groups}


def _broadcast_owned(part: OwnerPart, records: Records,
                     comm: Communicator) -> dict[tuple[str, str], torch.Tensor]:
    """(parameter name, key) -> the whole state tensor, each sent by its owner."""
    mine = part.whole_states()
    out = {}
    for pl in part.placed:
        for key, info in records.get(pl.name, {}).get("whole", {}).items():
            if pl.owner == comm.rank:
                tensor = mine[(pl.name, key)].detach().to(comm.device).contiguous()
            else:
                tensor = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]),
                                     device=comm.device)
            if comm.world_size > 1:
                comm.broadcast(tensor, src=pl.owner)
            out[(pl.name, key)] = tensor.to(pl.unit.param_store.master.device, copy=True)
    return out


def _gather_tensor_states(part: ShardPart, records: Records,
                          comm: Communicator) -> dict[tuple[str, str], torch.Tensor]:
    """(parameter name, key) -> the whole state tensor, one unit and key at a time."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    keys = sorted({k for r in records.values() for k in r["tensors"]})
    units = {id(s.unit): s.unit for s in part.segments}
    for unit in part.units:
        layout = unit.layout
        if not any(slot.group in part.groups for slot in layout.slots):
            continue  # the same test on every rank: the collectives below stay matched
        device = unit.param_store.full.device
        for key in keys:
            shard = torch.zeros(layout.shard_numel, dtype=unit.param_store.master.dtype,
                                device=device)
            if id(unit) in units:
                for seg in (s for s in part.segments if s.unit is unit):
                    value = part.inner.state.get(seg.view, {}).get(key)
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


def load_full_state_dict(part: ShardPart | OwnerPart, names: dict[int, str],
                         state_dict: dict[str, Any]) -> None:
    """Load what ``full_state_dict`` (or an unsharded run's ``optimizer.state_dict()``)
    returned: hyperparameters into the user's groups, each parameter's state into the pieces
    this rank owns (or whole, on its owner). Everything is checked before anything changes."""
    params = _user_params(part)
    groups = _check_torch_format(part, params, state_dict)
    owner = isinstance(part, OwnerPart)
    records: Records = {}
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    per_element = _per_element_keys(state_dict["state"].values())
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        name = names[id(p)]
        record = records.setdefault(name, {"scalars": {}, "tensors": [], "whole": {}})
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or (value.dim() == 0 and (
                    p.dim() > 0 or key not in per_element)):
                record["scalars"][key] = float(value)
            elif owner:
                record["whole"][key] = {"shape": list(value.shape)}
                tensors[(name, key)] = value.detach()
            elif tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key!r} of parameter {name!r} (index "
                                 f"{index}) has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(p.shape)}; nothing was loaded")
            else:
                record["tensors"].append(key)
                tensors[(name, key)] = value.detach().reshape(-1)
    for group, saved in zip(part.user.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})

    def read(name: str, key: str, lo: int | None, hi: int | None) -> torch.Tensor:
        return tensors[(name, key)] if lo is None else tensors[(name, key)][lo:hi]

    load_records_part(part, records, read)


SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})
"""State torch's optimizers keep as one number per parameter (0-dim tensors)."""


def _per_element_keys(entries: Any) -> set[str]:
    """Keys holding one value per parameter element. A 0-dim parameter's per-element state
    (Adam's ``exp_avg`` of a learnable temperature) is 0-dim like a step count, so a key is
    per-element when any parameter holds it with dimensions, or when it is not one of the
    counters torch keeps per parameter."""
    keys = {k for entry in entries for k, v in entry.items() if isinstance(v, torch.Tensor)}
    shaped = {k for entry in entries for k, v in entry.items()
              if isinstance(v, torch.Tensor) and v.dim() > 0}
    return shaped | {k for k in keys if k not in SCALAR_KEYS}


def load_records_part(part: ShardPart | OwnerPart, records: Records, read: Reader) -> None:
    if isinstance(part, OwnerPart):
        part.load(records, read)
    else:
        _load_pieces(part, records, read)


def _check_torch_format(opt: ShardPart | OwnerPart, params: list[torch.Tensor],
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
