"""Flat layout arithmetic and the ZeRO memory formula (no processes needed)."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy.core.flat import ALIGN_ELEMENTS, make_layout


def test_layout_shards_cover_every_element_once() -> None:
    entries = [("a", torch.Size([7, 3]), 0), ("b", torch.Size([5]), 1),
               ("c", torch.Size([4, 4]), 0)]
    for shards in (1, 2, 3, 5):
        layout = make_layout(entries, shards)
        assert layout.padded_numel % shards == 0 and layout.padded_numel >= layout.numel
        # In the order given, whatever the groups: a frozen parameter (group -1) that joins
        # a group later changes its slot's group, not where anything lies.
        assert [(s.name, s.group) for s in layout.slots] == [("a", 0), ("b", 1), ("c", 0)]
        assert all(s.offset % ALIGN_ELEMENTS == 0 for s in layout.slots)
        # Every rank's shard starts aligned (fused kernels, nccl), with less than one
        # alignment of padding per rank beyond the even split.
        assert all(layout.shard_bounds(r)[0] % ALIGN_ELEMENTS == 0 for r in range(shards))
        assert layout.shard_numel - -(-layout.numel // shards) < ALIGN_ELEMENTS
        seen: dict[str, list[int]] = {s.name: [0] * s.numel for s in layout.slots}
        for rank in range(shards):
            for piece in layout.pieces(rank):
                for i in range(piece.slot_start, piece.slot_start + piece.numel):
                    seen[piece.slot.name][i] += 1
        assert all(c == 1 for counts in seen.values() for c in counts)


@pytest.mark.parametrize(
    ("stage", "per_param"),
    [(0, 16), (1, 4 + 4 + 8 / 4), (2, 4 + (4 + 8) / 4), (3, (4 + 4 + 8) / 4)],
)
def test_formula_fp32_adam(stage: int, per_param: float) -> None:
    est = zs.estimate_memory(1_000_000, stage=stage, world_size=4)
    assert est.total_bytes == pytest.approx(per_param * 1_000_000, abs=4)


@pytest.mark.parametrize(
    ("stage", "per_param"),
    [(0, 16), (1, 2 + 2 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)],
)
def test_formula_mixed_precision_matches_paper(stage: int, per_param: float) -> None:
    est = zs.estimate_memory(8_000_000, stage=stage, world_size=8, precision="bf16-mixed",
                             reduce_dtype="compute")
    assert est.total_bytes == pytest.approx(per_param * 8_000_000, abs=8)
    assert (est.param_bytes_per_param, est.grad_bytes_per_param,
            est.optimizer_bytes_per_param) == (2, 2, 12)


def test_formula_offload_moves_optimizer_to_host() -> None:
    est = zs.estimate_memory(1000, stage=2, world_size=2, offload_optimizer=True)
    # fp32 offload keeps a separate master on the host: 4 (master) + 8 (Adam) per param / N
    assert est.host_bytes == est.optimizer_bytes == 1000 * 12 // 2
    assert est.device_bytes == 1000 * 4 + 1000 * 4 // 2
    with pytest.raises(ValueError, match="offload_params"):
        zs.estimate_memory(1000, stage=2, world_size=2, offload_params=True)
    # Training on the CPU, the host is the device: offloading adds no master and moves nothing.
    for stage, kw in ((2, {"offload_optimizer": True}),
                      (3, {"offload_optimizer": True, "offload_params": True})):
        cpu = zs.estimate_memory(1000, stage=stage, world_size=2, host_is_device=True, **kw)
        assert cpu == zs.estimate_memory(1000, stage=stage, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        zs.estimate_memory(1000, stage=2, world_size=0)


def test_a_frozen_slot_joining_a_group_moves_nothing() -> None:
    """``Unit.relabel`` relies on it: the offsets of a layout do not depend on its groups."""
    shapes = [("w", torch.Size([6, 5])), ("b", torch.Size([6])), ("adapter", torch.Size([3, 5]))]
    frozen = make_layout([(n, s, g) for (n, s), g in zip(shapes, (-1, -1, 0))], 3)
    joined = make_layout([(n, s, g) for (n, s), g in zip(shapes, (1, -1, 0))], 3)
    assert [(s.name, s.offset) for s in frozen.slots] == [(s.name, s.offset) for s in joined.slots]
    assert frozen.shard_numel == joined.shard_numel
