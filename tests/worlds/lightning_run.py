"""Lightning Trainer scenarios for tests/quick/test_lightning.py.

Run as ``python tests/worlds/lightning_run.py SUITE OUT_DIR``. The first ``Trainer.fit`` makes
Lightning re-run this same command line as rank 1 (``LOCAL_RANK=1``); later Trainers in the
script reuse that pair of processes, so one launch runs every scenario of a suite. Each rank
writes ``OUT_DIR/rank{r}.json`` after every scenario, and the tests assert on those files.

Suites (each a pair of processes; importing Lightning costs several seconds per process, so
tests share launches):
    quick    what tests/quick/ asserts on: trainer and fabric with the stage-3 presets
             (``zero3`` and small units) and every scenario that is not about one preset,
             then init.
    presets  what tests/integration/test_lightning_presets.py asserts on: memory, then
             trainer and fabric with every other preset (stages 1-2, offload, disk) against
             the same DDP run, then pretrained.
The parts, also runnable alone (``memory``, ``trainer``, ``fabric``, ``init``,
``pretrained``; trainer and fabric then with every preset):
    memory   configure_model at stage 3 on a ~34M-parameter model: peak RSS growth while the
             model is built and sharded (and, for contrast, the same model built in __init__),
             and ModelSummary's parameter count. First, before other scenarios warm the heap.
    trainer  DDP reference, then presets (and a stage-3 config with small units): fit
             with accumulation 2, clipping 1.0, a per-step LR schedule and ModelCheckpoint;
             validate / test / predict; save after fit; resume from the step-K checkpoint in a
             new Trainer; evaluate from the checkpoint in a fresh Trainer;
             load_from_checkpoint on the directory ModelCheckpoint reports; consolidate and
             load_from_checkpoint; a bf16-mixed run; two optimizers refused; Muon and AdamW
             as one CombinedOptimizer against single-process training, resumed from a
             checkpoint (tests/support/several_optimizers.py); BackboneFinetuning; a
             bias/LayerNorm-only fine-tune whose first param group is empty, against DDP.
    fabric   the same for Fabric (tests/worlds/lightning_fabric_scenarios.py).
    init     sharded init (configure_model / init_module(empty_init=True) at stage 3) starts
             from DDP's weights and generator state (tests/worlds/lightning_init_scenarios.py).
    pretrained  zero_strategy.transformers.from_pretrained in configure_model and with Fabric
             (zero3, zero2) against Model.from_pretrained under DDP
             (tests/worlds/lightning_pretrained_scenarios.py); in the presets launch, not the
             quick one: importing GPT-2's modeling code alone costs ~2 s per process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    BackboneFinetuning,
    Callback,
    ModelCheckpoint,
)
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.utilities.model_summary import ModelSummary  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import zero_strategy as zs  # noqa: E402
from tests.support import several_optimizers as so  # noqa: E402
from tests.support.harness import record_time  # noqa: E402
from tests.support.hostile import forge_framework_state, forge_traversal  # noqa: E402
from tests.support.models import MLP  # noqa: E402
from tests.worlds.lightning_fabric_scenarios import fabric_suite  # noqa: E402
from tests.worlds.lightning_init_scenarios import init_suite  # noqa: E402
from tests.worlds.lightning_launch import OTHER_PRESETS, QUICK_PRESETS  # noqa: E402
from tests.worlds.lightning_pretrained_scenarios import (  # noqa: E402
    pretrained_suite,
    save_folder,
)
from zero_strategy.integrations.shared import CLIENT_KEY  # noqa: E402
from zero_strategy.lightning import ZeroStrategy, consolidate_checkpoint  # noqa: E402

K = 4  # optimizer steps per epoch (64 samples, 2 ranks x batch 4, accumulation 2)
CLIP = 1.0
TIMEOUT = timedelta(seconds=120)


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Results:
    def __init__(self, out: Path) -> None:
        self.out, self.data = out, {}

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            self.data[name] = fn()
        except Exception:  # recorded per scenario; its test reports the traceback
            self.data[name] = {"error": traceback.format_exc()}
        (self.out / f"rank{rank()}.json").write_text(json.dumps(self.data))
        times = os.environ.get("ZS_SCENARIO_TIMES")  # as in tests/support/harness.py
        if times and rank() == 0:
            record_time(times, time.perf_counter() - started, f"lightning_run {name}")


# ---------------------------------------------------------------------- model and data
class MLPModule(L.LightningModule):
    def __init__(self, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TwoOptimizers(MLPModule):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net.inp.parameters(), lr=0.1),
                torch.optim.SGD(self.net.out.parameters(), lr=0.1)]


def loader(seed: int, n: int = 64, batch: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = 10 * torch.randn(n, 5, generator=gen)  # large targets: clipping at 1.0 engages
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


# ---------------------------------------------------------------------- recording
class Recorder(Callback):
    """Per micro-batch loss, LR, and gradient communication; parameter count at fit start."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.step: list[int] = []
        self.lr: list[float] = []
        self.reduce_bytes: list[int] = []
        self.ref_norm: list[float] = []
        self.ref_max: list[float] = []
        self.summary: dict[str, int] = {}
        self._before = 0

    def _reduce_bytes(self, trainer: L.Trainer) -> int:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return 0
        snap = engine.comm_bytes()
        return int(snap.get("all_reduce", 0) + snap.get("reduce_scatter", 0))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = ModelSummary(pl_module, max_depth=1)
        self.summary = {"total": summary.total_parameters,
                        "trainable": summary.trainable_parameters}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._before = self._reduce_bytes(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss.append(float(outputs["loss"]))
        self.step.append(trainer.global_step)
        self.lr.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.reduce_bytes.append(self._reduce_bytes(trainer) - self._before)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:  # only DDP leaves gradients on the parameters (before clipping)
            self.ref_norm.append(float(torch.nn.utils.get_total_norm(grads)))
            self.ref_max.append(max(float(g.abs().max()) for g in grads))


def trainer(strategy: Any, max_steps: int, callbacks: list[Callback] | None = None,
            **kwargs: Any) -> L.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu", devices=2, accumulate_grad_batches=2, gradient_clip_val=CLIP,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=2, num_sanity_val_steps=1,
    )
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, max_steps=max_steps, callbacks=callbacks or [],
                     **settings)


