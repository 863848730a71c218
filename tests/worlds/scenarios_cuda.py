"""CUDA scenarios, run by test_cuda.py on one GPU: N=1 with nccl, N=2 sharing the GPU through
the ``cuda:gloo`` backend (nccl refuses two ranks on one device).

The reference is the same model trained in one process on the global batch on the same GPU
(what DDP computes). Plain SGD with momentum keeps the update linear in the gradient, so the
weights' distance from the reference, relative to how far training moved them, bounds the
gradient's relative error: fp32 differs only by summation order (one GEMM over 4N rows
against N GEMMs over 4 rows, reductions in another order), ~1e-6 relative per step; we allow
1e-4. bf16 keeps 8 significant bits (2**-9 per rounding) and fp16 11 (2**-12); a forward and
backward of depth ~10 compound that to ~2e-2 and ~3e-3: we allow 5e-2 and 1e-2.

With ``ZS_LOAD_GPU_CHECKPOINT`` set the module instead registers the CPU side of the
checkpoint check: load what the GPU run saved into a CPU gloo world.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP, STAGE3, batch, loss_of
from zero_strategy.offload import transfers as offload

CKPT = Path(os.environ.get("ZS_CKPT_ROOT", "/tmp/zs-cuda-ckpt"))
TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 5e-2, "16-mixed": 1e-2}
INT8_TOLERANCE = 5e-2
"""int8 on the wire rounds each gradient element to half a step of 1/127 of its block's
largest magnitude (2**-8 of it); SGD's update is linear in the gradient, and small elements
of a block with a large one err most relative to themselves: the CPU measures 1.3e-2
(tests/quick/test_hybrid.py), 5e-2 allows 4x for the GPU's other summation order."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _config(stage: int, **extra: Any) -> zs.ZeroConfig:
    return zs.ZeroConfig(stage=stage, **{**(STAGE3["mlp"] if stage == 3 else {}), **extra})


def _on(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(_device()) for k, v in data.items()}


def parity(stage: int, precision: str = "32-true", accumulate: int = 1, steps: int = 4,
           tolerance: float | None = None, **extra: Any) -> dict[str, Any]:
    """Clipped SGD steps with ``accumulate`` micro-batches each, engine vs global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MLP().to(_device())
    model = copy.deepcopy(ref)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           _config(stage, precision=precision, **extra))
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        micro = [[_on(batch("mlp", gen)) for _ in range(world)] for _ in range(accumulate)]
        for per_rank in micro:
            for data in per_rank:
                (loss_of("mlp", ref, data) / (world * accumulate)).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for i, per_rank in enumerate(micro):
            sync = i == accumulate - 1
            with contextlib.nullcontext() if sync else engine.no_sync():
                engine.backward(loss_of("mlp", engine, per_rank[rank]) / accumulate)
        engine.clip_grad_norm_(0.5)
        engine.step()
    got = engine.full_state_dict()
    want = ref.state_dict()
    worst = max(float((got[k].float().to(_device()) - want[k]).norm()
                      / (want[k] - initial[k]).norm().clamp_min(1e-12)) for k in want)
    return {"rel_to_update": worst, "tolerance": tolerance or TOLERANCE[precision],
            "master_devices": sorted({u.param_store.master.device.type for u in engine.units}),
            "offloaded": engine.memory_report()["offloaded_activation_bytes"]}


def muon_parity(stage: int, steps: int = 4, **extra: Any) -> dict[str, Any]:
    """[Muon(hidden matrices), AdamW(rest)] placed on owners, against the global batch in one
    process; ``noise``: where DDP's rounding of the same gradient (per-rank gradients averaged
    in float64, AdamW's fused kernel) lands, since Muon's bf16 Newton-Schulz can amplify a
    last-bit difference."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def optimizers(m: nn.Module, fused: bool | None = None) -> list[torch.optim.Optimizer]:
        hidden = [b[0].weight for b in m.blocks]
        ids = {id(p) for p in hidden}
        rest = [p for p in m.parameters() if id(p) not in ids]
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=0.01, fused=fused)]

    torch.manual_seed(0)
    ref = MLP().to(_device())
    twin, model = copy.deepcopy(ref), copy.deepcopy(ref)
    # The twin also runs AdamW's fused kernel (the engine's choice on shards): another valid
    # implementation, whose last-bit differences Muon's bf16 may amplify alike.
    ref_opts, twin_opts = optimizers(ref), optimizers(twin, fused=True)
    engine = zs.ZeroEngine(model, optimizers(model), _config(stage, **extra))
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        data = [_on(batch("mlp", gen)) for _ in range(world)]
        (sum(loss_of("mlp", ref, d) for d in data) / world).backward()
        total: dict[str, torch.Tensor] = {}
        for d in data:
            twin.zero_grad(set_to_none=True)
            loss_of("mlp", twin, d).backward()
            for n, p in twin.named_parameters():
                total[n] = total.get(n, 0) + p.grad.double() / world
        for n, p in twin.named_parameters():
            p.grad = total[n].float()
        for opt in ref_opts + twin_opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        engine.backward(loss_of("mlp", engine, data[rank]))
        engine.step()
    got, want, other = engine.full_state_dict(), ref.state_dict(), twin.state_dict()

    def rel(a: dict[str, torch.Tensor]) -> float:
        return max(float((a[k].float().to(_device()) - want[k]).abs().max()
                         / want[k].abs().max().clamp_min(1e-12)) for k in want)
    return {"rel": rel(got), "noise": rel(other)}


