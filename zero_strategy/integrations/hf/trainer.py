"""``transformers.Trainer`` (and every subclass: TRL's trainers, ``Seq2SeqTrainer``) trained by
ZeroEngine.

``Trainer`` builds its own ``Accelerator`` and branches on DeepSpeed and FSDP wherever the
model's weights are saved, loaded or unwrapped; a Trainer that does not know the model is
sharded would save one rank's shard (or freed stage-3 placeholders) as "the model". So the
integration is a subclass that replaces exactly those places and leaves the training loop,
logging, evaluation, callbacks and data handling to ``Trainer``:

- the accelerator is a ``ZeroAccelerator`` (the options come from ``zero_plugin=``, else the
  plugin file named by ``$ZERO_STRATEGY_CONFIG``; precision from ``TrainingArguments``'
  ``bf16``/``fp16`` unless the plugin sets one, and a contradiction is refused);
- the model is never moved whole onto the device: the engine places its shards;
- at stage 3, parameters the optimizer Trainer builds would leave out (a frozen base under a
  LoRA adapter) join it in a group of their own with lr 0, so they are sharded like the rest;
  being frozen, they get no gradient and no optimizer state;
- ``checkpoint-N/`` holds the consolidated weights (``save_pretrained``'s files), our sharded
  model and optimizer in ``zero_checkpoint/``, and Trainer's own scheduler, RNG and
  ``trainer_state.json``; ``resume_from_checkpoint`` reads the sharded copy, on any world size;
- ``save_model()`` (and the weights of every ``checkpoint-N/``) writes what
  ``save_pretrained`` writes (for a PEFT model, the adapter only), streamed from the shards:
  rank 0 writes, each tensor gathered onto it alone, a bucket at a time (a collective);
- at stage 3, ``generate()`` (Trainer's evaluation, ``Seq2SeqTrainer``'s
  ``predict_with_generate``, TRL's ``unwrap_model_for_generation``) runs in the engine's
  generation mode: each unit gathered once per call and held while it fits
  ``generation_gather_budget``, else gathered per forward with the ranks kept in step
  (transformers' ``synced_gpus``, which the model's FSDP flag below also asks for);
- TRL's reference and reward models (``prepare_model(..., evaluation_mode=True)``) are
  sharded at stage 3 by frozen engines of their own (``ZeroAccelerator``); Trainer's own
  model never is; TRL's ``sync_ref_model`` goes through both engines (``trl.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import Trainer

from ... import compat
from ...checkpoint.verify import member
from ...comm import groups
from ..accelerate import (
    CHECKPOINT_SUBDIR,
    ZeroAccelerator,
    ZeroPlugin,
    has_accelerator_device,
)
from . import export, trl

TRAINING_ARGS_FILE = "training_args.bin"
"""Trainer's name for the pickled ``TrainingArguments`` beside a saved model."""
SCHEDULER_FILE = "scheduler.pt"
"""Trainer's name for the LR scheduler's state inside ``checkpoint-N``."""

T = TypeVar("T", bound=type)

# TrainingArguments fields whose feature the integration replaces or cannot honour, with why.
_REFUSED_ARGS = {
    "deepspeed": "DeepSpeed would shard the model a second time",
    "fsdp": "FSDP would shard the model a second time",
    "torch_compile": "the ZeRO model is not compiled by Trainer (compile the model's blocks "
                     "yourself before passing it)",
    "fp16_full_eval": "evaluation runs in the engine's precision",
    "bf16_full_eval": "evaluation runs in the engine's precision",
}


class _TrainerAccelerator(ZeroAccelerator):
    """``ZeroAccelerator`` as ``Trainer`` drives it: Trainer frees the accelerator's objects at
    the start of every ``train()`` and prepares the model and optimizer again; the engine (the
    sharded weights and optimizer state) must survive that, so ``free_memory()`` keeps it and
    ``prepare`` hands the same wrappers back. Frozen models prepared for evaluation beside it
    (TRL's reference and reward models) are kept the same way; Trainer's own model is never
    one of them, even when Trainer prepares it for an evaluation before ``train()``."""

    trainer: Any = None
    """The Trainer building this accelerator (a weak reference, set once it exists)."""

    def _trains(self, model: nn.Module) -> bool:
        trainer = self.trainer() if self.trainer is not None else None
        return trainer is not None and model is trainer.model

    def free_memory(self, *objects: Any) -> Any:
        if objects or (self._zero_model is None and not self._zero_frozen):
            return super().free_memory(*objects)
        # Accelerate's private lists of what it prepared, by the names compat.py pins
        models, optimizers = compat.ACCELERATOR_MODELS.name, compat.ACCELERATOR_OPTIMIZERS.name
        kept_models = [m for m in getattr(self, models)
                       if m is self._zero_model or any(m is f for f in self._zero_frozen)]
        kept_optimizers = [o for o in getattr(self, optimizers)
                           if any(o is z for z in self._zero_optimizers)]
        setattr(self, compat.ACCELERATOR_SCHEDULERS.name, [])
        setattr(self, compat.ACCELERATOR_DATALOADERS.name, [])
        setattr(self, models, kept_models)
        setattr(self, optimizers, kept_optimizers)
        if self._zero_model is None:  # the first train(): as Accelerate's own free_memory
            self.step = 0
        return None


