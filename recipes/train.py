"""The recipes' entry point (Hydra). Each job runs as a real multi-process world.

    python recipes/train.py                                     # GPT small, ZeRO-3, 2 processes
    python recipes/train.py model=bert strategy=zero2 trainer.max_steps=200
    python recipes/train.py experiment=resnet_digits
    python recipes/train.py -m strategy=ddp,zero1,zero2,zero3   # sweep -> report.md/.csv/.png
    python recipes/train.py -m hparams_search=optuna            # learning-rate / batch search

The Hydra process composes and validates the config, then starts ``trainer.devices`` worker
processes for this job alone (torch.distributed.run) and waits for them; workers never see
Hydra's command line, so a multirun sweep runs every job exactly once.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from recipes import launch, schema

schema.register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the final validation loss (what hparams_search minimises)."""
    return launch.run_job(cfg)


if __name__ == "__main__":
    main()
