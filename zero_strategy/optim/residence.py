"""Where the optimizer's tensors rest, decided once when ``ShardedOptimizer`` is built: in
memory (``InMemory``: the device, or host memory) or in the disk tier's files (``Streamed``).
Everything the optimizer does over masters, states and reduced gradients that depends on it
(the step, a pass over the gradients, multiplying them by a factor, their summaries) is a
method here, so nothing else asks whether there is a disk tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from ..core.grads import max_abs
from ..core.units import Unit
from ..offload.disk import keep_budget

if TYPE_CHECKING:
    from ..offload.disk import DiskTier


class Part(Protocol):
    """What a residence needs of an optimizer part (``ShardPart``, ``OwnerPart``)."""

    def step(self, unit: Unit | None = None, grad: torch.Tensor | None = None) -> None: ...


class StreamedPart(Part, Protocol):
    """A part the disk tier steps one unit at a time (``ShardPart``)."""

    def unit_states(self, unit: Unit) -> list[torch.Tensor]: ...

    def adopt_states(self, unit: Unit, tier: DiskTier) -> None: ...

    def reserve_states(self, tier: DiskTier) -> None: ...


class InMemory:
    """Masters, optimizer states and reduced gradients in memory: a pass over the gradients
    is a loop over the units, and a factor is multiplied in at once."""

    def __init__(self, units: list[Unit], parts: list[Part]) -> None:
        self.units = units
        """The engine's list (extended in place when parameters are adopted)."""
        self.parts = parts

    def graded(self) -> list[Unit]:
        """The units the last synchronised backward left a gradient in (``Unit.has_grad``):
        the others hold none and have nothing to step."""
        return [u for u in self.units if u.has_grad]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def master_grads(self) -> Iterator[torch.Tensor]:
        """Every reduced gradient shard, in unit order; the caller may change it."""
        for unit in self.graded():
            yield unit.master_grad

    def unscale(self, inv: float) -> None:
        """fp16: divide every gradient by the loss scale (``inv`` is its inverse)."""
        for g in self.master_grads():
            g.mul_(inv)

    def scale(self, coef: torch.Tensor) -> None:
        """Multiply every gradient by the clipping coefficient ``coef``."""
        on: dict[torch.device, torch.Tensor] = {}  # one copy per device, not one per unit
        for g in self.master_grads():
            if g.device not in on:
                on[g.device] = coef.to(g.device)
            g.mul_(on[g.device].to(g.dtype))

    def summaries(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each non-empty gradient's (2-norm ** 2, max-abs), known without reading it: None
        in memory, where a pass over the gradients reads no file."""
        return None

    def peaks(self) -> list[torch.Tensor]:
        """Each non-empty gradient's max-abs, in one multi-tensor pass."""
        return max_abs(list(self.master_grads()))

    def units_added(self) -> None:
        """Parameters adopted after construction (nothing to size in memory)."""

    def reserve_states(self) -> None:
        """Nothing: optimizer states in memory are created by the first step."""


class Streamed(InMemory):
    """The disk tier holds masters, optimizer states and reduced gradients
    (``offload/disk.py``): the step and every pass over the gradients stream units through
    memory one after another. Factors wait in each unit until the step reads the gradient
    (``Unit.defer_unscale``, ``Unit.defer_scale``), and the non-finite check and the clipping
    norm come from the summaries taken when each gradient was reduced (``Unit.grad_summary``),
    so with or without fp16 and clipping a step reads each gradient's file once: the step's
    read. Whether to skip is thereby agreed before the step writes any master or state."""

    def __init__(self, units: list[Unit], parts: list[StreamedPart], tier: DiskTier) -> None:
        super().__init__(units, list(parts))
        self.streamed = parts
        self.tier = tier
        self.units_added()

    def units_added(self) -> None:
        """The tier keeps a constant part of one phase for the next (``keep_budget``)."""
        sizes = [u.layout.shard_numel for u in self.units]
        itemsize = max((u.param_store.master.element_size() for u in self.units), default=4)
        self.tier.keep_bytes = keep_budget(sizes, itemsize)

    def reserve_states(self) -> None:
        """Create every optimizer state's file now (a full disk is an error when the engine is
        built, not in the middle of the first step)."""
        for part in self.streamed:
            part.reserve_states(self.tier)

    def step_tensors(self, unit: Unit) -> list[torch.Tensor]:
        """What ``unit``'s step reads and writes: master, gradient (read only), optimizer
        states, the parameter shard."""
        states = [t for part in self.streamed for t in part.unit_states(unit)]
        return unit.step_tensors() + states

    def step(self) -> None:
        """One unit at a time: the next unit's files are read ahead while this one steps,
        and each unit's pages are written back and dropped once it has stepped. Units are
        independent (every factor is known), so the order is free: the units whose gradient
        backward left in memory go first, before anything pushes them out (the bits do not
        depend on it)."""
        tier = self.tier

        def read_ahead(unit: Unit) -> None:
            grad = unit.master_grad
            tier.prefetch([grad])
            tier.prefetch([t for t in self.step_tensors(unit) if t is not grad], write=True)

        graded = self.graded()
        kept = {u.index for u in graded if tier.resident([u.master_grad])}
        order = sorted(graded, key=lambda u: u.index not in kept)
        if order:
            read_ahead(order[0])
        for k, unit in enumerate(order):
            if k + 1 < len(order):
                read_ahead(order[k + 1])
            tier.ready(self.step_tensors(unit))  # read ahead: written below
            grad = unit.scaled_grad()
            for part in self.streamed:
                part.step(unit, grad)
                part.adopt_states(unit, tier)
            unit.drop_scaled(grad)
            # Read, not written. A kept gradient was never written: it stays kept, unwritten,
            # for zero_grad() to clear (or for the tier to write if pushed out).
            tier.release([unit.master_grad], dirty=False, keep=unit.index in kept)
            tier.release([t for t in self.step_tensors(unit) if t is not unit.master_grad],
                         dirty=True)

    def master_grads(self) -> Iterator[torch.Tensor]:
        """Each is read ahead before it is yielded, its deferred factors applied, and written
        back once the caller moves on, so a loop over them holds about two in memory."""
        tier, graded = self.tier, self.graded()
        for k, unit in enumerate(graded):
            if k == 0:
                tier.prefetch([unit.master_grad])
            if k + 1 < len(graded):
                tier.prefetch([graded[k + 1].master_grad])
            tier.ready([unit.master_grad])  # the caller may change it
            grad = unit.settled_grad()
            yield grad
            tier.release([grad], dirty=True)

    def unscale(self, inv: float) -> None:
        """Deferred to the step's read (the summaries taken at reduction already assume it)."""
        for unit in self.graded():
            unit.defer_unscale(inv)

    def scale(self, coef: torch.Tensor) -> None:
        """Deferred to the step's read."""
        for unit in self.graded():
            unit.defer_scale(coef)

    def summaries(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every non-empty unit's summary, when all are current (else None: a pass that
        changed the gradients, or a clipping coefficient, came after them)."""
        out = []
        for unit in self.graded():
            summary = unit.grad_summary
            if summary is None and unit.layout.shard_numel:
                return None
            if summary is not None:
                out.append(summary)
        return out

    def peaks(self) -> list[torch.Tensor]:
        """From the summaries when current, else one gradient at a time as it streams by."""
        summaries = self.summaries()
        if summaries is not None:
            return [peak for _, peak in summaries]
        return [peak for g in self.master_grads() for peak in max_abs([g])]
