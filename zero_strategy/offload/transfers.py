"""Host-memory placement for offloaded state: pinned buffers and the copies to and from them.

Every copy between an offloaded (host) buffer and the compute device goes through one
``Transfers`` object per engine and returns a ``Copy``. On CUDA the copy is asynchronous, on a
side stream, so it overlaps compute; whoever reads its destination or overwrites its source
first waits on the ``Copy``:

- ``wait_host()`` before the host reads a buffer a device->host copy writes (the CPU optimizer
  step reading offloaded gradients) or writes a buffer a host->device copy still reads (the
  CPU step updating the master an earlier copy propagates);
- ``wait_device()`` before the compute stream uses a buffer a host->device copy writes (the
  staged shard an all-gather sends).

On a CPU-only run the host *is* the device and the copy completes at once, yet offloaded state
still goes through these calls, so the CPU suite exercises the same path a GPU run takes; a
test substitutes ``Transfers`` that delay every copy until it is waited on, which turns a
missing wait into a wrong result on the CPU.

On CUDA the host buffers are pinned, carved out of one ``PinnedArena`` per engine rather than
pinned one by one (torch rounds each pinned allocation up to a power of two);
``Transfers.pinned_bytes`` is what the arena holds.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .staging import Event, PinnedStaging

ARENA_ALIGN = 512
"""Byte alignment of every buffer in the pinned arena. Viewing bytes as a dtype needs only
the dtype's size; 512 is a multiple of every dtype's and of the 64 bytes torch's CPU allocator
gives every tensor, so the CPU optimizer's vectorised kernels and the host side of each copy
start on a cache line as they would on a tensor of their own, and it is the block size direct
file I/O (O_DIRECT) asks of a buffer. It costs under 512 bytes per buffer, each buffer being
a unit's shard."""
ARENA_CHUNK = 64 << 20
"""The smallest pinned allocation the arena makes: many small buffers share one."""


class Copy(Protocol):
    def wait_host(self) -> None: ...

    def wait_device(self) -> None: ...


class _Done:
    """A copy that completed when it was issued."""

    def wait_host(self) -> None:
        return None

    def wait_device(self) -> None:
        return None


DONE: Copy = _Done()


