"""A recipe job as a Ray Train job (``launcher=ray``): the Hydra process submits a
``TorchTrainer`` whose workers run ``worker.main`` on the job's resolved config, and writes
the job's ``metrics.json`` (the sweep report reads it as for torchrun's jobs).

``trainer.devices x trainer.num_nodes`` workers (one CPU each, or one GPU each with
``trainer.accelerator=gpu``), Ray's process group (gloo or nccl) with ``trainer.timeout_s``,
and ``FailureConfig(max_failures=trainer.max_restarts)``: a worker that dies makes Ray start
them all again, and they resume from the job's last checkpoint, which each worker reported to
Ray as its own files (``zero_strategy.ray.report``). With ``launcher.address`` unset the Hydra
process starts a local Ray once, for every job of a sweep, and it stops with the process.

The only module of the recipes importing Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import ray
import ray.train
from omegaconf import DictConfig
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayLightningEnvironment
from ray.train.torch import TorchConfig, TorchTrainer

CHECKOUT = Path(__file__).resolve().parents[1]
WORKER_ENV = ("ZS_JOB_T0", "ZS_LAUNCHER_ID", "OMP_NUM_THREADS", "HF_HUB_OFFLINE",
              "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED", "ZS_CHECKPOINT_COPY_AT")
"""What the workers of a torchrun job get from the Hydra process, handed to Ray's workers."""


class RayWorker:
    """What ``worker.main`` does differently in a Ray Train worker: ranks and world from
    Ray (``RayLightningEnvironment``, one device per worker), checkpoints reported to Ray
    and resumed from it, the job's measurements handed back through Ray."""

    def trainer_options(self, cfg: DictConfig) -> dict[str, Any]:
        """Ray's ranks and world; the devices per node as the config says (Lightning's own
        strategies, the anchors, index their device list by the local rank Ray reports)."""
        return {"plugins": [RayLightningEnvironment()], "devices": int(cfg.trainer.devices),
                "num_nodes": int(cfg.trainer.num_nodes)}

    def saved(self, trainer: L.Trainer, checkpoint: Path) -> None:
        """After each periodic checkpoint: its folder reported, each worker its own files."""
        from zero_strategy.ray import report

        report({"step": trainer.global_step}, checkpoint.parent)

    def resume_from(self, checkpoint: Path) -> Path | None:
        """The run's latest reported checkpoint (after a restart), as the worker saved it."""
        reported = ray.train.get_checkpoint()
        if reported is None:
            return None
        found = Path(reported.path) / checkpoint.name
        return found if found.exists() else None

    def finished(self, metrics_file: Path, rank: int) -> None:
        """Rank 0's record reported to Ray, for the Hydra process (a job directory on another
        node than the workers' is not where they write)."""
        record = json.loads(metrics_file.read_text()) if rank == 0 else {}
        ray.train.report({"record": json.dumps(record)} if record else {})


def _train(config: dict[str, Any]) -> None:
    """Ray Train's training function: a recipe worker."""
    os.environ.update(config["env"])
    from recipes import worker

    worker.main(config["config_file"], launcher=RayWorker())


def _start(launcher: DictConfig) -> None:
    """Connect to ``launcher.address``, or start a local Ray (once per process)."""
    if ray.is_initialized():
        return
    if launcher.address:
        ray.init(address=str(launcher.address))
        return
    # Ray's workers are children of the raylet started here: they inherit this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=launcher.num_cpus, include_dashboard=False,
             object_store_memory=int(launcher.object_store_mb) * 2**20,
             _temp_dir=str(launcher.temp_dir) if launcher.temp_dir else None)


def run(cfg: DictConfig, config_file: Path, env: dict[str, str], out: Path) -> int:
    """The job as a Ray Train job; its exit status (0: ``metrics.json`` is written)."""
    _start(cfg.launcher)
    gpu = str(cfg.trainer.accelerator) == "gpu"
    per_worker: dict[str, float] = {"CPU": float(cfg.launcher.cpus_per_worker)}
    if gpu:
        per_worker["GPU"] = 1.0
    # The job's own folder by default; in storage shared by several jobs, a name of its own.
    storage = cfg.launcher.storage_path or str(out / "ray")
    name = str(cfg.name) if not cfg.launcher.storage_path else (
        f"{cfg.name}-{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:10]}")
    trainer = TorchTrainer(
        _train,
        train_loop_config={"config_file": str(config_file),
                           "env": {k: env[k] for k in WORKER_ENV if k in env}},
        scaling_config=ScalingConfig(
            num_workers=int(cfg.trainer.devices) * int(cfg.trainer.num_nodes), use_gpu=gpu,
            resources_per_worker=per_worker),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo",
                                 timeout_s=int(cfg.trainer.timeout_s)),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(
                                 max_failures=int(cfg.trainer.max_restarts))))
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - the job failed: its cause, then the exit status
        print(f"[{cfg.name}] the Ray Train job failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    metrics_file = out / "metrics.json"
    record = (result.metrics or {}).get("record")
    if not metrics_file.exists() and record:
        metrics_file.write_text(json.dumps(json.loads(record), indent=1))
    return 0
