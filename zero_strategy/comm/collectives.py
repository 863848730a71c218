"""Every `torch.distributed` call of the package, behind one small class.

Keeping the collectives here means one place counts the bytes each rank moves (the sweep report
shows them), one place knows which backend quirks exist, and one place bounds how long a rank
waits for the others: a stalled or lost peer becomes an error naming the collective and the
step instead of a silent hang.

The quirk that matters most on a CPU: gloo's flat all-gather receives into a temporary buffer
of the whole output and copies it out, and its reduce-scatter clones the whole input and
all-reduces it (twice the bytes of a reduce-scatter) before copying one slice out. For host
tensors under gloo both are therefore done here as direct exchanges between each pair of
ranks (gloo's send/recv read and write the tensors themselves): an all-gather sends this
rank's shard to every peer and receives each peer's into its slice of the output; a
reduce-scatter sends every peer its slice of the input, receives this rank's slice from each
peer (the first one straight into the output, the others into scratch memory) and adds them up
in a fixed order. Same bytes as the ring algorithms,
no temporary of the whole buffer, half the traffic of gloo's reduce-scatter.

A collective that fails, when it starts (gloo sends on the caller's thread) or in its wait,
raises ``CollectiveError`` (``CollectiveTimeout`` past the timeout) naming the collective,
the step, this rank and the peer of a direct exchange, with the transport's error as its
``__cause__``. The rendezvous store's part (failure reports quoted in those errors,
agreements) is ``store.py``'s, bounded so that a store out of reach cannot hang or replace
the error being raised.
"""

from __future__ import annotations

import ctypes
import pickle
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import groups, int8
from .handles import Chain, Done, Exchange, Handle, Pending, Then
from .store import REPORT_WAIT_S, Ledger, StoreSilent

# torch 2.13 renamed the flat collectives; older releases (>= 2.4) only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextmanager
def _unprofiled() -> Iterator[None]:
    """Point-to-point works started with no profiler record. Under a profiler, torch (2.13,
    gloo) gives such a work a record that ends when the work is waited; ours are often
    waited after the call that started them (a gather prefetched for the next step), and a
    record ending after the profiler stopped writes into the profiler's freed state: heap
    corruption, then a segfault at exit (a profile of steps 2-4, then ``engine.close()``).
    The ``zero::`` scopes still mark where the engine waits."""
    if not torch.autograd._profiler_enabled():
        yield
        return
    torch.autograd._enable_record_function(False)
    try:
        yield
    finally:
        torch.autograd._enable_record_function(True)


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer died, or the group broke); the message names
    the collective, the training step and the rank."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within ``ZeroConfig.timeout``: some rank stopped
    responding (stalled, killed, or running different code)."""


_INSTANCES: Counter[tuple[int, ...]] = Counter()
_SIDE_GROUPS: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}
"""Side channels (``Communicator.side_channel``) by ranks, with the default group they were
made under: reused while that group is the default (however many engines are built on it),
made anew under a new one (a Hydra sweep's next job: the old group is destroyed, and a new
one may even reuse its address, so the object itself is held and compared)."""
"""Communicators built so far in this process, by their ranks."""

_KEPT_WORKS: deque[Any] = deque(maxlen=8)
"""The last few collectives of ours that gloo ran on its worker threads (``_queued``), kept
referenced here, and this container never freed, so that no worker thread frees one of them
while the interpreter exits.

A gloo worker thread marks a collective complete, then drops its reference to it; when that
reference is the last, the work's destructor releases the tensors it holds, and releasing a
tensor that has a Python object takes the GIL. A worker descheduled between the two (a loaded
host) can wake after the script returned, with the interpreter finalizing: taking the GIL then
ends the thread (``pthread_exit``) inside that ``noexcept`` destructor, and the process aborts
("terminate called without an active exception", SIGABRT) after a run that completed. The
workers outlive ``destroy_process_group()``, which joins them only when it drops the group's
last reference, and once ``torch._dynamo`` is imported (``torch.optim``'s optimizers import
it) the group stays referenced. Kept here, a work's last reference is never the worker's, so
its drop frees nothing; the works here are never freed (the container's reference count is
raised below), whether or not the script destroys its group or closes the engine.

