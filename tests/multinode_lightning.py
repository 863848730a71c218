"""``Trainer(strategy=ZeroStrategy(stage=3), num_nodes=2, devices=2)`` as a user's script, for
tests/test_multinode.py: started on each "node" by Lightning's own launcher (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK`` set, ``python tests/multinode_lightning.py OUT``; Lightning
starts the node's second process itself), or as well under torchrun (``--nnodes 2``).

The data is the engine test's global batches (tests/multinode_engine.py), one step each, rank
r's quarter handed to rank r, so the test compares with the same single-process reference.
Each rank writes ``rank<N>.json`` (its ranks as Lightning sees them, losses, gradient norms)
and rank 0 ``weights.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.models import STAGE3, loss_of, make_model, make_optimizer  # noqa: E402
from tests.multinode_engine import CLIP, STEPS, global_batches, my_part  # noqa: E402
from zero_strategy.comm.collectives import group_timeout  # noqa: E402
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
        self.norms.append(self.trainer.strategy.engine.get_global_grad_norm().item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer("sgd", self.model)

    def train_dataloader(self) -> DataLoader:
        # One pre-batched item per step, picked by this rank: no sampler splits it further.
        data = RankBatches(self.global_rank, self.trainer.world_size)
        return DataLoader(data, batch_size=None, shuffle=False)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    module = Module()
    # "zero3" with units small enough that this 4k-parameter MLP is really sharded
    strategy = ZeroStrategy(stage=3, **STAGE3["mlp"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2,
                        max_steps=STEPS, gradient_clip_val=CLIP, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    engine = trainer.strategy.engine
    record = {"rank": trainer.global_rank, "node_rank": trainer.node_rank,
              "local_rank": trainer.local_rank, "world_size": trainer.world_size,
              "losses": module.losses, "norms": module.norms,
              # The group ZeroStrategy created: Lightning's own barriers and broadcasts wait
              # this long, so it must be the engine's bound, not gloo's 30 minutes.
              "group_timeout": group_timeout(None), "engine_timeout": engine.comm.timeout_s}
    full = engine.full_state_dict()  # a collective: every rank
    if trainer.global_rank == 0:
        torch.save({k.removeprefix("model."): v for k, v in full.items()}, out / "weights.pt")
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
