"""Owner placement: an optimizer whose update reads each parameter whole (Muon's
orthogonalisation, Adafactor's row and column statistics, a user's ``p.shape``) runs, for each
of its parameters, on one owning rank, on the whole gradient.

A step moves the reduced gradient pieces and master pieces of every parameter to its owner
(one all-to-all), the owner's inner optimizer updates the whole parameter, and the new values
go back to the ranks whose shards hold them (a second all-to-all). Optimizer state lives only
on the owner, whole; owners are balanced by element count. Outside ``step`` an owner holds no
copy of the parameter: the inner optimizer's tensors are handles whose storage is attached for
the step and released after it. Exact for any optimizer whose update of a parameter depends
only on that parameter (every torch optimizer but LBFGS).

With the optimizer offloaded to host memory apart from the device (a GPU), the masters and
gradients an exchange sends and the values it receives are host memory while the collective
runs on the device: each exchange gathers what it sends into one pinned host buffer, moves it
with one asynchronous copy each way through the engine's ``Transfers``, and the host waits for
a copy only where it reads the values or reuses the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..core.flat import Slot
from ..core.units import Unit
from ..offload.transfers import DONE, Copy, Transfers
from .inner import inner_groups, rebuild, state_record, sync_hyperparameters

KNOWN_STATES = {"Muon": 1, "Adafactor": 0}
"""Parameter-sized states per element before the first step has created any."""

Route = list[tuple[int, int, int]]
"""Pieces of one parameter a rank holds: (offset in the parameter, offset in the rank's
shard, elements)."""
Entry = tuple[int, int, int]
"""One piece of a ``Route``."""


@dataclass
class Placed:
    """One whole parameter of an owner-placed optimizer."""

    unit: Unit
    index: int
    """The parameter's slot in the unit's layout."""
    owner: int
    holds: list[Route]
    """Per rank, the pieces of the parameter its shard holds (every rank holds all of it
    when the optimizer is not sharded)."""
    handle: nn.Parameter | None = None
    """On the owner: what the inner optimizer updates (storage attached only in step)."""
    sources: list[Route] = field(default_factory=list)
    """Per rank, the pieces it sends the owner for a step: its shard's pieces, or with an
    unsharded optimizer only the owner's own copy."""

    @property
    def slot(self) -> Slot:
        return self.unit.layout.slots[self.index]

    @property
    def name(self) -> str:
        return self.slot.name


Arrival = tuple[Placed, Entry, int]
"""What an exchange brings here: (parameter, route entry, elements)."""


def balance(numels: list[int], ranks: int) -> list[int]:
    """Owner per parameter: largest first, each to the least loaded rank (lowest on ties), so
    loads differ by at most the largest parameter; the same on every rank."""
    load = [0] * ranks
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def _holds(unit: Unit, index: int, ranks: int) -> list[Route]:
    layout = unit.layout
    name = layout.slots[index].name
    out = []
    for rank in range(ranks):
        pieces = layout.pieces(rank if layout.num_shards > 1 else 0)
        out.append([(p.slot_start, p.shard_start, p.numel) for p in pieces if p.slot.name == name])
    return out


