"""Distributed scenarios for mixed precision, loss scaling and CPU offload (N=2).

Run by tests/quick/test_precision_dist.py through tests.support.harness.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP, STAGE3, batch, loss_of, make_model, make_optimizer
from tests.support.shims import DelayedTransfers
from zero_strategy.offload import transfers as offload


def _config(kind: str, stage: int, **kw) -> zs.ZeroConfig:
    return zs.ZeroConfig(stage=stage, **{**(STAGE3[kind] if stage == 3 else {}), **kw})


def _train(engine: zs.ZeroEngine, kind: str, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = loss_of(kind, engine, batch(kind, gen))
        engine.backward(loss)
        engine.clip_grad_norm_(0.05)
        engine.step()
        losses.append(loss.item())
    return losses


def offload_bitwise(stage: int, offload_params: bool = False, kind: str = "gpt2",
                    delayed: bool = False, **extra) -> dict:
    """The offloaded engine and the plain one, same data: weights must be bit-identical.
    ``delayed``: every host<->device copy of the offloaded engine is delayed until waited on."""
    plain_model, off_model = make_model(kind), make_model(kind)
    plain = zs.ZeroEngine(plain_model, make_optimizer("adamw", plain_model),
                          _config(kind, stage, **extra))
    made: list[DelayedTransfers] = []
    factory = offload.Transfers.for_device
    if delayed:
        offload.Transfers.for_device = lambda device: made.append(  # type: ignore[method-assign]
            DelayedTransfers(device)) or made[-1]
    try:
        off = zs.ZeroEngine(off_model, make_optimizer("adamw", off_model), _config(
            kind, stage, offload_optimizer=True, offload_params=offload_params, **extra))
    finally:
        offload.Transfers.for_device = factory  # type: ignore[method-assign]
    a, b = _train(plain, kind, 5, 7), _train(off, kind, 5, 7)
    sa, sb = plain.full_state_dict(), off.full_state_dict()
    masters = [u.param_store.master for u in off.units]
    return {
        "losses_equal": a == b,
        "weights_equal": all(torch.equal(sa[k], sb[k]) for k in sa),
        "master_devices": sorted({str(m.device) for m in masters}),
        "master_separate": all(_second_copy(u.param_store) for u in off.units),
        "report": off.memory_report(),
        "extra_bytes": off.memory_report()["total_bytes"] - plain.memory_report()["total_bytes"],
        "delayed_copies": made[0].issued if made else 0,
        "races": made[0].check() if made else 0,
    }


def _second_copy(store: Any) -> bool:
    """Whether the store keeps its master apart from the parameter memory it needs anyway
    (stages 0-2: the compute buffer; stage 3: the at-rest shard)."""
    kept = getattr(store, "shard", store.full)
    return store.master.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()


def bf16_vs_autocast(stage: int, kind: str = "mlp", steps: int = 6) -> dict:
    """bf16-mixed engine vs DDP + autocast(bf16) + fp32 AdamW, and vs the fp32 result."""
    ref, model, fp32_model = make_model(kind), make_model(kind), make_model(kind)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ddp, ref_opt = DDP(ref), make_optimizer("adamw", ref)
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model),
                           _config(kind, stage, precision="bf16-mixed"))
    fp32 = zs.ZeroEngine(fp32_model, make_optimizer("adamw", fp32_model), _config(kind, stage))
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    ref_losses, losses = [], []
    for _ in range(steps):
        data = batch(kind, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lr = loss_of(kind, ddp, data)
        lr.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        le = loss_of(kind, engine, data)
        engine.backward(le)
        engine.step()
        fp32.backward(loss_of(kind, fp32, data))
        fp32.step()
        ref_losses.append(lr.item())
        losses.append(le.float().item())
    full, ref_sd, exact = engine.full_state_dict(), ref.state_dict(), fp32.full_state_dict()
    upd = torch.cat([(full[k] - initial[k]).flatten() for k in initial])
    ref_upd = torch.cat([(ref_sd[k] - initial[k]).flatten() for k in initial])
    exact_upd = torch.cat([(exact[k] - initial[k]).flatten() for k in initial])
    return {
        "losses": losses, "ref_losses": ref_losses,
        "update_rel_to_autocast": ((upd - ref_upd).norm() / ref_upd.norm()).item(),
        "autocast_rel_to_fp32": ((ref_upd - exact_upd).norm() / exact_upd.norm()).item(),
        "master_dtypes": sorted({str(u.param_store.master.dtype) for u in engine.units}),
        "module_param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state_dtypes": sorted({str(t.dtype) for t in engine.optimizer.state_tensors()
                                if t.dim() > 0}),
    }


def mixed_memory(stage: int, precision: str, reduce_dtype: str, **kw) -> dict:
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=255, d_out=7)
    extra = {"unit_numel": 20_000, "param_persistence_threshold": 0} if stage == 3 else {}
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zs.ZeroConfig(
        stage=stage, precision=precision, reduce_dtype=reduce_dtype, **extra, **kw))
    engine.backward(engine(torch.randn(4, 64)).float().square().mean())
    engine.step()
    report = engine.memory_report()
    report["estimate"] = zs.estimate_memory(
        engine.num_params, stage=stage, world_size=2, precision=precision,
        reduce_dtype=reduce_dtype, host_is_device=True, **kw).as_dict()
    report["estimate_plain"] = zs.estimate_memory(
        engine.num_params, stage=stage, world_size=2, precision=precision,
        reduce_dtype=reduce_dtype).as_dict()
    return report


def _snapshot(engine: zs.ZeroEngine) -> list[torch.Tensor]:
    tensors = [u.param_store.master.clone() for u in engine.units]
    return tensors + [t.clone() for t in engine.optimizer.state_tensors()]


def fp16_overflow(stage: int, precision: str = "16-mixed") -> dict:
    """Inject inf on rank 0 only: every rank must skip, the scale must follow the knobs."""
    model = make_model("mlp")
    scale_cfg = zs.LossScaleConfig(initial_scale=1024.0, growth_interval=3, hysteresis=2,
                                   min_scale=1.0)
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), _config(
        "mlp", stage, precision=precision, loss_scale=scale_cfg))
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    events = []
    # steps 1-2 clean, 3-4 overflow on rank 0 only, 5-10 clean
    for step in range(1, 11):
        loss = loss_of("mlp", engine, batch("mlp", gen))
        if step in (3, 4) and dist.get_rank() == 0:
            loss = loss * math.inf
        before = _snapshot(engine)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        stepped = engine.step()
        after = _snapshot(engine)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        finite = all(torch.isfinite(u.param_store.master).all().item() for u in engine.units)
        events.append({"step": step, "stepped": stepped, "scale": engine.scaler.scale,
                       "unchanged": unchanged, "finite": finite})
    return {"events": events, "skipped": engine.skipped_steps,
            "master_dtypes": sorted({str(u.param_store.master.dtype) for u in engine.units})}


def fp16_predivide() -> dict:
    """fp16 gradients reduced in fp16 (reduce_dtype="compute") whose scaled value is 40960 on
    every rank: summed first they overflow (2 x 40960 > 65504, fp16's largest), divided by
    the world size first they average to 40960. The step must happen, and exactly: SGD with
    lr 2**-10 on gradient 1.25 moves each weight by 1.25 * 2**-10 (all exact in fp32)."""
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=2.0 ** -10),
                           zs.ZeroConfig(stage=2, precision="16-mixed", reduce_dtype="compute",
                                         loss_scale={"static_scale": 32768.0}))
    x = torch.full((1, 4), 1.25)
    engine.backward(engine(x).float().sum())
    stepped = engine.step()
    weight = engine.full_state_dict()["weight"]
    return {"stepped": stepped, "weight": weight.flatten().tolist(),
            "expected": [1.0 - 1.25 * 2.0 ** -10] * 4}


def fp16_trains(stage: int) -> dict:
    """fp16 at a scale that does not overflow trains the MLP close to the fp32 run (the
    default 2**16 overflows this loss on the first steps and would skip them, as DeepSpeed
    does; the skip path has its own test)."""
    model, ref_model = make_model("mlp"), make_model("mlp")
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), _config(
        "mlp", stage, precision="16-mixed", loss_scale={"initial_scale": 1024.0}))
    ref = zs.ZeroEngine(ref_model, make_optimizer("adamw", ref_model), _config("mlp", stage))
    initial = {k: v.clone() for k, v in make_model("mlp").state_dict().items()}
    a, b = _train(engine, "mlp", 6, 9), _train(ref, "mlp", 6, 9)
    full, exact = engine.full_state_dict(), ref.full_state_dict()
    upd = torch.cat([(full[k] - initial[k]).flatten() for k in initial])
    exact_upd = torch.cat([(exact[k] - initial[k]).flatten() for k in initial])
    return {"losses": a, "ref_losses": b, "skipped": engine.skipped_steps,
            "scale": engine.scaler.scale,
            "update_rel_to_fp32": ((upd - exact_upd).norm() / exact_upd.norm()).item()}


for _stage in (1, 2, 3):
    register(f"offload_optimizer_stage{_stage}", offload_bitwise, stage=_stage)
register("offload_params_stage3", offload_bitwise, stage=3, offload_params=True)
for _stage in (1, 2):
    register(f"delayed_offload_optimizer_stage{_stage}", offload_bitwise, stage=_stage,
             delayed=True)
# Every parameter sharded: no later replicated unit's copy flushes the stream before a gather.
register("delayed_offload_optimizer_stage3", offload_bitwise, stage=3, delayed=True,
         param_persistence_threshold=0)
register("delayed_offload_params_stage3", offload_bitwise, stage=3, offload_params=True,
         delayed=True)
register("delayed_offload_params_stage3_no_prefetch", offload_bitwise, stage=3,
         offload_params=True, delayed=True, prefetch=False)
register("fp16_sum_would_overflow", fp16_predivide)
for _stage in range(4):
    register(f"bf16_stage{_stage}", bf16_vs_autocast, stage=_stage)
    register(f"fp16_overflow_stage{_stage}", fp16_overflow, stage=_stage)
    for _reduce in ("fp32", "compute"):
        register(f"memory_bf16_{_reduce}_stage{_stage}", mixed_memory, stage=_stage,
                 precision="bf16-mixed", reduce_dtype=_reduce)
register("bf16_gpt2_stage3", bf16_vs_autocast, stage=3, kind="gpt2", steps=4)
register("fp16_trains_stage2", fp16_trains, stage=2)
# autocast over fp32 weights (Trainer's fp16=True): the same scaler, the same skips
register("fp16_overflow_autocast_stage3", fp16_overflow, stage=3, precision="16-autocast")
for _stage in (2, 3):
    register(f"memory_autocast_stage{_stage}", mixed_memory, stage=_stage,
             precision="bf16-autocast", reduce_dtype="fp32")
register("memory_bf16_true_stage3", mixed_memory, stage=3, precision="bf16-true",
         reduce_dtype="compute")
register("memory_offload_stage2", mixed_memory, stage=2, precision="32-true",
         reduce_dtype="fp32", offload_optimizer=True)
register("memory_offload_stage3", mixed_memory, stage=3, precision="bf16-mixed",
         reduce_dtype="compute", offload_optimizer=True, offload_params=True)
