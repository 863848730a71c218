"""Hybrid sharding (``ZeroConfig(shard_group_size=2)``) on 4 gloo processes: 2 groups of 2.

Run by tests/quick/test_hybrid.py through tests.support.harness (one world of 4). Parity scenarios
reuse tests/worlds/scenarios_engine.py's DDP comparison; the rest checks what is particular to
hybrid sharding: the traffic within and across groups, memory, checkpoints, bad sizes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register, scenario
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from tests.worlds.scenarios_engine import parity

ROOT = Path(os.environ.get("ZS_HYBRID_ROOT", "/tmp/zs-hybrid"))

for _stage in (1, 2, 3):
    register(f"hybrid_parity_gpt2_stage{_stage}", parity, kind="gpt2", stage=_stage,
             shard_group_size=2)
    register(f"hybrid_parity_mlp_stage{_stage}", parity, kind="mlp", stage=_stage,
             shard_group_size=2)
# Groups of one rank: nothing sharded, every gradient all-reduced across the 4 (DDP's traffic).
register("hybrid_parity_mlp_stage3_groups_of_1", parity, kind="mlp", stage=3,
         shard_group_size=1)
register("hybrid_parity_int8_stage3", parity, kind="mlp", stage=3, opt="sgd2", shard_group_size=2,
         quantize_gradients="int8")


def _engine(stage: int, **extra: Any) -> zs.ZeroEngine:
    model = make_model("gpt2")
    return zs.ZeroEngine(model, make_optimizer("adamw", model),
                         zero_config("gpt2", stage, **extra))


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    return [batch("gpt2", gen) for _ in range(steps)]


def _train(engine: zs.ZeroEngine, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    losses = []
    for data in batches:
        loss = loss_of("gpt2", engine, data)
        engine.backward(loss)
        engine.clip_grad_norm_(0.05)
        engine.step()
        losses.append(loss.item())
    return losses


@scenario
def hybrid_traffic() -> dict[str, Any]:
    """Bytes of one step within and across groups, and the shard sizes that predict them."""
    out: dict[str, Any] = {}
    for name, extra in (("hybrid", {"shard_group_size": 2}), ("flat", {}),
                        ("hybrid_int8", {"shard_group_size": 2,
                                         "quantize_gradients": "int8"})):
        engine = _engine(3, **extra)
        data = _batches(2)
        _train(engine, data[:1])
        before = engine.comm_bytes()
        _train(engine, data[1:])
        after = engine.comm_bytes()
        out[name] = {k: after[k] - before.get(k, 0) for k in after}
        out[name]["shard_numel"] = sum(u.layout.shard_numel for u in engine.units)
        out[name]["padded_numel"] = sum(u.layout.padded_numel for u in engine.units)
        # whole from their forward to their backward, gathered once: the root, and the
        # forward's last units
        out[name]["kept_numel"] = sum(u.layout.padded_numel for u in engine.units
                                      if u.index in engine.runtime._kept
                                      or u is engine.runtime.root_unit)
        # int8 across the 2 groups: each shard padded to whole blocks of both halves
        out[name]["int8_crossing_numel"] = sum(
            -(-u.layout.shard_numel // (2 * 256)) * 2 * 256 for u in engine.units)
        out[name]["memory"] = engine.memory_report()
    return out


@scenario
def hybrid_resume_is_exact() -> dict[str, Any]:
    """6 steps straight vs 3, save, a fresh hybrid engine loads, 3 more; the checkpoint holds
    one group's 2 shards (the other group's are the same), so a plain stage-2 engine over all
    4 ranks loads it too."""
    data = _batches(6)
    straight = _engine(3, shard_group_size=2)
    losses = _train(straight, data)
    first = _engine(3, shard_group_size=2)
    resumed = _train(first, data[:3])
    saved = first.full_state_dict()
    path = ROOT / "resume"
    first.save_checkpoint(path, tag="after3")
    second = _engine(3, shard_group_size=2)
    second.load_checkpoint(path, tag="after3")
    loaded = second.full_state_dict()
    resumed += _train(second, data[3:])
    a, b = straight.full_state_dict(), second.full_state_dict()
    plain = _engine(2)
    plain.load_checkpoint(path, tag="after3")
    manifest = (path / "after3" / "manifest.json").read_text()
    return {"losses": losses, "resumed": resumed,
            "loaded_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "final_equal": all(torch.equal(a[k], b[k]) for k in a),
            "plain_equal": all(torch.equal(saved[k], v)
                               for k, v in plain.full_state_dict().items()),
            "world_size_recorded": '"world_size": 2' in manifest,
            "files": sorted(p.name for p in (path / "after3").iterdir())}


@scenario
def hybrid_group_sizes() -> dict[str, str]:
    """A size that does not divide the world is refused naming the field and the sizes
    that do."""
    model = make_model("mlp")
    try:
        zs.ZeroEngine(model, make_optimizer("adamw", model), zs.ZeroConfig(
            stage=2, shard_group_size=3))
    except ValueError as e:
        return {"message": str(e)}
    return {"message": "no error"}


@scenario
def group_creation_order() -> dict[str, Any]:
    """The groups this rank creates while an engine is built, in order: with nccl splitting
    the world's communicator (a device-bound default group), every rank must create every
    group in one order, or the splits pair up wrongly and hang."""
    created: list[list[int]] = []
    original = dist.new_group

    def recording(ranks: list[int] | None = None, *args: Any, **kwargs: Any) -> Any:
        created.append(list(ranks or []))
        return original(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        engine = _engine(3, shard_group_size=2)
    finally:
        dist.new_group = original
    engine.close()
    return {"created": created, "every_rank": dist.get_world_size()}
