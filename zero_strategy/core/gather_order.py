"""The gather-order check: every rank gathers the same stage-3 unit at each point of a pass.

Stage-3 gathers follow the modules that run, so ranks running different code (a
mixture-of-experts expert idle on one rank, in a block not recognised as routed) would
exchange the wrong shards, or hang. Each gather is therefore accompanied by the unit's index,
and ranks that disagree raise ``GatherOrderError`` naming both units. Three ways, by where the
group communicates:

- host tensors (gloo on CPU): the index travels as a *header* sent beside the gather without
  waiting, on connections of its own (``Communicator.side_channel``); the headers are read in
  gather order before a unit's rows are waited for. A blocking round trip per unit would put
  the link's latency, and every byte queued ahead on it, between the gathers: across nodes
  the step would cost the link plus the compute. Each unit's rows travel on a channel of
  their own (the unit's index), so a rank gathering another unit at the same point never
  receives them;
- a GPU: reading the indices would stall the host once per unit, so each is a *tag*, a view
  of one index tensor made once, all-gathered with the gather and read at the end of
  backward (or after ``DEFERRED_TAGS`` gathers), still before the step can use anything
  gathered;
- ``check_gather_order="blocking"``: a blocking exchange before each gather.

In backward a header (or blocking exchange) also carries how many reductions this rank has
launched, in launch order; the least over the ranks is handed to ``agreed``: the reductions
the runtime may block on, since every rank has launched them (``runtime.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..comm.collectives import Communicator
from ..comm.handles import Handle
from .units import Unit

DEFERRED_TAGS = 64
"""Gather-order tags read at once on a GPU (one host sync) at the latest after this many
gathers, so a forward-only loop does not queue them without bound."""


class GatherOrderError(RuntimeError):
    """Ranks gathered different stage-3 units at the same point of a pass."""


class GatherOrder:
    """``comm``: the group gathering (the shard group under hybrid sharding); ``world``: every
    rank, all of which check (replicas reduce in the order their groups gathered).
    ``ready()``: this rank's count of reductions launched, in launch order; ``agreed(least)``:
    called with the least count over the ranks each time one is read."""

    def __init__(self, units: list[Unit], comm: Communicator, world: Communicator,
                 check: bool, blocking: bool, ready: Callable[[], int],
                 agreed: Callable[[int], None]) -> None:
        self.units = units
        self.world = world
        self.check = check and comm.world_size > 1
        self.deferred = comm.device.type != "cpu" and not blocking
        self.headers = comm.device.type == "cpu" and not blocking
        self._ready, self._agreed = ready, agreed
        self._pending: deque[tuple[Unit, torch.Tensor, Handle]] = deque()
        """Headers sent and not read yet, in gather order."""
        self._side = world.side_channel() if self.headers and self.check else world
        self.sent = 0
        """Headers sent in this process (``match_headers`` evens the counts out)."""
        self._indices: torch.Tensor | None = None
        """Every unit's index on the device, made once: a unit's tag is a view of it, so
        tagging a gather copies nothing from the host."""
        self._tags: list[tuple[Unit, torch.Tensor, Handle]] = []

    @property
    def agrees_launches(self) -> bool:
        """Whether the check agrees, at each gather of backward, which reductions every rank
        has launched (not where it is read only at the end)."""
        return self.check and not self.deferred

    def before_gather(self, unit: Unit) -> int | None:
        """Start checking ``unit``'s gather; the channel its rows travel on (None: the
        group's own)."""
        if not self.check:
            return None
        if self.deferred:
            self._tag(unit)
        elif self.headers:
            self._pending.append((unit, *self._send_header(unit.index)))
            return unit.index
        else:
            self._check_and_agree(unit)
        return None

    def _send_header(self, index: int) -> tuple[torch.Tensor, Handle]:
        self.sent += 1
        mine = torch.tensor([index, self._ready()], dtype=torch.int64)
        out = torch.empty(2 * self.world.world_size, dtype=torch.int64)
        return out, self._side.all_gather_polled(out, mine)

    def read(self, upto: Unit | None = None) -> None:
        """Check the headers of the gathers issued so far, in order, up to ``upto``'s (all
        by default). Each gather's headers agree which reductions may be waited for: the
        least count of reductions any rank had launched when it issued that gather."""
        if upto is not None and all(u is not upto for u, _, _ in self._pending):
            return
        while self._pending:
            if self._take() is upto:
                return

    def poll(self) -> None:
        """Read the headers that have arrived, without waiting for any: the agreement on
        which reductions may be waited for then takes effect as soon as every rank's header
        is in, not when this rank next waits for a gather (the side channel keeps them from
        queueing behind gathered rows)."""
        while self._pending and self._pending[0][2].ready():
            self._take()

    def _take(self) -> Unit:
        unit, out, handle = self._pending.popleft()
        handle.wait(host=True)  # read next
        rows = out.view(self.world.world_size, 2).tolist()
        self._check(unit, [r[0] for r in rows])
        self._agreed(min(r[1] for r in rows))
        return unit

    def _check_and_agree(self, unit: Unit) -> None:
        tags = self.world.all_gather_ints([unit.index, self._ready()])
        self._check(unit, [t[0] for t in tags])
        self._agreed(min(t[1] for t in tags))

    def _tag(self, unit: Unit) -> None:
        if self._indices is None:
            self._indices = torch.arange(len(self.units), dtype=torch.int64,
                                         device=self.world.device)
        mine = self._indices[unit.index : unit.index + 1]
        out = torch.empty(self.world.world_size, dtype=torch.int64, device=self.world.device)
        self._tags.append((unit, out, self.world.all_gather(out, mine, async_op=True)))
        if len(self._tags) >= DEFERRED_TAGS:
            self.verify()

    def verify(self) -> None:
        """Read the deferred tags (one host sync for all of them), or every header not read
        yet."""
        self.read()
        if not self._tags:
            return
        pending, self._tags = self._tags, []
        for _, _, handle in pending:
            handle.wait(host=True)  # the tags are read next
        rows = torch.stack([out for _, out, _ in pending]).tolist()
        for (unit, _, _), tags in zip(pending, rows):
            self._check(unit, tags)

    def match_headers(self) -> list[Handle]:
        """After a pass cut short: every rank sends as many headers as the most any sent
        (counts agreed through the store, behind no unmatched operation), so each header a
        peer sent is matched; returns the handles of this rank's unread headers, forgotten
        here, to wait for (what they carry is discarded with the pass)."""
        counts = self.world.agree(self.sent)
        for _ in range(max(counts) - self.sent):
            self._send_header(-1)
        handles = [handle for _, _, handle in self._pending]
        self._pending.clear()
        return handles

    def _check(self, unit: Unit, tags: list[int]) -> None:
        if any(t != unit.index for t in tags):
            names = ", ".join(f"rank {r}: unit {t} {self.units[t].name or '<root>'!r}"
                              for r, t in enumerate(tags))
            raise GatherOrderError(
                f"stage 3: ranks are gathering different units ({names}). A module ran on "
                "some ranks but not on others (e.g. a mixture-of-experts expert that received "
                "no tokens on one rank, in a block not recognised as routed: one is "
                "recognised by a router parameter beside its list of experts). Gather such "
                "modules with their parent: list the parent's class in "
                "ZeroConfig(unit_leaf_classes=[...]), or call every module on every rank (an "
                "expert may run on an empty batch)")
