"""Where a unit's gradients accumulate and how they are reduced, one class per stage layout.

The plan picks the class once; the backward pass only ever calls ``accumulate``,
``launch_reduce``, ``finish_reduce`` and ``zero``, so no hot path asks which stage it is in.
Every reduction divides the local gradient by the world size before summing over ranks (as
DDP does): summed first, an fp16 gradient at a loss scale of 2**16 overflows on 8 ranks
(``reduce_dtype="compute"``), and dividing by a power of two is exact, so nothing is lost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .collectives import Communicator, Handle
from .flat import FlatLayout


class GradStore(ABC):
    """Common interface; ``grad_shard`` is the reduced gradient of this rank's optimizer shard."""

    layout: FlatLayout
    grad_shard: torch.Tensor

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self._pending: tuple[Handle, torch.Tensor | None] | None = None

    def _local_view(self, buf: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return buf[slot.offset : slot.end].view(slot.shape)

    @abstractmethod
    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's local gradient (any float dtype) into the local buffer."""

    @abstractmethod
    def launch_reduce(self, comm: Communicator) -> None:
        """Start the asynchronous reduction of the local buffer."""

    @abstractmethod
    def finish_reduce(self) -> None:
        """Wait for the reduction and leave the averaged result in ``grad_shard``."""

    @abstractmethod
    def zero(self) -> None:
        """Forget all gradients (after the optimizer step)."""

    @abstractmethod
    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors this store holds now, for memory accounting."""

    def wait(self) -> torch.Tensor | None:
        handle, out = self._pending if self._pending else (None, None)
        if handle is not None:
            handle.wait()
        self._pending = None
        return out


class AllReducedGrads(GradStore):
    """Stage 0: every rank keeps the full gradient and all-reduces it (data parallel)."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layout, rank, dtype, device)
        self.buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self.grad_shard = self.buffer

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        self._local_view(self.buffer, index).add_(grad)

    def launch_reduce(self, comm: Communicator) -> None:
        # An averaged gradient is identical on every rank, so a second backward before the
        # step (without no_sync) still averages to the right sum, as with DDP.
        self.buffer.div_(comm.world_size)
        self._pending = (comm.all_reduce(self.buffer, async_op=True), None)

    def finish_reduce(self) -> None:
        self.wait()

    def zero(self) -> None:
        self.buffer.zero_()

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.buffer]


class ScatteredFullGrads(GradStore):
    """Stage 1: full-size local gradients; each rank receives only its shard reduced.

    Between reductions the non-owned part is zeroed, and before new local gradients are added
    the owned (averaged) part is turned back into a sum, so several backward passes per step
    reduce to the same result as one.
    """

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layout, rank, dtype, device)
        self.buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        lo, hi = layout.shard_bounds(rank)
        self.grad_shard = self.buffer[lo:hi]
        self._holds_average = False
        self._world_size = 1

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        if self._holds_average:
            self.grad_shard.mul_(self._world_size)
            self._holds_average = False
        self._local_view(self.buffer, index).add_(grad)

    def launch_reduce(self, comm: Communicator) -> None:
        out = torch.empty_like(self.grad_shard)
        self._world_size = comm.world_size  # what the average is taken over
        self.buffer.div_(comm.world_size)
        self._pending = (comm.reduce_scatter(out, self.buffer, async_op=True), out)

    def finish_reduce(self) -> None:
        reduced = self.wait()
        assert reduced is not None
        self.buffer.zero_()
        self.grad_shard.copy_(reduced)
        self._holds_average = True

    def zero(self) -> None:
        self.buffer.zero_()
        self._holds_average = False

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.buffer]


class ShardedGrads(GradStore):
    """Stages 2-3: a full-size buffer exists only between the first local gradient and its
    reduce-scatter; afterwards each rank holds just its reduced shard (allocated at the first
    reduction, so building the engine allocates no gradient memory)."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layout, rank, dtype, device)
        self._shard: torch.Tensor | None = None
        self.local: torch.Tensor | None = None

    @property  # type: ignore[override]
    def grad_shard(self) -> torch.Tensor:
        if self._shard is None:
            self._shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype,
                                      device=self.device)
        return self._shard

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        if self.local is None:
            self.local = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self._local_view(self.local, index).add_(grad)

    def launch_reduce(self, comm: Communicator) -> None:
        if self.local is None:  # nothing reached this unit on this rank: contribute zeros
            self.local = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        out = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.local.div_(comm.world_size)
        self._pending = (comm.reduce_scatter(out, self.local, async_op=True), out)

    def finish_reduce(self) -> None:
        reduced = self.wait()
        assert reduced is not None
        self.grad_shard.add_(reduced)
        self.local = None

    def zero(self) -> None:
        if self._shard is not None:
            self._shard.zero_()
        self.local = None  # a pass cut short by an exception may have left partial sums

    def held_tensors(self) -> list[torch.Tensor]:
        held = [t for t in (self._shard, self.local) if t is not None]
        return held


GRAD_STORES: dict[str, type[GradStore]] = {
    "all_reduce": AllReducedGrads,
    "reduce_scatter_full": ScatteredFullGrads,
    "reduce_scatter_sharded": ShardedGrads,
}
