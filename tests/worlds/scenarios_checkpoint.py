"""Checkpoint scenarios. The same module runs at world size 2 (writes checkpoints under
$ZS_CKPT_ROOT), then 3 and 1 (read them back on other layouts). See test_checkpoint_dist.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from zero_strategy.checkpoint import read as checkpoint_read

ROOT = Path(os.environ.get("ZS_CKPT_ROOT", "/tmp/zs-ckpt"))
WORLD = int(os.environ["WORLD_SIZE"])


def _engine(kind: str, stage: int, **extra) -> zs.ZeroEngine:
    model = make_model(kind)
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(kind, stage, **extra))


def _batches(kind: str, steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(77 + dist.get_rank())
    return [batch(kind, gen) for _ in range(steps)]


def _run(engine: zs.ZeroEngine, kind: str, batches: list[dict]) -> list[float]:
    losses = []
    for data in batches:
        loss = loss_of(kind, engine, data)
        engine.backward(loss)
        engine.clip_grad_norm_(0.05)
        engine.step()
        losses.append(loss.item())
    return losses


def exact_resume(stage: int, kind: str = "gpt2", **extra) -> dict:
    """6 steps straight vs 3 steps, save, a fresh engine loads, 3 more steps."""
    data = _batches(kind, 6)
    straight = _engine(kind, stage, **extra)
    losses = _run(straight, kind, data)
    first = _engine(kind, stage, **extra)
    resumed = _run(first, kind, data[:3])
    path = ROOT / f"resume{stage}{'_'.join(extra)}"
    first.save_checkpoint(path, client_state={"epoch": 3, "note": "hello"})
    second = _engine(kind, stage, **extra)
    client = second.load_checkpoint(path)
    resumed += _run(second, kind, data[3:])
    a, b = straight.full_state_dict(), second.full_state_dict()
    return {"losses": losses, "resumed": resumed, "client": client,
            "weights_equal": all(torch.equal(a[k], b[k]) for k in a),
            "global_step": second.global_step, "latest": (path / "latest").read_text()}


def write_for_other_worlds() -> dict:
    """N=2 stage 3 trains 3 steps and saves; other worlds load it (see load_elsewhere)."""
    engine = _engine("gpt2", 3)
    _run(engine, "gpt2", _batches("gpt2", 3))
    engine.save_checkpoint(ROOT / "cross", tag="after3")
    return {"tag": "after3"}


def write_format_v2() -> dict:
    """A checkpoint as format v2 wrote it (shard sizes not aligned), for load_elsewhere."""
    import functools
    import json

    import zero_strategy.core.units as units

    aligned = units.make_layout
    units.make_layout = functools.partial(aligned, shard_align=1)
    try:
        engine = _engine("mlp", 3)  # sizes 5, 16, ...: shards of 2 ranks unaligned
    finally:
        units.make_layout = aligned
    _run(engine, "mlp", _batches("mlp", 3))
    path = engine.save_checkpoint(ROOT / "v2", tag="after3")
    dist.barrier()
    if dist.get_rank() == 0:
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["version"] = 2
        for unit in manifest["units"]:
            del unit["shard_align"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    new = [u.layout.shard_numel for u in _engine("mlp", 3).units]
    return {"unaligned_units": sum(u.layout.shard_numel != n
                                   for u, n in zip(engine.units, new))}


def load_elsewhere(stage: int, source: str = "cross", kind: str = "gpt2") -> dict:
    """Load the N=2 stage-3 checkpoint at this world size and ``stage``: weights and every
    Adam state must equal the saved ones, and training continues."""
    engine = _engine(kind, stage)
    engine.load_checkpoint(ROOT / source)
    saved = zs.consolidate(ROOT / source)
    full = engine.full_state_dict()
    reader = checkpoint_read.CheckpointReader(checkpoint_read.resolve(ROOT / source))
    states_equal = True
    rank = dist.get_rank() if engine.plan.optimizer_shards > 1 else 0
    for seg in engine.optimizer.segments:
        state = engine.optimizer.parts[0].inner.state[seg.view]
        for piece in seg.unit.layout.pieces(rank):
            lo, hi = max(piece.shard_start, seg.start), min(piece.shard_start + piece.numel,
                                                            seg.end)
            if lo >= hi:
                continue
            off = piece.slot_start + lo - piece.shard_start
            for key in ("exp_avg", "exp_avg_sq"):
                want = reader.read_range(piece.slot.name, key, off, off + hi - lo)
                states_equal &= torch.equal(state[key][lo - seg.start : hi - seg.start], want)
        states_equal &= float(state["step"]) == 3.0
    losses = _run(engine, kind, _batches(kind, 2))
    return {"weights_equal": all(torch.equal(full[k], saved[k]) for k in saved),
            "states_equal": bool(states_equal), "losses": losses,
            "global_step": engine.global_step}


def damaged() -> dict:
    """Single process: every kind of bad checkpoint gives a CheckpointError naming it."""
    src = ROOT / "cross" / "after3"
    out = {}

    def attempt(name: str, mutate, kind: str = "gpt2") -> None:
        target = ROOT / f"damaged-{name}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(src, target)
        mutate(target)
        try:
            _engine(kind, 2).load_checkpoint(target)
            out[name] = "loaded"
        except zs.CheckpointError as e:
            out[name] = str(e)

    def truncate(t: Path) -> None:
        f = t / "shard-00001.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])

    def flip(t: Path) -> None:
        f = t / "shard-00000.safetensors"
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))

    attempt("truncated", truncate)
    attempt("corrupted", flip)
    attempt("missing", lambda t: (t / "shard-00001.safetensors").unlink())
    attempt("other_model", lambda t: None, kind="mlp")
    attempt("no_manifest", lambda t: (t / "manifest.json").unlink())
    return out


if WORLD == 2:
    for _stage in (1, 2, 3):
        register(f"resume_stage{_stage}", exact_resume, stage=_stage)
    register("resume_stage3_offload", exact_resume, stage=3, offload_optimizer=True,
             offload_params=True)
    register("resume_stage2_bf16", exact_resume, stage=2, kind="mlp", precision="bf16-mixed")
    register("resume_stage1_fp16", exact_resume, stage=1, kind="mlp", precision="16-mixed",
             loss_scale={"initial_scale": 256.0, "growth_interval": 2})
    register("write_cross", write_for_other_worlds)
    register("write_v2", write_format_v2)
elif WORLD == 3:
    register("load_n3_stage2", load_elsewhere, stage=2)
    register("load_n3_stage3", load_elsewhere, stage=3)
    register("load_v2_n3_stage1", load_elsewhere, stage=1, source="v2", kind="mlp")
else:
    register("load_v2_n1_stage3", load_elsewhere, stage=3, source="v2", kind="mlp")
    register("load_n1_stage0", load_elsewhere, stage=0)
    register("load_n1_stage3", load_elsewhere, stage=3)
    register("damaged", damaged)


def big_and_gpt2() -> dict:
    """Single process: a 67 MB model for the streaming test, and a tied GPT-2 for the CLI."""
    torch.manual_seed(0)
    big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    engine = zs.ZeroEngine(big, torch.optim.AdamW(big.parameters(), lr=1e-4), zs.ZeroConfig(
        stage=3))
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    engine.step()
    engine.save_checkpoint(ROOT / "big")
    gpt = _engine("gpt2", 2)
    _run(gpt, "gpt2", _batches("gpt2", 1))
    gpt.save_checkpoint(ROOT / "gpt2")
    return {}


if os.environ.get("ZS_BIG"):
    from tests.support.harness import SCENARIOS

    SCENARIOS.clear()
    register("big", big_and_gpt2)
