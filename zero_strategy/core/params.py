"""A unit's parameters: the compute copy the module sees, and the master shard the optimizer owns.

Replicated stores (stages 0-2, and stage 3's small persistent parameters) point the module's
parameters at views of one flat compute buffer that exists for good. With several optimizer
shards they are GATHERING from ``after_step`` (the all-gather of every rank's updated slice
runs in the background) until ``finish_unshard`` waited for it, UNSHARDED otherwise.

The sharded store (stage 3) is a state machine over the unit's whole compute copy, and it is
the only code that changes what the module's parameters hold:

    SHARDED --start_unshard--> GATHERING --finish_unshard--> UNSHARDED --reshard--> SHARDED

- SHARDED: the flat buffer's memory is back in the engine's pool (``buffers.py``), its storage
  object empty; every parameter holds a placeholder of
  its full shape expanded from one NaN element (never a tensor over freed memory): shapes and
  ``numel()`` stay right for code that inspects them (Lightning's ModelSummary), a stray read
  computes NaN instead of reading freed memory, and a write raises (its elements alias).
- GATHERING: an all-gather is writing the buffer; parameters still hold the placeholder.
- UNSHARDED: parameters are views of the gathered buffer. Tensors autograd saved during
  forward alias the buffer's storage object, which is lent memory rather than replaced, so
  they see the re-gathered values in backward.

Each store's ``MOVES`` lists, per operation, the states it starts from and the one it leads
to (a no-op where the store is already there: ``finish_unshard`` with nothing in flight);
``StateMachine._to`` (``states.py``) is the only code that changes ``ParamState`` and refuses
any other move by name.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..comm.handles import Handle
from ..offload.transfers import Copy, Transfers
from .buffers import BufferPool
from .flat import FlatLayout
from .grads import ShardMemory
from .precision import PrecisionPolicy
from .states import Moves, StateMachine
from .storage import alias_count

if TYPE_CHECKING:
    from ..offload.disk import DiskTier


class ParamState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard exists; the parameters hold placeholders (stage 3)."""
    GATHERING = "gathering"
    """An all-gather is writing the whole compute copy."""
    UNSHARDED = "unsharded"
    """The whole compute copy is the parameters' value."""


_P = ParamState