def weights_of(t: L.Trainer, model: L.LightningModule) -> dict[str, torch.Tensor]:
    engine = getattr(t.strategy, "engine", None)
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    return {k: v.detach().cpu().float() for k, v in state.items()}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp_min(1e-12)).item() for k in b)


def evaluate(t: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    val = t.validate(model, loader(2, n=16), verbose=False)[0]["val_loss"]
    test = t.test(model, loader(3, n=16), verbose=False)[0]["test_loss"]
    preds = t.predict(model, loader(4, n=16))
    return {"val": val, "test": test, "pred": torch.cat(preds).flatten().tolist()}


# ---------------------------------------------------------------------- trainer suite
REF: dict[str, Any] = {}


def reference() -> dict[str, Any]:
    rec = Recorder()
    model = MLPModule()
    t = trainer(DDPStrategy(timeout=TIMEOUT), 2 * K, [rec])
    t.fit(model, loader(1))
    REF.update(weights=weights_of(t, model), initial=MLPModule().state_dict())
    result = {"loss": rec.loss, "lr": rec.lr, "ref_norm": rec.ref_norm, "summary": rec.summary,
              "logged": float(t.callback_metrics["train_loss"]), **evaluate(t, model)}
    REF["result"] = result
    return result


def preset(strategy: Callable[[], Any], name: str, out: Path) -> dict[str, Any]:
    """Fit vs DDP with ModelCheckpoint, evaluate, save after fit, resume from step K,
    evaluate from the checkpoint, consolidate."""
    rec = Recorder()
    model = MLPModule()
    saver = ModelCheckpoint(dirpath=out / name, every_n_train_steps=K, save_top_k=-1)
    t = trainer(strategy(), 2 * K, [rec, saver], enable_checkpointing=True)
    t.fit(model, loader(1))
    weights = weights_of(t, model)
    result: dict[str, Any] = {
        "loss": rec.loss, "lr": rec.lr, "summary": rec.summary, "reduce": rec.reduce_bytes,
        "rel_vs_ddp": rel_diff(weights, REF["weights"]),
        "moved": rel_diff({k: v.float() for k, v in REF["initial"].items()}, weights),
        "precision": t.strategy.config.precision, "stage": t.strategy.config.stage,
        "saved": sorted(os.listdir(out / name)),
        "logged": float(t.callback_metrics["train_loss"]), **evaluate(t, model),
    }
    final = out / f"{name}-final.ckpt"
    t.save_checkpoint(final)  # after fit: the engine outlives the trainer call
    result["final_is_dir"] = final.is_dir()
    if name == "zero3":  # while t's engine is live (the resume below builds another)
        result["engine_only_error"] = engine_only_error(t, out / "zero3-engine-only")
    # The same model object, in a new Trainer, from the epoch-end checkpoint ModelCheckpoint
    # wrote at step K (where Lightning's loops resume exactly, DDP included).
    resumed = Recorder()
    second = trainer(strategy(), 2 * K, [resumed])
    second.fit(model, loader(1), ckpt_path=out / name / f"epoch=0-step={K}.ckpt")
    result.update(resume_loss=resumed.loss, resume_step=resumed.step, resume_lr=resumed.lr,
                  resume_rel=rel_diff(weights_of(second, model), weights))
    result.update(evaluate_from_checkpoint(strategy, final))
    if rank() == 0:  # no collective below: rank 1 goes on meanwhile
        # The path ModelCheckpoint reports (a sharded directory, the step-2K one), loaded the
        # Lightning way: consolidated in memory by the hook zero_strategy.lightning installs.
        best = MLPModule.load_from_checkpoint(saver.best_model_path)
        result["best_model_path"] = Path(saver.best_model_path).name
        result["best_rel"] = rel_diff({k: v.float() for k, v in best.state_dict().items()},
                                      weights)
        result["best_hparams"] = dict(best.hparams)
        ckpt = consolidate_checkpoint(final, out / f"{name}-consolidated.ckpt")
        loaded = MLPModule.load_from_checkpoint(out / f"{name}-consolidated.ckpt")
        result["consolidated_rel"] = rel_diff(
            {k: v.float() for k, v in loaded.state_dict().items()}, weights)
        result["consolidated_hparams"] = dict(loaded.hparams)
        result["consolidated_keys"] = sorted(ckpt)
        flat = zs.write_consolidated(final, out / f"{name}.safetensors")  # the CLI's format
        plain = MLPModule(seed=7)
        plain.load_state_dict(load_file(flat))
        result["safetensors_rel"] = rel_diff(
            {k: v.float() for k, v in plain.state_dict().items()}, weights)
    return result


def engine_only_error(t: L.Trainer, path: Path) -> dict[str, str] | None:
    """``load_from_checkpoint`` on a checkpoint the engine wrote by itself (no Lightning
    state to rebuild the module from): the error, which must name the conversion command."""
    t.strategy.engine.save_checkpoint(path)  # every rank
    if rank() != 0:
        return None
    try:
        MLPModule.load_from_checkpoint(path)
    except ValueError as e:
        return {"dir": str(path), "error": str(e)}
    return {"dir": str(path), "error": "no error"}


def hostile_fit(out: Path) -> dict[str, Any]:
    """``fit(ckpt_path=)`` from forged copies of the zero3 step-K checkpoint (a framework-state
    payload, a ``latest`` leaving the directory): refused, the model unchanged, nothing run."""
    source = out / "zero3" / f"epoch=0-step={K}.ckpt"
    marker = out / "lightning-payload.marker"
    forged = {"framework_payload": out / "forged-payload.ckpt",
              "traversal": out / "forged-traversal.ckpt"}
    if rank() == 0:
        forge_framework_state(source, forged["framework_payload"], marker, CLIENT_KEY)
        forge_traversal(source, forged["traversal"])
    torch.distributed.barrier()
    initial = {k: v.float() for k, v in MLPModule().state_dict().items()}
    result = {}
    for name, path in forged.items():
        model = MLPModule()
        t = trainer("zero3", 2 * K)
        try:
            t.fit(model, loader(1), ckpt_path=path)
            error = None
        except Exception as e:  # the test asserts on the type and text
            error = f"{type(e).__name__}: {e}"
        result[name] = {"raised": error, "marker": marker.exists(),
                        "untouched": rel_diff(weights_of(t, model), initial) == 0.0}
    return result


def evaluate_from_checkpoint(strategy: Any, ckpt: Path) -> dict[str, Any]:
    """A fresh model evaluated from the post-fit checkpoint (an evaluation-only engine)."""
    t = trainer(strategy(), 1)
    test = t.test(MLPModule(seed=123), loader(3, n=16), ckpt_path=ckpt, verbose=False)
    return {"ckpt_test": test[0]["test_loss"]}


def two_optimizers() -> str:
    try:
        trainer("zero2", 2).fit(TwoOptimizers(), loader(1))
    except ValueError as err:
        return str(err)
    return "no error"


class CombinedModule(L.LightningModule):
    """Muon for the hidden matrices beside AdamW for the rest, returned as one
    ``zs.CombinedOptimizer``, with a per-step LambdaLR on the Muon part only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = so.build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return so.loss(self.net, batch)

    def configure_optimizers(self) -> Any:
        muon, adamw = so.optimizers(self.net)
        return {"optimizer": zs.CombinedOptimizer([muon, adamw]),
                "lr_scheduler": {"scheduler": so.schedule(muon), "interval": "step"}}


class PartLRs(Callback):
    """Each part's lr as each optimizer step uses it (before the scheduler's step)."""

    def __init__(self) -> None:
        self.lr: list[list[float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        combined = trainer.optimizers[0]
        self.lr.append([opt.param_groups[0]["lr"] for opt in combined.optimizers])


def combined_optimizer(out: Path) -> dict[str, Any]:
    """An epoch of so.STEPS steps at zero2 on each rank's own batches, against single-process
    training; ``save_checkpoint`` after it, and a fresh module resumed from it for a second
    epoch (the same batches again) against the reference's steps STEPS+1..2*STEPS."""
    def fit(model: CombinedModule, epochs: int, ckpt: Path | None = None) -> L.Trainer:
        data = DataLoader(so.rank_batches(rank()), batch_size=None)  # this rank's batches
        t = trainer("zero2", -1, [lrs], max_epochs=epochs, accumulate_grad_batches=1,
                    gradient_clip_val=None, use_distributed_sampler=False,
                    limit_val_batches=0, num_sanity_val_steps=0)
        t.fit(model, data, ckpt_path=ckpt)
        return t

    def net_weights(t: L.Trainer, model: CombinedModule) -> dict[str, torch.Tensor]:
        return {k.removeprefix("net."): v for k, v in weights_of(t, model).items()}

    lrs = PartLRs()
    model = CombinedModule()
    t = fit(model, 1)
    ref = so.reference(2, steps=2 * so.STEPS, cycle=so.STEPS)
    first = net_weights(t, model)
    result: dict[str, Any] = {
        "rel": so.rel_diff(first, ref[so.STEPS - 1]["weights"]), "moved": so.moved(first),
        "engine_steps": t.strategy.engine.global_step,
        "combined": type(t.optimizers[0]).__name__}
    ckpt = out / "combined.ckpt"
    t.save_checkpoint(ckpt)
    resumed = CombinedModule()
    t2 = fit(resumed, 2, ckpt)
    result.update(lr=lrs.lr, resumed_step=t2.global_step,
                  resumed_rel=so.rel_diff(net_weights(t2, resumed), ref[-1]["weights"]))
    return result


