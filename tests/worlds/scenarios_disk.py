"""Distributed scenarios for the disk tier (N=2): parity with the host tier, the GPU copy path,
checkpoints both ways, and full or shared directories.

Run by tests/quick/test_disk.py through tests.support.harness.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from tests.support.shims import DelayedTransfers
from zero_strategy.offload import disk as disk_module
from zero_strategy.offload import transfers as offload
from zero_strategy.offload.disk import DiskFullError

ROOT = Path(os.environ.get("ZS_DISK_ROOT", tempfile.gettempdir()))
STAGING_BYTES = 16 << 10


def _dir(name: str) -> str:
    """A directory shared by the ranks of this world (ranks get rank<r> inside it)."""
    return str(ROOT / name)


def _engine(kind: str, stage: int, tier: str | bool, offload_dir: str | None = None,
            **extra) -> zs.ZeroEngine:
    model = make_model(kind)
    params = tier if stage == 3 else False
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(
        kind, stage, offload_optimizer=tier, offload_params=params,
        offload_dir=offload_dir if tier == "disk" else None, **extra))


def _train(engine: zs.ZeroEngine, kind: str, steps: int, seed: int = 7,
           micro: int = 1) -> list[float]:
    """``micro`` micro-batches per step (the first ones under no_sync), clipped at 0.05 so
    the clip coefficient is below 1 and every step scales the gradients."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        for m in range(micro):
            loss = loss_of(kind, engine, batch(kind, gen))
            if m < micro - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            losses.append(loss.item())
        engine.clip_grad_norm_(0.05)
        engine.step()
    return losses


def parity(stage: int, kind: str = "gpt2", micro: int = 1, mapped: bool = False,
           **extra) -> dict:
    """The same training with the host tier ("cpu") and the disk tier: the arithmetic is the
    same, so losses and weights must be equal bit for bit. ``mapped``: as on a filesystem
    that refuses O_DIRECT (every tensor a file mapping, read ahead with madvise)."""
    where = _dir(f"parity{stage}{kind}{micro}{'m' if mapped else ''}")
    host = _engine(kind, stage, "cpu", **extra)
    probe = disk_module._direct_io_works
    if mapped:
        disk_module._direct_io_works = lambda directory: False
    try:
        disk = _engine(kind, stage, "disk", where, **extra)
    finally:
        disk_module._direct_io_works = probe
    direct = disk.tier is not None and disk.tier.direct
    a, b = _train(host, kind, 4, micro=micro), _train(disk, kind, 4, micro=micro)
    norm_host, norm_disk = _norms(host, kind), _norms(disk, kind)
    sa, sb = host.full_state_dict(), disk.full_state_dict()
    mine = Path(where, f"rank{dist.get_rank()}")
    direct_here = probe(str(mine))
    # The tier's tensors are mappings of files already unlinked (nothing to leave behind).
    maps = Path("/proc/self/maps").read_text().splitlines()
    files = sum(1 for line in maps if str(mine) in line and line.endswith("(deleted)"))
    listed = len(list(mine.iterdir()))
    report = disk.memory_report()
    module = disk.close()
    closed_equal = all(torch.equal(module.state_dict()[k], sa[k]) for k in sa)
    return {"losses_equal": a == b, "weights_equal": all(torch.equal(sa[k], sb[k]) for k in sa),
            "norms": [norm_host, norm_disk], "files": files, "listed": listed,
            "disk_bytes": report["disk_bytes"],
            "predicted_disk_bytes": report["predicted_disk_bytes"],
            "closed_equal": closed_equal, "left_after_close": mine.exists(),
            "direct": direct, "direct_here": direct_here}


def _norms(engine: zs.ZeroEngine, kind: str) -> list[float]:
    """Every way of reading the gradients once more: norms of three types (the 2- and
    inf-norms first from the disk tier's summaries), value clipping."""
    gen = torch.Generator().manual_seed(99 + dist.get_rank())
    engine.backward(loss_of(kind, engine, batch(kind, gen)))
    out = [engine.get_global_grad_norm(float("inf")).item(),
           engine.get_global_grad_norm().item(), engine.get_global_grad_norm(1.0).item(),
           engine.clip_grad_norm_(0.01).item(), engine.get_global_grad_norm().item()]
    engine.clip_grad_value_(1e-4)
    out.append(engine.get_global_grad_norm(float("inf")).item())
    engine.step()
    return out