class ZeroTrainerMixin:
    """What ``with_zero`` adds to a ``Trainer`` class (see the module docstring)."""

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        # Trainer.__init__ builds the accelerator, which needs the plugin: set it first.
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin.from_config()
        with trl.streamed_references(self):
            super().__init__(*args, **kwargs)
        trl.adapt_callbacks(self)  # TRL's trainers add theirs in their __init__

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        _refuse_unsupported(self.args)
        _check_precision(self.args, self.zero_plugin)
        _check_checkpointing(self.args, self.zero_plugin)
        build = functools.partial(_TrainerAccelerator, zero_plugin=self.zero_plugin)
        with _trainer_builds(build):
            super().create_accelerator_and_postprocess()
        self.accelerator.trainer = weakref.ref(self)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Not at construction: ``ZeroAccelerator.prepare`` puts the model on the device when
        the engine is built, and a model still on the meta device (``from_pretrained`` here)
        is materialised there by the engine unit by unit, which moving it now would break."""

    @property
    def zero_engine(self) -> Any:
        """The ``ZeroEngine`` training the model (None until ``train()`` prepared it)."""
        return getattr(self.accelerator, "_zero_model", None) and self.accelerator.engine

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if created and self.accelerator.zero_config.stage == 3:
            _shard_frozen_too(model if model is not None else self.model, optimizer)
        return optimizer

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> Any:
        model, loader = super()._prepare_for_training(max_steps, train_dataloader,
                                                      resume_from_checkpoint)
        self._engine_built()
        return model, loader

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``evaluate()``/``predict()`` before ``train()``: a model still on the meta device
        (``from_pretrained`` streaming into shards) needs the engine to exist first; Trainer's
        own evaluation preparation would try to move it to the device."""
        if self.zero_engine is None and any(p.is_meta for p in self.model.parameters()):
            self.create_optimizer()
            self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model,
                                                                          self.optimizer)
            self._engine_built()
        return super().evaluation_loop(*args, **kwargs)

    def _engine_built(self) -> None:
        engine = self.zero_engine
        if engine is not None and engine.config.stage == 3 and groups.group_size() > 1:
            # transformers reads this to run generate() with synced_gpus (every rank keeps
            # calling forward until all are done) and to keep layer-drop the same on every
            # rank: both are what a model whose forward gathers from all ranks needs.
            setattr(self.model, compat.FSDP_MANAGED.name, True)

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """What ``save_pretrained`` writes (for a PEFT model, its adapter), streamed from the
        shards: each tensor gathered onto the process that saves, a bucket at a time, no rank
        ever holding the whole model (a collective: call it on every rank; Trainer's own
        callers do, ``checkpoint-N/`` included)."""
        engine = self.zero_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._save_streamed(engine, output_dir)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's writer, reached with a ``state_dict`` only by callers that consolidated
        one themselves; without, once the engine exists, the weights stream from the shards
        (``save_model``)."""
        engine = self.zero_engine
        if engine is None or state_dict is not None:
            return super()._save(output_dir, state_dict=state_dict)
        self._save_streamed(engine, output_dir if output_dir is not None
                            else self.args.output_dir)
        return None

    def _save_streamed(self, engine: Any, output_dir: str) -> None:
        """The weights (rank 0 writes), then what Trainer saves beside them on the saving
        process: the processing class (or the collator's tokenizer) and the arguments."""
        export.save_model(engine, output_dir)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class
        if tokenizer is None and self.data_collator is not None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.zero_engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.accelerator.save_zero_checkpoint(output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
        return None

    def _save_scaler(self, output_dir: str) -> None:
        """fp16 loss scaling is the engine's, saved in ``zero_checkpoint``."""
        if self.zero_engine is None:
            super()._save_scaler(output_dir)

    # ------------------------------------------------------------------ resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        """Before the engine exists, Trainer loads a checkpoint's weights into the plain model;
        a checkpoint with our sharded copy is read after ``prepare`` instead (exact fp32
        masters, any world size). A plain Trainer checkpoint (from DDP) loads as Trainer
        loads it."""
        if _zero_folder(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.zero_engine is None or _zero_folder(checkpoint) is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        scheduler_file = Path(checkpoint) / SCHEDULER_FILE
        state: dict[str, Any] = {}

        def read_scheduler() -> None:
            # Read once every check of the engine's files passed, before anything changes.
            if scheduler_file.exists():
                member(Path(checkpoint), scheduler_file, "LR scheduler state")
                state.update(torch.load(scheduler_file, map_location="cpu", weights_only=True))

        self.accelerator.load_zero_checkpoint(checkpoint, then=read_scheduler)
        if state:
            self.lr_scheduler.load_state_dict(state)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self.zero_engine is None:
            super()._load_scaler(checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint's sharded copy when it has one (exact masters)."""
        best = self.state.best_model_checkpoint
        if self.zero_engine is None or best is None or _zero_folder(best) is None:
            return super()._load_best_model()
        self.zero_engine.load_checkpoint(Path(best) / CHECKPOINT_SUBDIR, load_optimizer=False)
        return None


def with_zero(trainer_class: T) -> T:
    """``trainer_class`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``SFTTrainer``)
    trained by ZeroEngine: a subclass taking ``zero_plugin=`` beside its own arguments."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"with_zero takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ZeroTrainerMixin):
        return trainer_class
    return _zero_class(trainer_class)


@functools.cache
def _zero_class(trainer_class: type) -> type:
    # Cached, so with_zero(SFTTrainer) is one class however often it is called (pickling and
    # isinstance checks see the same class).
    return type(f"Zero{trainer_class.__name__}", (ZeroTrainerMixin, trainer_class),
                {"__module__": __name__, "__doc__": trainer_class.__doc__})


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """``transformers.Trainer`` trained by ZeroEngine; takes ``zero_plugin=ZeroPlugin(...)``
    beside Trainer's arguments (without it, the plugin file in ``$ZERO_STRATEGY_CONFIG``)."""


# ---------------------------------------------------------------------------------- helpers
def _refuse_unsupported(args: Any) -> None:
    for field, why in _REFUSED_ARGS.items():
        if getattr(args, field, None):
            raise ValueError(f"TrainingArguments({field}=...) cannot be combined with a ZeRO "
                             f"Trainer: {why}; leave {field} unset")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"TrainingArguments: {args.n_gpu} GPUs in one process (DataParallel) "
                         "is not supported by a ZeRO Trainer; launch one process per GPU "
                         "(torchrun or accelerate launch)")
    if (int(os.environ.get("WORLD_SIZE", "1")) > 1 and not getattr(args, "use_cpu", False)
            and not has_accelerator_device()):
        # Without it Trainer runs every process alone (each rank the whole data set, no
        # reduction), as plain Trainer silently does on a machine without GPUs.
        raise ValueError("TrainingArguments(use_cpu=True) is needed to train several CPU "
                         "processes together on a machine without GPUs")
    if getattr(args, "save_only_model", False):
        raise ValueError("TrainingArguments(save_only_model=True) is not supported by a ZeRO "
                         "Trainer: a checkpoint without the sharded optimizer cannot be "
                         "resumed; leave save_only_model unset")


def _check_precision(args: Any, plugin: ZeroPlugin) -> None:
    """A plugin precision against TrainingArguments' flags, named as a Trainer user sets them
    (ZeroAccelerator would name Accelerate's mixed_precision instead)."""
    flag = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) \
        else None
    if flag is not None:  # Trainer hands Accelerate the same name
        plugin.settle_precision(flag, setting=f"TrainingArguments({flag}=True)")


