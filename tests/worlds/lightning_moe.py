"""A tiny Qwen3-MoE (router load-balancing loss on) fine-tuned with Lightning, under DDP,
under ``ZeroStrategy`` at stage 3 with every module its own unit, and under the ``zero2`` and
``zero3_offload`` presets by name, for tests/integration/test_moe_training.py. Run as
``python tests/worlds/lightning_moe.py moe OUT_DIR`` (tests/worlds/lightning_launch.py's
``run_suite``): Lightning starts rank 1 itself, and each rank writes
``OUT_DIR/rank{r}.json``. Each rank trains on its own half of the vocabulary, so ranks route
to different experts; the router's token counts come back."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.support.moe_configs import VOCAB, config, count_routes  # noqa: E402
from tests.worlds.lightning_run import Results, rank, rel_diff, weights_of  # noqa: E402
from zero_strategy.lightning import ZeroStrategy  # noqa: E402

TIMEOUT = timedelta(seconds=120)
STEPS = 3


def save_folder(out: Path) -> Path:
    """Written by rank 0 before the first Trainer (Lightning starts rank 1 only then)."""
    from transformers import AutoModelForCausalLM

    folder = out / "qwen3moe"
    if rank() == 0 and not folder.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config("qwen3moe")).save_pretrained(folder)
    return folder


class MoEModule(L.LightningModule):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        from transformers import Qwen3MoeForCausalLM

        # from_pretrained returns the model in eval mode, and Lightning (>= 2.2) keeps each
        # submodule's mode as it finds it: train mode is the user's to set.
        self.model = Qwen3MoeForCausalLM.from_pretrained(folder).train()
        self.routes = count_routes(self.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self) -> DataLoader:
        """This rank's rows, from its half of the vocabulary."""
        half = VOCAB // 2
        g = torch.Generator().manual_seed(100 + self.global_rank)
        rows = torch.randint(self.global_rank * half, (self.global_rank + 1) * half, (32, 8),
                             generator=g)
        return DataLoader(rows, batch_size=2, shuffle=False)

    def configure_optimizers(self) -> Any:
        # SGD with momentum, not AdamW: Lightning's DDP clips with torch's per-tensor norm,
        # the engine with its per-shard one, so each step's clipping factor differs by an ulp
        # or two, and differently per step. AdamW is invariant to one common scale only: where
        # an element's gradients cancel across steps (m ~ 0), it divides their tiny sum by
        # sqrt(v) and turns those ulps into weight differences of ~2e-5 of the tensor's
        # largest (measured in one expert weight). SGD's update is linear in the gradient:
        # the same ulps stay ulps of lr * |g|.
        # lr 0.05: at 0.5 the weights moved so far that a router's top-k near-tie flipped
        # between runs (one token of one forward went to another expert, from ulp-level
        # differences), a discrete change no tolerance covers; the test asserts equal routing.
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)


class Record(Callback):
    def __init__(self) -> None:
        self.loss: list[float] = []
        self.norm: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Any) -> None:
        """The gradient norm before clipping: DDP's from ``.grad``, the engine's own."""
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.norm.append(float(engine.get_global_grad_norm()))
        else:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norm.append(float(torch.nn.utils.get_total_norm(grads)))


def fit(strategy: Any, folder: Path, tag: str) -> dict[str, Any]:
    model, record = MoEModule(folder), Record()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                  accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, use_distributed_sampler=False,
                  callbacks=[record])
    t.fit(model)
    weights = weights_of(t, model)
    path = folder.parent / f"weights_{tag}_{rank()}.pt"
    torch.save(weights, path)
    return {"loss": record.loss, "norm": record.norm, "routes": model.routes,
            "moved": rel_diff(weights, {k: v.float() for k, v in initial.items()}),
            "weights": str(path)}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    folder = save_folder(out)
    results = Results(out)
    results.run("ddp", lambda: fit(DDPStrategy(timeout=TIMEOUT), folder, "ddp"))
    # Stage 3 with every module its own unit (the fused experts, the router), then the
    # presets by name as a user writes them.
    results.run("zero3", lambda: fit(ZeroStrategy(stage=3, unit_numel=1,
                                                  param_persistence_threshold=0,
                                                  timeout=TIMEOUT), folder, "zero3"))
    for preset in ("zero2", "zero3_offload"):
        results.run(preset, lambda preset=preset: fit(preset, folder, preset))


if __name__ == "__main__":
    main(Path(sys.argv[2]))
