"""What every recipe job measures: throughput, peak memory per rank beside the ZeRO formula,
activation bytes per rank beside their formula (``zs.estimate_activations``), bytes
communicated per step, first/final train loss and validation loss/accuracy of the final
model; and what ran (strategy, precision, world size, optimizer), read from the run."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

import zero_strategy as zs
from recipes.anchors import anchor_label, anchor_offload, census, full_state_dict
from recipes.comm_count import COUNTER

WARMUP_STEPS = 3  # the first steps pay for lazy allocation and are not timed


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def strategy_label(strategy: Any) -> tuple[str, int | None]:
    """(name, ZeRO stage) of the strategy object that trained: ``ddp``; an anchor's preset
    name (``fsdp``, ``deepspeed_stage_3``); or ``zero<stage>`` with ``_offload`` (CPU) or
    ``_disk`` when everything that stage can offload rests there (the presets' names), else
    each offloaded part named (``zero3_offload_optimizer``)."""
    anchor = anchor_label(strategy)
    if anchor is not None:
        return anchor
    config = getattr(strategy, "config", None)
    if config is None or not hasattr(config, "stage"):
        from lightning.pytorch.strategies import DDPStrategy

        return ("ddp" if type(strategy) is DDPStrategy else type(strategy).__name__), None
    tiers = {"optimizer": config.optimizer_tier, "params": config.params_tier}
    full = ["optimizer", "params"] if config.stage == 3 else ["optimizer"]
    for tier, word in (("disk", "disk"), ("cpu", "offload")):
        on = [part for part in full if tiers[part] == tier]
        if on == full:
            return f"zero{config.stage}_{word}", int(config.stage)
    suffix = "".join(f"_{'disk' if tiers[part] == 'disk' else 'offload'}_{part}"
                     for part in full if tiers[part] != "device")
    return f"zero{config.stage}{suffix}", int(config.stage)


def optimizer_label(optimizers: list[Any]) -> str:
    """The optimizer classes that stepped, ``+``-joined for a CombinedOptimizer's parts
    (``muon+adamw``)."""
    # DeepSpeed's ZeRO optimizers wrap the one configure_optimizers returned (.optimizer).
    inner = [o.optimizer if type(o).__module__.startswith("deepspeed") else o for o in optimizers]
    parts = [p for opt in inner for p in getattr(opt, "optimizers", [opt])]
    return "+".join(type(p).__name__.lower() for p in parts)


def run_columns(trainer: L.Trainer) -> dict[str, Any]:
    """The report's description of a job, read from what ran, never from the request:
    Lightning may change the request (``16-mixed`` on a CPU runs as ``bf16-mixed``), so the
    precision is the engine's policy (under ZeRO) or the Trainer's precision plugin's, the
    strategy and stage come from the strategy object, N from the Trainer's world."""
    name, stage = strategy_label(trainer.strategy)
    engine = getattr(trainer.strategy, "engine", None)
    precision = engine.plan.policy.name if engine is not None else trainer.precision
    return {"strategy": name, "stage": stage, "precision": str(precision),
            "world_size": int(trainer.world_size),
            "optim": optimizer_label(trainer.optimizers) if trainer.optimizers else None,
            "zero_options": changed_options(engine.config) if engine is not None else None}


def changed_options(config: zs.ZeroConfig) -> str:
    """The engine's options that differ from ZeroConfig's defaults for its stage (stage and
    precision have columns of their own), e.g. ``quantize_weights=int8``; "defaults" if none."""
    default = zs.ZeroConfig(stage=config.stage).to_dict()
    changed = {k: v for k, v in config.to_dict().items()
               if k not in ("stage", "precision") and v != default[k]}
    return ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "defaults"


def predicted_activations(trainer: L.Trainer, module: L.LightningModule,
                          cfg: Any) -> dict[str, int] | None:
    """Activation bytes one rank's micro-batch leaves for backward (``saved``) and its
    backward peak, by the activation formula for the model as built, the precision that ran
    and the engine's ``activation_checkpointing`` (read with getattr: an engine without the
    field checkpoints nothing). None where the formula does not apply: a ``-mixed``
    precision outside our engine runs under autocast, whose dtypes per op it does not model."""
    engine = getattr(trainer.strategy, "engine", None)
    precision = str(run_columns(trainer)["precision"])
    if engine is None and precision.endswith("-mixed"):
        return None
    checkpointing = getattr(getattr(engine, "config", None), "activation_checkpointing", False)
    model = getattr(module, "model", module)
    shape = ({"image_size": int(cfg.data.image_size)} if cfg.model.name == "resnet"
             else {"seq_len": int(cfg.model.seq_len)})
    device = trainer.strategy.root_device.type
    try:
        est = zs.estimate_activations(
            model, batch_size=int(cfg.data.batch_size), precision=precision,
            checkpointing=checkpointing, device="cuda" if device == "cuda" else "cpu", **shape)
    except ValueError:  # a model or checkpointing choice the formula does not cover
        return None
    return {"saved": est.saved_bytes, "peak": est.peak_bytes}


class JobMetrics(L.Callback):
    def __init__(self, cfg: Any, out: Path) -> None:
        self.cfg, self.out = cfg, out
        self.samples = 0
        self.timed_s = 0.0
        self.timed_batches = 0
        self.first_loss: float | None = None
        self.train_loss = float("nan")
        self.val_step: int | None = None
        """The optimizer step of the newest validation (None: none ran yet)."""
        self._t: float | None = None
        self._comm0 = (0, 0)
        self._counting = False
        self._comm_end: tuple[int, int] | None = None
        self._excluded = [0, 0]
        self._outside_from: tuple[int, int] | None = None
        self._census: dict[str, Any] | None = None
        self.startup: dict[str, float] = {}
        """Seconds since the job started (launch.py) at which this rank reached each point."""

    # ----------------------------------------------------------- bytes sent
    def _comm_totals(self, trainer: L.Trainer) -> tuple[int, int]:
        """(the engine's own count, or 0 without an engine; the process-group counter's)."""
        engine = getattr(trainer.strategy, "engine", None)
        return (engine.comm_bytes()["total"] if engine is not None else 0), COUNTER.total()

    def outside_training_start(self, trainer: L.Trainer) -> None:
        """From here to ``outside_training_end`` (validation, a checkpoint) the bytes sent are
        not training traffic: they are left out of the per-step figure. After training the
        figure's end is fixed already (``on_train_end``): a validation then is not counted,
        so nothing is left out either (it was, and made the figure negative)."""
        if self._outside_from is None and self._comm_end is None:
            self._outside_from = self._comm_totals(trainer)

    def outside_training_end(self, trainer: L.Trainer) -> None:
        if self._outside_from is not None:
            now = self._comm_totals(trainer)
            for i in range(2):
                self._excluded[i] += now[i] - self._outside_from[i]
            self._outside_from = None

    def _comm_per_step(self, trainer: L.Trainer, steps: int) -> tuple[float | None, float]:
        """(bytes per step in the report, the process-group counter's figure). The report's
        is the engine's own count under ZeRO, else the process-group counter's; None (not
        measured) when that counter saw nothing although N >= 2 ranks trained: the system
        communicated where Python cannot see it."""
        end = self._comm_end if self._comm_end is not None else self._comm_totals(trainer)
        engine, pg = ((end[i] - self._comm0[i] - self._excluded[i]) / steps for i in range(2))
        if getattr(trainer.strategy, "engine", None) is not None:
            return engine, pg
        if pg <= 0 and trainer.world_size > 1:
            return None, pg
        return pg, pg

    # ----------------------------------------------------------- hooks
    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.mark("fit_start")
        # A requeued job resuming from a checkpoint at max_steps trains nothing: Lightning
        # then skips on_train_start, and the peak is this attempt's growth since fit start
        # (a SLURM requeue after the last checkpoint died on the missing base, 2026-11-30).
        self.base_rss = _status_mib("VmRSS")

    def mark(self, point: str) -> None:
        t0 = float(os.environ.get("ZS_JOB_T0", "nan"))
        self.startup[point] = time.time() - t0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.mark("train_start")
        ddp = getattr(trainer.strategy, "model", None)
        if isinstance(ddp, DistributedDataParallel):
            # Lightning registers no hook on CPU, and DDP's reducer then all-reduces from C++
            # where the process-group counter cannot see it; the default hook runs the same
            # all-reduce through Python.
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(state=None, hook=allreduce_hook)
        try:  # reset the peak-RSS mark so it measures training, not imports and setup
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base_rss = _status_mib("VmRSS")

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any,
                             idx: int) -> None:
        if "first_batch" not in self.startup:
            self.mark("first_batch")
        if trainer.global_step == WARMUP_STEPS and not self._counting:
            # (This once tested `self._t is None`, true only before the first batch: the
            # warm-up steps' bytes were divided by the timed steps, 2x at max_steps=6.)
            self._counting = True
            self._comm0 = self._comm_totals(trainer)
            self._excluded = [0, 0]
        self._t = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule,
                                 optimizer: Any) -> None:
        # Gradients and (after the first step) optimizer states both exist here; the census
        # is taken in the untimed warm-up steps, the last one's kept.
        if trainer.global_step < WARMUP_STEPS:
            self._census = self._model_states(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if self.first_loss is None and loss is not None:
            self.first_loss = float(loss.detach().float())
        if trainer.global_step > WARMUP_STEPS and self._t is not None:
            self.timed_s += time.perf_counter() - self._t
            self.timed_batches += 1
            first = next(iter(batch.values()))
            self.samples += first.shape[0] * trainer.world_size

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.outside_training_start(trainer)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.outside_training_end(trainer)
        if not trainer.sanity_checking:
            self.val_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # Read now: a validation after fit resets the Trainer's metrics, and its parameter
        # gathers are not training traffic.
        self.train_loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
        self._comm_end = self._comm_totals(trainer)

    def needs_final_validation(self, trainer: L.Trainer) -> bool:
        """Training stopped after the last periodic validation (``max_steps`` not a multiple
        of ``val_check_interval``), or none ran: the val loss would be stale or missing."""
        return self.val_step != trainer.global_step

    # ----------------------------------------------------------- the record
    def _model_states(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        """Model-state bytes this rank holds, beside the ZeRO formula for its stage: the
        engine's own accounting under ZeRO, else a census of the strategy's tensors."""
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            report = engine.memory_report()
            return {"held": report["total_bytes"], "predicted": report["predicted_total_bytes"],
                    "num_params": engine.num_params, "by_kind": {
                        k: report[f"{k}_bytes"] for k in ("params", "grads", "optimizer")},
                    # what the engine measured its forward keeping for backward, if it does
                    "activations": report.get("activation_bytes")}
        counted = census(module, list(trainer.optimizers))
        num_params = int(self.cfg_num_params(module))
        _, stage = strategy_label(trainer.strategy)
        offload_opt, offload_params = anchor_offload(trainer.strategy)
        predicted = zs.estimate_memory(
            num_params, stage=stage or 0, world_size=trainer.world_size,
            precision=str(trainer.precision), offload_optimizer=offload_opt,
            offload_params=offload_params and stage == 3).total_bytes
        return {"held": counted.model_states, "predicted": predicted, "num_params": num_params,
                "by_kind": dict(counted.bytes), "labels": counted.labels}

    def cfg_num_params(self, module: L.LightningModule) -> int:
        """Parameters of the model as built (a sharding strategy's module shows shards, or
        DeepSpeed stage 3's empty placeholders, with their full size in ``ds_numel``)."""
        return getattr(module, "built_num_params", None) or sum(
            getattr(p, "ds_numel", p.numel()) for p in module.parameters())

    def _rank_record(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        states = self._census or self._model_states(trainer, module)
        activations = predicted_activations(trainer, module, self.cfg) or {}
        measured = states.get("activations")
        return {"rank": trainer.global_rank, "peak_rss_mib": _status_mib("VmHWM") - self.base_rss,
                "model_state_bytes": int(states["held"]),
                "predicted_bytes": int(states["predicted"]),
                "activation_bytes": int(measured) if measured is not None else None,
                "predicted_activation_bytes": activations.get("saved"),
                "predicted_activation_peak_bytes": activations.get("peak"),
                "model_state_by_kind": states["by_kind"],
                "model_state_labels": states.get("labels"), "num_params": int(states["num_params"]),
                "first_loss": self.first_loss, "train_loss": self.train_loss,
                "startup_s": self.startup, "pg_calls": dict(COUNTER.calls)}

    def finish(self, trainer: L.Trainer, module: L.LightningModule,
               copy_here: bool = False) -> None:
        """Rank 0 writes the job's record; with several nodes, it is sent to every rank, and
        those told ``copy_here`` (their node's local rank 0 where rank 0's job directory is
        not visible, nodes.py) write it into their own node's job directory."""
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, self._rank_record(trainer, module))
        digest = weights_digest(trainer, module)  # a collective under ZeRO: every rank
        record = self._record(trainer, module, ranks, digest) if trainer.global_rank == 0 else None
        if trainer.num_nodes > 1:
            sent = [record]
            dist.broadcast_object_list(sent, src=0)
            record = sent[0]
        if trainer.global_rank == 0 or copy_here:
            tmp = self.out.with_name(f".{self.out.name}.rank{trainer.global_rank}")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, self.out)

    def _record(self, trainer: L.Trainer, module: L.LightningModule, ranks: list[Any],
                digest: str) -> dict[str, Any]:
        """The job's measurements as rank 0 took them, with every rank's own record."""
        steps = max(1, trainer.global_step - WARMUP_STEPS)
        samples_per_s = self.samples / self.timed_s if self.timed_s else float("nan")
        seq = int(self.cfg.model.get("seq_len", 0) or 0) if self.cfg.model.name != "resnet" else 0
        cm = trainer.callback_metrics
        comm, comm_pg = self._comm_per_step(trainer, steps)
        return {
            "name": self.cfg.name, **run_columns(trainer),
            "requested": {"strategy": self.cfg.strategy.name,
                          "precision": self.cfg.precision.name,
                          "world_size": int(self.cfg.trainer.devices)
                          * int(self.cfg.trainer.num_nodes)},
            "nodes": int(trainer.num_nodes), "launcher": os.environ.get("ZS_LAUNCHER_ID"),
            "model": module.label, "steps": trainer.global_step,
            "ms_per_batch": 1000 * self.timed_s / self.timed_batches if self.timed_batches
            else float("nan"),
            "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * seq,
            "comm_bytes_per_step": comm, "comm_bytes_per_step_pg": comm_pg,
            "first_loss": sum(r["first_loss"] for r in ranks) / len(ranks),
            "train_loss": sum(r["train_loss"] for r in ranks) / len(ranks),
            "val_loss": float(cm.get("val_loss", float("nan"))), "val_step": self.val_step,
            "val_acc": float(cm["val_acc"]) if "val_acc" in cm else None,
            "num_params": ranks[0]["num_params"], "ranks": ranks, "weights_sha256": digest,
        }


def weights_digest(trainer: L.Trainer, module: L.LightningModule) -> str:
    """sha256 of the final weights (fp32 masters under ZeRO), key by key: equal digests mean
    bit-identical models (a restarted job against an uninterrupted one)."""
    engine = getattr(trainer.strategy, "engine", None)
    state = engine.full_state_dict() if engine is not None else full_state_dict(trainer, module)
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        # Raw bytes through uint8: numpy has no bfloat16 (a bf16_true job's weights).
        raw = state[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()