def _check_checkpointing(args: Any, plugin: ZeroPlugin) -> None:
    """Trainer's own checkpointing replaces the function the engine gives transformers'
    layers (its offload would be lost without a word): one of the two."""
    chosen = plugin.options.get("activation_checkpointing")
    if chosen and getattr(args, "gradient_checkpointing", False):
        raise ValueError(
            f"{plugin.source}: activation_checkpointing={chosen!r} and "
            "TrainingArguments(gradient_checkpointing=True) would both checkpoint the layers; "
            "keep one (the plugin's also offloads with offload_activations and plans stage "
            "3's gathers of the recomputation)")


def _shard_frozen_too(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Frozen parameters outside the optimizer stay whole on every rank (the engine only shards
    what an optimizer holds); at stage 3 they join it in a group of their own, with lr 0 so
    that no scheduler or weight decay can move them even if one is unfrozen by mistake."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    # parameters() yields a tied parameter once
    frozen = [p for p in model.parameters() if id(p) not in held and not p.requires_grad]
    if frozen:
        optimizer.add_param_group({"params": frozen, "lr": 0.0, "weight_decay": 0.0})


def _zero_folder(checkpoint: str) -> Path | None:
    folder = Path(checkpoint) / CHECKPOINT_SUBDIR
    return folder if folder.is_dir() else None


@contextlib.contextmanager
def _trainer_builds(factory: Any) -> Iterator[None]:
    """``Trainer.create_accelerator_and_postprocess`` builds ``Accelerator(**args)`` by the
    name it imported; for that one call the name means ``factory``, so the rest of Trainer's
    set-up (gradient accumulation plugin, data loader config, flags) stays its own."""
    name = compat.TRAINER_ACCELERATOR
    trainer_module = compat.owner_of(name)
    original = getattr(trainer_module, name.name)
    setattr(trainer_module, name.name, factory)
    try:
        yield
    finally:
        setattr(trainer_module, name.name, original)


__all__ = ["ZeroTrainer", "ZeroTrainerMixin", "with_zero"]