def bf16() -> dict[str, Any]:
    model, rec = MLPModule(), Recorder()
    t = trainer("zero3", 2, [rec], precision="bf16-mixed")
    t.fit(model, loader(1))
    engine = t.strategy.engine
    return {"config": t.strategy.config.precision, "plugin": type(t.precision_plugin).__name__,
            "compute": str(engine.plan.policy.compute_dtype), "loss": rec.loss,
            "master": sorted({str(v.dtype) for v in engine.full_state_dict().values()})}


def value_clip(strategy: Any, reference: bool = False) -> dict[str, Any]:
    """gradient_clip_algorithm="value": the engine clamps its shards elementwise."""
    rec, model = Recorder(), MLPModule()
    t = trainer(strategy, 2 * K, [rec], gradient_clip_algorithm="value", gradient_clip_val=0.5)
    t.fit(model, loader(1))
    weights = weights_of(t, model)
    if reference:
        REF["value_weights"] = weights
    return {"loss": rec.loss, "rel_vs_ddp": rel_diff(weights, REF["value_weights"]),
            "largest_grad": max(rec.ref_max) if rec.ref_max else None}


def checkpointed() -> dict[str, Any]:
    """``ZeroStrategy(activation_checkpointing=True, offload_activations="disk")``: the MLP's
    blocks recomputed, their inputs on disk; no dropout, so DDP without checkpointing is the
    reference (recomputation repeats the same arithmetic)."""
    rec, model = Recorder(), MLPModule()
    strategy = ZeroStrategy(stage=3, unit_numel=500, param_persistence_threshold=40,
                            activation_checkpointing=True, offload_activations="disk",
                            timeout=TIMEOUT)
    t = trainer(strategy, 2 * K, [rec])
    t.fit(model, loader(1))
    report = t.strategy.engine.memory_report()
    return {"loss": rec.loss, "rel_vs_ddp": rel_diff(weights_of(t, model), REF["weights"]),
            "checkpointed": report["checkpointed_modules"],
            "offloaded": report["offloaded_activation_bytes"]}


