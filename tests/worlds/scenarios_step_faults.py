"""Faults in the middle of a step, caught, then training on (issue 51): at N=1 and N=2
(tests/quick/test_step_faults.py), each compared with a reference engine built alike that
never ran the failed micro-batch, bit for bit.

A full disk under ``offload_activations="disk"`` (``tests.support.faults.disk_full``): the
step raises the tier's ``DiskFullError`` naming the folder, the module and the bytes; the
files and descriptors the step took are given back; the next steps train as the reference.
The one-rank fault runs last, in a group of its own with a short timeout (it leaves that
group's collectives unmatched).

Also: only rank 0's disk tier full (the ranks agree whether to recover or refuse), a
checkpoint's shard file cut short on rank 0 (``checkpoint_write_fault``), and a checkpoint
saved before the first step loaded after training.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.faults import (
    POINTS,
    InjectedFault,
    census,
    checkpoint_write_fault,
    disk_full,
    inject,
)
from tests.support.harness import register
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from zero_strategy.engine.step import PeerCutShort
from zero_strategy.offload.disk import DiskFullError

KIND = "mlp"


def _engine(stage: int, folder: str, group: Any = None, **extra: Any) -> zs.ZeroEngine:
    model = make_model(KIND)
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(
        KIND, stage, activation_checkpointing=True, offload_activations="disk",
        offload_dir=folder, **extra), process_group=group)


def _step(engine: zs.ZeroEngine, data: dict[str, torch.Tensor]) -> float:
    loss = loss_of(KIND, engine, data)
    engine.backward(loss)
    engine.clip_grad_norm_(1.0)
    engine.step()
    return loss.item()


def _failed_step(engine: zs.ZeroEngine, data: dict[str, torch.Tensor],
                 fail: bool) -> dict[str, Any]:
    """One step, its second activation write refused with ENOSPC where ``fail``."""
    out: dict[str, Any] = {"raised": None}
    try:
        with disk_full("pwrite", after=1 if fail else 10**9) as seen:
            _step(engine, data)
    except OSError as e:
        out.update(raised=type(e).__name__, errno=e.errno, message=str(e),
                   is_disk_full=isinstance(e, DiskFullError))
    finally:
        engine.zero_grad()
    out["refused"] = seen.refused
    return out


def _same_state(a: zs.ZeroEngine, b: zs.ZeroEngine) -> dict[str, bool]:
    wa, wb = a.full_state_dict(), b.full_state_dict()
    oa, ob = a.optimizer_state_dict()["state"], b.optimizer_state_dict()["state"]
    return {
        "weights": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
        "optimizer": oa.keys() == ob.keys() and all(
            torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k]))
            for i in oa for k in oa[i]),
    }


def activations_disk_full(stage: int) -> dict[str, Any]:
    """Every rank's disk fills in step 1; steps 2-3 must equal a reference without step 1."""
    rank = dist.get_rank()
    folder = tempfile.mkdtemp(prefix="zs-stepfault-")
    engine, ref = _engine(stage, folder), _engine(stage, tempfile.mkdtemp(prefix="zs-ref-"))
    gen = torch.Generator().manual_seed(7 + rank)
    data = [batch(KIND, gen) for _ in range(4)]
    _step(engine, data[0]), _step(ref, data[0])
    before = census(folder)
    out = _failed_step(engine, data[1], fail=True)
    out["census_before"], out["census_after"] = before, census(folder)
    out["losses"] = [_step(engine, d) for d in data[2:]]
    out["ref_losses"] = [_step(ref, d) for d in data[2:]]
    out["same"] = _same_state(engine, ref)
    out["census_end"] = census(folder)
    engine.close(), ref.close()
    out["left"] = os.listdir(folder)
    return out


def _tier_engine(stage: int, folder: str) -> zs.ZeroEngine:
    model = make_model(KIND)
    tiers = {"offload_optimizer": "disk", "offload_params": "disk" if stage == 3 else False}
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(
        KIND, stage, offload_dir=folder, **tiers))


