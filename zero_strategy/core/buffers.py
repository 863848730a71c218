"""Memory reused across units for the buffers that live only while a unit is in use: a stage-3
unit's gathered parameters, a unit's full-size local gradients until their reduce-scatter, the
reduced slice on its way into the gradient shard.

Every unit needs these for a short time, one or two units after another, in the same sizes
every step. Allocated and freed per unit they cost, on a CPU, fresh pages from the kernel each
time (glibc serves buffers this large with mmap) and a heap that keeps what it freed between
model-state tensors, so the process's resident memory grows far beyond what is live (measured
on a 168M GPT-2 at stage 3: 1.0 GiB held free by the allocator next to 1.3 GiB of model
states). Kept here, a step reuses the blocks of the previous one: the pool holds as many blocks
of a size as were ever in use at once, which is the peak a step needs anyway.

A stage-3 unit's gathered buffer must stay the *same storage object* between gathers: tensors
autograd saved in forward alias it and must see the values re-gathered for backward. The pool
therefore lends host memory into that storage and takes it back out by swapping the two
storages' memory (``storage.swap_memory``, torch's private swap, confined there); the unit's
storage is empty (size 0) while the memory is in the pool. Device memory is lent by resizing
the unit's own storage instead: the caching allocator reuses the blocks (as FSDP2 does).

Device work is asynchronous: a block given back may still be read by kernels queued on the
stream that used it last, and the next user may take it on another one (autograd runs a
backward op on its forward op's stream, a user may step on a stream of their own). A device
block therefore carries an event recorded on the current stream when it comes back, and the
current stream waits on it when the block goes out again. Handing device blocks to the caching
allocator instead (take = ``torch.empty``, give = drop) would be safe only for blocks used
solely on the stream that allocated them: the allocator reuses a freed block at once on that
stream, and a block used elsewhere needs ``record_stream``, after which the allocator keeps it
until the host sees the recorded work end, so memory grows with how far the host runs ahead
(why FSDP2 stopped using it). The event orders the two users on the device itself: the block
is reused at once, the host never waits, and the pool still holds only as many blocks as were
in use together. It covers the work of the stream current at ``give``, which is where the
stores give a block back: right after its last use, or after a collective's ``wait()``, which
made that stream wait on the communication stream. Host memory needs no event, as a CPU op has
finished when it returns; the host path pays one branch for this.
"""

from __future__ import annotations

from typing import Any

import torch

from .storage import swap_memory, swaps_memory


class StreamFence:
    """Orders a device block's next user after its last one: ``record`` marks the work queued
    so far on the current stream, ``wait`` makes the current stream wait for it. An event is
    recorded again once waited on (a stream's wait takes the event as it is at the call), so a
    steady step creates none."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = torch.get_device_module(device)
        self._spare: list = []

    def record(self) -> Any:
        event = self._spare.pop() if self._spare else self._streams.Event()
        event.record(self._streams.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        self._streams.current_stream(self.device).wait_event(event)
        self._spare.append(event)


def stream_fence(device: torch.device) -> StreamFence | None:
    """What orders reused blocks on ``device``; None for host memory (see the module's
    docstring). Read once per pool, so a test can stand a fake in for a GPU's streams."""
    return None if device.type == "cpu" else StreamFence(device)


class BufferPool:
    """Free blocks of one device by size in bytes; taken and given back by the stores."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._swaps = swaps_memory(device)
        self._fence = stream_fence(device)
        self._tokens: dict[int, Any] = {}
        """What each free block (by id) waits on before its next user, where there is a fence:
        its last user's work, marked when the block came back."""
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._shells: list[torch.UntypedStorage] = []
        """Empty storage objects that received a lent block's nothing in exchange, reused to
        take memory back (so lending and reclaiming allocate no Python objects in a step)."""

    def _block(self, nbytes: int) -> torch.UntypedStorage:
        """The smallest free block of at least ``nbytes`` and at most twice that (buffers of
        other kinds and units share blocks), else a new one of exactly ``nbytes``."""
        fits = [size for size, free in self._free.items() if free and nbytes <= size <= 2 * nbytes]
        if fits:
            block = self._free[min(fits)].pop()
            if self._fence is not None:
                self._fence.wait(self._tokens.pop(id(block)))
            return block
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements with undefined contents, for work on the current
        stream; return it with ``give`` once nothing reads it (a collective writing or reading
        it included)."""
        nbytes = numel * dtype.itemsize
        block = self._block(nbytes)
        return torch.empty(0, dtype=dtype, device=self.device).set_(block, 0, (numel,))

    def give(self, tensor: torch.Tensor) -> None:
        """On device memory, on the stream that used ``tensor`` last or one that waited on it:
        the block's next user waits for the work queued there so far."""
        storage = tensor.untyped_storage()
        if self._fence is not None:
            self._tokens[id(storage)] = self._fence.record()
        self._free.setdefault(storage.nbytes(), []).append(storage)

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (contents undefined)."""
        if not self._swaps:  # device memory: the caching allocator pools it
            storage.resize_(nbytes)
            return
        block = self._block(nbytes)
        swap_memory(storage, block)  # ``storage`` holds the memory, ``block`` is empty
        self._shells.append(block)

    def reclaim(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory back into the pool, leaving it empty (size 0)."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if not self._swaps:
            storage.resize_(0)
            return
        shell = (self._shells.pop() if self._shells
                 else torch.empty(0, dtype=torch.uint8, device=self.device).untyped_storage())
        swap_memory(shell, storage)
        if self._fence is not None:
            self._tokens[id(shell)] = self._fence.record()
        self._free.setdefault(nbytes, []).append(shell)

    def held_bytes(self) -> int:
        """Bytes of free blocks the pool keeps for the next unit."""
        return sum(s.nbytes() for blocks in self._free.values() for s in blocks)
