"""Where each parameter sits in a flat, padded buffer, and which slice each rank owns.

Pure arithmetic, no tensors of the model and no communication: the unit classes and the
checkpoint code both read the same layout, so a shard can be mapped back to parameter names
on any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FROZEN_GROUP = -1
"""The group of a parameter in no optimizer group: frozen, and sharded with the rest at
stage 3 (a LoRA base, a frozen backbone) so that no rank holds it whole."""


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    group: int
    """Index of the optimizer param group the parameter belongs to (``FROZEN_GROUP``: none)."""

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of a slot that falls inside one rank's shard."""

    slot: Slot
    slot_start: int
    """Offset inside the parameter (flattened)."""
    shard_start: int
    """Offset inside the shard."""
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    num_shards: int
    shard_align: int = 1
    """Shard sizes are a multiple of this many elements (``ALIGN_ELEMENTS`` for new layouts;
    1 for layouts read from checkpoints older than format 3)."""

    @property
    def numel(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        # Padding to a multiple of the shard count keeps every collective equal-sized; to a
        # multiple of the alignment, every rank's shard starts on an aligned boundary too.
        return shard_numel_for(self.numel, self.num_shards, self.shard_align)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parameters (or parts) rank ``rank`` owns, in flat order; padding excluded."""
        lo, hi = self.shard_bounds(rank)
        out = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.end)
            if start < end:
                out.append(Piece(slot, start - slot.offset, start - lo, end - start))
        return out


# Every parameter and every rank's shard starts on a 64-byte boundary (fp32; 32 bytes in
# 16-bit): kernels take the same vectorised paths as on a standalone tensor, so results match
# an unsharded model's bit for bit where the math allows, and GPU loads, fused optimizers and
# nccl buffers stay aligned on every rank, not only rank 0.
ALIGN_ELEMENTS = 16


def shard_numel_for(numel: int, num_shards: int, align: int) -> int:
    per_rank = max(1, -(-numel // num_shards))
    return -(-per_rank // align) * align


def make_layout(
    entries: list[tuple[str, torch.Size, int]], num_shards: int,
    shard_align: int = ALIGN_ELEMENTS,
) -> FlatLayout:
    """Lay out ``(name, shape, group)`` entries in the order given. Not grouped by optimizer
    group: a frozen parameter added to a group later (``Unit.relabel``) then changes its
    slot's group and nothing else, where sorting would move its neighbours in the shards.
    (Layouts written before 2026-11-29 were sorted by group; a checkpoint stores its layout,
    so both read alike.)"""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    slots = []
    offset = 0
    for name, shape, group in entries:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        offset = -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        slots.append(Slot(name, tuple(int(d) for d in shape), offset, numel, group))
        offset += numel
    return FlatLayout(tuple(slots), num_shards, shard_align)