class BackboneModule(MLPModule):
    """``backbone`` (frozen by BackboneFinetuning until epoch 1) and a head; the optimizer
    starts with the trainable parameters only, the callback adds the backbone's group."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(self.net.inp, nn.ReLU(), self.net.blocks[0])
        self.head = nn.Sequential(self.net.norm, self.net.out)
        del self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class EpochWeights(Callback):
    """The consolidated backbone weights at the end of each epoch."""

    def __init__(self) -> None:
        self.backbone: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights = weights_of(trainer, pl_module)
        self.backbone.append({k: v for k, v in weights.items() if k.startswith("backbone")})


def finetune(strategy: Any) -> dict[str, Any]:
    """BackboneFinetuning through the strategy: the backbone is frozen at construction, then
    unfrozen and added to the optimizer at epoch 1; the engine must follow both."""
    torch.manual_seed(0)
    model, epochs = BackboneModule(), EpochWeights()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()
               if k.startswith("backbone")}
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=1e-3)
    t = trainer(strategy, 2 * K, [callback, epochs], gradient_clip_val=None)
    t.fit(model, loader(1))
    frozen_epoch = max((epochs.backbone[0][k] - v).abs().max().item() for k, v in initial.items())
    trained_epoch = max((epochs.backbone[1][k] - epochs.backbone[0][k]).abs().max().item()
                        for k in initial)
    return {"weights": {k: v.flatten().tolist() for k, v in weights_of(t, model).items()},
            "frozen_epoch_change": frozen_epoch, "trained_epoch_change": trained_epoch,
            "groups": len(t.optimizers[0].param_groups)}


class NoDecayModule(MLPModule):
    """Bias and LayerNorm tuning as transformers' Trainer groups it: every weight matrix
    frozen, so the weight-decay group (the first) is empty; a LambdaLR with one lambda per
    group, which lines up only if the empty group keeps its place."""

    def __init__(self) -> None:
        super().__init__()
        for name, p in self.named_parameters():
            p.requires_grad_(name.endswith("bias") or ".norm." in name)

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW([{"params": [], "weight_decay": 0.1},
                                 {"params": trained, "weight_decay": 0.0}], lr=3e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda k: 0.5**k, lambda k: 0.9**k])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def no_decay(strategy: Any) -> dict[str, Any]:
    """Fit ``NoDecayModule``; the weights, the losses and both groups' final lr."""
    rec, model = Recorder(), NoDecayModule()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = trainer(strategy, 2 * K, [rec])
    t.fit(model, loader(1))
    weights = weights_of(t, model)
    return {"weights": {k: v.flatten().tolist() for k, v in weights.items()}, "loss": rec.loss,
            "lrs": [g["lr"] for g in t.optimizers[0].param_groups],
            "moved": sorted(k for k, v in weights.items() if not torch.equal(v, initial[k]))}


