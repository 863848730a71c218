"""Fault and hostile-checkpoint scenarios, 2 processes (tests/quick/test_checkpoint_faults.py).

Checkpoints go under $ZS_FAULT_ROOT: ``good`` and ``v2`` (the same tag ``t`` saved one step
apart, for the publishing crash tests), ``hostile/*`` (tests/support/hostile.py's variants). The
stalled-peer scenario runs last: it leaves a collective abandoned in a separate group.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
import zero_strategy.checkpoint.write as ckpt
from tests.support.harness import scenario
from tests.support.hostile import TAG, make_variants
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from zero_strategy.comm.collectives import CollectiveTimeout

ROOT = Path(os.environ.get("ZS_FAULT_ROOT", "/tmp/zs-faults"))


def _engine(stage: int = 3, group: Any = None, **extra: Any) -> zs.ZeroEngine:
    model = make_model("mlp")
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config("mlp", stage, **extra),
                         process_group=group)


def _train(engine: zs.ZeroEngine, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 10 * dist.get_rank())
    for _ in range(steps):
        engine.backward(loss_of("mlp", engine, batch("mlp", gen)))
        engine.step()


def _snapshot(engine: zs.ZeroEngine) -> dict[str, Any]:
    """Everything a load may change: weights, optimizer states, hyperparameters, counters."""
    inner = engine.optimizer.parts[0].inner
    states = [{k: v.clone() for k, v in inner.state.get(s.view, {}).items()}
              for s in engine.optimizer.segments]
    return {"weights": engine.full_state_dict(), "states": states,
            "lr": [g["lr"] for g in engine.user_optimizer.param_groups],
            "counters": (engine.global_step, engine.skipped_steps)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    weights = a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    states = len(a["states"]) == len(b["states"]) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a["states"], b["states"]))
    return weights and states and a["lr"] == b["lr"] and a["counters"] == b["counters"]


@scenario
def write_good() -> dict:
    """``good``: tag t after one step (with client state); ``v2``: tag t after two."""
    engine = _engine()
    _train(engine, 1, seed=1)
    engine.save_checkpoint(ROOT / "good", tag=TAG, client_state={"epoch": 1})
    _train(engine, 1, seed=2)
    engine.save_checkpoint(ROOT / "v2", tag=TAG, client_state={"epoch": 2})
    return {"global_step": engine.global_step}


@scenario
def hostile_loads() -> dict:
    """Every hostile variant refused on both ranks with the expected text, nothing changed."""
    if dist.get_rank() == 0:
        variants = make_variants(ROOT / "good", ROOT / "hostile")
        (ROOT / "hostile.json").write_text(json.dumps(variants))
    dist.barrier()
    variants = json.loads((ROOT / "hostile.json").read_text())
    engine = _engine()
    _train(engine, 2, seed=5)  # a state that differs from every checkpoint
    before = _snapshot(engine)
    out: dict[str, Any] = {}
    for name, variant in variants.items():
        start = time.perf_counter()
        try:
            engine.load_checkpoint(variant["root"])
            error = None
        except Exception as e:  # the test asserts on the type and text
            error = f"{type(e).__name__}: {e}"
        out[name] = {"raised": error, "seconds": time.perf_counter() - start,
                     "untouched": _same(before, _snapshot(engine)),
                     "marker": Path(variant["marker"]).exists()}
    client = engine.load_checkpoint(ROOT / "good")  # the control: loads, and changes things
    out["_control"] = {"client": client, "changed": not _same(before, _snapshot(engine))}
    return out


@scenario
def failed_saves() -> dict:
    """A full disk on rank 1 while writing, then on rank 0 while writing the manifest: every
    rank raises at once naming the rank, partial files are removed, ``latest`` unchanged;
    debris of an earlier crash is cleared; the next save works."""
    root, rank = ROOT / "enospc", dist.get_rank()
    engine = _engine()
    _train(engine, 1, seed=3)
    engine.save_checkpoint(root, tag="first")
    if rank == 0:  # what a save killed mid-write left behind
        (root / ".tmp-crashed").mkdir()
        (root / ".tmp-crashed" / "shard-00000.safetensors").write_bytes(b"\0" * (3 << 20))
    dist.barrier()
    out = {"rank1_disk_full": _failing_save(engine, root, "second", "_save_tensors", 1)}
    out["rank0_manifest"] = _failing_save(engine, root, "third", "write_atomic", 0)
    if rank == 0:
        (root / ".tmp-crashed").mkdir()  # debris again: the next successful save clears it
    dist.barrier()
    engine.save_checkpoint(root, tag="fourth")
    out["after_success"] = {"entries": sorted(os.listdir(root)),
                            "latest": (root / "latest").read_text()}
    return out


def _failing_save(engine: zs.ZeroEngine, root: Path, tag: str, target: str,
                  failing_rank: int) -> dict[str, Any]:
    """Save with ``checkpoint.<target>`` raising ENOSPC (after writing part of a shard) on
    ``failing_rank``; how long this rank took to raise, what it said, what is left."""
    real = getattr(ckpt, target)

    def disk_full(*args: Any) -> Any:
        path = Path(args[-1] if target == "_save_tensors" else args[0])
        if target == "_save_tensors":
            path.write_bytes(b"\0" * (1 << 20))  # the part that fit
        elif path.name != "manifest.json":
            return real(*args)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if dist.get_rank() == failing_rank:
        setattr(ckpt, target, disk_full)
    start = time.perf_counter()
    try:
        engine.save_checkpoint(root, tag=tag)
        error = None
    except Exception as e:  # the test asserts on the type and text
        error = f"{type(e).__name__}: {e}"
    finally:
        setattr(ckpt, target, real)
    seconds = time.perf_counter() - start
    dist.barrier()
    left = {"entries": sorted(os.listdir(root)), "latest": (root / "latest").read_text()}
    dist.barrier()  # every rank looked before anything else changes the directory
    return {"raised": error, "seconds": seconds, **left}


@scenario
def stalled_peer() -> dict:
    """Rank 1 is stopped (SIGSTOP) in the middle of training; rank 0's next collective must
    raise within ZeroConfig.timeout naming the collective and the step. Rank 0 then lets
    rank 1 continue (SIGCONT). In its own group with a short timeout of its own, so the
    abandoned collective dies there and the harness's group stays usable."""
    return _stall(group_timeout=4, timeout=1.5)


@scenario
def stalled_peer_group_timeout() -> dict:
    """As ``stalled_peer``, but the bound is the one the user gave their process group (2 s)
    while the engine keeps ZeroConfig's default (600 s): the stricter one applies."""
    return _stall(group_timeout=2)


def _stall(group_timeout: float, **config: Any) -> dict:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout))
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    engine = _engine(stage=2, group=group, **config)
    _train(engine, 1, seed=7)
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 sends SIGCONT
        return {"continued": True}
    start = time.perf_counter()
    try:
        _train(engine, 1, seed=8)
        error = None
    except CollectiveTimeout as e:
        error = str(e)
    seconds = time.perf_counter() - start
    os.kill(pids[1], signal.SIGCONT)
    return {"raised": error, "seconds": seconds, "bound": engine.comm.timeout_s}
