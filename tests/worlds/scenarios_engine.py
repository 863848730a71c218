"""Distributed scenarios for the engine: parity with DDP, memory vs formula, bad input.

Run by tests/quick/test_engine_dist.py through tests.support.harness (one process group per
world size).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP, batch, loss_of, make_model, make_optimizer, zero_config
from tests.support.parity import AdamWGain, rel_diff


def parity(kind: str, stage: int, opt: str = "adamw", freeze: bool = False, steps: int = 6,
           accum: int = 2, clip: float = 0.05, clip_value: float | None = None,
           **extra) -> dict:
    """Train the engine beside DDP on the same per-rank data; compare every step and the end."""
    rank = dist.get_rank()
    ref, model = make_model(kind), make_model(kind)
    if freeze:
        for m in (ref, model):
            m.blocks[1].requires_grad_(False)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ddp = DDP(ref)
    ref_opt = make_optimizer(opt, ref)
    adam = AdamWGain(ref, ref_opt)
    engine = zs.ZeroEngine(model, make_optimizer(opt, model), zero_config(kind, stage, **extra))
    gen = torch.Generator().manual_seed(1000 + rank)
    out: dict[str, list[float]] = {"ref_loss": [], "loss": [], "ref_norm": [], "norm": []}
    for _ in range(steps):
        ref_loss = loss = 0.0
        for micro in range(accum):
            data = batch(kind, gen)
            last = micro == accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                lr = loss_of(kind, ddp, data) / accum
                lr.backward()
            with contextlib.nullcontext() if last else engine.no_sync():
                le = loss_of(kind, engine, data) / accum
                engine.backward(le)
            ref_loss, loss = ref_loss + lr.item(), loss + le.item()
        if clip_value is None:
            out["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            out["norm"].append(engine.clip_grad_norm_(clip).item())
        else:  # record the largest element before clamping: the clamp must engage
            out["ref_norm"].append(max(p.grad.abs().max().item() for p in ref.parameters()))
            torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
            out["norm"].append(engine.get_global_grad_norm(float("inf")).item())
            engine.clip_grad_value_(clip_value)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
        out["ref_loss"].append(ref_loss)
        out["loss"].append(loss)
    full, ref_sd = engine.full_state_dict(), ref.state_dict()
    return {
        **out,
        "rel": rel_diff(full, ref_sd, adam),
        "rel_eps_bound": rel_diff(full, ref_sd, adam, eps_bound=True),
        "eps_bound_elements": sum(int(m.sum()) for m in adam.bound.values()),
        "moved": max((ref_sd[k] - initial[k]).abs().max().item() for k in ref_sd),
        "keys": sorted(full) == sorted(ref_sd),
        "shapes": all(full[k].shape == ref_sd[k].shape for k in ref_sd),
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "frozen_equal": all(torch.equal(full[k], initial[k]) for k in initial if ".1." in k)
        if freeze else True,
    }


def memory(stage: int) -> dict:
    """One AdamW step on a model where model states dominate, then the engine's accounting."""
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=255, d_out=7)
    extra = {"unit_numel": 20_000, "param_persistence_threshold": 0} if stage == 3 else {}
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zs.ZeroConfig(stage=stage, **extra))
    gen = torch.Generator().manual_seed(dist.get_rank())
    loss = engine(torch.randn(8, 64, generator=gen)).square().mean()
    engine.backward(loss)
    engine.step()
    return engine.memory_report()


def bad_input() -> dict:
    """Errors raised at construction, as text."""
    messages = {}
    model, other = MLP(), MLP()
    cases = {
        "foreign_param": lambda: zs.ZeroEngine(model, torch.optim.SGD(other.parameters(), lr=0.1)),
        "missing_param": lambda: zs.ZeroEngine(
            model, torch.optim.SGD(model.out.parameters(), lr=0.1)),
        "two_devices": lambda: zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             device="meta"),
        "meta_without_init": lambda: _meta_gpt2_engine(init=False),
        "not_optimizer": lambda: zs.ZeroEngine(model, "adam"),
    }
    for name, build in cases.items():
        try:
            build()
            messages[name] = "no error"
        except (ValueError, TypeError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


def _meta_gpt2_engine(init: bool = True) -> zs.ZeroEngine:
    from tests.support.models import tiny_gpt2

    with torch.device("meta"):
        model = tiny_gpt2()
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config("gpt2", 3),
                         param_init_fn=model._init_weights if init else None)


