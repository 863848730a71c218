"""The user's optimizer, rebuilt over this rank's master shards.

The inner optimizer is the same class with the same hyperparameters, given one tensor per
parameter piece this rank owns (a view of the master shard). Elementwise optimizers (SGD, Adam,
AdamW, ...) then compute exactly what they would on the whole parameters, and each parameter
keeps its own state and step count, so a parameter that gets no gradient on any rank in a step
(frozen with ``requires_grad_(False)``, or an unused expert) is skipped exactly as torch skips
a parameter whose ``.grad`` is None. The user's optimizer object
stays the source of hyperparameters: LR schedulers attached to it keep working because its
groups are copied onto the inner groups before every step.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from .collectives import Communicator
from .units import Unit

# How many parameter-sized state tensors each optimizer keeps (the ZeRO formula's K / 4 in
# fp32). Used for the memory prediction before the first step has created any state.
_STATES_PER_PARAM = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "Adadelta": 2,
    "RMSprop": 1, "Rprop": 2, "ASGD": 2,
}


# torch's optimizers whose update of each element reads only that element's gradient and
# state: run on flat shards they compute exactly what they compute on whole parameters.
ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)


def check_elementwise(optimizer: torch.optim.Optimizer, declared: bool) -> None:
    """Refuse an optimizer whose update reads a parameter as a whole (its shape, a norm, row
    or column statistics): on flat shards it would silently compute something else."""
    if declared:
        return
    for base in ELEMENTWISE:  # a subclass that keeps the base's step is the same math
        if isinstance(optimizer, base) and type(optimizer).step is base.step:
            return
    name = type(optimizer).__name__
    raise ValueError(
        f"{name} is not one of torch's elementwise optimizers "
        f"({', '.join(c.__name__ for c in ELEMENTWISE)}). ZeRO runs the optimizer on flat "
        "shards of the parameters, which is exact only for elementwise updates; an update that "
        "reads a whole parameter (Adafactor's row/column statistics, Muon's "
        "orthogonalisation, LAMB's per-tensor trust ratio, LBFGS's history, anything using "
        "p.shape or a norm) would silently compute something else. If every element of "
        f"{name}'s update depends only on that element's gradient and state, declare it with "
        "ZeroConfig(elementwise_optimizer=True)")


# Group keys that choose a kernel rather than the math; the inner optimizer keeps its own.
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


def _rebuild(cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
             groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The same optimizer class over ``groups``; torch's fused kernel when the user left the
    implementation unset (on CPU it is ~6x faster than the per-tensor loop, and the shard is
    a handful of large tensors, its best case)."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    wants_default = kwargs.get("fused") is None and kwargs.get("foreach") is None
    if "fused" in accepted and wants_default and not kwargs.get("differentiable"):
        fused_groups = [{**g, "fused": True, "foreach": None} for g in groups]
        try:
            return cls(fused_groups, **{**kwargs, "fused": True})
        except (RuntimeError, ValueError):  # dtype/device without a fused kernel
            pass
    return cls(groups, **kwargs)


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


class ShardedOptimizer:
    def __init__(self, user_optimizer: torch.optim.Optimizer, units: list[Unit],
                 comm: Communicator, shards: int) -> None:
        self.user = user_optimizer
        self.units = units
        self.comm = comm
        self.shards = shards
        self.rank = comm.rank if shards > 1 else 0
        self.segments = _segments(units, self.rank)
        groups: list[list[torch.Tensor]] = [[] for _ in user_optimizer.param_groups]
        for seg in self.segments:
            groups[seg.group].append(seg.view)
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": params}
            for g, params in zip(user_optimizer.param_groups, groups)
        ]
        self.inner = _rebuild(type(user_optimizer), user_optimizer.defaults, inner_groups)

    def add_units(self, units: list[Unit]) -> None:
        """Parameters the engine took over after construction (unfrozen and added to the
        user's optimizer): their pieces join the inner groups, new groups included."""
        new = _segments(units, self.rank)  # self.units is the engine's list: already extended
        self.segments += new
        while len(self.inner.param_groups) < len(self.user.param_groups):
            user_group = self.user.param_groups[len(self.inner.param_groups)]
            hyper = {k: v for k, v in user_group.items() if k not in _IMPLEMENTATION_KEYS}
            self.inner.add_param_group({**hyper, "params": []})
        for seg in new:
            self.inner.param_groups[seg.group]["params"].append(seg.view)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def _sync_hyperparameters(self) -> None:
        for user_group, inner_group in zip(self.user.param_groups, self.inner.param_groups):
            for key, value in user_group.items():
                if key not in _IMPLEMENTATION_KEYS:
                    inner_group[key] = value

    def _attach_grads(self) -> None:
        for seg in self.segments:
            if seg.unit.stepped[seg.index]:
                seg.view.grad = seg.unit.master_grad[seg.start : seg.end]

    def step(self) -> None:
        self._sync_hyperparameters()
        for unit in self.units:  # the host is about to write masters copies may still read
            unit.param_store.wait_host_copies()
        self._attach_grads()
        with record_function("zero::optimizer_step"):
            self.inner.step()
        for seg in self.segments:
            seg.view.grad = None

    def master_grads(self) -> list[torch.Tensor]:
        return [unit.master_grad for unit in self.units]

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Norm of the whole (reduced) gradient, from the shards every rank holds; on the
        communication device (offloaded shards are summed on the host, then moved)."""
        return global_norm(self.master_grads(), float(norm_type), self.comm, self.shards > 1)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        total = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        on: dict[torch.device, torch.Tensor] = {}  # one copy per device, not one per unit
        for g in self.master_grads():
            if g.device not in on:
                on[g.device] = coef.to(g.device)
            g.mul_(on[g.device].to(g.dtype))
        return total

    def states_per_param(self) -> int:
        """Parameter-sized state tensors per parameter, measured once state exists."""
        seg_numel = sum(seg.view.numel() for seg in self.segments)
        if self.inner.state and seg_numel:
            sized = sum(
                t.numel() for s in self.inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0
            )
            return round(sized / seg_numel)
        name = type(self.user).__name__
        if name == "SGD":
            return 1 if self.user.defaults.get("momentum", 0) else 0
        return _STATES_PER_PARAM.get(name, 2)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]


def global_norm(grads: list[torch.Tensor], norm_type: float, comm: Communicator,
                sharded: bool) -> torch.Tensor:
    """The ``norm_type`` norm over every rank's ``grads`` (disjoint shards when ``sharded``),
    as an fp32 scalar on ``comm.device``."""
    grads = [g for g in grads if g.numel()]
    device = grads[0].device if grads else comm.device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g in grads]
                            or [torch.zeros((), device=device)]).max()
        local = local.to(comm.device)
        if sharded:
            comm.all_reduce_max(local)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local += torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
    local = local.to(comm.device)
    if sharded:
        comm.all_reduce(local)
    return local ** (1.0 / norm_type)
