"""The disk tier (ZeroConfig offload_optimizer/offload_params="disk") on 2 gloo processes."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("disk")
    return run_world("tests/worlds/scenarios_disk.py", 2, env={"ZS_DISK_ROOT": str(root)})


@pytest.mark.parametrize("name", ["parity_stage2", "parity_stage3", "parity_stage3_accumulate",
                                  "parity_stage3_bf16", "parity_stage3_mapped"])
def test_disk_tier_equals_host_tier_bit_for_bit(world: dict, name: str) -> None:
    """Only where the bytes rest differs, so every loss, weight and gradient norm is equal:
    clipping from the summaries taken at reduction, deferred into the step, included; with
    direct I/O where the filesystem takes it, and with file mappings alone ("mapped")."""
    for r in check(world[name]):
        assert r["direct"] == (r["direct_here"] and not name.endswith("mapped"))
        assert r["losses_equal"] and r["weights_equal"], name
        host, disk = r["norms"]
        assert host == disk
        assert r["closed_equal"], "close() must give back the trained weights"
        assert r["files"] > 0 and r["listed"] == 0 and not r["left_after_close"]
        # Every model state of the tier in files: the formula's disk bytes, plus padding
        # and the small parameters kept whole at stage 3 (a few KiB on these models).
        assert r["predicted_disk_bytes"] <= r["disk_bytes"] <= 1.1 * r["predicted_disk_bytes"]


@pytest.mark.parametrize("name", ["delayed_stage2", "delayed_stage3"])
def test_disk_tier_waits_for_every_copy(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["copies"] > 0 and r["races"] == 0
        assert r["equal"], name
        # Pinned host memory (what Transfers.host_empty allocates on a GPU): the host tier
        # pins every master and gradient shard; the disk tier pins none, its host side is
        # the files' pages (DeepSpeed's NVMe users run out of pinned buffers: #3000, #3062).
        host, disk = r["host_buffers"]
        assert host > 0 and disk == 0
        # What it pins instead: the staging ring, allocated once, exactly its configured
        # bound (4 slots of 4 KiB here) however large the shards it carries, and every
        # copy between the device and the tier passes through it.
        bound = r["bound"]
        assert r["pinned"] == [0, bound] and r["reported_pinned"] == bound
        assert r["largest_shard_bytes"] > bound
        assert r["chunks"] > 0 and r["chunks"] + r["within_tier"] == r["copies"]


@pytest.mark.parametrize("name", ["checkpoints_stage2", "checkpoints_stage3"])
def test_disk_tier_checkpoints_are_ordinary(world: dict, name: str) -> None:
    for r in check(world[name]):
        for route in ("disk->False", "False->disk"):
            assert r[route] == r["reference"], route
            assert r[f"{route} weights"], route


def test_unusable_directories_are_refused(world: dict) -> None:
    for r in check(world["refusals"]):
        assert "in use by another engine" in r["shared"] and "offload_dir=" in r["shared"]
        assert r["stale_removed"] == "True"
        assert "offload_dir=" in r["unwritable"] and "not writable" in r["unwritable"]
        assert "offload_optimizer='disk'" in r["muon"] and "Muon" in r["muon"]


def test_full_disk(world: dict) -> None:
    results = check(world["full_disk"])
    if "skipped" in results[0]:
        pytest.skip(results[0]["skipped"])
    small = results[0]["small"]
    assert "offload_dir=" in small and "needs" in small and "free" in small, small
    assert "another rank" in results[1]["small"], results[1]["small"]
    for r in results:
        assert r["equal_when_full"] and r["closed_equal"]


def test_a_users_optimizer_the_probe_cannot_step(world: dict) -> None:
    """Its states are adopted into files when the first step creates them."""
    for r in check(world["custom_optimizer"]):
        assert r["cpu"] == r["disk"]
        assert r["disk_in_files"]


def _resident_kib(address: int) -> int:
    """Rss of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        if not line[:1].isupper():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("address not mapped")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "mapped"])
