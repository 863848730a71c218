"""``zero_strategy.transformers.from_pretrained`` the way Lightning and Fabric users call it,
against ``Model.from_pretrained`` under DDP, for tests/integration/test_lightning_presets.py;
run inside tests/worlds/lightning_run.py's processes (suite "pretrained", part of "presets").

Lightning: a LightningModule whose ``configure_model`` builds a tiny GPT-2 from a
``save_pretrained`` folder, once with ``from_pretrained`` (ours) under ``zero3`` and ``zero2``,
once with ``GPT2LMHeadModel.from_pretrained`` under ``strategy="ddp"``. Fabric: the same model
built inside ``fabric.init_module(empty_init=True)`` (and, at stage 3, without it: docs/
pretrained.md allows both) before ``fabric.setup``. Each records the consolidated weights and
the generator state when training starts, the loss of every step and the weights after the
last. GPT-2's dropout is on: its masks come from the global generator, so equal losses also
show that building on meta and streaming the weights left the generator where
``Model.from_pretrained`` leaves it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

TIMEOUT = timedelta(seconds=120)
STEPS = 3
VOCAB = 96


def save_folder(out_dir: Path) -> Path:
    """A tiny GPT-2 written with ``save_pretrained``, one copy per rank (the same bytes: same
    seed, same ops), so no rank waits for another's. Call it before the process's first
    Trainer or Fabric: once a process group exists, ``save_pretrained`` writes the weights on
    global rank 0 only (transformers 5), and rank 1's folder would hold a config alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = out_dir / f"gpt2-rank{os.environ.get('LOCAL_RANK', '0')}"
    torch.manual_seed(1234)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def build(folder: Path, streamed: bool) -> Any:
    """The user's line: ``from_pretrained(GPT2LMHeadModel, folder)`` (ours: on meta, loaded
    into the shards by the engine) or transformers' own (the reference)."""
    from transformers import GPT2LMHeadModel

    from zero_strategy.transformers import from_pretrained

    if streamed:
        return from_pretrained(GPT2LMHeadModel, folder)
    return GPT2LMHeadModel.from_pretrained(folder)


def optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW with ``eps=1e-6`` (common for fine-tuning), so that the weights can be held to
    lightning_checks.TOL. At the default 1e-8 the comparison measures rounding noise: the key
    bias of GPT-2's ``c_attn`` (its middle third) has a zero gradient in exact arithmetic
    (softmax ignores a constant added to every score of a row), so its computed gradient is
    summation-order noise (~1e-10), which Adam's ``g / (sqrt(v) + eps)`` turns into steps of
    ~lr/100 that follow the reduction order (DDP's buckets or the engine's reduce-scatter):
    4e-4 relative apart after 3 steps. Here those steps are 100 times smaller (3e-6 apart)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def token_batches(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (STEPS * 4, 16), generator=gen)


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


# ---------------------------------------------------------------------- Lightning
class PretrainedLM(L.LightningModule):
    def __init__(self, folder: Path, streamed: bool) -> None:
        super().__init__()
        self.folder, self.streamed = folder, streamed
        self.model: Any = None
        self.on_meta = False

    def configure_model(self) -> None:
        if self.model is None:  # configure_model may run again (validate after fit)
            self.model = build(self.folder, self.streamed)
            self.on_meta = all(p.is_meta for p in self.model.parameters())
            # from_pretrained (both) leaves the model in eval mode, as transformers does, and
            # Lightning keeps each module's mode (it only warns): without this, dropout is off
            self.model.train()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return optimizer(self.parameters())


class Record(Callback):
    def __init__(self) -> None:
        self.result: dict[str, Any] = {"loss": []}

    def weights(self, trainer: L.Trainer, pl_module: PretrainedLM) -> dict[str, torch.Tensor]:
        engine = getattr(trainer.strategy, "engine", None)
        return cpu_copy(engine.full_state_dict() if engine is not None
                        else pl_module.state_dict())

    def on_fit_start(self, trainer: L.Trainer, pl_module: PretrainedLM) -> None:
        self.result.update(initial=self.weights(trainer, pl_module), on_meta=pl_module.on_meta,
                           rng=torch.get_rng_state(), training=pl_module.model.training)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: PretrainedLM, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.result["loss"].append(float(outputs["loss"]))

    def on_fit_end(self, trainer: L.Trainer, pl_module: PretrainedLM) -> None:
        self.result["final"] = self.weights(trainer, pl_module)


