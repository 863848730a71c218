"""Lightning's batch-size finder over a model that runs out of memory above a batch size
(issue 51 part 3), for tests/integration/test_batch_size_finders.py.

Run as ``python tests/worlds/lightning_batch_size.py all OUT_DIR`` (two processes: Lightning
starts rank 1). The model raises what Lightning takes for an out-of-memory error on the CPU
(``is_out_of_cpu_memory``: a ``RuntimeError`` whose one argument holds "DefaultCPUAllocator:
can't allocate memory") from its forward, or from its backward, when a rank's batch holds more
than ``LIMIT`` samples (``tests.support.faults.HungryMLP``); the threshold is deterministic,
so both ranks fail at the same size.

``BatchSizeFinder`` refuses every distributed strategy, DDP's included (Lightning cannot know
that the ranks agree on a failure); ``AgreeingFinder`` drops that one check, as a user whose
ranks fail alike would, and is used for DDP and ZeRO the same. mode="power" from 2: 2, 4 and 8
train, 16 fails, 8 is kept; the fit then trains on from the restored weights at 8 per rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import BatchSizeFinder, Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.tuner import batch_size_scaling as scaling  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.support.faults import HungryMLP  # noqa: E402
from zero_strategy.lightning import ZeroStrategy  # noqa: E402

STEPS = 6  # optimizer steps trained after the search
TIMEOUT = timedelta(seconds=60)


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Hungry(L.LightningModule):
    """``HungryMLP`` (out of memory above LIMIT rows, in ``where``) and its data."""

    def __init__(self, where: str, batch_size: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.batch_size = HungryMLP(where), batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(512, 16, generator=gen), 10 * torch.randn(512, 5, generator=gen)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class AgreeingFinder(BatchSizeFinder):
    """``BatchSizeFinder`` without its refusal of distributed strategies (module docstring),
    and with one name for the checkpoint it saves before the search and restores after it:
    each rank draws its own ``uuid4()``, so under DDP (rank 0 writes) rank 1 finds none."""

    def scale_batch_size(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        name = trainer.strategy.broadcast(uuid.uuid4())
        real = scaling.uuid
        scaling.uuid = SimpleNamespace(uuid4=lambda: name)  # type: ignore[assignment]
        try:
            super().scale_batch_size(trainer, pl_module)
        finally:
            scaling.uuid = real

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule,
              stage: str | None = None) -> None:
        distributed = type(trainer._accelerator_connector).is_distributed
        type(trainer._accelerator_connector).is_distributed = property(lambda _: False)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            type(trainer._accelerator_connector).is_distributed = distributed


class Losses(Callback):
    def __init__(self) -> None:
        self.loss: list[float] = []
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss.append(float(outputs["loss"]))
        self.rows.append(int(batch[0].shape[0]))


def run(strategy: Any, where: str) -> dict[str, Any]:
    model, losses = Hungry(where), Losses()
    finder = AgreeingFinder(mode="power", steps_per_trial=2, init_val=2)
    t = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                  gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, callbacks=[finder, losses],
                  default_root_dir=os.environ["ZS_BSF_ROOT"])
    t.fit(model)
    engine = getattr(t.strategy, "engine", None)
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    leftovers = sorted(p.name for p in Path(t.default_root_dir).iterdir()
                       if p.name.startswith(".scale_batch_size"))
    return {"found": finder.optimal_batch_size, "batch_size": model.batch_size,
            "loss": losses.loss, "rows": losses.rows, "leftovers": leftovers,
            "weights": {k: v.detach().float().flatten().tolist() for k, v in state.items()}}


SCENARIOS = {
    "ddp_forward": lambda: run(DDPStrategy(timeout=TIMEOUT), "forward"),
    "zero3_forward": lambda: run(ZeroStrategy(stage=3, timeout=TIMEOUT), "forward"),
    "zero3_backward": lambda: run(ZeroStrategy(stage=3, timeout=TIMEOUT), "backward"),
    "zero2_backward": lambda: run(ZeroStrategy(stage=2, timeout=TIMEOUT), "backward"),
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[2])
    root = out / "root"
    root.mkdir(exist_ok=True)
    os.environ["ZS_BSF_ROOT"] = str(root)
    data: dict[str, Any] = {}
    wanted = sys.argv[1].split(",") if sys.argv[1] != "all" else list(SCENARIOS)
    for name in wanted:
        fn = SCENARIOS[name]
        try:
            data[name] = fn()
        except Exception:  # recorded per scenario; its test reports the traceback
            data[name] = {"error": traceback.format_exc()}
        (out / f"rank{rank()}.json").write_text(json.dumps(data))