def tier_disk_full(stage: int, share: float, one_rank: bool = False) -> dict[str, Any]:
    """The disk tier's write-backs (parameters, gradients, optimizer states) refused from the
    ``share`` point of a step on: a DiskFullError naming the folder and the tensors; then the
    engine goes on (the values were still in memory) or refuses to train until the checkpoint
    saved before the step is loaded. Either way the next steps equal the reference's: one
    that never ran the failed step, or, where the step went through and only a write-back
    after it failed (raised by ``settle_tier()``), one that ran it. ``one_rank``: only rank
    0's disk fills; the other ranks raise ``PeerCutShort`` where rank 0's error stops the step
    and refuse with it (the ranks agree), so every rank takes the same way on."""
    folder, checkpoints = tempfile.mkdtemp(prefix="zs-tierfault-"), _shared_folder()
    engine, ref = _tier_engine(stage, folder), _tier_engine(stage, tempfile.mkdtemp())
    gen = torch.Generator().manual_seed(3)
    warm, *data = [batch(KIND, gen) for _ in range(5)]
    _step(engine, warm), _step(ref, warm)  # the first step creates the optimizer states
    with disk_full("pwritev", after=10**9) as seen:  # how many write-backs a step makes
        _step(engine, data[0])
        engine.settle_tier()
    _step(ref, data[0])
    engine.save_checkpoint(checkpoints, tag="before")
    ref.settle_tier()  # none of the reference's write-backs in flight when the disk fills
    before = census(folder)
    fill = not one_rank or dist.get_rank() == 0
    out = _failed_step_tier(engine, data[1], after=int(share * seen.calls) if fill else 10**9)
    out["calls_in_a_step"] = seen.calls
    out["census_before"], out["census_after"] = before, census(folder)
    try:
        losses = [_step(engine, data[2])]
    except RuntimeError as e:
        out["refused"] = str(e)
        engine.load_checkpoint(checkpoints, tag="before")
        losses = [_step(engine, data[2])]
    losses.append(_step(engine, data[3]))
    if out["stepped"]:
        _step(ref, data[1])
    ref_losses = [_step(ref, d) for d in data[2:]]
    out.update(losses=losses, ref_losses=ref_losses, same=_same_state(engine, ref),
               census_end=census(folder))
    engine.close(), ref.close()
    out["left"] = os.listdir(folder)
    return out


def _failed_step_tier(engine: zs.ZeroEngine, data: dict[str, torch.Tensor],
                      after: int) -> dict[str, Any]:
    out: dict[str, Any] = {"raised": None, "refused": None, "stepped": False}
    try:
        with disk_full("pwritev", after=after):
            _step(engine, data)
            out["stepped"] = True
            engine.settle_tier()  # a write-back still in flight fails here, if not before
    except OSError as e:
        out.update(raised=type(e).__name__, errno=e.errno, message=str(e),
                   is_disk_full=isinstance(e, DiskFullError))
    except PeerCutShort as e:  # another rank's disk filled
        out.update(raised=type(e).__name__, message=str(e))
    engine.zero_grad()
    return out


OFFLOAD = {"none": {}, "cpu": {"offload_optimizer": "cpu"},
           "disk": {"offload_optimizer": "disk"}}


def point_fault(stage: int, point: str, offload: str = "none") -> dict[str, Any]:
    """``inject(point)`` in step 1 on every rank; the engine's error is the injected one; the
    files and descriptors are as before; then the next steps equal a reference that never ran
    step 1, directly or, where the engine refuses (a step cut short), after loading the
    checkpoint saved before it."""
    rank = dist.get_rank()
    folder, checkpoints = tempfile.mkdtemp(prefix="zs-pointfault-"), _shared_folder()
    tiers = OFFLOAD[offload] if stage else {}
    engine = _engine(stage, folder, **tiers)
    ref = _engine(stage, tempfile.mkdtemp(prefix="zs-ref-"), **tiers)
    gen = torch.Generator().manual_seed(21 + rank)
    warm, *data = [batch(KIND, gen) for _ in range(4)]
    _step(engine, warm), _step(ref, warm)
    engine.save_checkpoint(checkpoints, tag="before")
    engine.settle_tier()
    before = census(folder)
    out: dict[str, Any] = {"raised": None, "refused": None}
    try:
        with inject(engine, point) as seen:
            _step(engine, data[0])
    except InjectedFault as e:
        out["raised"] = str(e)
    out["calls"] = seen.calls
    engine.zero_grad()
    engine.settle_tier()
    out["census_before"], out["census_after"] = before, census(folder)
    _train_on(engine, ref, data[1:], checkpoints, out)
    engine.close(), ref.close()
    out["left"] = os.listdir(folder)
    return out