A worker holds one work at a time, so it has dropped every work older than the last 8 unless
the group's other worker ran 8 collectives while it waited for a CPU. Kept are the
collectives a script ends on: all-reduces (norms, the step's flags) and ``all_gather_object``
(the exchanges that end checkpoint saves and loads), and only while their tensors are small
(``_KEPT_BYTES``), so no large buffer outlives its use. Not kept: all-gathers, reduce-scatters,
broadcasts and all-to-alls, whose tensors are units' buffers (a kept reference would count as
an escaped view of a gathered buffer, ``ParamStore.aliases``) or large; under gloo on the
host all-gathers and reduce-scatters are sends and receives, which run on no worker thread. A
barrier holds no tensors: freeing it takes no GIL."""

_KEPT_BYTES = 1 << 20
"""The most tensor bytes a kept work may hold (see ``_KEPT_WORKS``)."""

try:  # never freed, not even at interpreter exit: see _KEPT_WORKS
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT_WORKS))
except AttributeError:  # an interpreter without the C API: nothing kept beyond its time
    pass


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


Scratch = Callable[[int, torch.dtype], torch.Tensor]
"""Lends a 1-D tensor of (numel, dtype) for a collective's receive buffer."""

Release = Callable[[torch.Tensor], None]

# Tags of the direct exchanges: each kind of collective matches its sends and receives on its
# own tag, in the order every rank issues them.
_GATHER_TAG, _REDUCE_TAG = 11, 12
_CHANNEL_TAG = 1 << 20
"""Tags from here on: one per gather channel (a stage-3 unit), so that ranks gathering
different units at the same point never match one unit's row with another's (gloo aborts
the process when a message is longer than the buffer posted for it); the runtime's ordered
header exchange then tells them apart and raises, before anything waits for the rows."""