class _CudaCopy:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait_host(self) -> None:
        self.event.synchronize()

    def wait_device(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class _StagedCopy:
    """A copy through the pinned ring: waiting on the host copies out what it brought back."""

    def __init__(self, transfers: Transfers, slots: list[int], event: Event | None) -> None:
        self.transfers, self.slots, self.event = transfers, slots, event

    def wait_host(self) -> None:
        assert self.transfers.staging is not None
        if self.slots:
            self.transfers.staging.land(self.slots)
        elif self.event is not None:  # host -> device: done, as a direct copy's wait means
            self.event.synchronize()

    def wait_device(self) -> None:
        if self.event is not None:
            self.transfers.device_wait(self.event)


class PinnedArena:
    """Pinned host buffers carved out of a few large pinned allocations.

    torch's pinned allocator rounds every allocation up to a power of two (ATen's
    ``CachingHostAllocator``: ``PowerOf2Ceil(size)`` before ``cudaHostAlloc``), so pinning each
    offloaded buffer on its own can pin up to twice the host memory the buffers need. The
    arena asks for power-of-two chunks of at least ``min_chunk`` bytes (the size it would be
    rounded to anyway) and places each buffer first-fit, ``ARENA_ALIGN``-aligned, in the
    first chunk with room. The buffers are only known one by one (units are built one after
    another, gradient buffers at the first backward), so the arena grows rather than sizing
    itself once.

    Each buffer is a storage of its own (a slice of the chunk's storage, keeping the chunk
    alive): code that tells tensors apart or counts memory by storage sees one buffer, of its
    own size, as with a separate allocation."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], min_chunk: int = ARENA_CHUNK,
                 align: int = ARENA_ALIGN) -> None:
        self._alloc, self.min_chunk, self.align = alloc, min_chunk, align
        self._chunks: list[torch.UntypedStorage] = []
        self._used: list[int] = []
        self.buffers = 0
        """Buffers handed out so far."""

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory allocated (every chunk, used or not)."""
        return sum(c.nbytes() for c in self._chunks)

    @property
    def used_bytes(self) -> int:
        """Bytes the buffers take, alignment included."""
        return sum(self._used)

    @property
    def allocations(self) -> int:
        return len(self._chunks)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements; its contents are whatever the chunk held."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:  # nothing to pin (and no chunk to make for it)
            return torch.empty(0, dtype=dtype, device="cpu")
        size = -(-nbytes // self.align) * self.align
        index = next((k for k, (c, used) in enumerate(zip(self._chunks, self._used))
                      if used + size <= c.nbytes()), None)
        if index is None:
            chunk = 1 << (max(size, self.min_chunk) - 1).bit_length()
            self._chunks.append(self._alloc(chunk).untyped_storage())
            self._used.append(0)
            index = len(self._chunks) - 1
        start = self._used[index]
        self._used[index] = start + size
        self.buffers += 1
        storage = self._chunks[index][start : start + nbytes]
        return torch.empty(0, dtype=dtype, device="cpu").set_(storage, 0, (numel,), (1,))


class Transfers:
    """Host buffers and host<->device copies for one compute device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self.staging: PinnedStaging | None = None
        self._pageable: Callable[[torch.Tensor], bool] = lambda t: False
        self.pins_host = self._cuda
        """Whether host buffers are pinned (so copies to and from them are asynchronous)."""
        self.arena = PinnedArena(self.pinned_empty)
        if self._stream is not None:
            # torch's pinned cache holds a freed block back until the copies recorded on it
            # ran, finding the block by the host tensor's storage or start address; an arena
            # buffer's storage is a slice of the chunk's, mostly starting inside it, so its
            # copies go unrecorded: the chunks go back only once every copy issued here ran.
            weakref.finalize(self.arena, self._stream.synchronize).atexit = False

    def use_staging(self, total_bytes: int, pageable: Callable[[torch.Tensor], bool]) -> None:
        """Copies between the device and host tensors ``pageable`` picks (the disk tier's)
        go through a pinned ring of ``total_bytes`` (on CUDA; elsewhere nothing crosses)."""
        if self._stream is not None:
            self.staging = PinnedStaging(total_bytes, self.pinned_empty)
            self._pageable = pageable

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """One pinned allocation (the arena's chunks, the disk tier's staging slots)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory of the offloaded buffers (the arena's chunks; the disk tier's
        staging ring, a bound of its own, is ``staging.pinned_bytes``)."""
        return self.arena.pinned_bytes

    @classmethod
    def for_device(cls, device: torch.device) -> Transfers:
        return cls(device)

    @property
    def host_is_separate(self) -> bool:
        """Whether host buffers are memory apart from the compute device's: when not (a CPU
        run), an offloaded gradient shard is used where it is instead of copied."""
        return self.device.type != "cpu"

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer; pinned (in the arena) when the compute device is CUDA so copies can
        be asynchronous."""
        if self.pins_host:
            return self.arena.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device="cpu")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """dst <- src (cast and move). Across host and GPU the copy runs on the side stream
        after everything the compute stream issued so far (which produced ``src`` or last
        used ``dst``); callers wait on the returned ``Copy`` as the module docstring says."""
        crosses = dst.device.type != src.device.type
        if self._stream is None or not crosses:
            dst.copy_(src)
            return DONE
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        staged = self._through_staging(dst, src)
        if staged is not None:
            return staged
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):  # the caching allocator must not reuse them before the copy ran
            if t.is_cuda:
                t.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return _CudaCopy(event, self.device)

    def copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst <- src, complete on return (for rare paths: loading, user edits)."""
        self.copy(dst, src).wait_host()
        return dst

    def _through_staging(self, dst: torch.Tensor, src: torch.Tensor) -> Copy | None:
        """dst <- src through the pinned ring when exactly one side is pageable host memory
        (else None: the caller copies directly)."""
        to_device = self._pageable(src)
        if (self.staging is None or to_device == self._pageable(dst)
                or not (dst.is_contiguous() and src.is_contiguous())):
            return None
        slots: list[int] = []
        with self.side_stream():
            if to_device:
                event = self.staging.to_device(dst, src, self.device_copy)
            else:
                slots, event = self.staging.to_host(dst, src, self.device_copy)
        device_side = dst if to_device else src
        if device_side.is_cuda:  # the caching allocator must not reuse it before the copy ran
            device_side.record_stream(self._stream)  # type: ignore[arg-type]
        return _StagedCopy(self, slots, event)

    def side_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Issue dst <- src on the side stream (inside ``side_stream()``); its event."""
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def device_wait(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]