def _train(engine: zs.ZeroEngine, steps: int, seed: int = 3, on_gpu: bool = True
           ) -> list[float]:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        data = batch("mlp", gen)
        loss = loss_of("mlp", engine, _on(data) if on_gpu else data)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
    return losses


class SlowTransfers(offload.Transfers):
    """Every host<->device copy starts after a GPU busy-wait on the side stream: a consumer
    that does not wait for the copy reads its destination before it is written."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> offload.Copy:
        if self._stream is not None and dst.device.type != src.device.type:
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(2_000_000)  # ~1 ms at ~2 GHz
        return super().copy(dst, src)


def offload_race() -> dict[str, Any]:
    """zero3_offload with every copy delayed on the GPU against the same run undelayed."""
    results = []
    for transfers in (offload.Transfers, SlowTransfers):
        torch.manual_seed(0)
        model = MLP().to(_device())
        factory = offload.Transfers.for_device
        offload.Transfers.for_device = transfers  # type: ignore[method-assign,assignment]
        try:
            engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   _config(3, offload_optimizer=True, offload_params=True))
        finally:
            offload.Transfers.for_device = factory  # type: ignore[method-assign]
        losses = _train(engine, 5)
        results.append((losses, engine.full_state_dict()))
    (a, wa), (b, wb) = results
    return {"losses_equal": a == b, "weights_equal": all(torch.equal(wa[k], wb[k]) for k in wa)}


def host_syncs(stage: int, layers: int, **extra: Any) -> dict[str, Any]:
    """Synchronising CUDA calls per steady-state step, by torch's sync debug mode."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(_device())
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zs.ZeroConfig(
        stage=stage, **({"unit_numel": 1, "param_persistence_threshold": 0} if stage == 3
                        else {}), **extra))
    x = torch.randn(8, 64, device=_device())

    def step() -> None:
        engine.backward(engine(x).square().mean())
        engine.clip_grad_norm_(1.0)
        engine.step()

    step()
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught
             if "synchroniz" in str(w.message).lower()]
    return {"per_step": len(syncs) / 3, "units": len(engine.units), "first": syncs[:5]}


def memory(stage: int, **extra: Any) -> dict[str, Any]:
    """Peak allocated GPU memory of model states against the ZeRO formula: a model whose
    states dominate (8 x 1024^2 parameters, batch 2), after two AdamW steps."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    model = model.to(_device())
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), zs.ZeroConfig(
        stage=stage, **extra))
    x = torch.randn(2, 1024, device=_device())
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    predicted = engine.predicted_memory()
    device_bytes = predicted.total_bytes - predicted.host_bytes
    result = {"peak_bytes": peak, "formula_device_bytes": device_bytes,
              "ratio": peak / device_bytes}
    del engine, model
    return result


def unindexed_device() -> dict[str, Any]:
    """``meta_init("cuda")`` and ``ZeroEngine(device="cuda")``, no index: the engine names
    its device as its tensors report it, and sharded init gives the weights eager
    construction on the GPU gives under the same seed."""
    torch.manual_seed(0)
    with torch.device(_device()):
        eager = MLP()
    torch.manual_seed(0)
    with zs.meta_init("cuda"):
        model = MLP()
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(3),
                           device="cuda")
    got = engine.full_state_dict()
    want = eager.state_dict()
    return {"device": str(engine.device), "expected": str(_device()),
            "equal": all(torch.equal(got[k].to(_device()), want[k]) for k in want)}


def pinned_arena() -> dict[str, Any]:
    """Offloaded host buffers are pinned (copies asynchronous) and come from one arena."""
    torch.manual_seed(0)
    model = MLP().to(_device())
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           _config(3, offload_optimizer=True, offload_params=True))
    _train(engine, 2)
    masters = [u.param_store.master for u in engine.units]
    return {"pinned": all(m.is_pinned() for m in masters),
            "reported": engine.memory_report()["pinned_bytes"],
            "arena": engine.transfers.arena.pinned_bytes,
            "allocations": engine.transfers.arena.allocations}


class _RankOrdered(nn.Module):
    """Two layers of one size that rank 0 runs in one order and the other rank in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(torch.tanh(first(h)))


