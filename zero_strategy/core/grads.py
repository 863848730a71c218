"""Where a unit's gradients accumulate and how they are reduced, one class per stage layout.

The plan picks the class once; the backward pass only ever calls ``accumulate``,
``launch_reduce``, ``finish_reduce`` and ``zero``, so no hot path asks which stage it is in.
Every reduction divides the local gradient by the world size before summing over ranks (as
DDP does): summed first, an fp16 gradient at a loss scale of 2**16 overflows on 8 ranks
(``reduce_dtype="compute"``), and dividing by a power of two is exact, so nothing is lost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..comm.collectives import Communicator
from ..comm.handles import Handle
from .buffers import BufferPool
from .flat import FlatLayout

NORM_ROW = 1024
"""Elements per row of ``powered_norm``'s partial sums."""


def powered_norm(grad: torch.Tensor, norm_type: float,
                 factor: torch.Tensor | None = None) -> torch.Tensor:
    """``||grad||_p ** p`` (p finite) as an fp32 scalar, in rows of ``NORM_ROW`` elements summed
    by ``torch.sum``. ``torch.linalg.vector_norm`` over one long fp32 vector accumulates far
    beyond fp32's rounding on CPU: measured (torch 2.13) 3.8e-6 relative error in the squared
    norm of 62k elements and 8.6e-5 of 1M, against a float64 reference, where per-row norms
    summed with ``torch.sum`` (pairwise) stay within 6e-8 (1024-element rows, up to 1e7
    elements). A flat shard holds many parameters at once, so the engine's clipping norm
    would otherwise drift from torch's per-parameter ``clip_grad_norm_`` by more than the
    summation-order bound its parity tests argue (found by tests/integration/
    test_moe_training.py at stage 2). One kernel for the rows; no copy of them.

    ``factor``: the norm of ``grad * factor`` (each element rounded as ``grad.mul_(factor)``
    rounds it), bit for bit, with at most ``SCALED_ROWS`` rows of the product in memory at a
    time: each row's norm does not depend on the rows reduced beside it, and the rows' norms
    are summed whole as above (tests/quick/test_norm_accuracy.py compares the two)."""
    flat = grad.reshape(-1)
    rows = flat.numel() // NORM_ROW
    head = flat[: rows * NORM_ROW].view(rows, NORM_ROW)
    if factor is None:
        parts = _row_norms(head, norm_type)
    else:
        factor = factor.to(grad.device, grad.dtype)
        parts = torch.empty(rows, dtype=torch.float32, device=grad.device)
        for start in range(0, rows, SCALED_ROWS):
            block = head[start : start + SCALED_ROWS]
            parts[start : start + len(block)] = _row_norms(block * factor, norm_type)
    # The last partial row (under NORM_ROW elements: a small copy) by the same pairwise sum.
    tail = flat[rows * NORM_ROW:]
    rest = (tail if factor is None else tail * factor).float().abs().pow(norm_type).sum()
    return parts.sum() + rest


SCALED_ROWS = 256
"""Rows of ``grad * factor`` ``powered_norm`` holds at once (1 MiB of fp32)."""