class OwnerPart:
    """One user optimizer, placed whole parameter by whole parameter on owning ranks."""

    def __init__(self, user: torch.optim.Optimizer, first_group: int, units: list[Unit],
                 comm: Communicator, chunk_numel: int) -> None:
        self.user = user
        self.comm = comm
        self.chunk_numel = chunk_numel
        self.groups = range(first_group, first_group + len(user.param_groups))
        found = [(u, i) for u in units for i, s in enumerate(u.layout.slots)
                 if s.group in self.groups]
        owners = balance([u.layout.slots[i].numel for u, i in found], comm.world_size)
        self.placed = [Placed(u, i, owner, _holds(u, i, comm.world_size))
                       for (u, i), owner in zip(found, owners)]
        for pl in self.placed:
            sharded = pl.unit.layout.num_shards > 1
            pl.sources = [route if sharded or rank == pl.owner else []
                          for rank, route in enumerate(pl.holds)]
        self.owned = [pl for pl in self.placed if pl.owner == comm.rank]
        self.dtype = units[0].param_store.master.dtype if units else torch.float32
        self.chunks = self._chunks(self.placed)
        """Each a run of parameters moved by one exchange; a step leaves out those it does
        not update. Fixed, so that the largest exchange, and the staging for it, is known."""
        self.staging = self._host_staging()
        params: list[list[torch.Tensor]] = [[] for _ in user.param_groups]
        for pl in self.owned:
            master = pl.unit.param_store.master
            # Full-shaped while the optimizer is built (constructors check shapes), then
            # released: between steps the owner keeps state, not a copy of the parameter.
            pl.handle = nn.Parameter(torch.empty(pl.slot.shape, dtype=master.dtype,
                                                 device=master.device))
            params[pl.slot.group - first_group].append(pl.handle)
        self.inner = rebuild(type(user), user.defaults, inner_groups(user, params))
        for pl in self.owned:
            self._release(pl)

    @property
    def segments(self) -> list[Any]:
        return []  # no shard pieces: state lives whole on owners

    def owned_numel(self) -> int:
        return sum(pl.slot.numel for pl in self.owned)

    def placed_numel(self) -> int:
        return sum(pl.slot.numel for pl in self.placed)

    def states_per_param(self) -> int:
        """Parameter-sized state tensors per owned element (Muon: 1; Adafactor's factored
        statistics are not parameter-sized: 0), measured once state exists."""
        sized = sum(v.numel() for pl in self.owned
                    for v in self.inner.state.get(pl.handle, {}).values()
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == pl.slot.shape)
        if sized:
            return round(sized / self.owned_numel())
        return KNOWN_STATES.get(type(self.user).__name__, 2)

    @staticmethod
    def _release(pl: Placed) -> None:
        assert pl.handle is not None
        pl.handle.grad = None
        pl.handle.data = torch.empty(0, dtype=pl.handle.dtype, device=pl.handle.device)

    # ------------------------------------------------------------------ moving pieces
    def _plan(self, active: list[Placed], to_owner: bool) -> tuple[
            list[tuple[Placed, Entry]], list[int], list[int], list[list[Arrival]]]:
        """One exchange as seen from this rank, following ``to_owner`` ("sources": the pieces
        each rank holds go to the owner, gradient and master; else "holds": the owner sends
        each rank its pieces): the route entries it sends, in send order; elements sent to and
        received from each rank; per sending rank, (parameter, route entry, elements) of what
        arrives, in arrival order."""
        me, ranks = self.comm.rank, self.comm.world_size
        per = 2 if to_owner else 1
        out: list[tuple[Placed, Entry]] = []
        send_counts, recv_counts = [0] * ranks, [0] * ranks
        expected: list[list[Arrival]] = [[] for _ in range(ranks)]
        for other in range(ranks):  # what goes to / comes from ``other``, in one fixed order
            for pl in active:
                if to_owner:
                    sends = pl.sources[me] if pl.owner == other else []
                    into = pl.sources[other] if pl.owner == me else []
                else:
                    sends = pl.holds[other] if pl.owner == me else []
                    into = pl.holds[me] if pl.owner == other else []
                for entry in sends:
                    out.append((pl, entry))
                    send_counts[other] += entry[2] * per
                for entry in into:
                    expected[other].append((pl, entry, entry[2] * per))
                    recv_counts[other] += entry[2] * per
        return out, send_counts, recv_counts, expected

    def _exchange(self, active: list[Placed], routes: str, pieces: Any) -> Iterator[
            tuple[Placed, int, Entry, torch.Tensor]]:
        """One all-to-all. Every rank sends, per destination rank d, ``pieces(pl, route)``
        (tensors) for each active parameter, following ``routes`` (see ``_plan``). Yields what
        arrived here: (parameter, sending rank, route entry, values); the values are valid
        until the next exchange (they may be the host staging buffer)."""
        out, send_counts, recv_counts, expected = self._plan(active, routes == "sources")
        send = [t.reshape(-1) for pl, entry in out for t in pieces(pl, entry)]
        received = self._all_to_all(send, send_counts, recv_counts)
        offset = 0
        for sender, arrivals in enumerate(expected):
            for pl, entry, width in arrivals:
                yield pl, sender, entry, received[offset : offset + width]
                offset += width

    def _all_to_all(self, send: list[torch.Tensor], send_counts: list[int],
                    recv_counts: list[int]) -> torch.Tensor:
        if self.staging is not None:
            return self._staged_all_to_all(send, send_counts, recv_counts)
        device, dtype = self.comm.device, self.dtype
        flat = (torch.cat([t.to(device, dtype) for t in send]) if send else
                torch.empty(0, dtype=dtype, device=device))
        return self.comm.all_to_all(flat, send_counts, recv_counts)

    def _staged_all_to_all(self, send: list[torch.Tensor], send_counts: list[int],
                           recv_counts: list[int]) -> torch.Tensor:
        """The all-to-all of host pieces through the pinned staging buffer: one copy to the
        device of everything sent, one back of everything received (a view of the buffer)."""
        staging, transfers = self.staging, self.transfers
        assert staging is not None
        total = sum(send_counts)
        flat = torch.empty(total, dtype=self.dtype, device=self.comm.device)
        sent: Copy = DONE
        if total:
            offset = 0
            for t in send:  # host to host: only pinned memory moves asynchronously
                staging[offset : offset + t.numel()].copy_(t)
                offset += t.numel()
            sent = transfers.copy(flat, staging[:total])
            sent.wait_device()  # the collective sends ``flat``
        received = self.comm.all_to_all(flat, send_counts, recv_counts)
        sent.wait_host()  # the buffer is written again below, or by the next exchange
        landed = staging[: received.numel()]
        if received.numel():
            transfers.copy(landed, received).wait_host()  # read by the caller next
        return landed

    def _host_staging(self) -> torch.Tensor | None:
        """With the optimizer offloaded to host memory: the pinned buffer every exchange
        passes through, as large as the largest one sends or receives here (None: the
        masters are device memory, the collective's own)."""
        placement = self.placed[0].unit.param_store.placement if self.placed else None
        if placement is None or not placement.offload_optimizer or placement.optimizer_disk:
            return None
        width = 0
        for chunk in self.chunks:
            for to_owner in (True, False):
                _, send_counts, recv_counts, _ = self._plan(chunk, to_owner)
                width = max(width, sum(send_counts), sum(recv_counts))
        return self.transfers.host_empty(width, self.dtype)

    @property
    def transfers(self) -> Transfers:
        """The engine's host<->device copies (every unit's)."""
        return self.placed[0].unit.transfers

    def _chunks(self, active: list[Placed]) -> list[list[Placed]]:
        """Consecutive runs of parameters of at most ``chunk_numel`` elements (or one larger
        parameter): each run is one exchange, so the send and receive buffers stay bounded
        (whole parameters on their owners are needed for the update anyway)."""
        chunks: list[list[Placed]] = []
        size = 0
        for pl in active:
            if not chunks or size + pl.slot.numel > self.chunk_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(pl)
            size += pl.slot.numel
        return chunks

    def step(self) -> None:
        sync_hyperparameters(self.user, self.inner)
        chunks = [run for run in ([pl for pl in chunk if pl.unit.stepped[pl.index]]
                                  for chunk in self.chunks) if run]

        def grad_and_master(pl: Placed, entry: tuple[int, int, int]) -> list[torch.Tensor]:
            _, start, n = entry
            return [pl.unit.master_grad[start : start + n],
                    pl.unit.param_store.master[start : start + n]]

        whole: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for chunk in chunks:
            for pl, _, (at, _, n), values in self._exchange(chunk, "sources", grad_and_master):
                if id(pl) not in whole:
                    master = pl.unit.param_store.master
                    whole[id(pl)] = (torch.empty(pl.slot.shape, dtype=master.dtype,
                                                 device=master.device),
                                     torch.empty(pl.slot.shape, dtype=master.dtype,
                                                 device=master.device))
                grad, value = whole[id(pl)]
                grad.view(-1)[at : at + n].copy_(values[:n])
                value.view(-1)[at : at + n].copy_(values[n:])
        error = self._run_inner(whole)
        del whole  # the gradients; the updated values stay attached to the handles
        self._agree(error)

        def updated(pl: Placed, entry: tuple[int, int, int]) -> list[torch.Tensor]:
            at, _, n = entry
            assert pl.handle is not None
            return [pl.handle.data.view(-1)[at : at + n]]

        with torch.no_grad():
            for chunk in chunks:
                for pl, _, (_, start, n), values in self._exchange(chunk, "holds", updated):
                    pl.unit.param_store.master[start : start + n].copy_(values)
                for pl in chunk:
                    if pl.owner == self.comm.rank:
                        self._release(pl)

    def _run_inner(self, whole: dict[int, tuple[torch.Tensor, torch.Tensor]]
                   ) -> BaseException | None:
        """The owner's update of its whole parameters; an exception is returned, not raised,
        so every rank learns of it before anyone leaves the step."""
        try:
            for pl in self.owned:
                if id(pl) in whole:
                    assert pl.handle is not None
                    grad, value = whole[id(pl)]
                    pl.handle.data = value
                    pl.handle.grad = grad
            self.inner.step()
        except Exception as e:  # reported to every rank by _agree
            for pl in self.owned:
                self._release(pl)
            return e
        for pl in self.owned:
            if pl.handle is not None:
                pl.handle.grad = None
        return None

    def _agree(self, error: BaseException | None) -> None:
        """Every rank learns whether some owner's update failed (one scalar): all raise, the
        masters unchanged everywhere (the owner's update ran on copies)."""
        if self.comm.world_size > 1:
            flag = torch.full((1,), 0.0 if error is None else self.comm.rank + 1.0,
                              device=self.comm.device)
            failed = int(self.comm.all_reduce_max_to_host(flag)[0])
        else:
            failed = 0 if error is None else 1
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"{type(self.user).__name__}.step() failed on rank {failed - 1} (at least); "
                "no parameter was changed on any rank. The cause is in that rank's traceback")

    # ------------------------------------------------------------------ state
    def records(self) -> dict[str, dict[str, Any]]:
        """Records of the owned parameters that have state; tensors listed under "whole"
        with shape and dtype (they need not be parameter-sized: Adafactor's factored
        statistics)."""
        out = {}
        for pl in self.owned:
            state = self.inner.state.get(pl.handle, {})
            if not state:
                continue
            record = state_record(state)
            record["whole"] = {key: {"shape": list(state[key].shape),
                                     "dtype": str(state[key].dtype).replace("torch.", "")}
                               for key in record.pop("tensors")}
            record["tensors"] = []
            out[pl.name] = record
        return out

    def whole_states(self) -> dict[tuple[str, str], torch.Tensor]:
        """(parameter name, key) -> this rank's owned state tensors."""
        out = {}
        for pl in self.owned:
            for key, value in self.inner.state.get(pl.handle, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[(pl.name, key)] = value
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]

    def load(self, records: dict[str, dict[str, Any]],
             read: Any) -> None:
        """Replace the owned parameters' state with the records' (read whole, any layout the
        source had); a parameter without a record has no state afterwards."""
        state_dict = self.inner.state_dict()
        index = {id(p): i for i, p in
                 enumerate(p for g in self.inner.param_groups for p in g["params"])}
        new_state: dict[int, dict[str, Any]] = {}
        for pl in self.owned:
            record = records.get(pl.name)
            if record is None:
                continue
            keys = list(record.get("tensors", [])) + list(record.get("whole", {}))
            entry: dict[str, Any] = {key: read(pl.name, key, None, None).clone() for key in keys}
            for key, value in record["scalars"].items():
                entry[key] = torch.tensor(value, dtype=torch.float32)
            new_state[index[id(pl.handle)]] = entry
        state_dict["state"] = new_state
        self.inner.load_state_dict(state_dict)

    def requests(self, records: dict[str, dict[str, Any]]
                 ) -> Iterator[tuple[str, str, None, None]]:
        """The reads ``load`` will make: whole state tensors of the owned parameters."""
        for pl in self.owned:
            record = records.get(pl.name)
            if record is not None:
                for key in list(record.get("tensors", [])) + list(record.get("whole", {})):
                    yield pl.name, key, None, None
