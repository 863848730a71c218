"""Lightning under Ray Train: every checkpoint ``ModelCheckpoint`` saves, reported to Ray.

``Trainer(strategy=ZeroStrategy(...), plugins=[RayLightningEnvironment()],
callbacks=[RayModelCheckpoint(...)])`` in a ``TorchTrainer`` training function. Each save of
``ModelCheckpoint`` (every option of it: ``every_n_train_steps``, ``monitor``,
``save_top_k``, ...) writes the sharded directory as under torchrun, then each worker reports
its own files of it (``report.report``), with ``trainer.callback_metrics``, the epoch and the
step as the metrics. The run's checkpoint is then that directory: ``trainer.fit(model,
ckpt_path=...)`` resumes from ``ray.train.get_checkpoint()``'s path at any worker count.

No ``prepare_trainer`` is needed: Ray's checks that its own strategy classes and
environment are used have their counterparts in ``setup`` below, and what Ray's strategies
override (the device, the sampler's replica count) ``ZeroStrategy`` does itself.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import ray.train
from lightning.pytorch.callbacks import ModelCheckpoint

from ..lightning import ZeroStrategy
from .report import Reported, report


def lightning_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """What Ray's own Lightning callback reports: the logged metrics, the epoch and step."""
    metrics: dict[str, Any] = {k: v.item() if hasattr(v, "item") else v
                               for k, v in trainer.callback_metrics.items()}
    metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
    return metrics


class RayModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose every save is reported to Ray Train, each worker uploading its
    own shard files (see the module docstring). Takes ``ModelCheckpoint``'s arguments."""

    last_reported: Reported | None = None
    """What this worker uploaded in the latest report."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, ZeroStrategy):
            raise TypeError(
                f"RayModelCheckpoint reports the sharded directories ZeroStrategy saves; the "
                f"Trainer's strategy is {type(trainer.strategy).__name__} (for Ray's own "
                "strategies use ray.train.lightning.RayTrainReportCallback)")
        workers = ray.train.get_context().get_world_size()
        if trainer.world_size != workers:
            raise RuntimeError(
                f"the Trainer counts {trainer.world_size} processes but Ray Train started "
                f"{workers} workers: pass plugins=[ray.train.lightning.RayLightningEnvironment()]"
                " to the Trainer, so that Lightning takes the ranks and world size from Ray")
        super().setup(trainer, pl_module, stage)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self.last_reported = report(lightning_metrics(trainer), filepath)
