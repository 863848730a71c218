"""Every `torch.distributed` call of the package, behind one small class.

Keeping the collectives here means one place counts the bytes each rank moves (the sweep report
shows them), and one place knows which backend quirks exist.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases (>= 2.4) only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size() -> int:
    """World size of the default group (1 when none exists)."""
    return dist.get_world_size() if group_is_initialized() else 1


def init_single_process_group(device: torch.device) -> None:
    """A group of one, for a script run without a launcher (no rendezvous needed)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def destroy_default_group() -> None:
    if group_is_initialized():
        dist.destroy_process_group()


class Handle(Protocol):
    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that ran synchronously (one rank, nothing to wait for)."""

    def wait(self) -> bool:
        return True


class Communicator:
    """Collectives over one process group (the default group unless one is given).

    Byte counts follow the ring convention: what each rank sends for the operation.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "zero_strategy needs an initialised process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') before building a "
                "ZeroEngine (a single process can use world_size=1)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.bytes_sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _count(self, op: str, nbytes: float) -> None:
        self.bytes_sent[op] += int(nbytes)
        self.calls[op] += 1

    def _fraction(self) -> float:
        return (self.world_size - 1) / self.world_size

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum in place over ranks."""
        self._count("all_reduce", 2 * tensor.nbytes * self._fraction())
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count("all_reduce", 2 * tensor.nbytes * self._fraction())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def reduce_scatter(
        self, output: torch.Tensor, flat_input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Sum ``flat_input`` over ranks; rank r receives the r-th equal slice in ``output``."""
        self._count("reduce_scatter", flat_input.nbytes * self._fraction())
        work = _reduce_scatter(output, flat_input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_gather(
        self, flat_output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Concatenate every rank's ``shard`` into ``flat_output`` (rank order)."""
        self._count("all_gather", flat_output.nbytes * self._fraction())
        work = _all_gather(flat_output, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank ``src`` of this group sends ``tensor`` to every rank, in place."""
        self._count("broadcast", tensor.nbytes)
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                       group=self.group)

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast many small tensors as one flat message per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src)
            offset = 0
            for t in group:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_gather_ints(self, value: int, device: torch.device) -> list[int]:
        """Every rank's ``value`` (a blocking round trip of 8 bytes per rank)."""
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        out = torch.empty(self.world_size, dtype=torch.int64, device=device)
        self.all_gather(out, mine)
        return out.tolist()

    def all_gather_object(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def snapshot(self) -> dict[str, int]:
        """Bytes sent so far per operation, plus the total."""
        out = dict(self.bytes_sent)
        out["total"] = sum(self.bytes_sent.values())
        return out