class Placement:
    """Where the master shard and (stage 3) the at-rest parameter shard live, the transfers
    that move offloaded ones, and the pool lending memory to gathered buffers.

    Host offloading takes effect only where host memory is apart from the compute device's (a
    GPU): on a CPU device an offloaded master or shard would be a second copy of the same
    bytes in the same memory, so there the stores keep one copy, as without offloading. The
    disk tier (``offload/disk.py``) takes effect on every device: its tensors are files.

    ``offload_optimizer`` / ``offload_params`` say whether the master / the shard rest
    anywhere but the compute device (host memory or disk)."""

    def __init__(self, device: torch.device, offload_optimizer: bool, offload_params: bool,
                 transfers: Transfers, pool: BufferPool, tier: DiskTier | None = None,
                 optimizer_disk: bool = False, params_disk: bool = False):
        self.device = device
        apart = transfers.host_is_separate
        self.optimizer_disk = optimizer_disk and tier is not None
        self.params_disk = params_disk and tier is not None
        self.offload_optimizer = bool(offload_optimizer) and apart or self.optimizer_disk
        self.offload_params = bool(offload_params) and apart or self.params_disk
        self.transfers = transfers
        self.pool = pool
        self.tier = tier

    @property
    def master_is_shard(self) -> bool:
        """Stage 3 without a separate master: both rest in the same place (one copy)."""
        if self.optimizer_disk or self.params_disk:
            return self.optimizer_disk == self.params_disk
        return not (self.offload_optimizer or self.offload_params)

    def master_empty(self, numel: int, dtype: torch.dtype, name: str = "master") -> torch.Tensor:
        if self.optimizer_disk:
            assert self.tier is not None
            return self.tier.empty(numel, dtype, name)
        if self.offload_optimizer:
            return self.transfers.host_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def shard_empty(self, numel: int, dtype: torch.dtype, name: str = "shard") -> torch.Tensor:
        if self.params_disk:
            assert self.tier is not None
            return self.tier.empty(numel, dtype, name)
        if self.offload_params:
            return self.transfers.host_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def master_grad_empty(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """Where an offloaded master's reduced gradient rests until the step."""
        if self.optimizer_disk:
            assert self.tier is not None
            return self.tier.empty(numel, dtype, name)
        return self.transfers.host_empty(numel, dtype)

    def grad_shard_memory(self, name: str) -> ShardMemory | None:
        """How a stage 2-3 unit allocates and clears its reduced gradient shard: in the disk
        tier when the gradient is reduced where the master rests (a CPU device); None: on
        the device."""
        tier = self.tier
        if not self.optimizer_disk or self.device.type != "cpu" or tier is None:
            return None
        return ShardMemory(lambda numel, dtype: tier.empty(numel, dtype, name), tier.zero_range,
                           tier.ready)

    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        if self.tier is not None:
            self.tier.prefetch(tensors)

    def before_read(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` are about to be read whole (a gather's source): in memory first."""
        if self.tier is not None:
            self.tier.load(tensors)

    def to_overwrite(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, about to be overwritten whole: in the disk tier its transfers are
        waited for and its old contents dropped unread (fresh memory)."""
        if self.tier is not None and self.tier.holds(tensor):
            self.tier.zero_range(tensor)
        return tensor

    def before_write(self, tensors: list[torch.Tensor]) -> None:
        """Wait for the disk tier's reads and write-backs of ``tensors`` (a write racing
        one would be lost: the tier makes it fault instead)."""
        if self.tier is not None:
            self.tier.ready(tensors)

    def done_with(self, tensors: list[torch.Tensor], dirty: bool, keep: bool = False) -> None:
        """``keep``: the next phase may begin with these (the disk tier keeps the most
        recent such releases in memory, up to its budget)."""
        if self.tier is not None:
            self.tier.release(tensors, dirty, keep)


def _initial_flat(
    params: list[nn.Parameter], layout: FlatLayout, dtype: torch.dtype, device: torch.device,
    comm: Communicator,
) -> torch.Tensor:
    """The padded flat copy of the parameters' values, rank 0's values on every rank."""
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for slot, p in zip(layout.slots, params):
            flat[slot.offset : slot.end].copy_(p.detach().reshape(-1))
    comm.broadcast(flat, src=0)
    return flat


def _point_params_at(params: list[nn.Parameter], layout: FlatLayout, full: torch.Tensor) -> None:
    for slot, p in zip(layout.slots, params):
        p.data = full[slot.offset : slot.end].view(slot.shape)


class ParamStore(StateMachine, ABC):
    """The compute copy (what forward reads) and the master shard (what the optimizer updates).

    Its ``ParamState`` changes only in ``_to``, by the store's ``MOVES``."""

    layout: FlatLayout
    master: torch.Tensor
    full: torch.Tensor
    gathers: bool
    """True when the compute copy must be gathered before the module runs (forward hooks)."""

    def __init__(self, layout: FlatLayout, rank: int, policy: PrecisionPolicy,
                 placement: Placement, name: str, module: str):
        self.name = name
        self.module = module
        """The module whose parameters these are (errors name it)."""
        self.layout = layout
        self.rank = rank
        self.policy = policy
        self.placement = placement
        self.transfers = placement.transfers
        self.bounds = layout.shard_bounds(rank)
        self._reading_host: Copy | None = None
        """The newest copy reading this store's host buffers (the master, an offloaded
        shard); copies run in issue order, so earlier ones are done when it is."""

    def wait_host_copies(self) -> None:
        """Block until no copy still reads this store's host buffers: run before the host
        writes them (the CPU optimizer step, loading, user edits)."""
        if self._reading_host is not None:
            self._reading_host.wait_host()
            self._reading_host = None

    def _owner(self) -> str:
        return (f"parameter store {self.name} ({type(self).__name__}) of module "
                f"{self.module or '<root>'!r}")

    @property
    def state(self) -> ParamState:
        """Whether the compute copy is whole on this rank right now."""
        return self._state

    @abstractmethod
    def start_unshard(self, comm: Communicator, channel: int | None = None) -> None:
        """Begin making the compute copy whole (asynchronously where it needs communication);
        ``channel``: the gather's own (``Communicator.all_gather``)."""

    @abstractmethod
    def finish_unshard(self) -> None:
        """Block until the compute copy is whole."""

    @abstractmethod
    def reshard(self) -> None:
        """Give back the memory of the whole compute copy where the layout allows it."""

    def aliases(self) -> int | None:
        """Tensors viewing the memory a gather fills (None: nothing is gathered, or torch
        cannot count them)."""
        return None

    def read_ahead(self) -> None:
        """A gather of this unit is coming: start reading its at-rest shard (disk tier)."""
        return None

    @abstractmethod
    def after_step(self, comm: Communicator) -> None:
        """Start propagating the updated master shard into the compute copy (a store left
        GATHERING is complete after ``finish_unshard``)."""

    @abstractmethod
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held now by category ("params", "master"), for memory accounting."""

    @abstractmethod
    def write_param(self, index: int, value: torch.Tensor) -> None:
        """Set parameter ``index`` to ``value`` (its full, unsharded value, identical on every
        rank): the master at full precision, the compute copy at compute precision."""

    @abstractmethod
    def adopt_compute_edits(self) -> None:
        """After user code wrote into the (whole) compute copy: carry the edits into the
        master. Only elements that differ from the master's rounding count as edited, so an
        untouched element keeps its full-precision master value under mixed precision."""

    @abstractmethod
    def was_edited(self) -> bool:
        """Whether this rank's part of the whole compute copy no longer matches the master
        (only detectable where the compute copy is not the master itself)."""

    @abstractmethod
    def discard_compute_edits(self, comm: Communicator) -> None:
        """Make the whole compute copy equal the master again (collective)."""

    def _merge_into_master(self, edited: torch.Tensor) -> None:
        lo, hi = self.bounds
        own = edited[lo:hi]
        master = self.master.to(own.device)
        changed = own != master.to(own.dtype)
        self.wait_host_copies()
        self.placement.before_write([self.master])
        self.transfers.copy_now(self.master, torch.where(changed, own.to(master.dtype), master))

    def shares_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` aliases compute-copy memory this store may give back."""
        return False

    def _write_master(self, index: int, value: torch.Tensor) -> None:
        slot = self.layout.slots[index]
        lo, hi = self.bounds
        start, end = max(lo, slot.offset), min(hi, slot.end)
        if start < end:
            self.wait_host_copies()
            self.placement.before_write([self.master])
            flat = value.reshape(-1)[start - slot.offset : end - slot.offset]
            self.master[start - lo : end - lo].copy_(flat.to(self.master.dtype))

    def gather_master(self, comm: Communicator) -> torch.Tensor:
        """The whole flat master copy (padded), assembled on every rank's compute device."""
        device = self.full.device
        src = self.master.to(device, copy=True)
        if self.layout.num_shards == 1:
            return src
        out = torch.empty(self.layout.padded_numel, dtype=self.master.dtype, device=device)
        comm.all_gather(out, src).wait()
        return out


class ReplicatedParams(ParamStore):
    """Stages 0-2 (and stage 3's small persistent parameters): the compute copy is always
    allocated. After a step it is GATHERING while the all-gather of every rank's updated
    slice runs in the background, UNSHARDED once ``finish_unshard`` waited for it.

    Without a separate master (fp32, no offload) the optimizer updates a view of this rank's
    slice of the compute buffer itself, so no second copy of the parameters exists.
    """

    gathers = False
    MOVES: Moves = {
        # Always whole: already, or once the post-step gather in flight has landed.
        "start_unshard": {_P.UNSHARDED: _P.UNSHARDED, _P.GATHERING: _P.GATHERING},
        "finish_unshard": {_P.GATHERING: _P.UNSHARDED, _P.UNSHARDED: _P.UNSHARDED},
        # The compute copy is never freed.
        "reshard": {_P.UNSHARDED: _P.UNSHARDED, _P.GATHERING: _P.GATHERING},
        # The all-gather of every rank's updated slice (``after_step`` waits for an earlier
        # one first).
        "gather_update": {_P.UNSHARDED: _P.GATHERING},
    }

    def __init__(
        self, params: list[nn.Parameter], layout: FlatLayout, rank: int,
        policy: PrecisionPolicy, placement: Placement, comm: Communicator, name: str = "unit",
        module: str = "",
    ) -> None:
        super().__init__(layout, rank, policy, placement, name, module)
        flat = _initial_flat(params, layout, policy.master_dtype, placement.device, comm)
        lo, hi = self.bounds
        self.master_is_view = not (policy.separate_master or placement.offload_optimizer)
        if self.master_is_view:
            self.full = flat
            self.master = flat[lo:hi]
        else:
            self.master = placement.master_empty(layout.shard_numel, policy.master_dtype,
                                                 f"{name}.master")
            self.master.copy_(flat[lo:hi])
            self.full = flat.to(policy.compute_dtype)
        _point_params_at(params, layout, self.full)
        self._state = ParamState.UNSHARDED  # born whole
        self._handle: Handle | None = None
        placement.done_with([self.master], dirty=True)

    def start_unshard(self, comm: Communicator, channel: int | None = None) -> None:
        self._to("start_unshard")

    def finish_unshard(self) -> None:
        if self._to("finish_unshard") is ParamState.GATHERING:
            handle, self._handle = self._handle, None
            assert handle is not None
            handle.wait()

    def reshard(self) -> None:
        self._to("reshard")

    def write_param(self, index: int, value: torch.Tensor) -> None:
        self.finish_unshard()  # else the gather in flight would overwrite the value
        slot = self.layout.slots[index]
        if not self.master_is_view:
            self._write_master(index, value)
        self.full[slot.offset : slot.end].copy_(value.reshape(-1))

    def adopt_compute_edits(self) -> None:
        if not self.master_is_view:  # else the master is the compute copy: nothing to carry
            self._merge_into_master(self.full)

    def was_edited(self) -> bool:
        if self.master_is_view:
            return False
        lo, hi = self.bounds
        own = self.full[lo:hi]
        return bool((own != self.master.to(own.device, own.dtype)).any())

    def discard_compute_edits(self, comm: Communicator) -> None:
        self.after_step(comm)
        self.finish_unshard()

    def after_step(self, comm: Communicator) -> None:
        self.finish_unshard()  # a gather still writing the buffer (two steps, no read between)
        lo, hi = self.bounds
        own = self.full[lo:hi]
        if not self.master_is_view:
            pending = self.transfers.copy(own, self.master)
            pending.wait_device()  # the all-gather (and forward) read ``own``
            self._reading_host = pending
        if self.layout.num_shards > 1:
            self._handle = comm.all_gather(self.full, own, async_op=True)
            self._to("gather_update")

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.full], "master": [] if self.master_is_view else [self.master]}


