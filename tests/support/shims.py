"""Stand-ins for GPU behaviour on the CPU, shared by scenario modules (importing a scenario
module would register its scenarios in the importer's world too)."""

from __future__ import annotations

import torch

from zero_strategy.offload import transfers as offload
from zero_strategy.offload.staging import PinnedStaging


class DelayedTransfers(offload.Transfers):
    """Host<->device copies as a slow GPU runs them, on the CPU. A copy happens only when
    waited on (or when a later one is: one stream runs them in order), into host buffers that
    start as NaN, so reading a copy's destination before waiting gives a different result.
    ``wait_device`` makes a copy visible to compute (a copy into device memory), not to the
    host. A host buffer a copy reads must not change until the host waited on that copy
    (``wait_host_copies``): changes made earlier are counted in ``races``, as a GPU would
    have copied the new values or a mix."""

    host_is_separate = True  # type: ignore[assignment]  # host buffers stand for pinned memory

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.pinned: list[torch.Tensor] = []
        """Pinned allocations of the disk tier's staging ring (``pinned_empty``)."""
        self.queue: list[dict] = []
        self.reading: list[dict] = []
        """Copies that ran from a host buffer the host has not waited on since."""
        self.issued = self.races = self.within_tier = 0
        self.host_storages: set[int] = set()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.full((numel,), float("nan"), dtype=dtype)
        self.host_storages.add(buffer.untyped_storage().data_ptr())
        return buffer

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host_storages

    def use_staging(self, total_bytes: int, pageable) -> None:
        """The ring a GPU run builds, here for every engine with a disk tier: its slots
        start as 0xFF bytes and its device copies run only when their event is waited on,
        so a slot reused or read too early gives a different result."""
        self.staging = PinnedStaging(total_bytes, self.pinned_empty)
        self._pageable = pageable

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.pinned.append(torch.full((nbytes,), 255, dtype=torch.uint8))
        return self.pinned[-1]

    def device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> _DelayedEvent:
        entry = {"dst": dst, "src": src, "done": False, "index": self.issued}
        self.queue.append(entry)
        self.issued += 1
        return _DelayedEvent(self, entry)

    def device_wait(self, event) -> None:
        event.synchronize()  # a copy into device memory: visible to compute once run

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> offload.Copy:
        self.check()
        staged = self._through_staging(dst, src)
        if staged is not None:
            return staged
        # Between two of the tier's tensors: on a CPU device the reduced gradient shard is
        # in the tier too (on a GPU it is device memory, so this copy goes through the ring).
        self.within_tier += bool(self._pageable(dst) and self._pageable(src))
        if self.is_host(dst) and self.is_host(src):  # Transfers copies these at once
            dst.copy_(src)
            return offload.DONE
        entry = {"dst": dst, "src": src, "done": False, "index": self.issued}
        self.queue.append(entry)
        self.issued += 1
        return _Delayed(self, entry)

    def run_through(self, entry: dict) -> None:
        while not entry["done"]:
            head = self.queue.pop(0)
            head["dst"].copy_(head["src"])
            head["done"] = True
            if self.is_host(head["src"]):
                self.reading.append({**head, "snapshot": head["src"].clone()})

    def settle_through(self, entry: dict) -> None:
        self.run_through(entry)
        self.check()
        self.reading = [r for r in self.reading if r["index"] > entry["index"]]

    def check(self) -> int:
        for r in self.reading:
            if not torch.equal(r["src"], r["snapshot"]) and not r.get("counted"):
                r["counted"] = True
                self.races += 1
        return self.races


class _Delayed:
    def __init__(self, transfers: DelayedTransfers, entry: dict) -> None:
        self.transfers, self.entry = transfers, entry

    def wait_host(self) -> None:
        self.transfers.settle_through(self.entry)

    def wait_device(self) -> None:
        if not self.transfers.is_host(self.entry["dst"]):
            self.transfers.run_through(self.entry)


class _DelayedEvent:
    def __init__(self, transfers: DelayedTransfers, entry: dict) -> None:
        self.transfers, self.entry = transfers, entry

    def synchronize(self) -> None:
        self.transfers.run_through(self.entry)