def _io(engine: zs.ZeroEngine) -> tuple[int, int, int]:
    tier = engine.tier
    return (tier.read_bytes, tier.written_bytes, tier.reused_bytes) if tier else (0, 0, 0)


def _reads_without_keeping(engine: zs.ZeroEngine, stepped: bool) -> int:
    """What one steady step reads when nothing stays for the next phase, from the units'
    files: every gathered shard in forward, again in backward but the root's and the
    forward's last ones' (whole from their forward to their backward), and every file the
    optimizer step reads (master, gradient, states)."""
    tier = engine.tier
    assert tier is not None
    gathered = [u for u in engine.units if u.param_store.gathers]
    forward = sum(tier.file_bytes([u.param_store.shard]) for u in gathered)
    whole = {engine.runtime.root_unit} | {u for u in gathered if u.index in engine.runtime._kept}
    backward = sum(tier.file_bytes([u.param_store.shard]) for u in gathered if u not in whole)
    step = sum(tier.file_bytes(engine.optimizer.where.step_tensors(u)) for u in engine.units)
    return forward + backward + (step if stepped else 0)


def streaming(keep: bool, precision: str = "32-true",
              clipped: tuple[int, ...] = (0, 1, 2, 3, 4)) -> dict:
    """Stage 3 with clipping at the steps ``clipped`` and a step skipped for a NaN gradient
    (rank 0, step 2): per step, the bytes the tier read against the units' files, the
    bytes kept for the next phase against its budget, and the losses against the host
    tier's. Under fp16 the unscale, the non-finite check and clipping must read no gradient
    file of their own: the step's read is the only one, and the skip (agreed from the
    clipping norm, or unclipped from the summaries taken at reduction) reads none, with the
    loss scaler moved as the host tier's."""
    kind, nan_step = "gpt2", 2
    engines = {"cpu": _engine(kind, 3, "cpu", nonfinite_grads="skip", precision=precision),
               "disk": _engine(kind, 3, "disk", _dir(f"streaming{int(keep)}{precision}"),
                               nonfinite_grads="skip", precision=precision)}
    disk = engines["disk"]
    tier = disk.tier
    assert tier is not None
    if not keep:
        tier.keep_bytes = 0
    out: dict = {"direct": tier.direct, "keep_bytes": tier.keep_bytes, "steps": [],
                 "kept_peak": 0, "budget": disk_module.keep_budget(
                     [u.layout.shard_numel for u in disk.units], 4)}
    losses: dict[str, list[float]] = {"cpu": [], "disk": []}
    for name, engine in engines.items():
        gen = torch.Generator().manual_seed(5 + dist.get_rank())
        weight = engine.module.transformer.h[0].mlp.c_fc.weight
        for step in range(5):
            before = _io(engine)
            hook = None
            if step == nan_step and dist.get_rank() == 0:
                hook = weight.register_hook(lambda g: g * float("nan"))
            loss = loss_of(kind, engine, batch(kind, gen))
            out["kept_peak"] = max(out["kept_peak"], tier.kept_bytes)
            engine.backward(loss)
            out["kept_peak"] = max(out["kept_peak"], tier.kept_bytes)
            if hook is not None:
                hook.remove()
            if step in clipped:
                engine.clip_grad_norm_(0.05)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the skipped step's warning
                stepped = engine.step()
            losses[name].append(loss.item())
            if engine is disk:
                tier.drain(keep_resident=True)
                read, written, reused = (b - a for a, b in zip(before, _io(engine)))
                out["steps"].append({"stepped": stepped, "read": read, "written": written,
                                     "reused": reused, "kept": tier.kept_bytes,
                                     "expected": _reads_without_keeping(engine, stepped)})
    out["losses_equal"] = losses["cpu"] == losses["disk"]
    sa, sb = engines["cpu"].full_state_dict(), disk.full_state_dict()
    out["weights_equal"] = all(torch.equal(sa[k], sb[k]) for k in sa)
    out["skipped"] = disk.skipped_steps
    out["scalers"] = [e.scaler.state_dict() if e.scaler else None for e in engines.values()]
    disk.close()
    return out