class ShardedParams(ParamStore):
    """Stage 3: only this rank's shard persists; the whole copy exists between gather and free."""

    gathers = True
    MOVES: Moves = {
        "start_unshard": {_P.SHARDED: _P.GATHERING},
        # From SHARDED: nothing to wait for (``Runtime.settle`` waits on every store).
        "finish_unshard": {_P.GATHERING: _P.UNSHARDED, _P.UNSHARDED: _P.UNSHARDED,
                           _P.SHARDED: _P.SHARDED},
        # After ``finish_unshard``: memory a collective is still writing is never freed.
        "reshard": {_P.UNSHARDED: _P.SHARDED, _P.SHARDED: _P.SHARDED},
        # The master into the at-rest shard, never while a gather reads it; a unit that
        # ``gathered_parameters()`` holds stays whole.
        "after_step": {_P.SHARDED: _P.SHARDED, _P.UNSHARDED: _P.UNSHARDED},
    }

    def __init__(
        self, params: list[nn.Parameter], layout: FlatLayout, rank: int,
        policy: PrecisionPolicy, placement: Placement, comm: Communicator, name: str = "unit",
        module: str = "",
    ) -> None:
        super().__init__(layout, rank, policy, placement, name, module)
        flat = _initial_flat(params, layout, policy.master_dtype, placement.device, comm)
        lo, hi = self.bounds
        self.shard = placement.shard_empty(layout.shard_numel, policy.compute_dtype,
                                           f"{name}.shard")
        self.shard.copy_(flat[lo:hi])
        if policy.separate_master or not placement.master_is_shard:
            self.master = placement.master_empty(layout.shard_numel, policy.master_dtype,
                                                 f"{name}.master")
            self.master.copy_(flat[lo:hi])
        else:
            self.master = self.shard
        del flat
        # Memory from the pool, given back by ``reshard`` below: units built one after
        # another reuse one block, and the buffer's storage object stays this unit's for good.
        self.pool = placement.pool
        self.full = self.pool.take(layout.padded_numel, policy.compute_dtype)
        self._full_nbytes = layout.padded_numel * policy.compute_dtype.itemsize
        self.params = params
        # 0-dim, so it expands to every shape, a 0-dim parameter's () included.
        nan = torch.full((), float("nan"), dtype=policy.compute_dtype, device=placement.device)
        self._placeholders = [nan.expand(slot.shape) for slot in layout.slots]
        # Views of the buffer made once: they stay valid while its storage is freed and
        # re-allocated in place, so a gather only re-points the parameters at them.
        self._views = [self.full[slot.offset : slot.end].view(slot.shape)
                       for slot in layout.slots]
        _point_params_at(params, layout, self.full)
        self._state = ParamState.UNSHARDED  # born whole, resharded at once
        self._handle: Handle | None = None
        self._source: torch.Tensor | None = None
        self.reshard()
        placement.done_with([self.shard, self.master], dirty=True)

    def _device_shard(self) -> torch.Tensor:
        self.placement.before_read([self.shard])
        if not self.placement.offload_params or not self.transfers.host_is_separate:
            # The disk tier on a CPU device: the shard's memory is the device's already; a
            # staged copy would cost a fresh allocation and a copy of every gathered byte.
            return self.shard
        # Offloaded shards are staged on the compute device just for the gather.
        staged = torch.empty(self.shard.numel(), dtype=self.shard.dtype, device=self.full.device)
        pending = self.transfers.copy(staged, self.shard)
        pending.wait_device()  # the all-gather sends ``staged``
        self._reading_host = pending
        return staged

    def start_unshard(self, comm: Communicator, channel: int | None = None) -> None:
        self.expect("start_unshard")
        self.pool.lend(self.full.untyped_storage(), self._full_nbytes)
        self._source = self._device_shard()
        gather = comm.all_gather_int8 if self.policy.int8_gathers else comm.all_gather
        self._handle = gather(self.full, self._source, async_op=True, channel=channel)
        self._to("start_unshard")

    def finish_unshard(self) -> None:
        if self._to("finish_unshard") is not ParamState.GATHERING:
            return  # whole already, or nothing gathered: listed in MOVES
        handle, self._handle, self._source = self._handle, None, None
        assert handle is not None
        handle.wait()
        for p, view in zip(self.params, self._views):
            p.data = view
        # The whole copy serves until the reshard: the shard's memory need not be held
        # beside it (a disk tier keeps it only among the most recent, up to its budget).
        self.placement.done_with([self.shard], dirty=False, keep=True)

    def reshard(self) -> None:
        self.finish_unshard()  # never free memory a collective is still writing
        if self._to("reshard") is not ParamState.UNSHARDED:
            return  # sharded already: listed in MOVES
        for p, placeholder in zip(self.params, self._placeholders):
            p.data = placeholder
        self.pool.reclaim(self.full.untyped_storage())
        # The units freed last are gathered first by the next pass (backward runs
        # forward's order backwards; the step begins with backward's last units).
        self.placement.done_with([self.shard], dirty=False, keep=True)

    def read_ahead(self) -> None:
        if self._state is ParamState.SHARDED:
            self.placement.read_ahead([self.shard])

    def aliases(self) -> int | None:
        """Tensors viewing the gathered buffer's memory, the engine's own views included
        (None where torch cannot count them): more after a gather than before means a view
        escaped, which would read freed memory once the unit is resharded."""
        return alias_count(self.full.untyped_storage())

    def shares_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) this unit's gathered compute copy."""
        return (self._state is ParamState.UNSHARDED
                and tensor.untyped_storage().data_ptr() == self.full.untyped_storage().data_ptr())

    def write_param(self, index: int, value: torch.Tensor) -> None:
        self._write_master(index, value)
        slot = self.layout.slots[index]
        lo, hi = self.bounds
        start, end = max(lo, slot.offset), min(hi, slot.end)
        if start < end and self.shard is not self.master:
            self.wait_host_copies()
            self.placement.before_write([self.shard])
            flat = value.reshape(-1)[start - slot.offset : end - slot.offset]
            self.transfers.copy_now(self.shard[start - lo : end - lo], flat.to(self.shard.dtype))
        if self._state is ParamState.UNSHARDED:
            self.full[slot.offset : slot.end].copy_(value.reshape(-1))

    def adopt_compute_edits(self) -> None:
        if self._state is not ParamState.UNSHARDED:
            return  # nothing was exposed, so nothing can have been edited
        lo, hi = self.bounds
        if self.shard is not self.master:
            self._merge_into_master(self.full)
        self.wait_host_copies()
        self.placement.before_write([self.shard])
        self.transfers.copy_now(self.shard, self.full[lo:hi])

    def was_edited(self) -> bool:
        if self._state is not ParamState.UNSHARDED:
            return False
        lo, hi = self.bounds
        return bool((self.full[lo:hi] != self.shard.to(self.full.device)).any())

    def discard_compute_edits(self, comm: Communicator) -> None:
        if self._state is ParamState.UNSHARDED:
            comm.all_gather(self.full, self._device_shard())

    def after_step(self, comm: Communicator) -> None:
        self._to("after_step")
        if self.master is not self.shard:
            self.wait_host_copies()  # an offloaded shard may still be read by a staging copy
            self.placement.before_write([self.shard])
            pending = self.transfers.copy(self.shard, self.master)
            pending.wait_device()  # the next gather reads ``shard``
            self._reading_host = pending

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held: dict[str, list[torch.Tensor]] = {"params": [self.shard], "master": []}
        if self._state is not ParamState.SHARDED:
            held["params"].append(self.full)
        if self.master is not self.shard:
            held["master"].append(self.master)
        return held


PARAM_STORES: dict[str, type[ParamStore]] = {
    "replicated": ReplicatedParams,
    "sharded": ShardedParams,
}
