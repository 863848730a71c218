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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .staging import Event, PinnedStaging


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


class Transfers:
    """Host buffers and host<->device copies for one compute device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self.staging: PinnedStaging | None = None
        self._pageable: Callable[[torch.Tensor], bool] = lambda t: False

    def use_staging(self, total_bytes: int, pageable: Callable[[torch.Tensor], bool]) -> None:
        """Copies between the device and host tensors ``pageable`` picks (the disk tier's)
        go through a pinned ring of ``total_bytes`` (on CUDA; elsewhere nothing crosses)."""
        if self._stream is not None:
            self.staging = PinnedStaging(total_bytes, self.pinned_empty)
            self._pageable = pageable

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @classmethod
    def for_device(cls, device: torch.device) -> Transfers:
        return cls(device)

    @property
    def host_is_separate(self) -> bool:
        """Whether host buffers are memory apart from the compute device's: when not (a CPU
        run), an offloaded gradient shard is used where it is instead of copied."""
        return self.device.type != "cpu"

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer; pinned when the compute device is CUDA so copies can be asynchronous."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self._cuda)

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