def delayed(stage: int) -> dict:
    """On a GPU the reduced gradient is copied to the host and the master shard to the
    device asynchronously; with every copy delayed until waited on (the shim of
    tests/worlds/scenarios_precision.py), the disk tier must still equal the host tier."""
    made: list[DelayedTransfers] = []
    factory = offload.Transfers.for_device
    offload.Transfers.for_device = lambda device: made.append(  # type: ignore[method-assign]
        DelayedTransfers(device)) or made[-1]
    try:
        host = _engine("gpt2", stage, "cpu")
        # 4 slots of 4 KiB: every copy of a shard spans several, and slots are reused
        # within one copy, so a slot reused or landed too early shows in the results.
        disk = _engine("gpt2", stage, "disk", _dir(f"delayed{stage}"),
                       disk_staging_bytes=STAGING_BYTES)
    finally:
        offload.Transfers.for_device = factory  # type: ignore[method-assign]
    a, b = _train(host, "gpt2", 4), _train(disk, "gpt2", 4)
    sa, sb = host.full_state_dict(), disk.full_state_dict()
    report = disk.memory_report()
    largest = max(u.param_store.master.nbytes for u in disk.units)
    disk.close()
    staging = made[1].staging
    assert staging is not None
    return {"equal": a == b and all(torch.equal(sa[k], sb[k]) for k in sa),
            "copies": made[1].issued, "races": made[1].check(),
            "host_buffers": [len(m.host_storages) for m in made],
            "pinned": [sum(t.nbytes for t in m.pinned) for m in made],
            "reported_pinned": report["pinned_staging_bytes"], "chunks": staging.chunks,
            "largest_shard_bytes": largest, "bound": STAGING_BYTES,
            "within_tier": made[1].within_tier}


def checkpoints(stage: int) -> dict:
    """3 steps, save, load into a fresh engine of the other tier, 3 more, against one engine
    fed the same 6 batches: a disk-tier checkpoint is an ordinary one, and an ordinary one
    loads into the disk tier."""
    kind = "gpt2"
    straight = _engine(kind, stage, False)
    reference = _train(straight, kind, 3) + _train(straight, kind, 3, seed=1007)
    reference_weights = straight.full_state_dict()
    out: dict[str, object] = {"reference": reference}
    for first_tier, second_tier in (("disk", False), (False, "disk")):
        first = _engine(kind, stage, first_tier, _dir(f"ck{stage}b"))
        resumed = _train(first, kind, 3)
        path = ROOT / f"ck{stage}-{first_tier}"
        first.save_checkpoint(path)
        first.close()
        second = _engine(kind, stage, second_tier, _dir(f"ck{stage}c"))
        second.load_checkpoint(path)
        resumed += _train(second, kind, 3, seed=1007)
        weights = second.full_state_dict()
        out[f"{first_tier}->{second_tier}"] = resumed
        out[f"{first_tier}->{second_tier} weights"] = all(
            torch.equal(weights[k], reference_weights[k]) for k in weights)
        second.close()
    return out


def refusals() -> dict:
    """Directories a disk tier cannot use: refused on every rank, naming what is wrong."""
    out: dict[str, str] = {}
    rank = dist.get_rank()
    shared = _dir("shared")
    holder = _engine("mlp", 3, "disk", shared)
    try:
        _engine("mlp", 3, "disk", shared)
        out["shared"] = "no error"
    except ValueError as e:
        out["shared"] = str(e)
    holder.close()
    again = _engine("mlp", 3, "disk", shared)  # free once the holder closed
    again.close()
    # A killed process's leftovers: its lock is free, so they are removed, never read.
    stale = Path(shared, f"rank{rank}")
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "000001-u0.master.bin").write_bytes(b"\x7f" * 64)
    engine = _engine("mlp", 3, "disk", shared)
    out["stale_removed"] = str(not (stale / "000001-u0.master.bin").exists())
    engine.close()
    readonly = _dir(f"readonly{rank}")
    Path(readonly).mkdir(exist_ok=True)
    os.chmod(readonly, 0o500)
    try:
        if os.geteuid() == 0:  # root writes anyway: a file where the directory should be
            Path(readonly).rmdir()
            Path(readonly).write_text("not a directory")
        _engine("mlp", 3, "disk", readonly)
        out["unwritable"] = "no error"
    except ValueError as e:
        out["unwritable"] = str(e)
    try:
        model = make_model("mlp")
        for p in model.parameters():
            p.requires_grad_(p.dim() == 2)  # Muon takes matrices only
        zs.ZeroEngine(model, torch.optim.Muon([p for p in model.parameters() if p.dim() == 2]),
                      zero_config("mlp", 2, offload_optimizer="disk"))
        out["muon"] = "no error"
    except ValueError as e:
        out["muon"] = str(e)
    return out


