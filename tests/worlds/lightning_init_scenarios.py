"""Sharded init under Lightning and Fabric against DDP, for tests/quick/test_sharded_init.py; run
inside tests/worlds/lightning_run.py's processes (suite "init").

The same module built in ``configure_model`` (Lightning) or under
``fabric.init_module(empty_init=True)`` (Fabric): eagerly under DDP, on meta and materialised
unit by unit (every module its own unit, children first) under stage 3. Both must start from
the same weights and leave the generator where construction left it, which the dropout in the
model then exposes in every loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.init_models import AttentionNet, Net, loss_of, token_batches
from zero_strategy.fabric import ZeroFabricStrategy
from zero_strategy.lightning import ZeroStrategy

TIMEOUT = timedelta(seconds=120)
STEPS = 4
UNITS = {"stage": 3, "unit_numel": 32, "param_persistence_threshold": 0}


class ConfiguredNet(L.LightningModule):
    def __init__(self, build: Callable[[], nn.Module] = Net) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.build = build
        self.net: nn.Module | None = None
        self.on_meta = False

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self.build()
            self.on_meta = all(p.is_meta for p in self.net.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.net, batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Start(Callback):
    """Weights and generator state when training starts; the loss of every step."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.rng = torch.empty(0)
        self.loss: list[float] = []
        self.on_meta = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        state = engine.full_state_dict() if engine is not None else pl_module.state_dict()
        self.weights = {k: v.detach().cpu().clone() for k, v in state.items()}
        self.rng = torch.get_rng_state()
        self.on_meta = pl_module.on_meta

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss.append(float(outputs["loss"]))


def lightning_run(strategy: Any, build: Callable[[], nn.Module] = Net,
                  steps: int = STEPS) -> Start:
    start = Start()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    data = DataLoader(TensorDataset(torch.cat(token_batches(rank, steps))), batch_size=4)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[start])
    trainer.fit(ConfiguredNet(build), data)
    return start


def fabric_run(strategy: Any, empty_init: bool) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=empty_init):
        net = Net()
    rng = torch.get_rng_state()  # right after construction: code here sees the same stream
    on_meta = all(p.is_meta for p in net.parameters())
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    engine = getattr(model._forward_module, "engine", None)
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    weights = {k: v.detach().cpu().clone() for k, v in state.items()}  # before training
    losses = []
    for ids in token_batches(fabric.global_rank, STEPS):
        loss = loss_of(model, ids)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"weights": weights, "rng": rng,
            "loss": losses, "on_meta": on_meta}


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    assert run["weights"].keys() == ref["weights"].keys()
    return {
        "differ": sorted(k for k in ref["weights"]
                         if not torch.equal(run["weights"][k], ref["weights"][k])),
        "rng_equal": torch.equal(run["rng"], ref["rng"]),
        "loss": run["loss"], "ref_loss": ref["loss"], "on_meta": run["on_meta"],
        "ref_on_meta": ref["on_meta"],
    }


def init_suite(results: Any, out_dir: Any) -> None:
    """Registers Lightning and Fabric results on ``results`` (a lightning_run.Results)."""
    ref: dict[str, Any] = {}
    calls: list[str] = []

    def init(module: nn.Module) -> None:  # the default, recorded
        calls.append(type(module).__name__)
        module.reset_parameters()

    def as_dict(start: Start) -> dict[str, Any]:
        return {"weights": start.weights, "rng": start.rng, "loss": start.loss,
                "on_meta": start.on_meta}

    def lightning_ddp() -> dict[str, Any]:
        ref["lightning"] = as_dict(lightning_run(DDPStrategy(timeout=TIMEOUT)))
        return {"loss": ref["lightning"]["loss"]}

    def lightning_zero3() -> dict[str, Any]:
        run = lightning_run(ZeroStrategy(**UNITS, param_init_fn=init, timeout=TIMEOUT))
        return {**compare(as_dict(run), ref["lightning"]), "init_calls": list(calls)}

    # nn.TransformerEncoderLayer with no param_init_fn: its MultiheadAttention has no
    # reset_parameters() and zeroes its out_proj's bias (materialised first, every module its
    # own unit). Three steps: the dropout inside the layer draws in each.
    def attention_ddp() -> dict[str, Any]:
        ref["attention"] = as_dict(lightning_run(DDPStrategy(timeout=TIMEOUT), AttentionNet, 3))
        return {"loss": ref["attention"]["loss"]}

    def attention_zero3() -> dict[str, Any]:
        run = lightning_run(ZeroStrategy(**UNITS, timeout=TIMEOUT), AttentionNet, 3)
        return compare(as_dict(run), ref["attention"])

    def fabric_ddp() -> dict[str, Any]:
        ref["fabric"] = fabric_run(FabricDDP(timeout=TIMEOUT), empty_init=False)
        return {"loss": ref["fabric"]["loss"]}

    def fabric_zero3() -> dict[str, Any]:
        return compare(fabric_run(ZeroFabricStrategy(**UNITS, timeout=TIMEOUT), True),
                       ref["fabric"])

    results.run("init_lightning_ddp", lightning_ddp)
    results.run("init_lightning_zero3", lightning_zero3)
    results.run("init_lightning_attention_ddp", attention_ddp)
    results.run("init_lightning_attention_zero3", attention_zero3)
    results.run("init_fabric_ddp", fabric_ddp)
    results.run("init_fabric_zero3", fabric_zero3)