def trainer_suite(results: Results, out: Path, presets: tuple[str, ...],
                  extras: bool = True) -> None:
    """DDP's reference, then each of ``presets`` against it; with ``extras`` the scenarios
    that are not about one preset (clipping by value, bf16, optimizers, fine-tuning)."""
    results.run("ddp", reference)
    strategies: dict[str, Callable[[], Any]] = {
        name: (lambda name=name: name) for name in presets if name != "zero3_units"
    }
    if "zero3_units" in presets:
        strategies["zero3_units"] = lambda: ZeroStrategy(
            stage=3, unit_numel=500, param_persistence_threshold=40, timeout=TIMEOUT)
    for name, make in strategies.items():
        results.run(name, lambda make=make, name=name: preset(make, name, out))
    if not extras:
        return
    results.run("hostile_fit", lambda: hostile_fit(out))
    results.run("ddp_value", lambda: value_clip(DDPStrategy(timeout=TIMEOUT), reference=True))
    results.run("zero3_value", lambda: value_clip("zero3"))
    results.run("bf16", bf16)
    results.run("zero3_checkpointed", checkpointed)
    results.run("two_optimizers", two_optimizers)
    results.run("combined_optimizer", lambda: combined_optimizer(out))
    results.run("finetune_zero0", lambda: finetune(ZeroStrategy(stage=0, timeout=TIMEOUT)))
    results.run("finetune_zero2", lambda: finetune("zero2"))
    results.run("finetune_zero3", lambda: finetune(ZeroStrategy(
        stage=3, unit_numel=100, param_persistence_threshold=40, timeout=TIMEOUT)))
    results.run("nodecay_ddp", lambda: no_decay(DDPStrategy(timeout=TIMEOUT)))
    results.run("nodecay_zero3", lambda: no_decay(ZeroStrategy(
        stage=3, unit_numel=100, param_persistence_threshold=0, timeout=TIMEOUT)))