def _train_on(engine: zs.ZeroEngine, ref: zs.ZeroEngine, data: list[Any], checkpoints: str,
              out: dict[str, Any]) -> None:
    """After the fault: two steps, loading the checkpoint "before" first where the engine
    refuses (``out["refused"]``), beside the reference's same two steps."""
    try:
        losses = [_step(engine, data[0])]
    except RuntimeError as e:
        out["refused"] = str(e)
        engine.load_checkpoint(checkpoints, tag="before")
        losses = [_step(engine, data[0])]
    losses.append(_step(engine, data[1]))
    out.update(losses=losses, ref_losses=[_step(ref, d) for d in data],
               same=_same_state(engine, ref))


def _shared_folder() -> str:
    """One folder for every rank (rank 0's), for a checkpoint."""
    made = [tempfile.mkdtemp(prefix="zs-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return str(made[0])


def one_rank_disk_full() -> dict[str, Any]:
    """Only rank 0's disk fills: rank 0 raises the DiskFullError, rank 1, waiting for its
    reductions, a timeout that names rank 0 and its error, within the bound; never a hang."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    folder = tempfile.mkdtemp(prefix="zs-stepfault-")
    engine = _engine(2, folder, group=group, timeout=2.0)
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    _step(engine, batch(KIND, gen))
    out: dict[str, Any] = {"raised": None}
    try:
        with disk_full("pwrite", after=1 if dist.get_rank() == 0 else 10**9):
            _step(engine, batch(KIND, gen))
    except Exception as e:  # noqa: BLE001 - which error, and its words, is the result
        out.update(raised=type(e).__name__, message=str(e))
    return out


def _gpt2() -> torch.nn.Module:
    """Layer inputs of 32 KiB a sequence: a batch of 1 fits a 4 MiB disk, one of 64 not."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=96, n_positions=128, n_embd=64, n_layer=3, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def real_tmpfs(folder: str) -> dict[str, Any]:
    """The issue's report on a real 4 MiB tmpfs: two steps at batch 1, one at 64 that fills
    it, then three at batch 1 beside a reference (states on the host) that skipped it."""
    def build(where: str) -> zs.ZeroEngine:
        model = _gpt2()
        return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                             zs.ZeroConfig(stage=2, offload_optimizer="cpu",
                                           activation_checkpointing=True,
                                           offload_activations="disk", offload_dir=where))

    def step(engine: zs.ZeroEngine, ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    engine, ref = build(folder), build(tempfile.mkdtemp(prefix="zs-ref-"))
    gen = torch.Generator().manual_seed(0)
    ones = [torch.randint(0, 96, (1, 128), generator=gen) for _ in range(5)]
    big = torch.randint(0, 96, (64, 128), generator=gen)
    for ids in ones[:2]:
        step(engine, ids), step(ref, ids)
    before = {**census(folder), "used": _used(folder)}
    out: dict[str, Any] = {"raised": None}
    try:
        step(engine, big)
    except OSError as e:
        out.update(raised=type(e).__name__, errno=e.errno, message=str(e))
    engine.zero_grad()
    out["before"], out["after"] = before, {**census(folder), "used": _used(folder)}
    out["losses"] = [step(engine, ids) for ids in ones[2:]]
    out["ref_losses"] = [step(ref, ids) for ids in ones[2:]]
    out["same"] = _same_state(engine, ref)
    engine.close(), ref.close()
    out["left"] = os.listdir(folder)
    return out


def _used(folder: str) -> int:
    stat = os.statvfs(folder)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def one_rank_point(stage: int, point: str) -> dict[str, Any]:
    """``inject(point)`` on rank 0 only: rank 0 raises the injected error, rank 1, waiting
    in a collective rank 0 will not issue, a timeout naming rank 0 and its error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    engine = _engine(stage, tempfile.mkdtemp(prefix="zs-stepfault-"), group=group, timeout=2.0)
    gen = torch.Generator().manual_seed(13 + dist.get_rank())
    _step(engine, batch(KIND, gen))
    out: dict[str, Any] = {"raised": None}
    try:
        with inject(engine, point, fire=dist.get_rank() == 0):
            _step(engine, batch(KIND, gen))
        # the step's gathers of the new weights may be waited for by the next forward only
        _step(engine, batch(KIND, gen))
    except Exception as e:  # noqa: BLE001 - which error, and its words, is the result
        out.update(raised=type(e).__name__, message=str(e))
    return out


def mixed_cut_disk(stage: int, first: str | None) -> dict[str, Any]:
    """Disk tier, N=2: rank 1's optimizer step raises before any update (its pre-hook); rank
    0's raises after its update (``first="optimizer_step_after"``) or goes through
    (``None``). Alone, rank 1 could zero_grad and go on while rank 0's shards moved on; the
    ranks agree instead (``_agree_after_update``: shards no longer one step's leave every
    rank refusing), and after the reload both train on as a reference that skipped the
    step."""
    rank = dist.get_rank()
    folder, checkpoints = tempfile.mkdtemp(prefix="zs-mixedcut-"), _shared_folder()
    engine = _engine(stage, folder, offload_optimizer="disk")
    ref = _engine(stage, tempfile.mkdtemp(prefix="zs-ref-"), offload_optimizer="disk")
    gen = torch.Generator().manual_seed(31 + rank)
    warm, *data = [batch(KIND, gen) for _ in range(4)]
    _step(engine, warm), _step(ref, warm)
    engine.save_checkpoint(checkpoints, tag="before")
    out: dict[str, Any] = {"raised": None, "refused": None}
    point = (first or "optimizer_step_after") if rank == 0 else "optimizer_step"
    try:
        with inject(engine, point, fire=rank == 1 or first is not None):
            _step(engine, data[0])
    except (InjectedFault, PeerCutShort) as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    engine.zero_grad()
    _train_on(engine, ref, data[1:], checkpoints, out)
    engine.close(), ref.close()
    return out


def _plain(stage: int) -> zs.ZeroEngine:
    model = make_model(KIND)
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(KIND, stage))


def checkpoint_write(stage: int) -> dict[str, Any]:
    """Rank 0's shard file is cut short while tag "b" is written (``checkpoint_write_fault``):
    every rank raises the save's ``CheckpointError`` naming rank 0; "a" (the previous
    checkpoint) is still ``latest`` and holds the same tensors; "b" is not there to load, and
    no temporary file is left; training then goes on bit for bit as a reference that never
    tried the save, and the next save of "b" holds the engine's weights."""
    folder = _shared_folder()
    engine, ref = _plain(stage), _plain(stage)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    data = [batch(KIND, gen) for _ in range(4)]
    _step(engine, data[0]), _step(ref, data[0])
    engine.save_checkpoint(folder, tag="a")
    before = zs.consolidate(folder, tag="a")
    _step(engine, data[1]), _step(ref, data[1])
    out: dict[str, Any] = {"raised": None}
    with checkpoint_write_fault(fire=dist.get_rank() == 0) as seen:
        try:
            engine.save_checkpoint(folder, tag="b")
        except zs.CheckpointError as e:
            out["raised"] = str(e)
    out["calls"], out["refused"] = seen.calls, seen.refused
    dist.barrier()  # every rank's save is over before rank 0's look at the folder
    after = zs.consolidate(folder, tag="a")
    out["entries"] = sorted(os.listdir(folder))
    out["latest"] = open(os.path.join(folder, "latest")).read()
    out["a_intact"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)
    try:
        zs.consolidate(folder, tag="b")
        out["b_refused"] = None
    except (zs.CheckpointError, FileNotFoundError) as e:
        out["b_refused"] = f"{type(e).__name__}: {e}"
    out["losses"] = [_step(engine, d) for d in data[2:]]
    out["ref_losses"] = [_step(ref, d) for d in data[2:]]
    out["same"] = _same_state(engine, ref)
    engine.save_checkpoint(folder, tag="b")
    saved, now = zs.consolidate(folder, tag="b"), engine.full_state_dict()
    out["b_saved"] = all(torch.equal(saved[k], now[k]) for k in now)
    engine.close(), ref.close()
    return out


def reload_before_first_step(stage: int) -> dict[str, Any]:
    """A checkpoint saved before the first step (what a batch-size finder saves, and loads
    after its trials) holds no optimizer state: loading it drops the trained one, so the
    next steps are a new engine's (before, Adam's moments of the trials stayed)."""
    folder = _shared_folder()
    engine, fresh = _plain(stage), _plain(stage)
    engine.save_checkpoint(folder, tag="start")
    gen = torch.Generator().manual_seed(9 + dist.get_rank())
    data = [batch(KIND, gen) for _ in range(4)]
    for d in data[:2]:
        _step(engine, d)
    engine.load_checkpoint(folder, tag="start")
    out = {"losses": [_step(engine, d) for d in data[2:]],
           "ref_losses": [_step(fresh, d) for d in data[2:]], "same": _same_state(engine, fresh)}
    engine.close(), fresh.close()
    return out


QUICK = os.environ.get("ZS_STEP_FAULTS", "quick") == "quick"
"""tests/quick runs the cases below marked quick; tests/integration (ZS_STEP_FAULTS=all)
all of them."""
SIZE = int(os.environ.get("WORLD_SIZE", "1"))
NONE = os.environ.get("ZS_STEP_FAULTS") == "none"


def _wanted(quick: bool) -> bool:
    return not NONE and (quick or not QUICK)


for _stage in (2, 3):
    if _wanted(SIZE == 1 or _stage == 2):
        register(f"activations_disk_full_s{_stage}", activations_disk_full, stage=_stage)
if SIZE == 1:
    for _stage in (2, 3):
        for _share in (0.0, 0.5, 0.9):
            if _wanted(_stage == 2 or _share == 0.9):
                register(f"tier_disk_full_s{_stage}_{int(_share * 100)}", tier_disk_full,
                         stage=_stage, share=_share)
if SIZE > 1 and not NONE:
    # Only rank 0's disk fills, in the write-backs before the update (stage 2 from the start:
    # every rank raises, all recover), in the optimizer step (stage 3 half-way: rank 0's step
    # is cut short, rank 1's went through, both refuse until the reload) or after it (stage
    # 2 half-way: rank 0's settle_tier() raises, nothing to agree on). Stage 3 from the
    # start fails in backward: rank 1's reduction times out naming rank 0 (as above).
    register("tier_disk_full_one_rank_s2_0", tier_disk_full, stage=2, share=0.0,
             one_rank=True)
    register("tier_disk_full_one_rank_s3_50", tier_disk_full, stage=3, share=0.5,
             one_rank=True)
    if not QUICK:
        register("tier_disk_full_one_rank_s2_50", tier_disk_full, stage=2, share=0.5,
                 one_rank=True)
for _stage in range(4):
    for _point in POINTS:
        if _wanted(_point == "optimizer_step_after" or (_stage == 3 and SIZE == 1)):
            register(f"point_{_point}_s{_stage}", point_fault, stage=_stage, point=_point)
for _offload in ("cpu", "disk"):
    for _point in ("backward", "optimizer_step", "optimizer_step_after"):
        if _wanted(SIZE == 1):
            register(f"point_{_point}_s3_{_offload}", point_fault, stage=3, point=_point,
                     offload=_offload)
for _stage in (1, 3):
    if _wanted(_stage == 3):
        register(f"checkpoint_write_s{_stage}", checkpoint_write, stage=_stage)
        register(f"reload_before_first_step_s{_stage}", reload_before_first_step,
                 stage=_stage)
if os.environ.get("ZS_TMPFS"):
    register("real_tmpfs", real_tmpfs, folder=os.environ["ZS_TMPFS"])
if SIZE > 1 and not NONE:
    register("mixed_cut_disk_s2", mixed_cut_disk, stage=2, first="optimizer_step_after")
    register("mixed_stepped_disk_s2", mixed_cut_disk, stage=2, first=None)
if SIZE > 1 and not NONE:  # last: each leaves a group of its own with collectives unmatched
    register("one_rank_disk_full", one_rank_disk_full)
    if not QUICK:
        register("one_rank_forward_s3", one_rank_point, stage=3, point="forward")
        register("one_rank_optimizer_step_after_s2", one_rank_point, stage=2,
                 point="optimizer_step_after")
