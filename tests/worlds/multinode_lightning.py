"""``Trainer(strategy=ZeroStrategy(stage=3), num_nodes=2, devices=2)`` as a user's script, for
tests/integration/test_multinode.py: started on each "node" by Lightning's own launcher
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` set, ``python tests/worlds/multinode_lightning.py
OUT``; Lightning starts the node's second process itself), or as well under torchrun (``--nnodes
2``); and by tests/integration/test_slurm.py under ``srun --ntasks-per-node=2`` (Lightning's
SLURMEnvironment), ``OUT zero3 1`` beside ``OUT ddp 1``.

The data is the engine test's global batches (tests/worlds/multinode_engine.py), one step each, rank
r's quarter handed to rank r, so the test compares with the same single-process reference. Each rank
writes ``rank<N>.json`` (its ranks as Lightning sees them, losses, gradient norms) and rank 0
``weights.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from tests.support.models import STAGE3, loss_of, make_model, make_optimizer  # noqa: E402
from tests.worlds.multinode_engine import CLIP, STEPS, global_batches, my_part  # noqa: E402
from zero_strategy.comm.groups import group_timeout  # noqa: E402
from zero_strategy.lightning import ZeroStrategy  # noqa: E402


class RankBatches(Dataset):
    """Step s's quarter of the global batch for this rank, as one pre-batched item."""

    def __init__(self, rank: int, world: int) -> None:
        self.items = [my_part(data, rank) for data in global_batches(world)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model("mlp")
        self.losses: list[float] = []
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        loss = loss_of("mlp", self, batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(self.trainer.strategy, ZeroStrategy):
            self.norms.append(self.trainer.strategy.engine.get_global_grad_norm().item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer("sgd", self.model)

    def train_dataloader(self) -> DataLoader:
        # One pre-batched item per step, picked by this rank: no sampler splits it further.
        data = RankBatches(self.global_rank, self.trainer.world_size)
        return DataLoader(data, batch_size=None, shuffle=False)


def main(out: Path, strategy_name: str = "zero3", num_nodes: int = 2) -> None:
    torch.set_num_threads(1)
    module = Module()
    # "zero3" with units small enough that this 4k-parameter MLP is really sharded
    strategy: Any = ZeroStrategy(stage=3, **STAGE3["mlp"]) if strategy_name == "zero3" \
        else DDPStrategy()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=num_nodes,
                        max_steps=STEPS, gradient_clip_val=CLIP, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    record = {"rank": trainer.global_rank, "node_rank": trainer.node_rank,
              "local_rank": trainer.local_rank, "world_size": trainer.world_size,
              "losses": module.losses, "norms": module.norms,
              "environment": type(trainer.strategy.cluster_environment).__name__}
    if strategy_name == "zero3":
        engine = trainer.strategy.engine
        # The group ZeroStrategy created: Lightning's own barriers and broadcasts wait
        # this long, so it must be the engine's bound, not gloo's 30 minutes.
        record.update(group_timeout=group_timeout(None), engine_timeout=engine.comm.timeout_s)
        full = engine.full_state_dict()  # a collective: every rank
    else:
        full = {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({k.removeprefix("model."): v for k, v in full.items()}, out / "weights.pt")
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()


if __name__ == "__main__":  # OUT [STRATEGY (zero3 | ddp)] [NUM_NODES]
    main(Path(sys.argv[1]), *sys.argv[2:3], *[int(n) for n in sys.argv[3:4]])
