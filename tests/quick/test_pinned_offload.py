"""CPU offload's host<->device copies (tests/worlds/scenarios_pinned.py, N=2 gloo processes): Muon's
owner exchanges staged through one pinned buffer, the pinned arena of offloaded buffers; and
the arena itself, single-process."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import check, run_world
from zero_strategy.offload.transfers import ARENA_ALIGN, ARENA_CHUNK, PinnedArena, Transfers


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_pinned.py", 2)


@pytest.mark.parametrize("name", ["muon_offload_stage1", "muon_offload_stage2",
                                  "muon_offload_stage2_small_exchanges", "muon_offload_stage3"])
def test_owner_exchanges_copy_once_per_exchange_through_transfers(world: dict,
                                                                  name: str) -> None:
    """Every copy delayed until waited on and host buffers NaN until written: reading a
    staged value before its copy was waited on changes the weights; a copy made around the
    engine's ``Transfers`` (``.to()``) is not counted, so the count is the proof that the
    pieces go through it: one copy per exchange that sends, one per exchange that receives,
    however many pieces the exchange holds."""
    for r in check(world[name]):
        assert r["equal"], "offloaded Muon differs from the run without offload"
        assert r["races"] == 0, "a host buffer changed while a copy could still read it"
        assert r["exchanges"] >= 2 and all(n is not None for n in r["staging_numel"])
        assert r["copies"] == r["per_exchange"] > 0, r
        assert r["copies"] <= 2 * r["exchanges"] < r["per_piece"], r


@pytest.mark.parametrize("name", ["arena_stage2", "arena_stage3_params", "arena_muon_stage2"])
def test_offloaded_buffers_share_one_pinned_allocation(world: dict, name: str) -> None:
    """Every offloaded host buffer (masters, stage-3 shards, gradient buffers, Muon's
    staging) in the arena: one pinned allocation for the whole engine instead of one per
    buffer, each buffer still a storage of its own, the weights as without offload."""
    for r in check(world[name]):
        assert r["equal"] and r["races"] == 0 and r["copies"] > 0, r
        assert r["buffers"] >= 2 and r["distinct_storages"] == r["buffers"], r
        assert r["allocations"] == [r["min_chunk"]] == [ARENA_CHUNK], r
        assert r["pinned_bytes"] == sum(r["allocations"]) == r["reported_pinned"], r
        # What the buffers take is what they asked for, up to alignment per buffer.
        slack = (r["align"] - 1) * r["buffers"]
        assert r["requested_bytes"] <= r["used_bytes"] <= r["requested_bytes"] + slack, r


def _arena(min_chunk: int = 4096) -> tuple[PinnedArena, list[torch.Tensor]]:
    pinned: list[torch.Tensor] = []

    def alloc(nbytes: int) -> torch.Tensor:
        pinned.append(torch.full((nbytes,), 255, dtype=torch.uint8))
        return pinned[-1]

    return PinnedArena(alloc, min_chunk=min_chunk), pinned


def test_arena_places_aligned_disjoint_buffers_first_fit() -> None:
    arena, pinned = _arena()
    sizes = [(100, torch.float32), (3, torch.bfloat16), (800, torch.float32),
             (5000, torch.uint8), (10, torch.float64), (0, torch.float32)]
    buffers = [arena.empty(n, dtype) for n, dtype in sizes]
    # 400 and 6 bytes take 512 each of the first 4 KiB chunk; 3200 bytes (3584 aligned) do
    # not fit beside them, so a second chunk; 5000 bytes fit neither and get a power-of-two
    # chunk (8 KiB); the 80 bytes go first-fit into the first chunk; an empty buffer takes
    # nothing.
    assert [t.nbytes for t in pinned] == [4096, 4096, 8192]
    assert arena.pinned_bytes == 16384 and arena.allocations == 3
    assert arena.used_bytes == 512 + 512 + 3584 + 5120 + 512
    bases = [t.untyped_storage().data_ptr() for t in pinned]
    spans = []
    for (n, dtype), t in zip(sizes, buffers):
        assert t.shape == (n,) and t.dtype == dtype and t.is_contiguous()
        if n == 0:
            continue
        assert t.untyped_storage().nbytes() == t.nbytes  # a storage of its own, its size
        start = t.data_ptr()
        assert any(0 <= start - b and (start - b) % ARENA_ALIGN == 0 for b in bases)
        spans.append((start, start + t.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "buffers overlap"
    for k, t in enumerate(buffers):  # writing one leaves the others alone
        t.fill_(k + 1)
    assert all(bool((t == k + 1).all()) for k, t in enumerate(buffers))


def test_arena_buffer_keeps_its_chunk_alive() -> None:
    """A buffer is a slice of the chunk's storage that holds a reference to it (what torch's
    ``UntypedStorage`` slicing does on this torch): the chunk outlives the arena."""
    arena, pinned = _arena()
    buffer = arena.empty(16, torch.float32).fill_(2.5)
    chunk_ptr = pinned[0].untyped_storage().data_ptr()
    del arena, pinned
    import gc
    gc.collect()
    assert buffer.data_ptr() == chunk_ptr and bool((buffer == 2.5).all())


def test_transfers_pins_only_for_cuda() -> None:
    """On a CPU device host buffers are ordinary memory: nothing pinned, no arena chunk."""
    transfers = Transfers(torch.device("cpu"))
    buffer = transfers.host_empty(1000, torch.float32)
    assert not transfers.pins_host and transfers.pinned_bytes == 0
    assert buffer.shape == (1000,) and transfers.arena.allocations == 0