def lightning_run(strategy: Any, folder: Path, streamed: bool) -> dict[str, Any]:
    torch.manual_seed(0)  # the generator dropout draws from, as a user's seed_everything
    record = Record()
    data = DataLoader(TensorDataset(token_batches(int(os.environ.get("LOCAL_RANK", "0")))),
                      batch_size=4)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[record])
    trainer.fit(PretrainedLM(folder, streamed), data)
    return record.result


# ---------------------------------------------------------------------- Fabric
def fabric_run(strategy: Any, folder: Path, streamed: bool, empty_init: bool) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    if empty_init:
        with fabric.init_module(empty_init=True):
            net = build(folder, streamed)
    else:
        net = build(folder, streamed)
    on_meta = all(p.is_meta for p in net.parameters())
    model, opt = fabric.setup(net, optimizer(net.parameters()))
    model.train()  # from_pretrained (both) leaves the model in eval mode; Fabric keeps modes
    engine = getattr(model._forward_module, "engine", None)

    def weights() -> dict[str, torch.Tensor]:
        return cpu_copy(engine.full_state_dict() if engine is not None else model.state_dict())

    result: dict[str, Any] = {"initial": weights(), "on_meta": on_meta, "loss": [],
                              "rng": torch.get_rng_state(), "training": net.training}
    for ids in token_batches(fabric.global_rank).split(4):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        result["loss"].append(float(loss.detach()))
    result["final"] = weights()
    return result


# ---------------------------------------------------------------------- comparison
def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp_min(1e-12)).item() for k in b)


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """What the tests assert on (tensors stay in this process)."""
    initial, final = run["initial"], run["final"]
    return {
        "keys_equal": initial.keys() == ref["initial"].keys() == final.keys(),
        "initial_differ": sorted(k for k, v in ref["initial"].items()
                                 if k not in initial or not torch.equal(initial[k], v)),
        "rng_equal": torch.equal(run["rng"], ref["rng"]),
        "loss": run["loss"], "ref_loss": ref["loss"], "on_meta": run["on_meta"],
        "training": run["training"] and ref["training"],
        "rel_final": rel_diff(final, ref["final"]) if final.keys() == ref["final"].keys()
        else None,
        # absolute: GPT-2's biases start at 0, so a relative change would divide by 0
        "moved": max((ref["final"][k] - ref["initial"][k]).abs().max().item()
                     for k in ref["final"]),
    }


def pretrained_suite(results: Any, folder: Path) -> None:
    """Registers the Lightning and Fabric results on ``results`` (a lightning_run.Results),
    for the model in ``folder`` (``save_folder``)."""
    ref: dict[str, Any] = {}

    def lightning_ddp() -> dict[str, Any]:
        ref["lightning"] = lightning_run(DDPStrategy(timeout=TIMEOUT), folder, streamed=False)
        return {"loss": ref["lightning"]["loss"], "on_meta": ref["lightning"]["on_meta"]}

    def lightning_zero(stage: int) -> dict[str, Any]:
        return compare(lightning_run(f"zero{stage}", folder, streamed=True), ref["lightning"])

    def fabric_ddp() -> dict[str, Any]:
        ref["fabric"] = fabric_run(FabricDDP(timeout=TIMEOUT), folder, streamed=False,
                                   empty_init=False)
        return {"loss": ref["fabric"]["loss"], "on_meta": ref["fabric"]["on_meta"]}

    def fabric_zero(stage: int, empty_init: bool) -> dict[str, Any]:
        run = fabric_run(f"zero{stage}", folder, streamed=True, empty_init=empty_init)
        return compare(run, ref["fabric"])

    results.run("pretrained_lightning_ddp", lightning_ddp)
    results.run("pretrained_lightning_zero3", lambda: lightning_zero(3))
    results.run("pretrained_lightning_zero2", lambda: lightning_zero(2))
    results.run("pretrained_fabric_ddp", fabric_ddp)
    results.run("pretrained_fabric_zero3", lambda: fabric_zero(3, empty_init=True))
    results.run("pretrained_fabric_zero2", lambda: fabric_zero(2, empty_init=True))
    results.run("pretrained_fabric_zero3_no_init_module", lambda: fabric_zero(3, empty_init=False))