def _row_norms(rows: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.linalg.vector_norm(rows, norm_type, dim=1, dtype=torch.float32) ** norm_type


def adopts_autograd_gradient(layout: FlatLayout) -> bool:
    """Whether a stage 2-3 unit can take autograd's gradient as its full-size buffer instead
    of adding it into pool memory: one parameter, no padding (the memory bound reads this)."""
    return len(layout.slots) == 1 and layout.numel == layout.padded_numel


def max_abs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``max |g|`` of each non-empty tensor of ``grads``, in its dtype: inf or NaN exactly
    where it holds one (the non-finite check and the inf-norm both read it). One
    multi-tensor pass: a single kernel on a GPU. Times a positive factor it is the max-abs
    of the tensor times that factor, bit for bit (rounding is monotonic)."""
    grads = [g for g in grads if g.numel()]
    return list(torch._foreach_norm(grads, float("inf"))) if grads else []


class ShardMemory(NamedTuple):
    """Where a persistent reduced shard lives outside the device (the disk tier's files)."""

    alloc: Callable[[int, torch.dtype], torch.Tensor]
    """A new tensor reading as zeros."""
    clear: Callable[[torch.Tensor], None]
    """Make it read as zeros again, without writing every byte."""
    ready: Callable[[list[torch.Tensor]], None]
    """Wait until it may be written (no background read or write-back of it running)."""


class GradStore(ABC):
    """Common interface; ``grad_shard`` is the reduced gradient of this rank's optimizer shard."""

    layout: FlatLayout
    grad_shard: torch.Tensor

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool, int8: bool = False, replicas: Communicator | None = None):
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.pool = pool
        self.int8 = int8
        """Reduce-scatters go over the wire as block-wise int8 (``comm/int8.py``)."""
        self.replicas = replicas
        """Hybrid sharding: the ranks holding the same shard; each reduced shard is summed
        across them, so a gradient is divided by every rank of the world, not of the group."""
        self._pending: tuple[Handle, torch.Tensor | None] | None = None
        self._crossed = False
        """Hybrid sharding: the pending reduction is the one across replicas (the group's
        is in)."""
        self._shard_memory: ShardMemory | None = None

    def use_shard_memory(self, memory: ShardMemory | None) -> None:
        """Where a reduced shard that persists between steps is allocated and how it is
        cleared (the disk tier's files); None: zeros on the device. Stages whose shard is
        part of a full-size buffer keep it there."""
        self._shard_memory = memory

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

    def _ranks(self, comm: Communicator) -> int:
        """Every rank contributing to a reduced gradient: the average is taken over them."""
        return comm.world_size * (self.replicas.world_size if self.replicas else 1)

    def _reduce_scatter(self, comm: Communicator, out: torch.Tensor,
                        local: torch.Tensor) -> Handle:
        reduce = comm.reduce_scatter_int8 if self.int8 else comm.reduce_scatter
        return reduce(out, local, async_op=True)

    def advance(self) -> bool:
        """Hybrid sharding: once the group's reduction is in, start adding the other
        replicas' (the only traffic between shard groups) without waiting, so it crosses
        while backward goes on; polled by the runtime in launch order. Whether the crossing
        has started (or there is none to start)."""
        if self.replicas is None or self._pending is None or self._pending[1] is None:
            return True
        if not self._crossed:
            if not self._pending[0].ready():
                return False
            self._cross()
        return True

    def _cross(self) -> None:
        assert self.replicas is not None and self._pending is not None
        handle, out = self._pending
        assert out is not None
        handle.wait()
        reduce = self.replicas.all_reduce_int8 if self.int8 else self.replicas.all_reduce
        self._pending = (reduce(out, async_op=True), out)
        self._crossed = True

    def reduced(self) -> bool:
        """Whether the pending reduction is in, across replicas too, so ``finish_reduce``
        waits for no peer. Never blocks: polled on the oldest reduction in flight only, so a
        crossing it starts is in launch order, as ``advance`` requires."""
        if self._pending is None:
            return True
        return self.advance() and self._pending[0].ready()

    def wait(self, cross: bool = True) -> torch.Tensor | None:
        """The reduced tensor, once in; ``cross``: summed across replicas too (hybrid
        sharding; not for a reduction of a pass being abandoned)."""
        handle, out = self._pending if self._pending else (None, None)
        if cross and out is not None and self.replicas is not None and not self._crossed:
            self._cross()
            handle, out = self._pending if self._pending else (None, None)
        if handle is not None:
            handle.wait()
        self._pending, self._crossed = None, False
        return out


class AllReducedGrads(GradStore):
    """Stage 0: every rank keeps the full gradient and all-reduces it (data parallel)."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool, int8: bool = False, replicas: Communicator | None = None):
        super().__init__(layout, rank, dtype, device, pool, int8, replicas)
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

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool, int8: bool = False, replicas: Communicator | None = None):
        super().__init__(layout, rank, dtype, device, pool, int8, replicas)
        self.buffer = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self._bounds = layout.shard_bounds(rank)
        self.grad_shard = self.buffer[self._bounds[0] : self._bounds[1]]
        self._holds_average = False
        self._group_size = 1

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        if self._holds_average:
            # Back to what the next reduction must add: it divides by every rank and sums
            # over the shard group's ranks (the others hold zeros here) and over replicas,
            # each holding this same average, so the group's size, not the world's (times
            # the world's, hybrid sharding counted the first pass once per replica).
            self.grad_shard.mul_(self._group_size)
            self._holds_average = False
        self._local_view(self.buffer, index).add_(grad)

    def launch_reduce(self, comm: Communicator) -> None:
        # Not straight into ``grad_shard``: it is a slice of the input being reduced.
        out = self.pool.take(self.grad_shard.numel(), self.dtype)
        self._group_size = comm.world_size
        self.buffer.div_(self._ranks(comm))  # what the average is taken over
        self._pending = (self._reduce_scatter(comm, out, self.buffer), out)

    def finish_reduce(self) -> None:
        reduced = self.wait()  # across replicas too
        assert reduced is not None
        lo, hi = self._bounds
        self.buffer[:lo].zero_()  # the owned part is overwritten: no pass over it
        self.buffer[hi:].zero_()
        self.grad_shard.copy_(reduced)
        self.pool.give(reduced)
        self._holds_average = True

    def zero(self) -> None:
        # Holding the average, the buffer is zero outside the shard (``finish_reduce`` made it
        # so and nothing was added since): one pass over 1/N instead of the whole buffer,
        # every step.
        if self._holds_average:
            self.grad_shard.zero_()
        else:
            self.buffer.zero_()
        self._holds_average = False

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.buffer]


class ShardedGrads(GradStore):
    """Stages 2-3: a full-size buffer exists only between the first local gradient and its
    reduce-scatter (memory from the pool); afterwards each rank holds just its reduced shard
    (allocated at the first reduction, so building the engine allocates no gradient memory).
    The first reduction after ``zero`` lands in the shard itself; later ones (several
    synchronised backward passes per step) go through a pooled buffer and are added.

    A unit of one parameter whose gradient fills the padded buffer exactly (most stage-3
    units: one weight matrix) reduces autograd's gradient tensor itself instead of a copy:
    autograd hands each ``.grad`` over exclusively (it steals an unshared result or clones),
    and the runtime drops the parameter's reference right after."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool, int8: bool = False, replicas: Communicator | None = None):
        super().__init__(layout, rank, dtype, device, pool, int8, replicas)
        self._shard: torch.Tensor | None = None
        self._summed = False
        """Whether ``_shard`` holds a reduced gradient (else zeros, or nothing yet)."""
        self.local: torch.Tensor | None = None
        self._adopted = False
        """Whether ``local`` is a gradient autograd produced (not pool memory)."""
        self._adoptable = adopts_autograd_gradient(layout)

    @property  # type: ignore[override]
    def grad_shard(self) -> torch.Tensor:
        if self._shard is None:
            if self._shard_memory is not None:  # a new file: reads as zeros
                self._shard = self._shard_memory.alloc(self.layout.shard_numel, self.dtype)
            else:
                self._shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype,
                                          device=self.device)
        return self._shard

    def _take_local(self) -> torch.Tensor:
        self.local = self.pool.take(self.layout.padded_numel, self.dtype).zero_()
        return self.local

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        if self.local is None and self._adoptable and self._owns_storage(grad):
            self.local, self._adopted = grad.view(-1), True
            return
        local = self.local if self.local is not None else self._take_local()
        self._local_view(local, index).add_(grad)

    def _owns_storage(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is a whole dense tensor of the reduce dtype alone in its storage,
        so dividing it in place changes nothing another tensor shows. Autograd already clones
        a gradient it cannot hand over (one a user retained, say); this keeps the reduction
        from dividing memory it does not own should a gradient still arrive as a view."""
        return (grad.dtype == self.dtype and grad.device == self.device
                and grad.layout == torch.strided and grad.is_contiguous()
                and not grad._is_view() and grad.storage_offset() == 0
                and grad.untyped_storage().nbytes() == grad.nbytes)

    def _drop_local(self) -> None:
        if self.local is not None and not self._adopted:
            self.pool.give(self.local)
        self.local, self._adopted = None, False

    def launch_reduce(self, comm: Communicator) -> None:
        # Nothing reached this unit on this rank: it still contributes (zeros).
        local = self.local if self.local is not None else self._take_local()
        out = (self.pool.take(self.layout.shard_numel, self.dtype) if self._summed
               else self.grad_shard)
        local.div_(self._ranks(comm))
        self._pending = (self._reduce_scatter(comm, out, local), out)

    def finish_reduce(self) -> None:
        # Across replicas too: only this reduction (earlier ones were summed already).
        reduced = self.wait()
        assert reduced is not None and self.local is not None
        if reduced is not self._shard:
            if self._shard_memory is not None:  # the last pass's may still be written back
                self._shard_memory.ready([self.grad_shard])
            self.grad_shard.add_(reduced)
            self.pool.give(reduced)
        self._summed = True
        self._drop_local()

    def zero(self) -> None:
        in_flight = self.wait(cross=False)  # a pass cut short may have left one running
        if in_flight is not None and in_flight is not self._shard:
            self.pool.give(in_flight)
        if self._shard is not None and self._shard_memory is not None:
            # Zeros written into a disk-tier shard would cost a write of every gradient byte
            # per step; the tier gives it fresh zero memory (or marks the file's range zeros)
            # instead, so the reduction that overwrites it next reads no old bytes in first.
            self._shard_memory.clear(self._shard)
        elif self._shard is not None:
            self._shard.zero_()
        self._summed = False
        self._drop_local()  # partial sums of such a pass

    def held_tensors(self) -> list[torch.Tensor]:
        held = [t for t in (self._shard, self.local) if t is not None]
        return held


GRAD_STORES: dict[str, type[GradStore]] = {
    "all_reduce": AllReducedGrads,
    "reduce_scatter_full": ScatteredFullGrads,
    "reduce_scatter_sharded": ShardedGrads,
}