class Communicator:
    """Collectives over one process group (the default group unless one is given).

    Every tensor handed to a collective must be on ``device`` (the engine's compute device):
    a host tensor in an nccl collective fails only on a GPU, at N >= 2, so the check is made
    here, on every backend, where a CPU test can see it.

    ``timeout`` (seconds) bounds every wait where the backend serving ``device`` is gloo
    (plain "gloo", or "cpu:gloo,cuda:nccl" with a CPU model), whose own default is 30 minutes
    and cannot be changed for a group someone else created. Under nccl a bounded ``wait``
    blocks the host until the GPU finishes (no more overlap), so only the waits after which
    the host reads the result anyway are bounded there (``wait(host=True)``, the ``*_to_host``
    collectives, barriers, object exchanges): a peer that never comes raises
    ``CollectiveTimeout`` there instead of leaving it to nccl's watchdog, which ends the
    process. ``step`` tells errors which training step they happened in.

    Byte counts follow the ring convention: what each rank sends for the operation.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None,
                 step: Callable[[], int] | None = None) -> None:
        if not groups.group_is_initialized():
            raise RuntimeError(
                "zero_strategy needs an initialised process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') before building a "
                "ZeroEngine (a single process can use world_size=1)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = groups.default_device(self.backend)
        own = groups.group_timeout(group)
        # The stricter of the engine's bound and the one the user gave their group: a group
        # created with timeout=10 s means 10 s, not ZeroConfig's default.
        self.timeout_s = min((t for t in (timeout, own) if t is not None), default=None)
        stricter = own is not None and (timeout is None or own < timeout)
        self._timeout_source = "the process group's timeout" if stricter else "ZeroConfig.timeout"
        self._host_timeout = (timedelta(seconds=self.timeout_s)
                              if self.timeout_s is not None else None)
        """Bounds the waits the host blocks on whatever the backend."""
        self._wait_timeout: timedelta | None = None
        """Bounds every wait: the timeout where the device's backend is gloo."""
        self._bound_waits()
        self._step = step
        self.bytes_sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._scratch: tuple[Scratch, Release] | None = None
        self._peers = [dist.get_global_rank(group, r) if group is not None else r
                       for r in range(self.world_size)]
        # Every rank builds its communicators in the same order: the count names this one
        # alike on all of them, for keys in the rendezvous store (``agree_max``).
        _INSTANCES[tuple(self._peers)] += 1
        key = f"zero_strategy/{'-'.join(map(str, self._peers))}/{_INSTANCES[tuple(self._peers)]}"
        self.ledger = Ledger(groups.default_store, key, self.rank, self.world_size)
        """Failure reports and agreements, through the rendezvous store."""

    def report_failure(self, message: str) -> bool:
        """Leave this rank's error where its peers' timeouts look (the rendezvous store): a
        rank whose step raised stops issuing collectives, and a peer waiting for one of them
        should say which rank failed and why, not only that one stopped responding. Never
        raises (``Ledger.report``): False when the report could not be left."""
        return self.ledger.report(message)

    def clear_failure(self) -> None:
        """The failed pass is over on this rank (``zero_grad()``): its report goes."""
        self.ledger.clear()

    def _report_wait(self) -> float:
        """After a timeout, how long to wait for a peer's report: ``REPORT_WAIT_S``, and
        never longer than the timeout itself (a short timeout stays short)."""
        return min(REPORT_WAIT_S, self.timeout_s or REPORT_WAIT_S)

    def _reported_failures(self, wait_s: float = 0.0) -> str:
        return self.ledger.reported(wait_s)

    def agree_max(self, value: int) -> int:
        """The largest ``value`` over this group's ranks, agreed through the rendezvous store
        instead of the group: usable while the group holds operations some rank never
        matched (a pass cut short), behind which a collective would wait."""
        return max(self.agree(value))

    def agree(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank, through the rendezvous store (as ``agree_max``)."""
        try:
            return self.ledger.agree(value, self.timeout_s or 600.0)
        except (RuntimeError, StoreSilent) as e:
            raise self._error("agree (store)", e) from e

    def split(self, group_size: int) -> tuple[Communicator, Communicator]:
        """Hybrid sharding: (this rank's shard group of ``group_size`` consecutive ranks, its
        replica group of the ranks at the same place in every shard group). Every rank of this
        communicator calls it, and they create every shard group, then every replica group,
        in one order (``_subgroup``)."""
        n = self.world_size
        if group_size > n or n % group_size:
            raise ValueError(f"shard_group_size={group_size} must divide the world size {n} "
                             f"(allowed: {[k for k in range(1, n + 1) if n % k == 0]})")
        blocks = [list(range(start, start + group_size)) for start in range(0, n, group_size)]
        columns = [list(range(first, n, group_size)) for first in range(group_size)]
        shards, replicas = (Communicator(self._subgroup(parts), timeout=self.timeout_s,
                                         step=self._step) for parts in (blocks, columns))
        for comm in (shards, replicas):
            comm.use_device(self.device)
            comm._scratch = self._scratch
        return shards, replicas

    def _subgroup(self, parts: list[list[int]]) -> dist.ProcessGroup:
        """This rank's group among ``parts``, a partition of this group's ranks.

        Where the world's group is bound to a device (``init_process_group(device_id=...)``,
        which Lightning passes), nccl makes a new group by splitting the world's
        communicator, and every rank of the world must take part in every split in the same
        order, members or not. So every group of the partition is created on every rank, in
        the partition's order. A subgroup's ranks cannot make the rest of the world take part:
        there the groups are split from this group itself (``split_group``)."""
        timeout = timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
        if self.group is not None and groups.splits_communicators():
            return dist.split_group(self.group, parts, timeout=timeout)
        mine = None
        for part in parts:
            group = dist.new_group([self._peers[r] for r in part], backend=self.backend,
                                   timeout=timeout,
                                   use_local_synchronization=self.group is not None)
            if self.rank in part:
                mine = group
        assert mine is not None, (self.rank, parts)  # a partition covers every rank
        return mine

    def side_channel(self) -> Communicator:
        """A communicator over the same ranks on connections of their own (a second gloo
        group, made once per group and reused), for small messages that must not queue
        behind this group's bulk transfers: a few bytes sent on a connection that carries
        megabytes of gathered rows arrive only after them. Every rank calls it, in one
        order (engines are built on every rank alike)."""
        default = dist.distributed_c10d._get_default_group()
        made = _SIDE_GROUPS.get(tuple(self._peers))
        if made is not None and made[0] is default:
            group = made[1]
        else:
            group = self._subgroup([list(range(self.world_size))])
            _SIDE_GROUPS[tuple(self._peers)] = (default, group)
        side = Communicator(group, timeout=self.timeout_s, step=self._step)
        side.use_device(self.device)
        side.bytes_sent = self.bytes_sent  # the same ranks' traffic: counted as theirs
        # and the same ranks' failures: a peer reports into this communicator's keys, which
        # an error on the side channel (the gather headers, often the first to time out
        # when a peer failed) must read to name the cause
        side.ledger = self.ledger
        return side

    def all_gather_polled(self, flat_output: torch.Tensor, shard: torch.Tensor) -> Handle:
        """``all_gather`` as one collective of the backend, never as direct exchanges: its
        handle's ``ready()`` reports completion as soon as it happens (gloo's point-to-point
        work reports it only once waited for), so a caller can read it without blocking."""
        self._check("all_gather", flat_output, shard)
        self._count("all_gather", flat_output.nbytes * self._fraction())
        # Not kept past its use (``_queued``): its caller waits for it long before a script
        # ends, and a kept one was seen to keep a step's saved activation (an offloaded
        # input's open file) alive after the step (tests/quick/test_step_faults.py).
        with self._starting("all_gather"):
            work = _all_gather(flat_output, shard, group=self.group, async_op=True)
        return Pending(self, work, "all_gather")

    def global_ranks(self) -> list[int]:
        """This group's members, as ranks of the default group (the store's agreements)."""
        return list(self._peers)

    def use_scratch(self, take: Scratch, give: Release) -> None:
        """Where receive buffers of the direct exchanges come from and go back to (the
        engine's buffer pool); without, they are allocated per call."""
        self._scratch = (take, give)

    @property
    def reduce_scatter_scratch_slices(self) -> int:
        """Output-sized receive buffers one ``reduce_scatter`` holds while in flight: the
        direct exchange receives every peer's slice at once, the first into the output and
        the other N - 2 into scratch (the memory bound counts them); a backend's own
        collective keeps its buffers outside the process's tensors."""
        return max(self.world_size - 2, 0) if self._direct else 0

    @property
    def _direct(self) -> bool:
        """Host tensors under gloo: gather and reduce-scatter as direct exchanges."""
        return (self.world_size > 1 and self.device.type == "cpu"
                and groups.backend_for(self.backend, "cpu") == "gloo")

    def use_device(self, device: torch.device) -> None:
        """Communicate tensors on ``device`` (the compute device); refuses a device the
        group's backend has no communicator for."""
        if groups.backend_for(self.backend, device.type) is None:
            raise ValueError(
                f"the process group's backend {self.backend!r} cannot communicate {device.type} "
                f"tensors, but the model is on {device}: move the model to a device the backend "
                "serves (nccl: cuda), or create the group with a backend for it (gloo for CPU, "
                "or 'cpu:gloo,cuda:nccl')")
        self.device = device
        self._bound_waits()

    def _bound_waits(self) -> None:
        """Decided per device: the backend string names a backend for each device type."""
        gloo = groups.backend_for(self.backend, self.device.type) == "gloo"
        self._wait_timeout = self._host_timeout if gloo else None
        self._gloo = gloo

    def _queued(self, work: Any, *tensors: torch.Tensor) -> Any:
        """``work``, an all-reduce or object exchange queued to the group's worker threads;
        under gloo kept referenced when its tensors are small, so that no worker thread frees
        it while the interpreter exits (``_KEPT_WORKS``)."""
        if self._gloo and sum(t.nbytes for t in tensors) <= _KEPT_BYTES:
            _KEPT_WORKS.append(work)
        return work

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device.type != self.device.type:
                raise ValueError(
                    f"collective {op}: a tensor on {t.device} was handed to a group that "
                    f"communicates on {self.device} ({self.backend}); copy it to {self.device} "
                    "first (host-side values such as an offloaded gradient norm included)")

    def _count(self, op: str, nbytes: float) -> None:
        self.bytes_sent[op] += int(nbytes)
        self.calls[op] += 1

    def _fraction(self) -> float:
        return (self.world_size - 1) / self.world_size

    # ---------------------------------------------------------------- waiting
    def wait(self, work: Any, op: str, host: bool = False, peer: int | None = None) -> None:
        """Wait for ``work`` (collective ``op``; a send to or receive from ``peer``, a rank
        of this group, when it is one) at most the timeout; raise naming it. ``host``: the
        host reads the result next, so the wait blocks it on every backend and is bounded on
        every backend (nccl's ``wait(timeout)`` blocks the host)."""
        limit = self._host_timeout if host else self._wait_timeout
        try:
            if limit is None:
                work.wait()
            else:
                work.wait(limit)
        except RuntimeError as e:
            raise self._error(op, e, peer) from e

    @contextmanager
    def _starting(self, op: str, peer: int | None = None) -> Iterator[None]:
        """Around the call that starts a collective: gloo sends on the caller's thread, so
        a peer gone already fails there (``Connection closed by peer``), not in the wait;
        that error becomes ours too. A point-to-point start (``peer``) is unprofiled."""
        try:
            with _unprofiled() if peer is not None else nullcontext():
                yield
        except RuntimeError as e:
            raise self._error(op, e, peer) from e

    def _error(self, op: str, cause: BaseException, peer: int | None = None
               ) -> CollectiveError:
        """The error a failed collective raises: the collective, the step, this rank, the
        peer it was exchanging with (when one), and the transport's own message; the
        caller chains ``cause`` as its ``__cause__``."""
        where = "outside training"
        if self._step is not None:
            try:
                where = f"at step {self._step()}"
            except AttributeError:  # raised while the engine is still being built
                where = "while building the engine"
        text = str(cause).lower()
        timed_out = isinstance(cause, TimeoutError) or "timed out" in text or "timeout" in text
        what = (f"did not complete within {self.timeout_s:g} s ({self._timeout_source})"
                if timed_out and self.timeout_s is not None else "failed")
        kind = CollectiveTimeout if timed_out else CollectiveError
        first_line = (str(cause).splitlines() or [""])[0][:200]
        return kind(
            f"collective {op} {what} {where} on rank {self.rank} of {self.world_size} "
            f"({self.backend}){self._with(peer)}: another rank stopped responding (stalled, "
            f"killed, or running different code) [{type(cause).__name__}: {first_line}]"
            f"{self._reported_failures(self._report_wait() if timed_out else 0.0)}")

    def _with(self, peer: int | None) -> str:
        if peer is None and self.world_size == 2:
            # A collective of the backend (the side channel's headers, an all-reduce) on two
            # ranks exchanges with the other one only: name it as a direct exchange would.
            peer = 1 - self.rank
        if peer is None:
            return ""
        known = f" (global rank {self._peers[peer]})" if self.group is not None else ""
        return f", exchanging with rank {peer}{known}"

    def _finish(self, work: Any, op: str, async_op: bool) -> Handle:
        if async_op:
            return Pending(self, work, op)
        self.wait(work, op)
        return Done()

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum in place over ranks."""
        self._check("all_reduce", tensor)
        self._count("all_reduce", 2 * tensor.nbytes * self._fraction())
        with self._starting("all_reduce"):
            work = self._queued(dist.all_reduce(tensor, group=self.group, async_op=True),
                                tensor)
        return self._finish(work, "all_reduce", async_op)

    def all_reduce_int8(self, tensor: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``tensor`` in place over ranks, sending block-wise int8 (ZeRO++'s quantized
        gradient reduction, between shard groups): a reduce-scatter of the encoded tensor,
        then an all-gather of the encoded sums, launched once the first has completed
        (``Chain``). A value is off by the reduce-scatter's error (half a step of each peer's
        block) plus half a step of its summed block, quantized once more for the gather so
        every rank ends with the same values. (n-1)/n of a quarter of the fp32 bytes each way,
        where an fp32 all-reduce sends 2(n-1)/n of them."""
        n, numel = self.world_size, tensor.numel()
        if n == 1:
            return Done()
        piece = -(-numel // (n * int8.BLOCK)) * int8.BLOCK  # block-aligned, one per rank
        take, give = self._lender()
        padded = take(n * piece, torch.float32)
        padded[:numel].copy_(tensor.reshape(-1))
        padded[numel:].zero_()
        summed = take(piece, torch.float32)
        first = self.reduce_scatter_int8(summed, padded, async_op=True)

        def gather() -> Handle:
            def done() -> None:
                tensor.reshape(-1).copy_(padded[:numel])
                give(summed)
                give(padded)
            return Then(self.all_gather_int8(padded, summed, async_op=True), done)

        chain = Chain(first, gather)
        if not async_op:
            chain.wait()
            return Done()
        return chain

    def all_reduce_max(self, tensor: torch.Tensor, *, host: bool = False) -> torch.Tensor:
        """Max in place over ranks; ``host``: complete for the host, which reads it next."""
        self._check("all_reduce(max)", tensor)
        self._count("all_reduce", 2 * tensor.nbytes * self._fraction())
        with self._starting("all_reduce(max)"):
            work = self._queued(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group,
                                                async_op=True), tensor)
        self.wait(work, "all_reduce(max)", host=host)
        return tensor

    def all_reduce_max_to_host(self, tensor: torch.Tensor) -> list[float]:
        """The max over ranks of ``tensor`` (1-D), read on the host (one bounded wait)."""
        if self.world_size > 1:
            self.all_reduce_max(tensor, host=True)
        return tensor.tolist()

    def reduce_scatter(
        self, output: torch.Tensor, flat_input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Sum ``flat_input`` over ranks; rank r receives the r-th equal slice in ``output``."""
        self._check("reduce_scatter", output, flat_input)
        self._count("reduce_scatter", flat_input.nbytes * self._fraction())
        if self._direct:
            return self._reduce_scatter_direct(output, flat_input, async_op)
        group = self.group if self.group is not None else dist.group.WORLD
        if self._wait_timeout is not None and hasattr(group, "_reduce_scatter_base"):
            # gloo's reduce-scatter work ignores wait(timeout) and would block for the
            # group's own timeout (30 minutes by default): the op carries the timeout itself.
            opts = dist.ReduceScatterOptions()
            opts.reduceOp, opts.timeout, opts.asyncOp = dist.ReduceOp.SUM, self._wait_timeout, True
            with self._starting("reduce_scatter"):
                work = group._reduce_scatter_base(output, flat_input, opts)
        else:
            with self._starting("reduce_scatter"):
                work = _reduce_scatter(output, flat_input, group=self.group, async_op=True)
        return self._finish(work, "reduce_scatter", async_op)

    def all_gather(
        self, flat_output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False,
        channel: int | None = None,
    ) -> Handle:
        """Concatenate every rank's ``shard`` into ``flat_output`` (rank order). ``channel``
        (a stage-3 unit's index): where the exchange is direct, its messages match only
        messages of the same channel (``_CHANNEL_TAG``)."""
        self._check("all_gather", flat_output, shard)
        self._count("all_gather", flat_output.nbytes * self._fraction())
        if self._direct:
            return self._all_gather_direct(flat_output, shard, async_op, channel)
        with self._starting("all_gather"):
            work = _all_gather(flat_output, shard, group=self.group, async_op=True)
        return self._finish(work, "all_gather", async_op)

    def _all_gather_direct(self, flat_output: torch.Tensor, shard: torch.Tensor,
                           async_op: bool, channel: int | None) -> Handle:
        rows = flat_output.view(self.world_size, -1)
        if rows[self.rank].data_ptr() != shard.data_ptr():
            rows[self.rank].copy_(shard)
        works = self._gather_rows(rows, "all_gather", channel)
        return self._finish_exchange(Exchange(self, works, "all_gather"), async_op)

    def _gather_rows(self, rows: torch.Tensor, op: str,
                     channel: int | None = None) -> list[tuple[Any, int | None]]:
        """Start filling every row of ``rows`` (one per rank) with that rank's own row, which
        is already in place here; uncounted (the callers count what they send). Each work
        with the rank it exchanges with (None: the whole group's)."""
        if not self._direct:
            with self._starting(op):
                return [(_all_gather(rows.view(-1), rows[self.rank], group=self.group,
                                     async_op=True), None)]
        tag = _GATHER_TAG if channel is None else _CHANNEL_TAG + channel
        works: list[tuple[Any, int | None]] = []
        for r in range(self.world_size):
            if r != self.rank:
                with self._starting(op, r):
                    works.append((dist.isend(rows[self.rank], self._peers[r], group=self.group,
                                             tag=tag), r))
                    works.append((dist.irecv(rows[r], self._peers[r], group=self.group,
                                             tag=tag), r))
        return works

    def _reduce_scatter_direct(self, output: torch.Tensor, flat_input: torch.Tensor,
                               async_op: bool) -> Handle:
        if _overlaps(output, flat_input):
            raise ValueError("reduce_scatter: the output must not alias the input")
        pieces = flat_input.view(self.world_size, -1)
        peers = [r for r in range(self.world_size) if r != self.rank]
        # The first peer's piece lands in ``output`` itself; only the others need scratch
        # (none on two ranks).
        take, give = self._lender()
        slices = self.reduce_scatter_scratch_slices  # what the memory bound counts
        scratch = take(slices * output.numel(), output.dtype) if slices else None
        targets = [output] + (list(scratch.view(slices, -1)) if scratch is not None else [])
        works: list[tuple[Any, int | None]] = []
        for peer, target in zip(peers, targets):
            with self._starting("reduce_scatter", peer):
                works.append((dist.isend(pieces[peer], self._peers[peer], group=self.group,
                                         tag=_REDUCE_TAG), peer))
                works.append((dist.irecv(target, self._peers[peer], group=self.group,
                                         tag=_REDUCE_TAG), peer))

        def finish() -> None:  # peers in rank order, then this rank: the same order every step
            for target in targets[1:]:
                output.add_(target)
            output.add_(pieces[self.rank])
            if scratch is not None:
                give(scratch)

        return self._finish_exchange(Exchange(self, works, "reduce_scatter", finish), async_op)

    def _lender(self) -> tuple[Scratch, Release]:
        """Where receive and encode buffers come from: the engine's pool, else fresh."""
        if self._scratch is not None:
            return self._scratch
        return (lambda numel, dtype: torch.empty(numel, dtype=dtype, device=self.device),
                lambda tensor: None)

    def _finish_exchange(self, exchange: Exchange, async_op: bool) -> Handle:
        if not async_op:
            exchange.wait()
            return Done()
        return exchange

    # ---------------------------------------------------------------- int8 on the wire
    def all_gather_int8(self, flat_output: torch.Tensor, shard: torch.Tensor, *,
                        async_op: bool = False, channel: int | None = None) -> Handle:
        """``all_gather`` sending block-wise int8 (``int8.py``); every piece of the output,
        this rank's too, holds the decoded values, so all ranks compute with the same ones."""
        self._check("all_gather", flat_output, shard)
        n, nb = self.world_size, int8.blocks(shard.numel())
        take, give = self._lender()
        payload = take(n * nb * int8.BLOCK, torch.int8).view(n, -1)
        scales = take(n * nb, torch.float32).view(n, -1)
        scratch = take(int8.scratch_numel(shard.numel(), shard.device), torch.float32)
        int8.encode(shard, payload[self.rank], scales[self.rank], scratch)
        give(scratch)
        self._count("all_gather", (n - 1) * (payload[0].nbytes + scales[0].nbytes))
        works = (self._gather_rows(payload, "all_gather", channel)
                 + self._gather_rows(scales, "all_gather", channel) if n > 1 else [])

        def finish() -> None:
            for row, out in zip(range(n), flat_output.view(n, -1)):
                int8.decode(payload[row], scales[row], out)
            give(payload)
            give(scales)

        return self._finish_exchange(Exchange(self, works, "all_gather", finish), async_op)

    def reduce_scatter_int8(self, output: torch.Tensor, flat_input: torch.Tensor, *,
                            async_op: bool = False) -> Handle:
        """``reduce_scatter`` sending block-wise int8: every peer's slice goes to it encoded
        (one all-to-all); the slices received are decoded and summed in fp32, this rank's
        own exact slice first, then the peers' in rank order."""
        self._check("reduce_scatter", output, flat_input)
        if _overlaps(output, flat_input):
            raise ValueError("reduce_scatter: the output must not alias the input")
        n, k = self.world_size, output.numel()
        pieces = flat_input.view(n, -1)
        if n == 1:
            output.copy_(pieces[0])
            return Done()
        nb = int8.blocks(k)
        take, give = self._lender()
        sent = [take(n * nb * int8.BLOCK, torch.int8), take(n * nb, torch.float32)]
        got = [take(t.numel(), t.dtype) for t in sent]
        scratch = take(int8.scratch_numel(k, output.device), torch.float32)
        for r in range(n):
            if r != self.rank:  # this rank's row is not sent: its slice stays exact
                int8.encode(pieces[r], sent[0].view(n, -1)[r], sent[1].view(n, -1)[r],
                            scratch)
        give(scratch)
        self._count("reduce_scatter", (n - 1) * (sent[0].nbytes + sent[1].nbytes) // n)
        with self._starting("reduce_scatter"):
            works: list[tuple[Any, int | None]] = [
                (dist.all_to_all_single(g, s, group=self.group, async_op=True), None)
                for g, s in zip(got, sent)]

        def finish() -> None:
            total = output if output.dtype == torch.float32 else take(k, torch.float32)
            values = take(int8.scratch_numel(k, output.device), torch.float32)
            total.copy_(pieces[self.rank])
            for r in range(n):
                if r != self.rank:
                    int8.decode_add(got[0].view(n, -1)[r], got[1].view(n, -1)[r], total,
                                    values)
            if total is not output:
                output.copy_(total)
                give(total)
            for t in (values, *sent, *got):
                give(t)

        return self._finish_exchange(Exchange(self, works, "reduce_scatter", finish), async_op)

    def all_to_all(self, send: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Rank r's ``send[sum(send_counts[:k]):...]`` goes to rank k; returns what every rank
        sent here, in rank order (``recv_counts[k]`` elements from rank k)."""
        self._check("all_to_all", send)
        out = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
        self._count("all_to_all", (send.numel() - send_counts[self.rank]) * send.element_size())
        if self.world_size == 1:
            out.copy_(send)
            return out
        with self._starting("all_to_all"):
            work = dist.all_to_all_single(out, send, recv_counts, send_counts,
                                          group=self.group, async_op=True)
        self.wait(work, "all_to_all")
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank ``src`` of this group sends ``tensor`` to every rank, in place."""
        self._check("broadcast", tensor)
        self._count("broadcast", tensor.nbytes)
        with self._starting("broadcast"):
            work = dist.broadcast(tensor, group=self.group, async_op=True,
                                  src=dist.get_global_rank(self.group, src) if self.group
                                  else src)
        self.wait(work, "broadcast")

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast many small tensors as one flat message per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src)
            offset = 0
            for t in group:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_gather_ints(self, values: list[int], counted: bool = True) -> list[list[int]]:
        """Every rank's ``values`` (a blocking round trip of 8 bytes per value and rank).
        ``counted=False``: left out of ``bytes_sent`` (metadata outside ZeRO's traffic)."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        before = self.bytes_sent["all_gather"]
        self.all_gather(out, mine, async_op=True).wait(host=True)
        if not counted:
            self.bytes_sent["all_gather"] = before
        return out.view(self.world_size, -1).tolist()

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj`` (picklable), in rank order. Peers are the job's own processes,
        as with ``torch.distributed.all_gather_object``; not counted in ``bytes_sent``."""
        if self.world_size == 1:
            return [pickle.loads(pickle.dumps(obj))]
        device = self.device
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        with self._starting("all_gather_object"):
            work = _all_gather(sizes, size, group=self.group, async_op=True)
        self.wait(self._queued(work, sizes, size), "all_gather_object", host=True)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        out = torch.empty(longest * self.world_size, dtype=torch.uint8, device=device)
        with self._starting("all_gather_object"):
            work = _all_gather(out, padded, group=self.group, async_op=True)
        self.wait(self._queued(work, out, padded), "all_gather_object", host=True)
        blobs = out.cpu().view(self.world_size, longest)
        return [pickle.loads(blobs[r, : int(n)].numpy().tobytes())
                for r, n in enumerate(sizes.tolist())]

    def barrier(self) -> None:
        with self._starting("barrier"):
            work = dist.barrier(group=self.group, async_op=True)
        self.wait(work, "barrier", host=True)

    def failures(self, error: str | None) -> list[tuple[int, str]]:
        """Agree on whether a local step (writing a file, validating) succeeded everywhere:
        every rank passes its error (None when fine) and gets every rank's, so all ranks raise
        together instead of the healthy ones waiting for a peer that gave up."""
        errors = [error] if self.world_size == 1 else self.all_gather_object(error)
        return [(r, str(e)) for r, e in enumerate(errors) if e is not None]

    def snapshot(self) -> dict[str, int]:
        """Bytes sent so far per operation, plus the total."""
        out = dict(self.bytes_sent)
        out["total"] = sum(self.bytes_sent.values())
        return out
