"""The user's optimizers, rebuilt over what this rank holds.

An elementwise optimizer (SGD, Adam, AdamW, ...) becomes a ``ShardPart``: the same class with
the same hyperparameters, given one tensor per parameter piece in this rank's shard (a view of
the master shard); it computes exactly what it would on the whole parameters, and each
parameter keeps its own state and step count, so a parameter that gets no gradient on any rank
in a step (frozen, or an unused expert) is skipped exactly as torch skips a parameter whose
``.grad`` is None. An optimizer that reads parameters whole (Muon, Adafactor) becomes an
``owner.OwnerPart``. The user's optimizer objects stay the source of hyperparameters: LR
schedulers attached to them keep working because their groups are copied onto the inner
groups before every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from ..comm.collectives import Communicator
from ..core.grads import max_abs, powered_norm
from ..core.units import Unit
from .combined import parts as combined_parts
from .inner import IMPLEMENTATION_KEYS, inner_groups, rebuild, state_record, sync_hyperparameters
from .owner import OwnerPart
from .residence import InMemory, Streamed

if TYPE_CHECKING:
    from ..offload.disk import DiskTier

# How many parameter-sized state tensors each optimizer keeps (the ZeRO formula's K / 4 in
# fp32). Used for the memory prediction before the first step has created any state.
_STATES_PER_PARAM = {
    "SGD": 0, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1,
    "Adadelta": 2, "RMSprop": 1, "Rprop": 2, "ASGD": 1,
}
_OPTIONAL_STATES = {"SGD": ("momentum",), "Adam": ("amsgrad",), "AdamW": ("amsgrad",),
                    "RMSprop": ("momentum", "centered")}
"""Options that each add one parameter-sized state when set (SGD's momentum buffer, Adam's
max_exp_avg_sq, RMSprop's momentum buffer and grad_avg)."""


# torch's optimizers whose update of each element reads only that element's gradient and
# state: run on flat shards they compute exactly what they compute on whole parameters.
ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)


# torch's optimizers whose update reads a parameter as a whole but each parameter on its own
# (Muon's orthogonalisation, Adafactor's row/column statistics): exact when one rank updates
# each whole parameter (``owner.OwnerPart``).
PER_PARAMETER = (torch.optim.Muon, torch.optim.Adafactor)

# Optimizers that couple parameters or need what a step() without a closure cannot give.
REFUSED = {
    torch.optim.LBFGS: "LBFGS treats all its parameters as one vector and re-evaluates the loss "
                       "through a closure",
    torch.optim.SparseAdam: "SparseAdam needs sparse gradients; ZeRO reduces dense ones",
}


def placement(optimizer: torch.optim.Optimizer, declared: bool) -> str:
    """"shard": run on the flat shard pieces (exact for elementwise updates, the fast path);
    "owner": each whole parameter updated on one owning rank (exact for any update that reads
    only that parameter: its shape, norms, rows or columns). ``declared``
    (``ZeroConfig(elementwise_optimizer=True)``) puts a user-defined optimizer on shards."""
    for base, why in REFUSED.items():
        if isinstance(optimizer, base):
            raise ValueError(f"{type(optimizer).__name__} cannot be trained with ZeRO: {why}")
    for base in ELEMENTWISE:  # a subclass that keeps the base's step is the same math
        if isinstance(optimizer, base) and type(optimizer).step is base.step:
            return "shard"
    user_defined = not type(optimizer).__module__.startswith("torch.")
    if declared and user_defined:
        return "shard"
    return "owner"


@dataclass(frozen=True)
class Segment:
    """One optimizer tensor: the piece of one parameter that lies in this rank's shard."""

    unit: Unit
    index: int
    """The parameter's slot in the unit's layout."""
    group: int
    start: int
    end: int
    view: torch.Tensor


def _segments(units: list[Unit], rank: int) -> list[Segment]:
    out = []
    for unit in units:
        slot_index = {slot.name: i for i, slot in enumerate(unit.layout.slots)}
        for piece in unit.layout.pieces(rank):
            start, end = piece.shard_start, piece.shard_start + piece.numel
            out.append(Segment(unit, slot_index[piece.slot.name], piece.slot.group, start, end,
                               unit.param_store.master[start:end]))
    return out


def _state_name(seg: Segment, key: str) -> str:
    return f"u{seg.unit.index}.p{seg.index}.{seg.start}.{key}"


