"""Weights out of a live engine in the layout of a model hub, a bounded bucket at a time.

``engine.full_state_dict()`` assembles the whole model on every rank. Here every tensor is
assembled on the receiving rank(s) only, a bucket of them at a time: each rank sends the part
of a tensor its master shard holds (one ``all_to_all`` per contiguous run of a unit's flat
buffer, so what arrives is the run itself, the tensors views into it), the receivers turn the
bucket's tensors into the hub's layout (``HubLayout.convert``), yield them, and drop them
before the next bucket is gathered. No rank ever holds more than one bucket (or one conversion
group, where a group is larger) beyond its own shards.

What the hub's layout is (transformers' reverse weight conversions, its tied-weight rule)
belongs to an integration, which registers a ``HubLayout`` factory here
(``register_layout``); this module knows no framework. Without one, the layout is the module's
own state dict (``PlainLayout``).

Every rank must run the same iteration (a collective): the plan (which tensors, in which
buckets, in which order) is computed from metadata every rank has, so all of them issue the
same collectives without exchanging it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..comm.collectives import Communicator
    from ..core.units import Unit
    from ..engine_view import EngineView

DEFAULT_BUCKET_BYTES = 64 * 2**20
"""What ``hub_weights`` and the streamed save hold whole at once by default: large enough that
each collective moves megabytes, small beside any model worth sharding."""

Receivers = int | Literal["all"]


# ---------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Output:
    """One tensor of the hub layout."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    @property
    def key(self) -> str:
        return self.name


@dataclass(frozen=True)
class Group:
    """In-memory tensors that turn into hub tensors together (a fused MoE projection into
    its per-expert weights; most groups are one tensor renamed or kept)."""

    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]


class HubLayout(Protocol):
    """How a module's state dict maps to the files a hub expects."""

    prefix: str
    """The key prefix of the exported model inside the engine's module ("" for itself);
    keys outside it are not exported, and it is stripped from the rest."""

    def plan(self, tensors: dict[str, torch.Tensor]) -> list[Group]:
        """The groups, in the hub's order, for the state dict ``tensors`` (on the meta
        device: shapes and dtypes only, keys without ``prefix``)."""
        ...

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One group's tensors (whole) in the hub's names and layout."""
        ...

    def aliases_to_drop(self, aliases: list[list[str]]) -> set[str]:
        """Of each list of keys naming one tensor (tied weights), those the hub leaves out."""
        ...


class PlainLayout:
    """The module's own state dict. Keys naming one tensor (tied weights) are all kept by
    default (a file may hold two equal tensors, and ``load_state_dict(strict=True)`` finds
    every key); with ``drop_aliases`` only the first in state-dict order, as Accelerate's
    ``save_model`` writes them."""

    prefix = ""

    def __init__(self, drop_aliases: bool = False) -> None:
        self.drop_aliases = drop_aliases

    def plan(self, tensors: dict[str, torch.Tensor]) -> list[Group]:
        return [Group((k,), (Output(k, tuple(t.shape), t.dtype),)) for k, t in tensors.items()]

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(tensors)

    def aliases_to_drop(self, aliases: list[list[str]]) -> set[str]:
        return {k for keys in aliases for k in keys[1:]} if self.drop_aliases else set()


LayoutFactory = Callable[[nn.Module, bool], "HubLayout | None"]
_FACTORIES: list[LayoutFactory] = []


def register_layout(factory: LayoutFactory) -> None:
    """Ask ``factory(module, merge_lora)`` for a layout before the plain one; it returns None
    for a module it does not know (and must not import its framework to find out).
    Idempotent."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)


def layout_for(module: nn.Module, merge_lora: bool = False) -> HubLayout:
    for factory in _FACTORIES:
        found = factory(module, merge_lora)
        if found is not None:
            return found
    if merge_lora:
        raise ValueError(f"merge_lora=True: {type(module).__name__} carries no adapter a "
                         "registered layout can merge (a PEFT model with a LoRA adapter)")
    return PlainLayout()


# ---------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    """One tensor of the engine's module state dict and where its value lives."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: Unit | None
    """The unit holding it in shards (None: kept whole on every rank)."""
    slot: int
    whole: torch.Tensor | None


def sources(engine: EngineView) -> tuple[dict[str, Source], list[list[str]]]:
    """Every state-dict key's source, and the lists of keys naming one tensor."""
    place = {id(p): (unit, i) for unit in engine.units for i, p in enumerate(unit.params)}
    out: dict[str, Source] = {}
    by_tensor: dict[int, list[str]] = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(key)
        if id(tensor) in place:
            unit, i = place[id(tensor)]
            slot = unit.layout.slots[i]
            out[key] = Source(key, slot.shape, unit.param_store.master.dtype, unit, i, None)
        else:
            out[key] = Source(key, tuple(tensor.shape), tensor.dtype, None, 0, tensor.detach())
    return out, [keys for keys in by_tensor.values() if len(keys) > 1]


