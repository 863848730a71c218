"""A fixed ring of pinned host buffers through which the disk tier's tensors reach a GPU.

A copy between the device and pageable host memory (the disk tier's tensors) cannot run
asynchronously: CUDA stages it through a driver buffer and the host waits. Pinning the tier's
tensors instead would pin what the tier exists to keep out of memory (DeepSpeed's NVMe users
report pinned buffers exhausting host memory: #3000, #3062). So each such copy is cut into
chunks that pass through ``SLOTS`` pinned slots allocated once, their total the configured
bound (``ZeroConfig.disk_staging_bytes``), never more:

- host -> device: the host copies a chunk into a free slot and the device copies it out,
  asynchronously; a slot is reused once the device copy that read it has run;
- device -> host: the device copies a chunk into a free slot; the host copies it out into the
  tier's tensor when someone waits for the copy (``land``), or when the slot is needed again.

The device side is a callable returning an event (``synchronize()``), so a CPU test can stand
in for the GPU with copies that run only when their event is waited on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

SLOTS = 4
"""Enough for a copy to fill one slot while the device drains the others."""
MIN_SLOT_BYTES = 4096


class Event(Protocol):
    def synchronize(self) -> None: ...


DeviceCopy = Callable[[torch.Tensor, torch.Tensor], Event]
"""``(dst, src)``: issue ``dst <- src`` on the device side; the event marks its completion."""


class PinnedStaging:
    """``SLOTS`` pinned buffers of ``total_bytes // SLOTS`` bytes each, and the chunked copies
    through them."""

    def __init__(self, total_bytes: int, alloc: Callable[[int], torch.Tensor]) -> None:
        slot = total_bytes // SLOTS // MIN_SLOT_BYTES * MIN_SLOT_BYTES
        if slot < MIN_SLOT_BYTES:
            raise ValueError(f"disk_staging_bytes={total_bytes} leaves less than "
                             f"{MIN_SLOT_BYTES} bytes per staging slot ({SLOTS} slots)")
        self.slot_bytes = slot
        self._slots = [alloc(slot) for _ in range(SLOTS)]
        self.pinned_bytes = sum(s.nbytes for s in self._slots)
        self._busy: list[Event | None] = [None] * SLOTS
        """The device copy last issued on each slot (reading it, or writing it)."""
        self._landing: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * SLOTS
        """(staged chunk, host destination) of a device->host copy not yet copied out."""
        self._next = 0
        self.chunks = 0
        """Chunks copied so far (either way)."""

    def _take(self) -> int:
        index = self._next
        self._next = (index + 1) % SLOTS
        self.land([index])  # its previous device->host chunk goes out first
        event, self._busy[index] = self._busy[index], None
        if event is not None:  # a host->device copy may still read it
            event.synchronize()
        return index

    def _staged(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._slots[index][: numel * dtype.itemsize].view(dtype)

    def _chunks(self, src: torch.Tensor) -> list[tuple[int, int]]:
        step = self.slot_bytes // src.dtype.itemsize
        return [(lo, min(lo + step, src.numel())) for lo in range(0, src.numel(), step)]

    def to_device(self, dst: torch.Tensor, src: torch.Tensor,
                  device_copy: DeviceCopy) -> Event | None:
        """``dst`` (device) <- ``src`` (pageable host): ``src`` may change once this returns;
        the returned event marks the last chunk on the device (None: nothing to copy)."""
        flat_dst, flat_src, last = dst.view(-1), src.view(-1), None
        for lo, hi in self._chunks(flat_src):
            index = self._take()
            staged = self._staged(index, src.dtype, hi - lo)
            staged.copy_(flat_src[lo:hi])
            last = self._busy[index] = device_copy(flat_dst[lo:hi], staged)
            self.chunks += 1
        return last

    def to_host(self, dst: torch.Tensor, src: torch.Tensor,
                device_copy: DeviceCopy) -> tuple[list[int], Event | None]:
        """``dst`` (pageable host) <- ``src`` (device): complete once ``land(slots)`` ran on the
        returned slots; the event marks the last chunk on the device."""
        flat_dst, flat_src, slots, last = dst.view(-1), src.view(-1), [], None
        for lo, hi in self._chunks(flat_src):
            index = self._take()
            staged = self._staged(index, src.dtype, hi - lo)
            last = self._busy[index] = device_copy(staged, flat_src[lo:hi])
            self._landing[index] = (staged, flat_dst[lo:hi])
            slots.append(index)
            self.chunks += 1
        return slots, last

    def land(self, slots: list[int]) -> None:
        """Copy out the device->host chunks still in ``slots`` (a later copy's, when the slot
        was reused: landing it early is as correct)."""
        for index in slots:
            landing, self._landing[index] = self._landing[index], None
            if landing is None:
                continue
            event, self._busy[index] = self._busy[index], None
            if event is not None:
                event.synchronize()
            staged, dst = landing
            dst.copy_(staged)
