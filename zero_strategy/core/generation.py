"""Generation at stage 3: each unit gathered once per ``generate()`` call, not once per token.

Every generated token runs one forward, and a stage-3 forward gathers every unit and frees it
again, so a call of T tokens sends T x (N-1)/N of the model's bytes from each rank. Inside
``GenerationMode.holding()`` the units that fit ``budget`` bytes (their whole compute copies)
are gathered once, up front and in unit order on every rank, and held (``Runtime.hold``, the
mechanism ``gathered_parameters()`` uses) until the block ends: the forwards inside find them
whole and gather nothing. Units that do not fit keep the per-forward gather and free, with
the runtime's prefetch (the streamed mode):

    all-gather bytes per call = (N-1)/N x (held bytes + T x streamed bytes)

The held set is chosen from a budget agreed over the ranks (their smallest), so every rank
holds the same units and gathers the rest in the same order. Nothing of training is touched:
gradients, optimizer state and the runtime's pass state stay as they were, and on exit every
unit the block gathered is freed again (also when the block raises). A block inside another
(a ``generate()`` calling another) is part of the outer one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from .params import ParamState

if TYPE_CHECKING:
    from ..comm.collectives import Communicator
    from .runtime import Runtime
    from .units import Unit


def gathered_bytes(unit: Unit) -> int:
    """Bytes of ``unit``'s whole compute copy (what holding it gathered costs)."""
    dtype = unit.param_store.policy.compute_dtype
    return unit.layout.padded_numel * torch.empty((), dtype=dtype).element_size()


def choose_held(units: list[Unit], budget: int) -> list[Unit]:
    """The units to hold for a call within ``budget`` bytes: all of them when they fit;
    otherwise those that fit in unit order beside room to stream the rest (the largest
    streamed unit twice: the one computing and the one prefetched)."""
    sizes = [gathered_bytes(u) for u in units]
    if sum(sizes) <= budget:
        return list(units)
    held: list[Unit] = []
    used = 0
    streamed = sorted(sizes, reverse=True)
    stream_room = 2 * streamed[0] if streamed else 0
    for unit, size in zip(units, sizes):
        if used + size + stream_room > budget:
            break
        held.append(unit)
        used += size
    return held


class GenerationMode:
    """Holds stage-3 units for the length of a generation call (see the module docstring)."""

    def __init__(self, units: list[Unit], runtime: Runtime, world: Communicator,
                 budget: Callable[[], int]) -> None:
        self.all_units = units
        self.runtime = runtime
        self.world = world
        self.budget = budget
        """This rank's budget in bytes (the config's, or what its memory has free)."""
        self._depth = 0
        self._synced = False
        self.last_held: list[str] = []
        """Names of the units the last outermost block held (observability, tests)."""

    def agreed_budget(self, budget: int | None) -> int:
        """The smallest budget over the ranks (one small all-reduce): every rank must hold
        the same units, or they would gather different ones at the same point."""
        mine = self.budget() if budget is None else budget
        # float64 holds byte counts exactly (below 2**53); max of the negation is the min.
        flag = torch.tensor([-float(mine)], dtype=torch.float64, device=self.world.device)
        return int(-self.world.all_reduce_max_to_host(flag)[0])

    @contextlib.contextmanager
    def holding(self, budget: int | None = None) -> Iterator[bool]:
        """Hold what fits ``budget`` bytes (None: this mode's default) whole until the block
        ends; a collective at entry (every rank enters together, as ``generate()`` does).

        Yields whether the ranks must run their forwards in step (transformers'
        ``synced_gpus``): only when some unit is streamed. With every unit held a forward
        communicates nothing, so a rank whose request is done need not keep stepping."""
        units = [u for u in self.all_units if u.param_store.gathers]
        if not units or self._depth:
            self._depth += 1
            try:
                yield self._synced
            finally:
                self._depth -= 1
            return
        held = choose_held(units, self.agreed_budget(budget))
        # What this block gathers it frees; a unit already whole (a gathered_parameters()
        # block around it, a read outside forward) is left as it was found.
        gathered = [u for u in held if u.param_store.state is ParamState.SHARDED]
        holds: list[Unit] = []
        self._depth += 1
        try:
            with record_function("zero::generation_gather"):
                for unit in held:  # all launched before any is waited for
                    self.runtime.unshard(unit)
                for unit in held:
                    self.runtime.finish(unit)
                    self.runtime.hold(unit)
                    holds.append(unit)
            self.last_held = [u.name for u in held]
            self._synced = len(held) < len(units) and self.world.world_size > 1
            yield self._synced
        finally:
            self._depth -= 1
            self._synced = False
            for unit in holds:
                self.runtime.unhold(unit)
            for unit in gathered:
                self.runtime.release(unit)