@dataclass(frozen=True)
class Plan:
    """What an export yields: the groups in order, each input's source, the output dtype."""

    groups: list[Group]
    sources: dict[str, Source]
    """By the layout's key (the prefix stripped)."""
    layout: HubLayout
    dtype: torch.dtype | None
    num_params: int
    """Elements of the exported model's parameters (``num_parameters()``, for the index)."""

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def gathered_bytes(self, group: Group) -> int:
        return sum(torch.Size(self.sources[k].shape).numel() * self.sources[k].dtype.itemsize
                   for k in group.inputs)

    def out_bytes(self, group: Group) -> int:
        return sum(torch.Size(o.shape).numel() * self.out_dtype(o.dtype).itemsize
                   for o in group.outputs)

    def held_bytes(self, group: Group) -> int:
        """What a receiver holds of a group at once, gathered or yielded."""
        return max(self.gathered_bytes(group), self.out_bytes(group))


def plan(engine: EngineView, layout: HubLayout, dtype: torch.dtype | None) -> Plan:
    """The export's groups from shapes alone (meta tensors), the same on every rank."""
    found, aliases = sources(engine)
    prefix = layout.prefix
    found = {k[len(prefix):]: replace(s, key=k[len(prefix):]) for k, s in found.items()
             if k.startswith(prefix)}
    aliases = [[k[len(prefix):] for k in keys if k.startswith(prefix)] for keys in aliases]
    drop = layout.aliases_to_drop([keys for keys in aliases if len(keys) > 1])
    kept = {k: s for k, s in found.items() if k not in drop}
    meta = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in kept.items()}
    groups = layout.plan(meta)
    missing = {k for g in groups for k in g.inputs} - set(kept)
    if missing:
        raise RuntimeError(f"the hub layout asked for {sorted(missing)[:5]}, which the "
                           "module's state dict does not hold")
    params = {id(p): p for name, p in engine.module.named_parameters()
              if name.startswith(prefix)}
    place = {id(p): unit.layout.slots[i] for unit in engine.units
             for i, p in enumerate(unit.params)}
    count = sum(torch.Size(place[k].shape).numel() if k in place else p.numel()
                for k, p in params.items())
    return Plan(groups, kept, layout, dtype, count)


def buckets(groups: list[Group], size: Callable[[Group], int],
            bucket_bytes: int) -> list[list[Group]]:
    """Consecutive groups, a new bucket wherever the next would overflow ``bucket_bytes``;
    a group larger than that is a bucket of its own."""
    out: list[list[Group]] = []
    current: list[Group] = []
    held = 0
    for group in groups:
        n = size(group)
        if current and held + n > bucket_bytes:
            out.append(current)
            current, held = [], 0
        current.append(group)
        held += n
    if current:
        out.append(current)
    return out


# ---------------------------------------------------------------------------- gathering
def receivers_of(engine: EngineView, to: Receivers) -> tuple[bool, int | None]:
    """(whether this rank receives, the receiving rank within this rank's shard group:
    None for every rank of it, -1 where no rank of this group receives)."""
    if to == "all":
        return True, None
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < engine.comm.world_size:
        raise ValueError(f"to must be a rank in [0, {engine.comm.world_size}) or 'all', got "
                         f"{to!r}")
    size = engine.shards.world_size  # hybrid sharding: shard groups are consecutive blocks
    if to // size != engine.comm.rank // size:
        return False, -1
    return engine.comm.rank == to, to % size


def gather(engine: EngineView, plan_: Plan, keys: list[str], to: Receivers,
           ) -> dict[str, torch.Tensor]:
    """The whole values of ``keys`` on the receiving rank(s), on CPU ({} elsewhere)."""
    mine, target = receivers_of(engine, to)
    out: dict[str, torch.Tensor] = {}
    for run in _runs([plan_.sources[k] for k in keys]):
        unit = run[0].unit
        if unit is None:
            if mine:
                out[run[0].key] = run[0].whole.cpu()  # type: ignore[union-attr]
            continue
        flat = _gather_run(engine.shards, unit, run, target)
        if mine:
            for s in run:
                slot = unit.layout.slots[s.slot]
                lo = slot.offset - unit.layout.slots[run[0].slot].offset
                out[s.key] = flat[lo : lo + slot.numel].view(slot.shape)
    return out