def blocking_gather_order() -> dict[str, Any]:
    """``check_gather_order="blocking"`` on a GPU: ranks gathering different units raise
    ``GatherOrderError`` before the first wrong exchange, the weights unchanged."""
    torch.manual_seed(0)
    model = _RankOrdered().to(_device())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zs.ZeroConfig(
        stage=3, unit_numel=1, param_persistence_threshold=0, check_gather_order="blocking"))
    error = None
    try:
        engine.backward(engine(torch.randn(4, 16, device=_device())).square().mean())
        engine.step()
    except zs.GatherOrderError as e:
        error = str(e)
    after = engine.full_state_dict()
    return {"raised": error,
            "unchanged": all(torch.equal(before[k], after[k].to(_device())) for k in before)}


def timeout_on_the_gpu() -> dict[str, Any]:
    """Rank 1 never joins rank 0's collective on a group of its own (the world stays usable):
    rank 0 raises ``CollectiveTimeout`` after the 2 s asked. Registered last."""
    from datetime import timedelta

    from zero_strategy.comm.collectives import CollectiveTimeout, Communicator

    group = dist.new_group(backend=os.environ["ZS_BACKEND"], timeout=timedelta(seconds=60))
    comm = Communicator(group, timeout=2.0)
    comm.use_device(_device())
    result: dict[str, Any] = {"raised": None}
    if comm.rank == 0:
        started = time.monotonic()
        try:
            comm.all_reduce_max_to_host(torch.ones(1, device=_device()))
        except CollectiveTimeout as e:
            result["raised"] = str(e)
        result["seconds"] = time.monotonic() - started
    dist.barrier()
    return result


def save_on_gpu() -> dict[str, Any]:
    """Stage 3 on the GPU trains and saves; the CPU world loads it (see load_on_cpu)."""
    torch.manual_seed(0)
    model = MLP().to(_device())
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _config(3))
    _train(engine, 3)
    engine.save_checkpoint(CKPT, tag="gpu")
    full = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, CKPT / "expected.pt")
    dist.barrier()
    return {"saved": True}


def load_on_cpu() -> dict[str, Any]:
    torch.manual_seed(1)  # other initial weights: only the checkpoint can make them equal
    model = MLP()
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _config(2))
    engine.load_checkpoint(CKPT, tag="gpu")
    expected = torch.load(CKPT / "expected.pt")
    got = engine.full_state_dict()
    losses = _train(engine, 2, on_gpu=False)
    return {"weights_equal": all(torch.equal(got[k], expected[k]) for k in expected),
            "global_step": engine.global_step, "finite": all(x == x for x in losses)}


if os.environ.get("ZS_LOAD_GPU_CHECKPOINT"):
    register("load_on_cpu", load_on_cpu)
else:
    for _stage in (0, 1, 2, 3):
        register(f"parity_stage{_stage}", parity, stage=_stage)
    register("parity_stage2_offload", parity, stage=2, offload_optimizer=True)
    register("parity_stage3_offload", parity, stage=3, offload_optimizer=True,
             offload_params=True)
    register("parity_stage2_bf16", parity, stage=2, precision="bf16-mixed")
    register("parity_stage3_bf16_offload", parity, stage=3, precision="bf16-mixed",
             offload_optimizer=True, offload_params=True)
    register("parity_stage1_fp16", parity, stage=1, precision="16-mixed")
    register("parity_stage3_fp16", parity, stage=3, precision="16-mixed")
    register("parity_stage2_accumulate", parity, stage=2, accumulate=2)
    register("parity_stage3_accumulate_offload", parity, stage=3, accumulate=2,
             offload_optimizer=True, offload_params=True)
    # The MLP's blocks recomputed, their inputs copied to pinned host memory on the side
    # stream / written to disk, and brought back ahead of their recomputation.
    register("parity_stage3_ckpt_cpu", parity, stage=3, activation_checkpointing=True,
             offload_activations="cpu")
    register("parity_stage2_ckpt_disk", parity, stage=2, accumulate=2,
             activation_checkpointing=True, offload_activations="disk")
    register("offload_race", offload_race)
    register("muon_stage1", muon_parity, stage=1)
    register("muon_stage3_offload", muon_parity, stage=3, offload_optimizer=True,
             offload_params=True)
    # With the gather-order check on (the default): on a GPU its tags are read once per
    # backward, not per unit (runtime.py).
    for _layers in (2, 6):
        register(f"syncs_stage3_{_layers}", host_syncs, stage=3, layers=_layers)
        register(f"syncs_stage2_offload_{_layers}", host_syncs, stage=2, layers=_layers,
                 offload_optimizer=True)
        register(f"syncs_stage2_bf16_{_layers}", host_syncs, stage=2, layers=_layers,
                 precision="bf16-mixed")
    for _stage in (0, 1, 2, 3):
        register(f"memory_stage{_stage}", memory, stage=_stage)
    register("save_on_gpu", save_on_gpu)
    register("int8_stage3", parity, stage=3, quantize_gradients="int8",
             tolerance=INT8_TOLERANCE)
    register("hybrid_groups_of_1_stage3", parity, stage=3, shard_group_size=1)
    register("unindexed_device", unindexed_device)
    register("pinned_arena", pinned_arena)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        register("blocking_gather_order", blocking_gather_order)
        register("timeout_on_the_gpu", timeout_on_the_gpu)