# ---------------------------------------------------------------------- memory suite
def rss_mib(field: str = "VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def reset_peak() -> float:
    """Reset the RSS high-water mark to the current RSS; returns that RSS (MiB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mib()


def layers() -> nn.Module:
    """32 x Linear(1024, 1024): ~33.6M parameters, 128 MiB in fp32."""
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(32)])


class BigModule(L.LightningModule):
    """The model is built in configure_model (``in_configure_model``) or in ``__init__``."""

    def __init__(self, in_configure_model: bool) -> None:
        super().__init__()
        self.peaks: dict[str, Any] = {}
        self.layers = None if in_configure_model else layers()

    def setup(self, stage: str) -> None:
        if self.layers is None:
            self.peaks["base"] = reset_peak()

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = layers()
            self.peaks["built_on_meta"] = all(p.is_meta for p in self.layers.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class MemoryProbe(Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: BigModule) -> None:
        engine = trainer.strategy.engine
        pl_module.peaks.update(
            peak_growth=rss_mib("VmHWM") - pl_module.peaks["base"],
            state_mib=engine.memory_report()["total_bytes"] / 2**20,
            summary=ModelSummary(pl_module).total_parameters, engine_numel=engine.num_params,
        )


def memory_suite(results: Results, out: Path) -> None:
    """Peak RSS growth from before the model exists to the start of training, for the model
    built in configure_model (meta, sharded by the engine) and, for contrast, in __init__."""
    def run(in_configure_model: bool) -> dict[str, Any]:
        base = reset_peak()
        model = BigModule(in_configure_model)
        model.peaks.setdefault("base", base)
        data = DataLoader(TensorDataset(torch.randn(4, 1024)), batch_size=2)
        calls = []

        def init(module: nn.Module) -> None:  # the engine's default, counted
            calls.append(type(module).__name__)
            module.reset_parameters()

        strategy = ZeroStrategy(stage=3, param_init_fn=init)
        t = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[MemoryProbe()])
        t.fit(model, data)
        return {**model.peaks, "full_mib": 32 * (1024 * 1024 + 1024) * 4 / 2**20,
                "init_calls": calls}

    results.run("memory_configure_model", lambda: run(True))
    results.run("memory_init", lambda: run(False))


ALL_PRESETS = (*QUICK_PRESETS, *OTHER_PRESETS)


def _suites() -> dict[str, Callable[[Results, Path], None]]:
    def quick(results: Results, out: Path) -> None:
        trainer_suite(results, out, QUICK_PRESETS)
        fabric_suite(results, out, QUICK_PRESETS)
        init_suite(results, out)

    def presets(results: Results, out: Path) -> None:
        folder = save_folder(out)  # before the first process group (see save_folder)
        memory_suite(results, out)
        trainer_suite(results, out, OTHER_PRESETS, extras=False)
        fabric_suite(results, out, OTHER_PRESETS, extras=False)
        pretrained_suite(results, folder)

    return {"quick": quick, "presets": presets, "memory": memory_suite,
            "trainer": lambda r, o: trainer_suite(r, o, ALL_PRESETS),
            "fabric": lambda r, o: fabric_suite(r, o, ALL_PRESETS), "init": init_suite,
            "pretrained": lambda r, o: pretrained_suite(r, save_folder(o))}


if __name__ == "__main__":
    torch.set_num_threads(1)
    suite, out_dir = sys.argv[1], Path(sys.argv[2])
    _suites()[suite](Results(out_dir), out_dir)
