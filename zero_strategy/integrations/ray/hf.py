"""transformers' ``Trainer`` under Ray Train: each ``checkpoint-N/`` it saves, reported to Ray.

``ZeroTrainer(..., callbacks=[RayCheckpointCallback()])`` (or ``with_zero(SFTTrainer)``) in a
``TorchTrainer`` training function. After every save (``save_strategy``, ``save_steps``), each
worker reports its own files of the new ``checkpoint-N/`` (``report.report``): the merged
Ray checkpoint is that folder, whose ``zero_checkpoint/`` resumes on any worker count
(``trainer.train(resume_from_checkpoint=<its path>)``). The metrics are the Trainer's logs so
far, merged, as Ray's own callback reports them.

Ray's ``ray.train.huggingface.transformers.RayTrainReportCallback`` works with our Trainers
too, but every worker copies and uploads the whole folder (each file N times, the last
upload kept): this one uploads each file once, from its writer's rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .report import Reported, report


class RayCheckpointCallback(TrainerCallback):
    """Reports every checkpoint a Trainer saves to Ray Train, each worker its own files."""

    def __init__(self) -> None:
        self.last_reported: Reported | None = None
        """What this worker uploaded in the latest report."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder}: the Trainer reported a save at step {state.global_step} but wrote "
                "no such folder (a hyperparameter search's run folder is not supported)")
        metrics: dict[str, Any] = {}
        for entry in state.log_history:
            metrics.update(entry)
        self.last_reported = report(metrics, folder)
