"""What user code may do with the module's parameters outside the engine's own calls.

The engine owns every managed parameter's storage and its master copy, so each way user code
can reach a parameter is routed through here (``hooks.ModulePatches`` swaps the module
classes that call it):

- reading one as an attribute (``model.emb.weight`` for a tied head, a loss term, a parent
  reading a child's weight) gathers its stage-3 unit and keeps it whole until the end of
  backward, so the value is real and its gradient flows into the unit's reduction;
- ``load_state_dict`` writes the managed parameters' masters at full precision and their
  compute copies, without gathering;
- ``state_dict()`` of a module whose parameters are sharded right now is refused (it would
  hold placeholders), and names the calls that work;
- ``.to(dtype)``, ``.half()``, ``to_empty()`` and other conversions that would replace a
  managed parameter's tensor are refused before anything is changed;
- ``gathered()`` is the explicit context for reading or editing whole parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .eager import eager
from .params import ParamState

if TYPE_CHECKING:
    from ..comm.collectives import Communicator
    from .runtime import Runtime
    from .units import Unit


class ParamAccess:
    def __init__(self, units: list[Unit], runtime: Runtime, comm: Communicator,
                 names: dict[int, str], overlap: bool, world: Communicator | None = None) -> None:
        self.overlap = overlap
        self.units = units
        self.runtime = runtime
        self.shards = comm
        self.comm = world or comm
        """Every rank: ``modifier_rank`` names one of them, and whether anything was edited is
        agreed over all of them (``shards`` re-gathers a unit)."""
        self.names = names
        self.place: dict[int, tuple[Unit, int]] = {}
        self.sharded: set[int] = set()
        """Parameters whose module attribute may hold a placeholder (stage 3)."""
        self.watched: set[int] = set()
        """Parameters a read must wait for: stage 3's, and with ``overlap_param_gather`` the
        replicated ones the post-step all-gather writes."""
        self.add_units(units)

    def add_units(self, units: list[Unit]) -> None:
        for unit in units:
            store = unit.param_store
            for i, p in enumerate(unit.params):
                self.place[id(p)] = (unit, i)
                if store.gathers:
                    self.sharded.add(id(p))
                if store.gathers or (self.overlap and store.layout.num_shards > 1):
                    self.watched.add(id(p))

    # ---------------------------------------------------------------- attribute reads
    def unit_to_gather(self, value: object) -> Unit | None:
        """The unit to gather before ``value`` (an attribute just read) can be used, if any.
        Plain Python on the hot path: every module attribute read at stage 3 comes here."""
        if id(value) not in self.watched:
            return None
        unit = self.place[id(value)][0]
        return None if unit.param_store.state is ParamState.UNSHARDED else unit

    @eager  # a gather cannot be traced; torch.compile breaks the graph here
    def gather(self, unit: Unit) -> None:
        self.runtime.gather_for_access(unit)

    def settle(self) -> None:
        """Before ``parameters()`` hands out the module's tensors: no gather may still be
        writing them (stage 3's placeholders stay what they are)."""
        if self.watched:
            self.runtime.settle()

    # ---------------------------------------------------------------- conversions
    def check_apply(self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuse, before anything changes, a conversion that would swap a managed
        parameter's tensor (a dtype or device change, ``to_empty``); no-op ones pass."""
        self.settle()
        keeps: dict[tuple[torch.dtype, torch.device], bool] = {}
        for p in module.parameters():
            if id(p) not in self.place:
                continue
            key = (p.dtype, p.device)
            if key not in keeps:
                probe = torch.zeros(1, dtype=p.dtype, device=p.device)
                keeps[key] = fn(probe) is probe
            if not keeps[key]:
                raise RuntimeError(
                    f"{type(module).__name__}._apply (.to / .half / .float / to_empty ...) would "
                    f"replace parameter {self.names[id(p)]!r} ({p.dtype}, {p.device}) after "
                    "the ZeroEngine took it over; nothing was changed. Choose the training "
                    "dtype with ZeroConfig(precision='bf16-mixed' | 'bf16-true' | '16-mixed') "
                    "and move the model to its device before building the engine, or call "
                    "engine.close() first to get a plain module back")

    # ---------------------------------------------------------------- state dicts
    def load_own(self, module: nn.Module, state_dict: dict, prefix: str,
                 errors: list[str]) -> set[str]:
        """Write this module's own managed parameters found in ``state_dict``; returns the
        keys handled (torch's loader must not copy them into placeholders)."""
        handled: set[str] = set()
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or id(p) not in self.place or key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                continue  # torch's loader reports it
            handled.add(key)
            unit, index = self.place[id(p)]
            shape = unit.layout.slots[index].shape
            if tuple(value.shape) != shape:
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(value.shape)} from checkpoint, the shape in current "
                              f"model is {torch.Size(shape)}.")
                continue
            with torch.no_grad():
                unit.param_store.write_param(index, value.detach().to(unit.grad_store.device))
        return handled

    def check_save(self, module: nn.Module, keep_vars: bool) -> None:
        """Runs for every module of a ``state_dict()``: only this module's own parameters'
        units are waited for (a post-step gather) or refused (stage-3 placeholders)."""
        for p in module._parameters.values():
            if p is None or id(p) not in self.watched:
                continue
            unit, _ = self.place[id(p)]
            if not unit.param_store.gathers:
                unit.param_store.finish_unshard()
            elif not keep_vars and unit.param_store.state is not ParamState.UNSHARDED:
                raise RuntimeError(
                    f"state_dict(): stage 3 holds only this rank's shard of "
                    f"{self.names[id(p)]!r}, so the module's own state_dict would hold "
                    "placeholders. Use engine.full_state_dict() (on every rank), or call "
                    "it inside `with engine.gathered_parameters(): ...`")

    # ---------------------------------------------------------------- explicit gathering
    def units_of(self, target: nn.Module | Iterable[torch.Tensor] | None) -> list[Unit]:
        if target is None:
            return list(self.units)
        params = target.parameters() if isinstance(target, nn.Module) else target
        wanted: set[int] = set()
        for p in params:
            if id(p) in self.place:
                wanted.add(self.place[id(p)][0].index)
        return [u for u in self.units if u.index in wanted]

    @contextlib.contextmanager
    def gathered(self, target: nn.Module | Iterable[torch.Tensor] | None, writable: bool,
                 modifier_rank: int | None) -> Iterator[None]:
        units = self.units_of(target)
        if modifier_rank is not None and not 0 <= modifier_rank < self.comm.world_size:
            raise ValueError(f"modifier_rank must be a rank in [0, {self.comm.world_size}), "
                             f"got {modifier_rank!r}")
        was_sharded = [u for u in units if u.param_store.state is not ParamState.UNSHARDED]
        aliases = [u.param_store.aliases() for u in was_sharded]
        for unit in units:
            self.runtime.unshard(unit)
        for unit in units:
            self.runtime.finish(unit)
            self.runtime.hold(unit)  # forwards inside the block must not free them
        try:
            yield
        finally:
            for unit in units:
                self.runtime.unhold(unit)
            try:
                if writable:
                    self._adopt(units, modifier_rank)
                else:
                    self._check_unedited(units)
            finally:
                for unit in was_sharded:
                    self.runtime.release(unit)
        self._check_nothing_escaped(was_sharded, aliases)

    def _check_nothing_escaped(self, units: list[Unit], before: list[int | None]) -> None:
        """A tensor kept from inside ``gathered()`` that views the whole parameters (``p.data``,
        ``p.detach()``, a slice) would read freed memory once the block ends: caught here, as
        one more view of the buffer than before the gather, while no forward is pending (its
        saved tensors are views too, re-gathered for backward)."""
        if not self.runtime.idle():
            return
        for unit, count in zip(units, before):
            now = unit.param_store.aliases()
            if (count is not None and now is not None and now > count
                    and unit.param_store.state is ParamState.SHARDED):
                raise RuntimeError(
                    f"a tensor taken out of engine.gathered_parameters() still views the "
                    f"parameters of unit {unit.name!r}, whose memory was freed as the "
                    "block ended: reading it would read freed memory. Keep a copy inside the "
                    "block (p.detach().clone()), not p.data, p.detach() or a view")

    def _adopt(self, units: list[Unit], modifier_rank: int | None) -> None:
        with torch.no_grad():
            for unit in units:
                if modifier_rank is not None and self.comm.world_size > 1:
                    self.comm.broadcast(unit.param_store.full, src=modifier_rank)
                unit.param_store.adopt_compute_edits()

    def _check_unedited(self, units: list[Unit]) -> None:
        edited = [u for u in units if u.param_store.was_edited()]
        if not units:
            return
        flag = torch.full((1,), float(bool(edited)), device=units[0].grad_store.device)
        if self.comm.all_reduce_max_to_host(flag)[0]:
            for unit in units:  # put the compute copies back: the edit is not kept
                unit.param_store.discard_compute_edits(self.shards)
            where = ", ".join(repr(u.name or "<root>") for u in edited) or "another rank"
            raise RuntimeError(
                f"parameters were modified inside engine.gathered_parameters() without "
                f"writable=True (units: {where}); the edits were discarded. Pass "
                "writable=True (and modifier_rank=r if only rank r's edit counts)")
