"""Every entry point of ours in one world of 2 processes, run twice by
tests/integration/test_ray.py: under ``torch.distributed.run`` (``python -m
torch.distributed.run --standalone --nproc-per-node 2 THIS OUT``), and as one Ray Train job
(``TorchTrainer(train_func, ScalingConfig(num_workers=2))``, ``train_func`` below). The same
functions train in both, in the same order and from the same seeds, so the test compares the
two runs number for number; under Ray each also reports its checkpoints to Ray.

Scenarios (each writes ``OUT/<name>/rank<r>.json``: the losses this rank computed, and under
Ray what it uploaded in each report with its peak RSS growth; rank 0 also the final
consolidated weights, ``OUT/<name>/weights.pt``):

- ``lightning_z1`` .. ``lightning_z3off``: Lightning's Trainer with ``ZeroStrategy`` at stages
  1, 2, 3 and 3 with CPU offload, gradient clipping, ``ModelCheckpoint`` every 2 steps
  (under Ray ``RayModelCheckpoint``; stage 1 under Ray as a new user first tries it: Ray's own
  ``RayLightningEnvironment`` and ``RayTrainReportCallback`` beside a plain ModelCheckpoint);
- ``fabric_z3``: Fabric with ``ZeroFabricStrategy``, ``fabric.save`` every 2 steps;
- ``engine_z3``: the engine in a plain loop (``ray_engine.train``), ``save_and_report``;
- ``accelerate_z2``: an Accelerate loop with ``ZeroAccelerator``, ``save_state`` every 2 steps;
- ``trainer_z3``: ``ZeroTrainer`` on a tiny GPT-2, ``checkpoint-N/`` every 2 steps (under Ray
  reported by Ray's ``RayTrainReportCallback`` and by ours);
- ``sft_z3``: ``with_zero(SFTTrainer)`` with a LoRA adapter, Ray's callback under Ray.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import zero_strategy as zs  # noqa: E402
from tests.support.models import MLP, STAGE3  # noqa: E402
from tests.worlds import ray_engine  # noqa: E402

STEPS, PER_RANK, SAVE_EVERY = 4, 4, 2
LIGHTNING = {"lightning_z1": {"stage": 1}, "lightning_z2": {"stage": 2},
             "lightning_z3": {"stage": 3, **STAGE3["mlp"]},
             "lightning_z3off": {"stage": 3, **STAGE3["mlp"], "offload_optimizer": True,
                                 "offload_params": True}}
SCENARIOS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {}


def scenario(fn: Callable[[Path, bool], dict[str, Any]]) -> Callable[[Path, bool], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def dataset(world: int) -> TensorDataset:
    """STEPS global batches of PER_RANK * world samples (a seeded draw)."""
    g = torch.Generator().manual_seed(7)
    n = STEPS * PER_RANK * world
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 5, generator=g))


def peak_growth() -> Callable[[], int]:
    """Peak RSS growth (bytes) from now until the returned function is called: the kernel's
    high-water mark (VmHWM), reset to the current RSS here (/proc/self/clear_refs, 5)."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS:")
    return lambda: status("VmHWM:") - start


def report_measured(folder: Path, loss: float, step: int) -> dict[str, Any]:
    """``zero_strategy.ray.report`` of a saved folder: what this rank uploaded and the peak
    RSS growth while reporting."""
    from zero_strategy.ray import report

    done = peak_growth()
    reported = report({"loss": loss, "step": step}, folder)
    return {"bytes": reported.bytes, "files": list(reported.files),
            "peak_rss_growth": done()}


# ---------------------------------------------------------------------------------- Lightning
def _lightning(out: Path, under_ray: bool, options: dict[str, Any], ray_callback: bool
               ) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zero_strategy.lightning import ZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = MLP()
            self.losses: list[float] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    reports: list[dict[str, Any]] = []
    checkpoints = dict(dirpath=str(out / "ckpt"), every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    plugins: list[Any] = []
    callbacks: list[Any] = [ModelCheckpoint(**checkpoints)]
    if under_ray:
        from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

        from zero_strategy.ray import RayModelCheckpoint

        plugins = [RayLightningEnvironment()]
        if ray_callback:  # as a new user first tries it: Ray's own callback
            callbacks.append(RayTrainReportCallback())
        else:
            class Measured(RayModelCheckpoint):
                def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
                    done = peak_growth()
                    super()._save_checkpoint(trainer, filepath)
                    reports.append({"bytes": self.last_reported.bytes,
                                    "files": list(self.last_reported.files),
                                    "save_and_report_rss_growth": done()})
            callbacks = [Measured(**checkpoints)]
    module = Module()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(**options), plugins=plugins, callbacks=callbacks,
        accelerator="cpu", devices="auto" if under_ray else dist.get_world_size(),
        max_steps=STEPS, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out))
    loader = DataLoader(dataset(dist.get_world_size()), batch_size=PER_RANK)
    trainer.fit(module, loader)
    last = out / "ckpt" / f"epoch=0-step={STEPS}.ckpt"
    return {"losses": module.losses, "reports": reports, "final_checkpoint": str(last),
            "weights": lambda: zs.consolidate(last)}


for _name, _options in LIGHTNING.items():
    SCENARIOS[_name] = (lambda options, ray_cb: lambda out, under_ray: _lightning(
        out, under_ray, options, ray_cb))(_options, _name == "lightning_z1")


