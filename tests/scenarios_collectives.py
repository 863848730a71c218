"""The direct exchanges that stand for gloo's all-gather and reduce-scatter on host tensors,
the buffer pool behind stage-3 gathers and gradient reductions, and gradients reduced in place.

Run by tests/test_collectives.py on 2 and 3 gloo processes (one process group each).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.harness import scenario
from tests.models import MLP
from zero_strategy.buffers import BufferPool
from zero_strategy.collectives import Communicator


def _rank_data(numel: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * salt + dist.get_rank())
    return torch.randn(numel, generator=gen) * 10 ** torch.randint(-3, 4, (numel,),
                                                                   generator=gen)


@scenario
def all_gather_matches_gloo() -> dict[str, Any]:
    """Every size class (one element per rank, the stage-3 tag; odd sizes; in place, where
    the shard is this rank's piece of the output, as after a stage 1-2 step)."""
    comm, n = Communicator(), dist.get_world_size()
    equal, in_place = [], []
    for salt, per_rank in enumerate((1, 7, 4096, 100_003)):
        shard = _rank_data(per_rank, salt)
        ours, native = torch.empty(n * per_rank), torch.empty(n * per_rank)
        comm.all_gather(ours, shard, async_op=True).wait()
        dist.all_gather_into_tensor(native, shard)
        equal.append(torch.equal(ours, native))
        flat = torch.zeros(n * per_rank)
        own = flat.view(n, -1)[dist.get_rank()]
        own.copy_(shard)
        comm.all_gather(flat, own)
        in_place.append(torch.equal(flat, native))
    return {"equal": equal, "in_place": in_place, "bytes": comm.bytes_sent["all_gather"],
            # two gathers of each size, each sending this rank's shard to N-1 peers
            "expected_bytes": 2 * sum(4 * (n - 1) * s for s in (1, 7, 4096, 100_003))}


@scenario
def reduce_scatter_matches_the_sum() -> dict[str, Any]:
    """Against the float64 sum of every rank's input, rounded once: two fp32 additions in
    another order than the exact sum differ from it by at most 2 roundings of the partial
    sums, i.e. 2 * 2^-24 * (|a| + |b| + |c|) per element; on 2 ranks a + b is the correctly
    rounded sum (one rounding), which a single fp32 addition is."""
    comm, n, rank = Communicator(), dist.get_world_size(), dist.get_rank()
    taken: list[int] = []
    pool = BufferPool(torch.device("cpu"))

    def take(numel: int, dtype: torch.dtype) -> torch.Tensor:
        taken.append(numel)
        return pool.take(numel, dtype)

    comm.use_scratch(take, pool.give)
    worst, exact_two = 0.0, True
    for salt, per_rank in enumerate((1, 4096, 100_003)):
        data = _rank_data(n * per_rank, salt)
        everyone = [torch.empty_like(data) for _ in range(n)]
        dist.all_gather(everyone, data)
        stacked = torch.stack(everyone).double()
        exact = stacked.sum(0).view(n, -1)[rank]
        bound = 2 * 2.0**-24 * stacked.abs().sum(0).view(n, -1)[rank]
        out = torch.empty(per_rank)
        comm.reduce_scatter(out, data, async_op=True).wait()
        err = (out.double() - exact).abs()
        worst = max(worst, (err / bound.clamp_min(1e-300)).max().item())
        exact_two &= bool(torch.equal(out, exact.float())) if n == 2 else True
    try:
        buf = torch.zeros(2 * n)
        comm.reduce_scatter(buf[:2], buf)
        aliased = "no error"
    except ValueError as e:
        aliased = str(e)
    return {"worst_over_bound": worst, "exact_two": exact_two, "scratch": taken,
            "pool_blocks": sum(len(v) for v in pool._free.values()), "aliased": aliased}


def _engine_stage3(steps: int) -> tuple[zs.ZeroEngine, list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=64, d_out=5)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zs.ZeroConfig(
        stage=3, unit_numel=1000, param_persistence_threshold=100))
    gen = torch.Generator().manual_seed(dist.get_rank())
    seen = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 5, generator=gen)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        seen.append({"pool_bytes": engine.pool.held_bytes(),
                     "blocks": sorted(s.data_ptr() for v in engine.pool._free.values()
                                      for s in v)})
    return engine, seen


@scenario
def pool_reuses_the_same_blocks_every_step() -> dict[str, Any]:
    """Stage 3: after the first step every gather and gradient buffer comes from the blocks
    the pool already holds, so what it holds between steps neither grows nor changes; the
    gathered buffer stays one storage object per unit (autograd's saved tensors alias it)."""
    engine, seen = _engine_stage3(5)
    sharded = [u for u in engine.units if u.param_store.gathers]
    storages = [u.param_store.full.untyped_storage()._cdata for u in sharded]
    with torch.no_grad():  # gathers every unit, and inference frees each again
        engine(torch.randn(4, 16))
    same_storage = storages == [u.param_store.full.untyped_storage()._cdata for u in sharded]
    return {"steps": seen, "same_storage": same_storage, "units": len(sharded),
            "freed": all(u.param_store.full.untyped_storage().nbytes() == 0 for u in sharded)}


class ViewedWeight(nn.Module):
    """A weight read through a view whose gradient the user retains: autograd's gradient for
    the weight is then a view of the retained one, which a reduction must not divide in place."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 8))
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = self.w.view(8, 64)
        seen.retain_grad()
        self.seen = seen
        return x @ seen


@scenario
def retained_gradients_are_left_alone() -> dict[str, Any]:
    """The retained gradient equals one process's gradient of the same local loss (the
    engine must neither divide it by the world size nor sum it across ranks)."""
    torch.manual_seed(0)
    model, ref = ViewedWeight(), ViewedWeight()
    ref.load_state_dict(model.state_dict())
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           zs.ZeroConfig(stage=3, unit_numel=100, param_persistence_threshold=0))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().sum())
    ref(x).square().sum().backward()
    assert model.seen is not None and ref.seen is not None
    return {"equal": torch.equal(model.seen.grad, ref.seen.grad)}


