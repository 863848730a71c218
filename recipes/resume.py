"""Fault tolerance for the recipe workers: a checkpoint every N optimizer steps, resumed after
torch.distributed.run restarts the workers (launch.py), and the fault the tests inject.

A restarted job ends with the weights of an uninterrupted one: the checkpoint holds the
engine's shards and optimizer state, the LR schedule, Lightning's loops and the data module's
position in the epoch, so the resumed run sees the same batches in the same order (the recipes
draw no random numbers while training: dropout is 0 and BERT masking is seeded per item).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """Lightning's own distributed shuffle (same seed, so the same order), which can skip
    what a resumed run already consumed of the epoch it resumes in."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.resume: tuple[int, int] | None = None
        """(epoch, samples of this rank to skip), used by the first iteration only."""

    def __iter__(self) -> Any:
        indices = list(super().__iter__())
        if self.resume is not None and self.resume[0] == self.epoch:
            indices = indices[self.resume[1]:]
        self.resume = None
        return iter(indices)


class PeriodicCheckpoint(L.Callback):
    """Every ``every`` optimizer steps, the job's whole state into ``path``, replaced as a
    whole: a worker killed while saving leaves the previous checkpoint loadable."""

    def __init__(self, path: Path, every: int, metrics: Any = None,
                 after_save: Callable[[L.Trainer, Path], None] | None = None) -> None:
        self.path, self.every, self.last = path, every, 0
        self.metrics = metrics
        """JobMetrics, told that the checkpoint's traffic is not training's (FSDP gathers
        the whole model to write it)."""
        self.after_save = after_save
        """Called on every rank once the checkpoint is complete (a Ray job reports it)."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every or step == self.last:
            return  # accumulating, or this step is saved already
        self.last = step
        trainer.datamodule.position = (trainer.current_epoch, batch_idx + 1)
        if self.metrics is not None:
            self.metrics.outside_training_start(trainer)
        save(trainer, self.path)
        if trainer.is_global_zero:
            copy_for_tests(self.path, step)
        trainer.strategy.barrier("recipes.resume.copied")
        if self.after_save is not None:
            self.after_save(trainer, self.path)
        if self.metrics is not None:
            self.metrics.outside_training_end(trainer)


def save(trainer: L.Trainer, path: Path) -> None:
    """ZeroStrategy writes a sharded directory whose ``latest`` is replaced atomically; other
    strategies write one file on rank 0 (DeepSpeed: a directory, every rank), renamed into
    place once complete."""
    from zero_strategy.lightning import ZeroStrategy

    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(trainer.strategy, ZeroStrategy):
        trainer.save_checkpoint(path, weights_only=False)
        return
    tmp = path.with_name(path.name + ".tmp")
    trainer.save_checkpoint(tmp, weights_only=False)  # rank 0 writes, then every rank waits
    trainer.strategy.barrier("recipes.resume.written")
    if trainer.is_global_zero:
        if tmp.is_dir():
            # A directory cannot replace a non-empty one: the old one steps aside first, and
            # last_checkpoint() falls back to it if a crash comes between the two renames.
            old = path.with_name(path.name + ".old")
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    trainer.strategy.barrier("recipes.resume.save")


def last_checkpoint(path: Path) -> Path | None:
    """``path`` if a complete checkpoint is there (a restart resumes from it), else None."""
    if path.is_dir():
        return path if _complete(path) else None
    if path.is_file():
        return path
    old = path.with_name(path.name + ".old")  # see save(): a directory being replaced
    return old if _complete(old) else None


def _complete(path: Path) -> bool:
    """A checkpoint directory that finished writing: ours and DeepSpeed's name their tag in
    ``latest`` last, DCP (FSDP's sharded state) writes ``.metadata`` last."""
    return (path / "latest").exists() or (path / ".metadata").exists()


def resume_source(value: str | None) -> Path | None:
    """``trainer.resume_from``: a job directory (its ``checkpoints/last.ckpt``) or a
    checkpoint directory or file of any strategy; None when unset. A path that is neither is
    refused naming the option."""
    if value is None or str(value) == "":
        return None
    path = Path(str(value)).expanduser()
    job = last_checkpoint(path / "checkpoints" / "last.ckpt") if path.is_dir() else None
    if job is not None:
        return job
    if path.is_file() or (path.is_dir() and any(
            (path / marker).exists() for marker in ("latest", "manifest.json", ".metadata"))):
        return path
    raise ValueError(
        f"trainer.resume_from={value!r}: neither a job directory with checkpoints/last.ckpt "
        "nor a checkpoint (a directory with 'latest', 'manifest.json' or DCP's '.metadata', "
        "or a checkpoint file)")


def copy_for_tests(path: Path, step: int) -> None:
    """Test seam: with ``$ZS_CHECKPOINT_COPY_AT`` equal to ``step``, the checkpoint just
    written is kept as ``<checkpoints>/at-step-<step>`` (the next save replaces last.ckpt)."""
    if os.environ.get("ZS_CHECKPOINT_COPY_AT") != str(step):
        return
    target = path.with_name(f"at-step-{step}")
    if path.is_dir():
        shutil.copytree(path, target, dirs_exist_ok=True)
    else:
        shutil.copy(path, target)


class InjectedFault(L.Callback):
    """Test seam (tests/quick/test_recipes.py): ``$ZS_FAULT_KILL_STEP`` and ``$ZS_FAULT_KILL_RANK``
    make that rank SIGKILL itself right after that optimizer step, in the first attempt only
    (``$TORCHELASTIC_RESTART_COUNT`` 0), as a lost node would. Not installed otherwise."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    @staticmethod
    def from_env() -> InjectedFault | None:
        step = os.environ.get("ZS_FAULT_KILL_STEP")
        if step is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        return InjectedFault(int(step), int(os.environ.get("ZS_FAULT_KILL_RANK", "1")))

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