# ---------------------------------------------------------------------------------- Fabric
@scenario
def fabric_z3(out: Path, under_ray: bool) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from zero_strategy.fabric import ZeroFabricStrategy

    plugins: list[Any] = []
    if under_ray:
        from ray.train.lightning import RayLightningEnvironment

        plugins = [RayLightningEnvironment()]
    fabric = Fabric(accelerator="cpu", strategy=ZeroFabricStrategy(stage=3, **STAGE3["mlp"]),
                    devices="auto" if under_ray else dist.get_world_size(), plugins=plugins)
    fabric.launch()
    torch.manual_seed(0)
    model = MLP()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(dataset(fabric.world_size), batch_size=PER_RANK))
    losses, reports = [], []
    for step, (x, y) in enumerate(loader, start=1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % SAVE_EVERY == 0:
            folder = out / f"step-{step}"
            fabric.save(folder, {"model": model, "optimizer": optimizer, "step": step})
            if under_ray:
                reports.append(report_measured(folder, loss.item(), step))
    last = out / f"step-{STEPS}"
    return {"losses": losses, "reports": reports, "final_checkpoint": str(last),
            "weights": lambda: zs.consolidate(last)}


# ---------------------------------------------------------------------------------- the engine
@scenario
def engine_z3(out: Path, under_ray: bool) -> dict[str, Any]:
    # Not resumed: under Ray the job's latest checkpoint is an earlier scenario's.
    result = ray_engine.train(out, under_ray, steps=ray_engine.UNINTERRUPTED, resume=False)
    return {**result,
            "weights": lambda: torch.load(out / f"weights-{ray_engine.UNINTERRUPTED}.pt")}


# ---------------------------------------------------------------------------------- Accelerate
@scenario
def accelerate_z2(out: Path, under_ray: bool) -> dict[str, Any]:
    from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin

    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=2), cpu=True)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(accelerator.num_processes), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, reports = [], []
    for step, (x, y) in enumerate(loader, start=1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % SAVE_EVERY == 0:
            folder = out / f"step-{step}"
            accelerator.save_state(str(folder))
            if under_ray:
                reports.append(report_measured(folder, loss.item(), step))
    last = out / f"step-{STEPS}"
    return {"losses": losses, "reports": reports, "final_checkpoint": str(last),
            "weights": lambda: zs.consolidate(last / "zero_checkpoint")}


# ---------------------------------------------------------------------------------- Trainer
def _trainer(out: Path, under_ray: bool, sft: bool) -> dict[str, Any]:
    from safetensors.torch import load_file

    from tests.worlds import transformers_run as tr

    callbacks: list[Any] = []
    ours = None
    if under_ray:
        from ray.train.huggingface.transformers import RayTrainReportCallback

        callbacks = [RayTrainReportCallback()]
        if not sft:
            from zero_strategy.ray import RayCheckpointCallback

            ours = RayCheckpointCallback()
            callbacks.append(ours)
    saving = dict(save_strategy="steps", save_steps=SAVE_EVERY, gradient_accumulation_steps=1)
    if sft:
        from peft import LoraConfig
        from trl import SFTConfig, SFTTrainer

        trainer = tr.trainer_for(
            "z3", SFTTrainer, model=tr.tiny_gpt2(), train_dataset=tr.texts(),
            processing_class=tr.word_tokenizer(), callbacks=callbacks,
            args=tr.arguments(out, SFTConfig, max_length=16, packing=False, bf16=False, **saving),
            peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                   target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    else:
        trainer = tr.trainer_for("z3", model=tr.tiny_gpt2(dropout=0.0),
                                 train_dataset=tr.Tokens(), callbacks=callbacks,
                                 args=tr.arguments(out, **saving))
    trainer.train()
    final = out / "final"
    trainer.save_model(str(final))
    weights = final / ("adapter_model.safetensors" if sft else "model.safetensors")
    reports = ([{"bytes": ours.last_reported.bytes, "files": list(ours.last_reported.files)}]
               if ours is not None else [])
    return {"losses": tr.history(trainer)["loss"], "reports": reports,
            "final_checkpoint": str(out / f"checkpoint-{tr.STEPS}"),
            "weights": lambda: load_file(str(weights))}


SCENARIOS["trainer_z3"] = lambda out, under_ray: _trainer(out, under_ray, sft=False)
SCENARIOS["sft_z3"] = lambda out, under_ray: _trainer(out, under_ray, sft=True)


# ---------------------------------------------------------------------------------- running
def run(out: Path, names: list[str], under_ray: bool) -> None:
    """Each scenario in turn on this process's group; a failure is recorded, the next runs."""
    rank = dist.get_rank()
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            result = SCENARIOS[name](folder, under_ray)
            weights = result.pop("weights")
            if rank == 0:
                torch.save({k: v.detach().clone() for k, v in weights().items()},
                           folder / "weights.pt")
        except Exception:
            result = {"error": traceback.format_exc()}
            print(result["error"], file=sys.stderr, flush=True)
        result.update(rank=rank, seconds=round(time.perf_counter() - start, 2))
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()


def train_func(config: dict[str, Any]) -> None:
    """Ray Train's training function: the process group is Ray's."""
    run(Path(config["out"]), config["names"], under_ray=True)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run(out, names, under_ray=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
