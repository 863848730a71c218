"""One process of a recipe job (started by launch.py under torch.distributed.run).

Builds the data, the model and the Lightning Trainer from the job's resolved config and
trains, checkpointing every ``trainer.checkpoint_every`` steps; a worker restarted after a
failure resumes from the last checkpoint (resume.py). The final model is validated (once more
after fit when the last periodic validation came before the last step). Rank 0 writes the
job's measurements to ``metrics.json`` beside the config (with several nodes, also each node's
local rank 0 whose node does not see rank 0's job directory: nodes.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf

from recipes.comm_count import COUNTER
from recipes.console import StepProgressBar, quiet_console
from recipes.lifetime import (
    die_with_parent,
    end_at_once_on_sigterm,
    leave_preemption_to_the_launcher,
)
from recipes.metrics import JobMetrics
from recipes.models import RecipeData, RecipeModule
from recipes.nodes import NodeAgreement
from recipes.resume import InjectedFault, PeriodicCheckpoint, last_checkpoint, resume_source


class EndAtOnceOnSigterm(L.Callback):
    """Lightning registers its SIGTERM handler after ``on_fit_start``; the first hooks after
    it put the default action back (``lifetime.end_at_once_on_sigterm``)."""

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end_at_once_on_sigterm()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end_at_once_on_sigterm()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end_at_once_on_sigterm()


def make_strategy(cfg: Any, module: RecipeModule) -> Any:
    impl = str(cfg.strategy.impl)
    if impl == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if impl in ("fsdp", "deepspeed"):
        from recipes.anchors import make_anchor_strategy

        return make_anchor_strategy(cfg, module)
    from recipes.schema import zero_options
    from zero_strategy.lightning import ZeroStrategy

    return ZeroStrategy(stage=cfg.strategy.stage, **zero_options(cfg.strategy.zero))


def process_started() -> float:
    """When this process was created (epoch seconds), from the kernel's records."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _callbacks(cfg: Any, metrics: JobMetrics, nodes: NodeAgreement | None,
               checkpoint: Path, launcher: Any) -> list[L.Callback]:
    callbacks: list[L.Callback] = [EndAtOnceOnSigterm(), metrics]
    if nodes is not None:
        callbacks.insert(0, nodes)  # its checks come before anything is written
    if int(cfg.trainer.checkpoint_every) > 0:
        callbacks.append(PeriodicCheckpoint(checkpoint, int(cfg.trainer.checkpoint_every),
                                            metrics, launcher.saved if launcher else None))
    fault = InjectedFault.from_env()  # tests only
    if fault is not None:
        callbacks.append(fault)
    if cfg.trainer.progress_bar:
        callbacks.append(StepProgressBar(leave=True))
    return callbacks


def _trainer(cfg: Any, module: RecipeModule, processes: dict[str, Any], callbacks: list[Any],
             job: Path) -> L.Trainer:
    """The job's Trainer: every option from the composed config, checkpoints and metrics
    by the recipes' own callbacks."""
    return L.Trainer(
        accelerator=cfg.trainer.accelerator, **processes,
        strategy=make_strategy(cfg, module), precision=cfg.precision.name,
        max_steps=int(cfg.trainer.max_steps),
        accumulate_grad_batches=int(cfg.trainer.accumulate_grad_batches),
        gradient_clip_val=float(cfg.trainer.gradient_clip_val),
        val_check_interval=int(cfg.trainer.val_check_interval), check_val_every_n_epoch=None,
        limit_val_batches=int(cfg.trainer.limit_val_batches),
        log_every_n_steps=int(cfg.trainer.log_every_n_steps),
        enable_progress_bar=bool(cfg.trainer.progress_bar), enable_checkpointing=False,
        enable_model_summary=True, logger=False, callbacks=callbacks,
        default_root_dir=str(job),
    )


def main(config_file: str, launcher: Any = None) -> None:
    """One worker of the job. ``launcher``: the hooks of a Ray Train worker
    (``recipes/ray_job.RayWorker``) when Ray started this one; torchrun's otherwise."""
    entered = time.time()
    if launcher is None:  # Ray keeps its workers' lives itself (and runs this off the main thread)
        # A worker whose agent is gone (killed outright) has nobody to wait for or restart it.
        die_with_parent(signal.SIGKILL)
        leave_preemption_to_the_launcher()
    quiet_console()
    COUNTER.install()  # before any strategy holds a reference to a collective
    cfg = OmegaConf.load(config_file)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    data = RecipeData(OmegaConf.to_container(cfg.data), OmegaConf.to_container(cfg.model))
    module = RecipeModule(OmegaConf.to_container(cfg.model), OmegaConf.to_container(cfg.optim),
                          vocab_size=int(cfg.data.vocab_size),
                          max_steps=int(cfg.trainer.max_steps))
    job = Path(config_file).parent
    metrics = JobMetrics(cfg, job / "metrics.json")
    t0 = float(os.environ.get("ZS_JOB_T0", "nan"))
    # From the process's creation to main() are its imports (none when forked preloaded).
    metrics.startup.update(worker_process=process_started() - t0, worker_main=entered - t0,
                           model_built=time.time() - t0)
    nodes = NodeAgreement(cfg, job) if int(cfg.trainer.num_nodes) > 1 else None
    checkpoint = job / "checkpoints" / "last.ckpt"
    callbacks = _callbacks(cfg, metrics, nodes, checkpoint, launcher)
    # Lightning cannot see that the data module restores the epoch's position (resume.py).
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended")
    processes = launcher.trainer_options(cfg) if launcher else {
        "devices": int(cfg.trainer.devices), "num_nodes": int(cfg.trainer.num_nodes)}
    trainer = _trainer(cfg, module, processes, callbacks, job)
    start = ((launcher.resume_from(checkpoint) if launcher else None)
             or last_checkpoint(checkpoint) or resume_source(cfg.trainer.get("resume_from")))
    trainer.fit(module, datamodule=data, ckpt_path=start)
    if metrics.needs_final_validation(trainer):
        # The val loss reported (and minimised by hparams_search) is the final model's, also
        # when max_steps is not a multiple of val_check_interval (or below it: none ran).
        trainer.validate(module, datamodule=data, verbose=False)
    metrics.finish(trainer, module,
                   copy_here=nodes is not None and nodes.writes_metrics_copy(trainer))
    if launcher is not None:  # Ray ends its workers' process group itself
        launcher.finished(metrics.out, trainer.global_rank)
        return
    # Shut the group down while every rank is alive: left to interpreter exit, gloo's threads
    # can be torn down mid-flight and abort the process after a successful run.
    from zero_strategy.comm.groups import destroy_default_group

    torch.distributed.barrier()
    destroy_default_group()


if __name__ == "__main__":
    main(sys.argv[1])