def _rss_mib(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def meta_init() -> dict:
    """A 134 MB model built on the meta device never exists whole on any rank."""
    def peak_of(build) -> float:
        import gc

        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # reset the RSS high-water mark
        base = _rss_mib("VmRSS")
        engine = build()
        peak = _rss_mib("VmHWM") - base
        engine.close()
        return peak

    def layers() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)])

    def meta_engine() -> zs.ZeroEngine:
        with torch.device("meta"):
            model = layers()
        engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), zs.ZeroConfig())
        out["bound_ok"] = all(float(u.param_store.master.abs().max()) <= 1024**-0.5 + 1e-6
                              for u in engine.units)
        return engine

    out: dict = {}
    out["meta_peak_mib"] = peak_of(meta_engine)
    out["real_peak_mib"] = peak_of(lambda: zs.ZeroEngine(
        (m := layers()), torch.optim.AdamW(m.parameters()), zs.ZeroConfig()))
    out["full_mib"] = 32 * (1024 * 1024 + 1024) * 4 / 2**20
    gpt = _meta_gpt2_engine()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        loss = loss_of("gpt2", gpt, batch("gpt2", gen))
        gpt.backward(loss)
        gpt.step()
        losses.append(loss.item())
    full = gpt.full_state_dict()
    out["gpt2_losses"] = losses
    out["gpt2_tied"] = gpt.module.lm_head.weight is gpt.module.transformer.wte.weight
    out["gpt2_checksum"] = float(sum(v.double().sum() for v in full.values()))
    return out


def no_sync_skips_communication(stage: int) -> dict:
    """Bytes per collective during a no_sync backward and during the synchronising one."""
    model = make_model("mlp")
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config("mlp", stage))
    gen = torch.Generator().manual_seed(5)
    before = engine.comm_bytes()
    with engine.no_sync():
        engine.backward(loss_of("mlp", engine, batch("mlp", gen)))
    during = engine.comm_bytes()
    engine.backward(loss_of("mlp", engine, batch("mlp", gen)))
    after = engine.comm_bytes()
    return {
        "no_sync": {k: during[k] - before.get(k, 0) for k in during},
        "sync": {k: after[k] - during.get(k, 0) for k in after},
    }


def inference_inside_gathered() -> dict:
    """No-grad forwards inside ``gathered_parameters()`` (generate() in one, as DeepSpeed's
    GatheredParameters is used) gather nothing more, and the parameters stay whole after each
    of them; outside the block every forward gathers again."""
    model = make_model("gpt2")
    config = zs.ZeroConfig(stage=3, param_persistence_threshold=0)
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), config)
    ids = batch("gpt2", torch.Generator().manual_seed(3))["input_ids"]
    gathered = lambda: engine.comm_bytes().get("all_gather", 0)  # noqa: E731
    with torch.no_grad():
        engine(input_ids=ids)
        outside = gathered()
        engine(input_ids=ids)
        per_forward = gathered() - outside
        with engine.gathered_parameters():
            entered = gathered()
            for _ in range(3):
                engine(input_ids=ids)
            inside = gathered() - entered
            whole = all(p.numel() == p.data.numel() and p.untyped_storage().size() > 0
                        for p in model.parameters())
    return {"per_forward": per_forward, "inside": inside, "whole_after_forwards": whole}


# N=4: tests/worlds/scenarios_hybrid.py
if __import__("os").environ.get("WORLD_SIZE") in ("2", "3"):
    for _kind in ("mlp", "gpt2"):
        for _stage in range(4):
            register(f"parity_{_kind}_stage{_stage}", parity, kind=_kind, stage=_stage)

if __import__("os").environ.get("WORLD_SIZE") == "2":
    for _stage in range(4):
        register(f"parity_sgd2_stage{_stage}", parity, kind="mlp", stage=_stage, opt="sgd2")
        register(f"parity_frozen_stage{_stage}", parity, kind="mlp", stage=_stage, freeze=True)
        register(f"parity_twice_stage{_stage}", parity, kind="twice", stage=_stage)
        register(f"memory_stage{_stage}", memory, stage=_stage)
        register(f"no_sync_stage{_stage}", no_sync_skips_communication, stage=_stage)
    register("parity_stage3_no_prefetch", parity, kind="gpt2", stage=3, prefetch=False)
    for _stage in (0, 2, 3):
        register(f"parity_clip_value_stage{_stage}", parity, kind="mlp", stage=_stage,
                 clip_value=0.01)
    register("bad_input", bad_input)
    register("inference_inside_gathered", inference_inside_gathered)
    register("meta_init", meta_init)
