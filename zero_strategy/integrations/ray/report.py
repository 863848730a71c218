"""A checkpoint folder reported to Ray Train by every worker, each uploading its own files.

Ray merges the folders its workers report into one directory of the run's storage; a file
two workers both upload is written twice and the last one wins. A checkpoint of ours is a
folder of per-rank files (``checkpoint/write.py``): shard ``k`` of every tag directory is
written by rank ``k``, the manifest, module and client state by rank 0. So each worker uploads
what its rank wrote (``owned_files``), and rank 0 also everything else in the folder (the
``latest`` file, a framework's own files beside our tags: Lightning's, a Trainer's
``trainer_state.json``): every file once, from its writer, and the merged directory is the
checkpoint. A worker's upload is its shard: about 1/N of the model states.

The uploaded files are hard links to the saved ones (made in a staging folder beside the
checkpoint, so on its file system; a copy where linking is refused), removed once Ray has
uploaded them, so reporting reads no tensor and holds nothing in memory. The folder must be
complete on the workers that report its files: a checkpoint the ranks wrote together into a
folder every rank sees (one node's disk, or storage shared by the nodes), as a save of ours
needs under any launcher.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train

from ...checkpoint.write import MANIFEST, shard_of
from ...comm import groups
from ...engine import ZeroEngine

RUN_FOLDER_PREFIX = "zero_strategy-ray"
"""Names the folder ``save_and_report`` saves into by default, under the system temp dir."""


@dataclass(frozen=True)
class Reported:
    """What one worker uploaded in a report: the files (relative to the folder) and bytes."""

    files: tuple[str, ...]
    bytes: int


def owned_files(folder: str | os.PathLike, rank: int) -> list[Path]:
    """The files of checkpoint ``folder`` that worker ``rank`` uploads, relative to it: shard
    ``k`` of each tag directory (a directory holding our manifest) for rank ``k``, every other
    file for rank 0. A symbolic link is refused: what it points to may lie outside the folder,
    or be uploaded twice."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint folder to report")
    owned = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path}: a symbolic link in the checkpoint folder {root}; a "
                             "reported checkpoint holds regular files only")
        if not path.is_file():
            continue
        shard = shard_of(path.name) if (path.parent / MANIFEST).is_file() else None
        if (shard if shard is not None else 0) == rank:
            owned.append(path.relative_to(root))
    return owned


def _stage(root: Path, files: list[Path]) -> Path:
    """A folder beside ``root`` holding ``files`` as hard links (same file system)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.ray-", dir=root.parent))
    try:
        for rel in files:
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(root / rel, target)
            except OSError:  # a file system without hard links: a copy, by the kernel
                shutil.copyfile(root / rel, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def report(metrics: dict[str, Any], folder: str | os.PathLike | None = None,
           **options: Any) -> Reported:
    """``ray.train.report(metrics, checkpoint=...)`` on this worker, the checkpoint being this
    worker's own files of ``folder`` (see ``owned_files``); every worker calls it, as
    ``ray.train.report`` requires. Without ``folder``, metrics alone. ``options`` go to
    ``ray.train.report`` (``checkpoint_dir_name``, ``checkpoint_upload_mode``, ...); the staged
    links are deleted once uploaded. Returns what this worker uploaded."""
    for owned in ("checkpoint", "delete_local_checkpoint_after_upload"):
        if owned in options:
            raise TypeError(f"zero_strategy.ray.report sets ray.train.report's {owned}= itself "
                            "(from the folder); pass the folder instead")
    if folder is None:
        ray.train.report(metrics, **options)
        return Reported((), 0)
    root = Path(folder)
    # Files of the folder another rank writes (a Trainer's rng_state_1.pth, uploaded by rank
    # 0) are complete once every rank is here: each wrote its part before reporting.
    groups.world_barrier()
    files = owned_files(root, ray.train.get_context().get_world_rank())
    staging = _stage(root, files) if files else None
    checkpoint = ray.train.Checkpoint.from_directory(str(staging)) if staging else None
    try:
        ray.train.report(metrics, checkpoint=checkpoint,
                         delete_local_checkpoint_after_upload=True, **options)
    finally:
        if staging is not None and staging.exists():  # a failed report keeps nothing either
            shutil.rmtree(staging, ignore_errors=True)
    size = sum((root / rel).stat().st_size for rel in files)
    return Reported(tuple(str(rel) for rel in files), size)


def run_folder() -> Path:
    """``save_and_report``'s default folder: under the system temp dir, named after the Ray
    job and run, the same on every worker of a node and different for every run."""
    context = ray.train.get_context()
    job = ray.get_runtime_context().get_job_id()
    return Path(tempfile.gettempdir()) / (
        f"{RUN_FOLDER_PREFIX}-job{job}-{context.get_experiment_name()}")


def save_and_report(engine: ZeroEngine, metrics: dict[str, Any], *,
                    client_state: dict[str, Any] | None = None,
                    directory: str | os.PathLike | None = None, **options: Any) -> Reported:
    """``engine.save_checkpoint`` into a new folder, reported (``report``), then removed: Ray
    keeps the checkpoint in the run's storage. Every worker calls it. ``directory`` (default
    ``run_folder()``) must be one every rank sees: on several nodes, storage they share.
    ``ray.train.get_checkpoint()`` then opens a directory ``engine.load_checkpoint`` (or
    ``restore``) reads at any worker count."""
    parent = Path(directory) if directory is not None else run_folder()
    folder = parent / f"step-{engine.global_step:08d}"
    saved = engine.save_checkpoint(folder, client_state=client_state)
    try:
        return report(metrics, saved, **options)
    finally:
        engine.comm.barrier()  # every worker's upload is done before its files go
        if engine.comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def restore(engine: ZeroEngine, *, load_optimizer: bool = True) -> dict[str, Any] | None:
    """Load the run's latest reported checkpoint (``ray.train.get_checkpoint()``) into
    ``engine``; returns its client state, or None when the run has no checkpoint yet (its first
    attempt). A checkpoint saved at another worker count or stage loads as well."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as path:
        client = engine.load_checkpoint(path, load_optimizer=load_optimizer)
    return client if client is not None else {}
