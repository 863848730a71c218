"""Host<->device copies of CPU offload on a stand-in GPU (tests/support/shims.py, N=2): the owner
exchanges of Muon with an offloaded optimizer go through the engine's ``Transfers``, one copy
per exchange and direction; every offloaded host buffer is carved out of one pinned arena.
The reference is the same training without offload: on the CPU both compute the same
operations on the same values, so the weights must be bit-identical.

Run by tests/quick/test_pinned_offload.py through tests.support.harness.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import STAGE3, batch, loss_of, make_model
from tests.support.shims import DelayedTransfers
from zero_strategy.offload import transfers as offload
from zero_strategy.optim.owner import OwnerPart

STEPS = 3


class ArenaTransfers(DelayedTransfers):
    """The stand-in GPU with the real ``Transfers.host_empty``: host buffers pinned, so carved
    out of the arena whose chunks ``pinned_empty`` records; NaN-filled like the shim's own."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.pins_host = True
        self.requested: list[int] = []
        """Bytes of every host buffer asked for."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = offload.Transfers.host_empty(self, numel, dtype).fill_(float("nan"))
        self.requested.append(buffer.nbytes)
        self.host_storages.add(buffer.untyped_storage().data_ptr())
        return buffer


@contextlib.contextmanager
def _transfers(kind: type[DelayedTransfers], made: list[DelayedTransfers]) -> Iterator[None]:
    factory = offload.Transfers.for_device
    offload.Transfers.for_device = lambda device: made.append(  # type: ignore[method-assign]
        kind(device)) or made[-1]
    try:
        yield
    finally:
        offload.Transfers.for_device = factory  # type: ignore[method-assign]


def _optimizers(model: torch.nn.Module, name: str) -> list[torch.optim.Optimizer]:
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)]
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=1e-2, eps=1e-6)]


def _engine(stage: int, optimizer: str, **config: Any) -> zs.ZeroEngine:
    model = make_model("mlp")
    extra = {**STAGE3["mlp"], "param_persistence_threshold": 0} if stage == 3 else {}
    return zs.ZeroEngine(model, _optimizers(model, optimizer),
                         zs.ZeroConfig(stage=stage, **extra, **config))


def _train(engine: zs.ZeroEngine) -> list[float]:
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = loss_of("mlp", engine, batch("mlp", gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _same(a: zs.ZeroEngine, b: zs.ZeroEngine) -> bool:
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return _train(a) == _train(b) and all(torch.equal(sa[k], sb[k]) for k in sa)


class OwnerCopies:
    """Counts, over the steps of one owner part: copies issued through the engine's
    ``Transfers``, exchanges (all-to-alls), and the copies a copy per sending or receiving
    exchange makes (from the counts each all-to-all is given)."""

    def __init__(self, part: OwnerPart, transfers: DelayedTransfers) -> None:
        self.copies = self.exchanges = self.per_exchange = 0
        step, comm = part.step, part.comm
        all_to_all = comm.all_to_all

        def counted(flat: torch.Tensor, send_counts: list[int],
                    recv_counts: list[int]) -> torch.Tensor:
            self.exchanges += 1
            self.per_exchange += (sum(send_counts) > 0) + (sum(recv_counts) > 0)
            return all_to_all(flat, send_counts, recv_counts)

        def counted_step() -> None:
            before = transfers.issued
            comm.all_to_all = counted  # type: ignore[method-assign]
            try:
                step()
            finally:
                comm.all_to_all = all_to_all  # type: ignore[method-assign]
            self.copies += transfers.issued - before

        part.step = counted_step  # type: ignore[method-assign]


def per_piece_copies(part: OwnerPart) -> int:
    """The copies one step makes with a copy per piece and tensor (every placed parameter
    stepped): gradient and master of each piece sent to the owner, each piece the owner
    receives, each updated piece it sends back, each piece this rank gets back."""
    me, copies = part.comm.rank, 0
    for pl in part.placed:
        copies += 2 * len(pl.sources[me]) + len(pl.holds[me])
        if pl.owner == me:
            copies += sum(map(len, pl.sources)) + sum(map(len, pl.holds))
    return copies


def muon_offload(stage: int, **config: Any) -> dict:
    """Muon (matrices) beside AdamW, optimizer offloaded, every copy delayed until waited
    on: the same weights as without offload, the owner's pieces moved through ``Transfers``
    one copy per exchange and direction."""
    plain = _engine(stage, "muon", **config)
    made: list[DelayedTransfers] = []
    with _transfers(DelayedTransfers, made):
        off = _engine(stage, "muon", offload_optimizer=True, **config)
    parts = [p for p in off.optimizer.parts if isinstance(p, OwnerPart)]
    counters = [OwnerCopies(p, made[0]) for p in parts]
    equal = _same(plain, off)
    return {
        "equal": equal, "races": made[0].check(),
        "copies": sum(c.copies for c in counters) / STEPS,
        "exchanges": sum(c.exchanges for c in counters) / STEPS,
        "per_exchange": sum(c.per_exchange for c in counters) / STEPS,
        "per_piece": sum(per_piece_copies(p) for p in parts),
        "staging_numel": [p.staging.numel() if p.staging is not None else None for p in parts],
    }


def arena(stage: int, optimizer: str = "adamw", **config: Any) -> dict:
    """Offloaded host buffers from the arena (``Transfers.host_empty`` pinning): the pinned
    allocations it makes, against the buffers asked for; the weights as without offload."""
    plain = _engine(stage, optimizer, **config)
    made: list[DelayedTransfers] = []
    with _transfers(ArenaTransfers, made):
        off = _engine(stage, optimizer, offload_optimizer=True, **config)
    equal = _same(plain, off)  # trains: gradient buffers join at the first backward
    t = made[0]
    assert isinstance(t, ArenaTransfers)
    return {
        "equal": equal, "races": t.check(), "copies": t.issued,
        "buffers": len(t.requested), "requested_bytes": sum(t.requested),
        "distinct_storages": len(t.host_storages),
        "allocations": [p.nbytes for p in t.pinned],
        "pinned_bytes": t.pinned_bytes, "used_bytes": t.arena.used_bytes,
        "reported_pinned": off.memory_report()["pinned_bytes"],
        "align": t.arena.align, "min_chunk": t.arena.min_chunk,
    }


for _stage in (1, 2):
    register(f"muon_offload_stage{_stage}", muon_offload, stage=_stage)
# Small exchanges: several per step, each holding pieces of a few matrices.
register("muon_offload_stage2_small_exchanges", muon_offload, stage=2, bucket_numel=1500)
register("muon_offload_stage3", muon_offload, stage=3, offload_params=True)
register("arena_stage2", arena, stage=2)
register("arena_stage3_params", arena, stage=3, offload_params=True)
register("arena_muon_stage2", arena, stage=2, optimizer="muon")
