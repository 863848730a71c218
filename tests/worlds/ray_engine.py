"""The engine in a plain training loop, as a Ray Train job runs it (``train_func``) and as the
same loop runs under torchrun (``ray_entry_points.engine_z3``).

Every step draws one global batch of ``GLOBAL`` samples from a seeded generator and each rank
trains on its equal slice, so any world size trains on the same data and the test can train
one process on the whole batch beside it. Under Ray the loop starts from
``zero_strategy.ray.restore`` (the run's latest checkpoint, at whatever worker count wrote
it), reports a checkpoint every ``SAVE_EVERY`` steps with ``save_and_report``, and stops after
step ``config["stop"]``; a new ``TorchTrainer`` with the same ``RunConfig`` name and storage
continues the run where it stopped, with any number of workers. ``config["kill"] = [step,
rank]`` SIGKILLs that rank in the middle of that step (after its forward) in the run's first
attempt, once Ray registered the previous report (``config["snapshot"]``: the run's
``checkpoint_manager_snapshot.json``), so Ray restarts the workers from it
(``FailureConfig(max_failures=1)``).

Each rank appends a line per step to ``OUT/steps-rank<r>.jsonl`` (step, world size, attempt,
the global loss) and after its last step rank 0 writes the consolidated weights
(``OUT/weights-<last step>.pt``) and every rank what it uploaded per report
(``OUT/reports-rank<r>.json``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.models import MLP

GLOBAL, SAVE_EVERY, SEED, CLIP = 8, 2, 11, 1.0
HIDDEN = 768
"""About 1.8M parameters, 21 MB of fp32 weights and AdamW states: a shard large enough that
its upload and the memory a report takes can be told from a copy of the whole model."""
CONFIG = {"stage": 3, "unit_numel": 200_000}
UNINTERRUPTED = 6
"""Steps of the uninterrupted 2-worker run (ray_entry_points.engine_z3), which the run with
a worker killed repeats: KILL (step, rank) in its first attempt, then a restart."""
KILL = [5, 1]
RESIZES = [(1, 8), (2, 10)]
"""The same run continued twice: (workers, last step); 2 -> 1, then 1 -> 2."""


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randn(GLOBAL, 16, generator=g), torch.randn(GLOBAL, 5, generator=g))
            for _ in range(steps)]


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(hidden=HIDDEN)
    # eps 1e-6, not 1e-8: an element whose gradient is rounding noise would otherwise take
    # lr-sized steps in a direction the summation order picks (tests/support/models.py).
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference(steps: int, halves: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on each whole global batch: the losses and the final weights. With
    ``halves``, its twin that rounds differently: the gradient summed over the batch's two
    halves apart and then added, as two ranks sum it."""
    model, optimizer = build()
    losses = []
    for x, y in global_batches(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if halves:
            for part in (slice(0, GLOBAL // 2), slice(GLOBAL // 2, GLOBAL)):
                (torch.nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _attempt(out: Path) -> int:
    """How many times this run's workers started before (a marker per start, rank 0's)."""
    return len(list(out.glob("started-*")))


def _registered(snapshot: Path, step: int, limit_s: float = 120.0) -> None:
    """Wait until Ray's controller has registered the checkpoint of ``step``. It collects the
    workers' reports every 2 s (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``); a report still
    uncollected when a worker dies is lost, and the restart resumes from the one before
    (exactly too). Waiting makes the test's restart point the last report."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
            if latest["metrics"]["step"] == step:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not written yet, or being replaced
        time.sleep(0.2)
    raise TimeoutError(f"{snapshot}: Ray registered no checkpoint of step {step} in {limit_s} s")


def train(out: Path, under_ray: bool, steps: int, kill: list[int] | None = None,
          resume: bool = True, snapshot: str = "") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out.mkdir(parents=True, exist_ok=True)
    attempt = _attempt(out)
    dist.barrier()  # every rank has read the count before rank 0 adds this start's marker
    if rank == 0:
        (out / f"started-{attempt}-world{world}").touch()
    model, optimizer = build()
    engine = zs.ZeroEngine(model, optimizer, zs.ZeroConfig(**CONFIG))
    start = 0
    if under_ray and resume:
        from zero_strategy.ray import restore

        client = restore(engine)
        start = int(client["step"]) if client is not None else 0
    reports: list[dict[str, Any]] = []
    losses: list[float] = []
    part = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    batches = global_batches(steps)
    for step in range(start + 1, steps + 1):
        x, y = batches[step - 1]
        loss = torch.nn.functional.mse_loss(engine(x[part]), y[part])
        if kill == [step, rank] and attempt == 0:
            _registered(Path(snapshot), step - 1 - (step - 1) % SAVE_EVERY)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peer waits in backward
        engine.backward(loss)
        engine.clip_grad_norm_(CLIP)
        engine.step()
        engine.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # equal slices: the global batch's loss is the ranks' mean
        losses.append(total.item() / world)
        with open(out / f"steps-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": world, "attempt": attempt,
                                "loss": losses[-1]}) + "\n")
        if step % SAVE_EVERY == 0:
            reports.append(_checkpoint(engine, out, step, losses[-1], under_ray))
    weights = engine.full_state_dict()  # a collective
    if rank == 0:
        torch.save(weights, out / f"weights-{steps}.pt")
    (out / f"reports-rank{rank}.json").write_text(json.dumps(reports))
    return {"losses": losses, "reports": reports, "start": start}


def _checkpoint(engine: zs.ZeroEngine, out: Path, step: int, loss: float,
                under_ray: bool) -> dict[str, Any]:
    if not under_ray:
        engine.save_checkpoint(out / "ckpt", client_state={"step": step})
        return {}
    from tests.worlds.ray_entry_points import peak_growth
    from zero_strategy.ray import save_and_report

    done = peak_growth()
    reported = save_and_report(engine, {"step": step, "loss": loss},
                               client_state={"step": step})
    return {"step": step, "bytes": reported.bytes, "files": list(reported.files),
            "save_and_report_rss_growth": done()}


def train_func(config: dict[str, Any]) -> None:
    """Ray Train's training function (the process group is Ray's)."""
    torch.set_num_threads(1)
    train(Path(config["out"]), True, int(config["stop"]), config.get("kill"),
          snapshot=config.get("snapshot", ""))
