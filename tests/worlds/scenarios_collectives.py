"""The direct exchanges that stand for gloo's all-gather and reduce-scatter on host tensors,
the buffer pool behind stage-3 gathers and gradient reductions, and gradients reduced in place.

Run by tests/quick/test_collectives.py on 2 and 3 gloo processes (one process group each).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import scenario
from tests.support.models import MLP
from zero_strategy.comm.collectives import Communicator
from zero_strategy.core.buffers import BufferPool


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
            "scratch_slices": comm.reduce_scatter_scratch_slices,
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
    """Stage 3: after the first step gathers and gradient buffers come from the blocks the
    pool already holds, so what it holds between steps is kept and bounded; the
    gathered buffer stays one storage object per unit (autograd's saved tensors alias it)."""
    engine, seen = _engine_stage3(8)
    sharded = [u for u in engine.units if u.param_store.gathers]
    largest = max(u.layout.padded_numel for u in engine.units) * 4  # fp32
    storages = [u.param_store.full.untyped_storage()._cdata for u in sharded]
    with torch.no_grad():  # gathers every unit, and inference frees each again
        engine(torch.randn(4, 16))
    same_storage = storages == [u.param_store.full.untyped_storage()._cdata for u in sharded]
    return {"steps": seen, "same_storage": same_storage, "units": len(sharded),
            "largest_unit_bytes": largest,
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




def _blockmax(x: torch.Tensor) -> torch.Tensor:
    """Per element, the largest |value| of its int8 block (blocks start at the tensor's
    first element): half a quantization step is that / 254."""
    from zero_strategy.comm import int8 as quantize

    nb = quantize.blocks(x.numel())
    padded = torch.zeros(nb * quantize.BLOCK, dtype=torch.float64)
    padded[: x.numel()] = x.double().abs()
    return padded.view(nb, -1).amax(1).repeat_interleave(quantize.BLOCK)[: x.numel()]


@scenario
def int8_all_gather_within_half_a_step() -> dict[str, Any]:
    """Each piece is its rank's shard decoded: within half a step (max|block| / 254) of the
    exact values, and the same on every rank (every rank decodes the same bytes)."""
    comm, n = Communicator(), dist.get_world_size()
    worst, same, sizes = 0.0, True, (1, 300, 100_003)
    for salt, per_rank in enumerate(sizes):
        shard = _rank_data(per_rank, salt)
        exact = torch.empty(n * per_rank)
        dist.all_gather_into_tensor(exact, shard)
        out = torch.empty(n * per_rank)
        comm.all_gather_int8(out, shard, async_op=True).wait()
        bound = torch.cat([_blockmax(row) for row in exact.view(n, -1)]) / 254
        worst = max(worst, ((out.double() - exact.double()).abs()
                            / bound.clamp_min(1e-300)).max().item())
        everyone = [torch.empty_like(out) for _ in range(n)]
        dist.all_gather(everyone, out)
        same &= all(torch.equal(e, out) for e in everyone)
    from zero_strategy.comm import int8 as quantize

    sent = sum((n - 1) * quantize.blocks(k) * (quantize.BLOCK + 4) for k in sizes)
    return {"worst_over_bound": worst, "same": same, "bytes": comm.bytes_sent["all_gather"],
            "expected_bytes": sent}


@scenario
def int8_reduce_scatter_within_the_peers_steps() -> dict[str, Any]:
    """Per element, the sum is off by at most the peers' half steps (this rank's own part is
    sent exactly) plus fp32 rounding of the N - 1 additions (2^-24 * N * sum|x| per element);
    where every peer sends zeros (to rank 0) the result is rank 0's part, bit for bit."""
    comm, n, rank = Communicator(), dist.get_world_size(), dist.get_rank()
    worst = 0.0
    for salt, per_rank in enumerate((1, 300, 100_003)):
        data = _rank_data(n * per_rank, salt)
        everyone = [torch.empty_like(data) for _ in range(n)]
        dist.all_gather(everyone, data)
        mine = [e.view(n, -1)[rank] for e in everyone]
        exact = sum(m.double() for m in mine)
        steps = sum(_blockmax(m) / 254 for r, m in enumerate(mine) if r != rank)
        rounding = 2.0**-24 * n * sum(m.double().abs() for m in mine)
        out = torch.empty(per_rank)
        comm.reduce_scatter_int8(out, data, async_op=True).wait()
        worst = max(worst, ((out.double() - exact).abs()
                            / (steps + rounding).clamp_min(1e-300)).max().item())
    alone = _rank_data(n * 513, 9) if rank == 0 else torch.zeros(n * 513)
    out = torch.empty(513)
    comm.reduce_scatter_int8(out, alone)
    own_exact = torch.equal(out, alone.view(n, -1)[0]) if rank == 0 else None
    return {"worst_over_bound": worst, "own_exact": own_exact}


@scenario
def int8_all_reduce_within_two_quantizations() -> dict[str, Any]:
    """The int8 sum across replicas (ZeRO++'s qgZ): a reduce-scatter (the piece's owner's
    part exact, each peer's off by its half step), then an all-gather of the summed piece
    (off by half a step of the summed block); the same on every rank."""
    from zero_strategy.comm import int8 as quantize

    comm, n = Communicator(), dist.get_world_size()
    worst, same = 0.0, True
    for salt, numel in enumerate((1, 300, 100_003)):
        data = _rank_data(numel, salt)
        everyone = [torch.empty_like(data) for _ in range(n)]
        dist.all_gather(everyone, data)
        exact = sum(e.double() for e in everyone)
        piece = -(-numel // (n * quantize.BLOCK)) * quantize.BLOCK
        owner = torch.arange(numel) // piece
        steps = sum(torch.where(owner == r, 0.0, _blockmax(e) / 254)
                    for r, e in enumerate(everyone))
        rounding = 2.0**-24 * n * sum(e.double().abs() for e in everyone)
        bound = steps + _blockmax(exact.abs() + steps + rounding) / 254 + 2 * rounding
        out = data.clone()
        comm.all_reduce_int8(out, async_op=True).wait()
        worst = max(worst, ((out.double() - exact).abs() / bound.clamp_min(1e-300))
                    .max().item())
        gathered = [torch.empty_like(out) for _ in range(n)]
        dist.all_gather(gathered, out)
        same &= all(torch.equal(g, out) for g in gathered)
    return {"worst_over_bound": worst, "same": same}


def _gpt2_stage3(config: zs.ZeroConfig, steps: int) -> tuple[list[float], dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                       n_positions=32, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0))
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 64, (4, 32), generator=gen)  # a small vocabulary: learnable
        if step == 1:
            before = engine.comm_bytes()["total"]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
    per_step = (engine.comm_bytes()["total"] - before) / (steps - 1)
    sharded = sum(u.layout.padded_numel for u in engine.units if u.param_store.gathers)
    return losses, {"bytes_per_step": per_step, "sharded_numel": sharded,
                    "num_params": engine.num_params}


@scenario
def int8_training_tracks_fp32() -> dict[str, Any]:
    """Stage 3 on a tiny GPT-2 with int8 weights and gradients beside the same run without."""
    common = {"stage": 3, "unit_numel": 4000, "param_persistence_threshold": 1000}
    plain, plain_info = _gpt2_stage3(zs.ZeroConfig(**common), 30)
    q8, q8_info = _gpt2_stage3(zs.ZeroConfig(**common, quantize_weights="int8",
                                             quantize_gradients="int8"), 30)
    return {"plain": plain, "q8": q8, "plain_info": plain_info, "q8_info": q8_info}


@scenario
def errors_name_the_peer() -> dict[str, Any]:
    """What a failed collective says about the rank it was exchanging with: a direct
    exchange names its peer; a collective of the backend names the other rank on two ranks
    (the only one it exchanges with), and none on more."""
    comm = Communicator()
    cause = RuntimeError("Connection closed by peer")
    # A failure rank 0 reported is read by an error on the side channel too (the gather
    # headers travel there, and often time out first when a peer failed).
    side = comm.side_channel()
    if comm.rank == 0:
        comm.ledger.report("InjectedFault in forward")
    dist.barrier()
    on_side = str(side._error("all_gather", TimeoutError("timed out")))
    dist.barrier()
    comm.ledger.clear()
    return {"backend": str(comm._error("all_gather", cause)),
            "direct": str(comm._error("reduce_scatter", cause, (comm.rank + 1) % comm.world_size)),
            "side": on_side}


def _trainer(engine: zs.ZeroEngine, gen: torch.Generator) -> Any:
    def step() -> None:
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 5, generator=gen)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    return step


@scenario
def profiled_steps_then_close() -> dict[str, Any]:
    """A profiler window over two steps, as users take one (torch.profiler around steps 2-3),
    then training on and ``close()``: the exchanges started in the window and waited after it
    (stage 1's gather of the updated weights into the next forward, stage 3's prefetch)
    must not end a profiler record after the profiler stopped. torch's gloo works did, which
    corrupted the heap: the profiler's result crashed the process when freed (below)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        model = MLP(d_in=16, hidden=64, d_out=5)
        engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               zs.ZeroConfig(stage=stage))
        gen = torch.Generator().manual_seed(dist.get_rank())
        step = _trainer(engine, gen)
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            step()
        step()
        engine.close()
        out[f"s{stage}_scopes"] = sorted({e.name for e in prof.events()
                                          if e.name.startswith("zero::")})
        del prof
        gc.collect()  # frees the profiler's result: where the corruption crashed
    return out