def state_keys(user: torch.optim.Optimizer) -> list[list[str] | None]:
    """Per group of ``user``: the parameter-sized state tensors its class creates under the
    group's hyperparameters (Adam: exp_avg, exp_avg_sq; with amsgrad also max_exp_avg_sq),
    found by stepping a throwaway one-element parameter once; None for a group whose class
    cannot step that way (a user's optimizer that needs a closure, say)."""
    out: list[list[str] | None] = []
    for group in user.param_groups:
        p = torch.zeros(1)
        hyper = {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS}
        try:
            probe = rebuild(type(user), user.defaults, [{**hyper, "params": [p]}])
            p.grad = torch.zeros_like(p)
            probe.step()
        except Exception:  # any failure of the user's class: its states are found later
            out.append(None)
            continue
        out.append([k for k, v in probe.state.get(p, {}).items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0])
    return out


def states_to_reserve(user: torch.optim.Optimizer) -> int:
    """Parameter-sized states per parameter the disk tier reserves room for: what the probe
    found, else the count known for the class (``known_states``)."""
    found = state_keys(user)
    return max((len(k) if k is not None else known_states(user) for k in found), default=0)


class ShardPart:
    """An elementwise optimizer over the pieces of its parameters in this rank's shard."""

    def __init__(self, user: torch.optim.Optimizer, first_group: int,
                 segments: list[Segment], units: list[Unit]) -> None:
        self.user = user
        self.units = units
        self.groups = range(first_group, first_group + len(user.param_groups))
        self.segments = [seg for seg in segments if seg.group in self.groups]
        params: list[list[torch.Tensor]] = [[] for _ in user.param_groups]
        for seg in self.segments:
            params[seg.group - first_group].append(seg.view)
        self.inner = rebuild(type(user), user.defaults, inner_groups(user, params))

    def _of_unit(self, unit: Unit | None) -> list[Segment]:
        return self.segments if unit is None else [s for s in self.segments if s.unit is unit]

    def add_segments(self, new: list[Segment]) -> None:
        """Pieces of parameters added to the user's optimizer after construction."""
        self.groups = range(self.groups.start, self.groups.start + len(self.user.param_groups))
        while len(self.inner.param_groups) < len(self.user.param_groups):
            user_group = self.user.param_groups[len(self.inner.param_groups)]
            hyper = {k: v for k, v in user_group.items() if k not in IMPLEMENTATION_KEYS}
            self.inner.add_param_group({**hyper, "params": []})
        for seg in new:
            self.segments.append(seg)
            self.inner.param_groups[seg.group - self.groups.start]["params"].append(seg.view)

    def step(self, unit: Unit | None = None, grad: torch.Tensor | None = None) -> None:
        """Step every piece, or only ``unit``'s with its gradient ``grad`` (the disk tier
        steps one unit at a time: torch skips a parameter whose grad is None, so the others
        are left as they are)."""
        sync_hyperparameters(self.user, self.inner)
        segments = self._of_unit(unit)
        for seg in segments:
            if seg.unit.stepped[seg.index]:
                source = seg.unit.master_grad if grad is None else grad
                seg.view.grad = source[seg.start : seg.end]
        try:
            self.inner.step()
        finally:
            for seg in segments:
                seg.view.grad = None

    def reserve_states(self, tier: DiskTier) -> None:
        """Create the files of every piece's optimizer states before the first step."""
        keys = state_keys(self.user)
        for seg in self.segments:  # unknown keys (None): files made when torch creates them
            for key in keys[seg.group - self.groups.start] or []:
                tier.reserve(seg.view.numel(), seg.view.dtype, _state_name(seg, key))

    def unit_states(self, unit: Unit) -> list[torch.Tensor]:
        states = [self.inner.state.get(seg.view, {}) for seg in self._of_unit(unit)]
        return [v for state in states for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]

    def adopt_states(self, unit: Unit, tier: DiskTier) -> None:
        """Move ``unit``'s optimizer states torch created in memory (the first step, a load)
        into the disk tier's files."""
        for seg in self._of_unit(unit):
            state = self.inner.state.get(seg.view, {})
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not tier.holds(value):
                    state[key] = tier.adopt(value, _state_name(seg, key))

    def records(self) -> dict[str, dict[str, Any]]:
        """Records of the parameters whose pieces on this rank have optimizer state."""
        out: dict[str, dict[str, Any]] = {}
        for seg in self.segments:
            state = self.inner.state.get(seg.view, {})
            if state:  # else never stepped (frozen since construction, or never used)
                record = state_record(state)
                known = out.setdefault(seg.unit.layout.slots[seg.index].name, record)
                known["tensors"] += [k for k in record["tensors"] if k not in known["tensors"]]
        return out

    def state_pieces(self) -> Iterator[tuple[Segment, str, torch.Tensor]]:
        for seg in self.segments:
            for key, value in self.inner.state.get(seg.view, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield seg, key, value

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]

    def state_numel(self) -> tuple[int, int]:
        """(elements of parameter-sized state, elements of parameters) on this rank."""
        sized = sum(v.numel() for _, _, v in self.state_pieces())
        return sized, sum(seg.view.numel() for seg in self.segments)