def full_disk() -> dict:
    """Rank 0's offload_dir on a 64 KiB filesystem: both ranks refuse to build, naming the
    bytes needed and free. Then filesystems with room for the engine: filling what is left
    after the build changes nothing, since every block was reserved when it was built (and
    close() on a full disk gives the weights back in memory)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return {"skipped": "needs root to mount a small tmpfs"}
    rank = dist.get_rank()
    mount = Path(_dir(f"tmpfs{rank}"))
    mount.mkdir(parents=True, exist_ok=True)

    def mount_tmpfs(size: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                       check=True)

    out: dict[str, object] = {}
    mount_tmpfs("64k" if rank == 0 else "16m")
    try:
        try:
            _engine("gpt2", 3, "disk", str(mount))
            out["small"] = "no error"
        except DiskFullError as e:
            out["small"] = str(e)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    mount_tmpfs("16m")
    try:
        big = _engine("gpt2", 3, "disk", str(mount))
        with open(mount / "filler", "wb") as f:  # whatever space is left, taken
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        reference = _engine("gpt2", 3, "cpu")
        out["equal_when_full"] = _train(big, "gpt2", 3) == _train(reference, "gpt2", 3)
        module = big.close()
        expected = reference.full_state_dict()
        out["closed_equal"] = all(torch.equal(module.state_dict()[k], expected[k])
                                  for k in expected)
        del module, big  # their mappings keep the filesystem busy
        gc.collect()
    finally:
        # lazily if a mapping still holds it: detached now, gone with the last reference
        if subprocess.run(["umount", str(mount)], check=False).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    return out


class TracedSGD(torch.optim.Optimizer):
    """A user's elementwise optimizer (momentum under the name "trace") that cannot step a
    one-element tensor, as a class with a shape check might not: the disk tier's probe of
    its state fails, so the state's files are made when the first step creates it."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.numel() < 2:
                    raise ValueError("TracedSGD: one-element parameters are not supported")
                trace = self.state[p].setdefault("trace", torch.zeros_like(p))
                trace.mul_(0.9).add_(p.grad)
                p.add_(trace, alpha=-group["lr"])


def custom_optimizer() -> dict:
    losses = {}
    for tier in ("cpu", "disk"):
        model = make_model("gpt2")
        engine = zs.ZeroEngine(model, TracedSGD(model.parameters()), zero_config(
            "gpt2", 3, offload_optimizer=tier, offload_params=tier, elementwise_optimizer=True,
            offload_dir=_dir("custom") if tier == "disk" else None))
        losses[tier] = _train(engine, "gpt2", 3)
        if engine.tier is not None:
            held = [engine.tier.holds(t) for t in engine.optimizer.state_tensors() if t.dim()]
            losses[f"{tier}_in_files"] = bool(held) and all(held)
        engine.close()
    return losses


for _stage in (2, 3):
    register(f"parity_stage{_stage}", parity, stage=_stage)
    register(f"checkpoints_stage{_stage}", checkpoints, stage=_stage)
    register(f"delayed_stage{_stage}", delayed, stage=_stage)
register("parity_stage3_accumulate", parity, stage=3, micro=2)
register("parity_stage3_mapped", parity, stage=3, micro=2, mapped=True)
register("parity_stage3_bf16", parity, stage=3, kind="mlp", precision="bf16-mixed")
register("streaming_kept", streaming, keep=True)
register("streaming_unkept", streaming, keep=False)
# The NaN step and the last unclipped: the skip decided from the summaries' max-abs alone.
register("streaming_kept_fp16", streaming, keep=True, precision="16-mixed", clipped=(0, 1, 3))
register("parity_stage2_fp16", parity, stage=2, precision="16-mixed")
register("parity_stage3_fp16", parity, stage=3, kind="mlp", micro=2, precision="16-mixed")
register("refusals", refusals)
register("custom_optimizer", custom_optimizer)
register("full_disk", full_disk)