def _runs(found: list[Source]) -> list[list[Source]]:
    """Consecutive sources that are consecutive slots of one unit, gathered as one range."""
    runs: list[list[Source]] = []
    for s in found:
        last = runs[-1][-1] if runs else None
        if (last is not None and s.unit is not None and last.unit is s.unit
                and s.slot == last.slot + 1):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _gather_run(comm: Communicator, unit: Unit, run: list[Source],
                target: int | None) -> torch.Tensor:
    """The flat master range from the run's first slot to its last (alignment gaps
    included) on ``target`` (None: every rank; -1: none), as a CPU tensor there."""
    layout, store = unit.layout, unit.param_store
    lo, hi = layout.slots[run[0].slot].offset, layout.slots[run[-1].slot].end
    master = store.master
    store.placement.before_read([master])
    try:
        if layout.num_shards == 1:  # every rank holds the whole master
            return master[lo:hi].cpu().clone() if target in (None, comm.rank) else master[:0]
        if target == -1:
            return master[:0]
        counts = []
        for r in range(comm.world_size):
            a, b = layout.shard_bounds(r)
            counts.append(max(0, min(b, hi) - max(a, lo)))
        a, _ = layout.shard_bounds(comm.rank)
        piece = master[max(a, lo) - a : max(a, lo) - a + counts[comm.rank]].to(comm.device)
        every = range(comm.world_size)
        if target is None:
            send = piece.repeat(comm.world_size)
            send_counts, recv_counts = [counts[comm.rank]] * comm.world_size, counts
        else:
            send = piece
            send_counts = [counts[comm.rank] if r == target else 0 for r in every]
            recv_counts = counts if comm.rank == target else [0] * comm.world_size
        return comm.all_to_all(send, send_counts, recv_counts).cpu()
    finally:
        store.placement.done_with([master], dirty=False)


# ---------------------------------------------------------------------------- iterating
def bucket_iter(engine: EngineView, plan_: Plan, groups: list[Group], bucket_bytes: int,
                to: Receivers, *, only: Callable[[Output], bool] | None = None,
                ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket of ``groups`` gathered, converted and cast: a list of (hub name, tensor)
    on the receivers, an empty list elsewhere (every rank runs every bucket). ``only`` keeps
    a group's outputs it accepts (a file holding part of a group)."""
    engine.runtime.settle()
    engine.settle_tier()
    mine = receivers_of(engine, to)[0]
    for bucket in buckets(groups, plan_.held_bytes, bucket_bytes):
        done: list[tuple[str, torch.Tensor]] = []
        for group in bucket:
            values = gather(engine, plan_, list(group.inputs), to)
            if not mine:
                continue
            converted = plan_.layout.convert(values)
            del values
            for out in group.outputs:
                if only is not None and not only(out):
                    continue
                value = converted[out.name]
                if tuple(value.shape) != out.shape:
                    raise RuntimeError(f"{out.name}: the layout planned {list(out.shape)}, "
                                       f"its conversion gave {list(value.shape)}")
                done.append((out.name, value.to(plan_.out_dtype(value.dtype)).contiguous()))
            del converted
        yield done
        del done


def hub_weight_buckets(engine: EngineView, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       to: Receivers = 0, dtype: torch.dtype | None = None,
                       merge_lora: bool = False, layout: HubLayout | None = None,
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """See ``ZeroEngine.hub_weight_buckets``."""
    check_bucket_bytes(bucket_bytes)
    check_dtype(dtype)
    receivers_of(engine, to)  # refuse a bad rank before any collective
    chosen = layout if layout is not None else layout_for(engine.module, merge_lora)
    p = plan(engine, chosen, dtype)
    yield from bucket_iter(engine, p, p.groups, bucket_bytes, to)


def check_bucket_bytes(bucket_bytes: Any) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")


def check_dtype(dtype: Any) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype)
                              or not dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch dtype, got {dtype!r}")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as "5GB" (powers of 1000, as huggingface_hub reads
    them) or "2GiB" (powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if unit in _UNITS and value > 0:
            return int(value * _UNITS[unit])
    raise ValueError(f"max_shard_size must be a positive int (bytes) or a size such as "
                     f"'5GB' or '500MiB', got {size!r}")


__all__ = ["DEFAULT_BUCKET_BYTES", "Group", "HubLayout", "Output", "Plan", "PlainLayout",
           "bucket_iter", "hub_weight_buckets", "layout_for", "parse_size", "plan",
           "register_layout"]