def test_tier_values_through_every_backing(tmp_path, monkeypatch, direct: bool) -> None:
    """A tier tensor reads its last written values whatever backs it: after a read-ahead,
    a write-back, a clear, a clean release of a cleared gradient (its file holds the old
    values: they must not come back), and a write made while a write-back waits in the
    queue; its memory is given back once released."""
    import threading

    import torch

    from zero_strategy.offload import disk

    if not direct:
        monkeypatch.setattr(disk, "_direct_io_works", lambda directory: False)
    tier = disk.DiskTier(str(tmp_path), 0)
    try:
        if direct and not tier.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        assert tier.direct is direct
        n = 4 << 20  # 16 MiB of fp32: resident size is easy to tell from nothing
        x = tier.empty(n, torch.float32, "x")
        values = torch.arange(n, dtype=torch.float32)
        x.copy_(values)
        tier.release([x], dirty=True)
        tier.drain()
        assert _resident_kib(x.data_ptr()) < 1024  # written back and dropped
        tier.prefetch([x], write=True)
        assert torch.equal(x, values)  # before, during or after the read: the same values
        tier.ready([x])
        x.add_(1)
        tier.release([x], dirty=True)
        tier.drain()
        assert _resident_kib(x.data_ptr()) < 1024  # reading it would fault it back in
        assert torch.equal(x, values + 1)

        tier.zero_range(x)  # a gradient cleared for the next backward
        assert not x.any()
        tier.release([x], dirty=False)  # untouched: clean
        tier.drain()
        tier.prefetch([x])
        tier.ready([x])
        assert not x.any(), "a cleared tensor released clean read its old values back"

        gate = threading.Event()
        tier._writers.submit(gate.wait)  # the writer busy: the next write-back queues
        tier.release([x], dirty=True)
        x.fill_(3.0)  # made before the write-back starts: it must be what is written
        gate.set()
        tier.drain()
        tier.prefetch([x])
        tier.ready([x])
        assert torch.equal(x, torch.full((n,), 3.0))
    finally:
        tier.close()


class _LateDevice:
    """Device copies as a GPU stream runs them, on the CPU: in order, each only once its
    event (or a later one's) is waited on."""

    def __init__(self) -> None:
        self.queue: list[list] = []

    def copy(self, dst, src):
        entry = [dst, src, False]
        self.queue.append(entry)
        device = self

        class _Event:
            def synchronize(self) -> None:
                while not entry[2]:
                    head = device.queue.pop(0)
                    head[0].copy_(head[1])
                    head[2] = True

        return _Event()


def test_pinned_staging_ring_carries_any_size_within_its_bound() -> None:
    """The disk tier's staging on a GPU: 4 slots allocated once, exactly the configured
    bytes; copies many times larger pass through in chunks both ways, interleaved, with a
    source free to change as soon as a host->device copy returns."""
    import torch

    from zero_strategy.offload.staging import SLOTS, PinnedStaging

    pinned: list[torch.Tensor] = []

    def alloc(nbytes: int) -> torch.Tensor:
        pinned.append(torch.full((nbytes,), 255, dtype=torch.uint8))
        return pinned[-1]

    bound = 64 << 10
    ring, late = PinnedStaging(bound, alloc), _LateDevice()
    assert sum(t.nbytes for t in pinned) == ring.pinned_bytes == bound and len(pinned) == SLOTS

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(40_000, generator=gen) for _ in range(2))  # 10 chunks each
    device_a, device_b = a.clone() * 0, b.clone() * 0
    event = ring.to_device(device_a, a, late.copy)
    kept = a.clone()
    a.fill_(7.0)  # the host copied it into pinned memory already
    assert event is not None
    event.synchronize()
    assert torch.equal(device_a, kept)

    out_a, out_b = torch.full_like(a, float("nan")), torch.full_like(b, float("nan"))
    slots_a, _ = ring.to_host(out_a, kept, late.copy)
    slots_b, _ = ring.to_host(out_b, b, late.copy)  # reuses a's slots: a's chunks land first
    ring.land(slots_a)
    assert torch.equal(out_a, kept)
    ring.land(slots_b)
    assert torch.equal(out_b, b)
    event = ring.to_device(device_b, out_b.to(torch.bfloat16), late.copy)  # casts on the way
    assert event is not None
    event.synchronize()
    assert torch.equal(device_b, b.to(torch.bfloat16).float())
    assert len(pinned) == SLOTS and ring.chunks == 10 + 10 + 10 + 5
