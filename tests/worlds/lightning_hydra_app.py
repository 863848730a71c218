"""A tiny Hydra app training with ``Trainer(strategy=..., devices=2)``, for
tests/quick/test_lightning.py and tests/integration/test_lightning_hydra.py.

Every process of every job writes one JSON record into ``out``; a ``-m`` sweep must produce
exactly one record per (job, rank), each with world size 2, and no process may run a job
twice. Lightning's own launcher re-runs the whole sweep in each child (its command line still
holds ``-m lr=a,b``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import hydra  # noqa: E402
import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import zero_strategy.lightning  # noqa: E402,F401  (registers the strategy names)


@dataclass
class AppConfig:
    lr: float = 0.1
    out: str = "???"
    steps: int = 2
    strategy: str = "zero2"


ConfigStore.instance().store(name="app", node=AppConfig)


class Tiny(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.layer = nn.Linear(8, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(version_base=None, config_name="app")
def main(cfg: AppConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8, generator=gen),
                                    torch.randn(16, 2, generator=gen)), batch_size=2)
    trainer = L.Trainer(strategy=cfg.strategy, accelerator="cpu", devices=2,
                        max_steps=cfg.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(cfg.lr), data)
    hydra_cfg = HydraConfig.get()
    record = {
        "lr": cfg.lr, "rank": trainer.global_rank, "world_size": trainer.world_size,
        "pid": os.getpid(), "job_dir": str(hydra_cfg.runtime.output_dir),
        "job_name": hydra_cfg.job.name, "mode": str(hydra_cfg.mode),
        "hydra_overrides": [str(o) for o in hydra_cfg.overrides.hydra],
        "argv": sys.argv[1:],
    }
    name = f"lr{cfg.lr}-rank{trainer.global_rank}-pid{os.getpid()}.json"
    Path(cfg.out, name).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