class ShardedOptimizer:
    """The user's optimizers (one, or the parts of a ``CombinedOptimizer``), each rebuilt as a
    ``ShardPart`` over this rank's shard pieces or an ``OwnerPart`` over whole parameters
    placed on owning ranks; groups are numbered across the parts in order."""

    def __init__(self, user_optimizer: torch.optim.Optimizer, units: list[Unit],
                 comm: Communicator, shards: int, declared_elementwise: bool = False,
                 exchange_numel: int = 5_000_000, tier: DiskTier | None = None) -> None:
        self.user = user_optimizer
        self.units = units
        self.comm = comm
        self.shards = shards
        self.rank = comm.rank if shards > 1 else 0
        self.segments = _segments(units, self.rank)
        self.parts: list[ShardPart | OwnerPart] = []
        first = 0
        for opt in combined_parts(user_optimizer):
            if placement(opt, declared_elementwise) == "shard":
                self.parts.append(ShardPart(opt, first, self.segments, units))
            else:
                self.parts.append(OwnerPart(opt, first, units, comm, exchange_numel))
            first += len(opt.param_groups)
        self.where = InMemory(units, self.parts) if tier is None else Streamed(
            units, [p for p in self.parts if isinstance(p, ShardPart)], tier)
        """Where masters, states and reduced gradients rest (chosen once): the step, every
        pass over the gradients and every factor on them go through it."""
        assert len(self.where.parts) == len(self.parts), "the engine refuses owners with disk"

    def check_adoptable(self, new: dict[str, int]) -> None:
        """Parameters ``new`` (name: its group, numbered across the optimizers) may join the
        last optimizer only, and only a shard-placed one: groups are numbered across the
        optimizers, so a group added before the last would shift the numbers of the groups
        after it, and owner-placed optimizers place their parameters at construction. Any
        optimizer's groups may be edited in place; empty groups may be added to the last."""
        last = len(self.parts) - 1
        for k, part in enumerate(self.parts):
            added = part.user.param_groups[len(part.groups):]
            if added and k != last:
                raise ValueError(
                    f"a param group was added to {type(part.user).__name__}, optimizer {k} of "
                    f"{len(self.parts)}: with several optimizers only the last may gain groups "
                    "after the engine is built; build the others with every parameter they "
                    "will train (frozen ones included)")
        first_of_last = self.parts[last].groups.start
        elsewhere = [n for n, g in new.items() if g < first_of_last]
        if elsewhere:
            group = new[elsewhere[0]]
            k = max(i for i, part in enumerate(self.parts) if part.groups.start <= group)
            raise ValueError(
                f"parameters {elsewhere[:5]} were added to a param group of "
                f"{type(self.parts[k].user).__name__}, optimizer {k} of {len(self.parts)}: "
                "with several optimizers only the last may gain parameters after the engine "
                "is built; build the others with every parameter they will train (frozen "
                "ones included)")
        if new and not isinstance(self.parts[last], ShardPart):
            raise ValueError(
                f"parameters {list(new)[:5]} were added to {type(self.parts[last].user).__name__}"
                ", whose parameters are placed whole on owning ranks when the engine is built; "
                "build it with every parameter it will train (frozen ones included; empty "
                "param groups may be added)")

    def add_units(self, units: list[Unit], only: set[str] | None = None) -> None:
        """Parameters the engine took over after construction (unfrozen and added to the
        last of the user's optimizers): their pieces join its inner groups. ``only``: just
        these parameters of ``units`` (sharded frozen before, in no group)."""
        new = [s for s in _segments(units, self.rank)  # self.units: the engine's, extended
               if only is None or s.unit.layout.slots[s.index].name in only]
        self.segments += new
        last = self.parts[-1]
        assert isinstance(last, ShardPart), "check_adoptable() runs first"
        last.add_segments(new)
        self.where.units_added()

    def step(self) -> None:
        for unit in self.units:  # the host is about to write masters copies may still read
            unit.param_store.wait_host_copies()
        with record_function("zero::optimizer_step"):
            self.where.step()

    def reserve_states(self) -> None:
        """Create whatever the optimizer states need before the first step (the disk tier's
        files: a full disk is an error when the engine is built)."""
        self.where.reserve_states()

    def master_grads(self) -> Iterator[torch.Tensor]:
        """The reduced gradient shard of every unit holding one, in unit order, with every
        factor deferred to it applied; the caller may change it (``InMemory``,
        ``Streamed``)."""
        return self.where.master_grads()

    def unscale_grads(self, inv: float) -> None:
        """fp16: divide the reduced gradients by the loss scale (``inv`` is its inverse); the
        disk tier defers it to the step's read."""
        self.where.unscale(inv)

    def nonfinite_local(self, device: torch.device) -> torch.Tensor:
        """1.0 where this rank holds an inf/NaN gradient, else 0.0 (fp32 on ``device``): a
        max-abs is inf/NaN exactly when the shard holds one."""
        local = torch.zeros((), dtype=torch.float32, device=device)
        peaks = self.where.peaks()
        if peaks:
            local += (~torch.isfinite(torch.stack(peaks))).any().to(device, torch.float32)
        return local

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Norm of the whole (reduced) gradient, from the shards every rank holds; on the
        communication device (offloaded shards are summed on the host, then moved)."""
        summaries = self.where.summaries()
        sharded = self.shards > 1
        if summaries is not None and float(norm_type) == 2.0:
            return norm_of_parts((sq for sq, _ in summaries), 2.0, self.comm, sharded)
        if summaries is not None and math.isinf(norm_type):
            return peak_of_parts((peak for _, peak in summaries), self.comm, sharded)
        return global_norm(self.master_grads(), float(norm_type), self.comm, sharded)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        total = self.grad_norm(norm_type)
        self.where.scale(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def states_per_param(self) -> int:
        """Parameter-sized state tensors per parameter of the shard-placed optimizers,
        measured once state exists (before: the count each optimizer is known to keep)."""
        shard_parts = [p for p in self.parts if isinstance(p, ShardPart)]
        sized = sum(p.state_numel()[0] for p in shard_parts)
        numel = sum(p.state_numel()[1] for p in shard_parts)
        if sized and numel:
            return round(sized / numel)
        return max((known_states(p.user) for p in shard_parts), default=0)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.state_tensors()]

    def state_pieces(self) -> Iterator[tuple[Segment, str, torch.Tensor]]:
        """Parameter-sized states of the shard-placed optimizers, piece by piece."""
        for part in self.parts:
            if isinstance(part, ShardPart):
                yield from part.state_pieces()


def known_states(optimizer: torch.optim.Optimizer) -> int:
    """Parameter-sized states ``optimizer`` will keep, the most any of its groups' options
    make (an optimizer not listed: 2, Adam's)."""
    name = type(optimizer).__name__
    base, optional = _STATES_PER_PARAM.get(name, 2), _OPTIONAL_STATES.get(name, ())
    return max((base + sum(1 for key in optional if group.get(key))
                for group in optimizer.param_groups), default=base)


def global_norm(grads: Iterable[torch.Tensor], norm_type: float, comm: Communicator,
                sharded: bool) -> torch.Tensor:
    """The ``norm_type`` norm over every rank's ``grads`` (disjoint shards when ``sharded``),
    as an fp32 scalar on ``comm.device``; ``grads`` is read once, in order."""
    if math.isinf(norm_type):
        return peak_of_parts((peak for g in grads for peak in max_abs([g])), comm, sharded)
    parts = (powered_norm(g, norm_type) for g in grads if g.numel())
    return norm_of_parts(parts, norm_type, comm, sharded)


def peak_of_parts(peaks: Iterable[torch.Tensor], comm: Communicator,
                  sharded: bool) -> torch.Tensor:
    """The inf-norm over every rank from each shard's max-abs (fp32, on ``comm.device``)."""
    found = [peak.float() for peak in peaks]
    local = torch.stack(found).max() if found else torch.zeros((), device=comm.device)
    local = local.to(comm.device)
    if sharded:
        comm.all_reduce_max(local)
    return local


def norm_of_parts(parts: Iterable[torch.Tensor], norm_type: float, comm: Communicator,
                  sharded: bool) -> torch.Tensor:
    """The global ``norm_type`` norm from each shard's ``norm ** norm_type``, summed in order
    in fp32 (so a summary taken earlier gives the bits the full pass gives)."""
    local: torch.Tensor | None = None
    for part in parts:
        if local is None:
            local = torch.zeros((), dtype=torch.float32, device=part.device)
        local += part
    if local is None:
        local = torch.zeros((), dtype=torch.float32, device=comm.device)
    local = local.to(comm.device)
    if sharded:
        comm.all_reduce(local)
    return local ** (1.0 / norm_type)
