"""Lightning ``Trainer(strategy="zero3")``: the engine as a Lightning strategy.

``register()`` (run by ``import zero_strategy`` when Lightning is installed, see
``registration.py``) adds ``zero1``, ``zero2``, ``zero3``, ``zero2_offload`` and
``zero3_offload`` to the Trainer's registry; ``ZeroStrategy(config=...)`` gives full control.

How Lightning's calls reach the engine:

- every ``*_step`` is redirected through ``EngineModule.forward``, i.e. ``engine(...)``;
- ``backward`` goes strategy -> ``ZeroPrecision.backward`` -> ``engine.backward``;
- ``optimizer.step(closure)`` -> ``ZeroPrecision.optimizer_step``: closure, hooks, clipping
  (``clip_gradients`` -> ``engine.clip_grad_norm_``), then ``engine.step()``;
- accumulation: Lightning wraps non-final micro-batches in ``block_backward_sync()``, which is
  ``engine.no_sync()``;
- Lightning swaps the precision plugin of a strategy it does not know for its own (autocast,
  GradScaler, torch clipping); our setter takes that plugin's precision name instead, so the
  engine's loss scaling and sharded clipping always run;
- checkpoints are the engine's sharded directories plus one file of Lightning state;
  ``LightningModule.load_from_checkpoint(<such a directory>)`` consolidates it in memory
  (``register()`` wraps Lightning's loader for these directories only);
- several optimizers over disjoint parameter sets (Muon for the hidden matrices, AdamW for the
  rest): ``configure_optimizers`` returns ``zero_strategy.CombinedOptimizer([muon, adamw])``,
  one optimizer to Lightning, whose ``lr_scheduler`` entries may each drive one part.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core import saving as _lightning_saving
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..checkpoint import read as checkpoint_read
from ..checkpoint.write import LATEST, MANIFEST
from ..config import ZeroConfig
from ..core.materialize import meta_init
from ..engine import ZeroEngine
from ..optim.combined import CombinedOptimizer
from .hydra_launch import HydraJobLauncherMixin
from .shared import (
    CLIENT_KEY,
    PRESET_DESCRIPTIONS,
    PRESETS,
    EngineModule,
    WorldDevice,
    backward_kwargs,
    build_config,
    decode_state,
    framework_precision_name,
    generic_precision_name,
    group_hyperparameters,
    has_meta_tensors,
    load_engine_checkpoint,
    merge_precision,
    placeholder_optimizer,
    precision_explicit,
    restore_hyperparameters,
    save_engine_checkpoint,
)

_GENERIC_PLUGINS = (Precision, MixedPrecision, HalfPrecision)
_NOT_SAVED = ("state_dict", "optimizer_states")  # the engine's shards hold these

_SLOT = "_zero_engine_slot"


class _EngineSlot:
    """The engine managing a LightningModule, kept on the module itself.

    The engine outlives a trainer call on purpose: ``trainer.save_checkpoint`` after ``fit``
    and ``validate``/``test``/``predict`` (even from another Trainer) use it. Kept on the
    module, it is freed with the module; copies and pickles of the module get an empty slot.
    """

    def __init__(self, engine: ZeroEngine | None = None, has_optimizer: bool = False) -> None:
        self.engine = engine
        self.has_optimizer = has_optimizer

    def __deepcopy__(self, memo: dict[int, Any]) -> _EngineSlot:
        return _EngineSlot()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_EngineSlot, ())


def _slot(module: nn.Module) -> _EngineSlot:
    slot = module.__dict__.get(_SLOT)
    if slot is None:
        slot = _EngineSlot()
        object.__setattr__(module, _SLOT, slot)
    return slot


class ZeroPrecision(Precision):
    """Hands backward, clipping and the optimizer step to the engine.

    No autocast, module conversion or input cast here: the engine casts inputs to its compute
    dtype itself (or autocasts, under "-autocast"), keeps fp32 masters for the mixed modes and
    scales the loss for fp16. ``precision`` is Lightning's name for the engine's.
    """

    def __init__(self, precision: str, strategy: ZeroStrategy) -> None:
        self.precision = framework_precision_name(precision)  # type: ignore[assignment]
        self._strategy = strategy
        self._warned_backward = False

    def _engine(self) -> ZeroEngine:
        return self._strategy.require_engine("train")

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any,
                 *args: Any, **kwargs: Any) -> None:
        if is_overridden("backward", model) and not self._warned_backward:
            self._warned_backward = True
            rank_zero_warn("ZeroStrategy runs engine.backward(loss): the LightningModule's "
                           "overridden backward() is not called")
        self._engine().backward(tensor, **backward_kwargs(args, kwargs))

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"optimizer.step() options {sorted(kwargs)} are not supported")
        result = closure()  # training_step + backward (gradients reduced when it ends)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, clipping
        if model.automatic_optimization and result is None:
            return None  # training_step returned None: no backward, nothing to step
        engine = self._engine()
        engine.step()
        return result

    def clip_gradients(
        self, optimizer: Any, clip_val: float | int = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._engine().clip_grad_value_(float(clip_val))
        else:
            self._engine().clip_grad_norm_(float(clip_val))


def _one_optimizer_message(count: int) -> str:
    return (
        f"ZeroStrategy trains a LightningModule with one optimizer object, but "
        f"configure_optimizers returned {count}. For several optimizers over disjoint "
        "parameter sets (e.g. Muon for the hidden matrices, AdamW for the rest) return "
        "zero_strategy.CombinedOptimizer([muon, adamw]): one optimizer to Lightning (automatic "
        "optimization works), each part with its own param groups; an lr_scheduler may be "
        "attached to any part"
    )


@contextmanager
def _schedulers_on_parts() -> Iterator[None]:
    """Lightning accepts a scheduler only on an optimizer ``configure_optimizers`` returned; a
    scheduler on a part of a returned ``CombinedOptimizer`` is one too (the part's param groups
    are the combined optimizer's). While Lightning sets the optimizers up, its check (looked up
    by name in ``lightning.pytorch.core.optimizer``) also accepts the parts."""
    import lightning.pytorch.core.optimizer as lightning_optimizer

    original = lightning_optimizer._validate_optimizers_attached

    def check(optimizers: list[Any], configs: list[Any]) -> None:
        parts = [p for opt in optimizers if isinstance(opt, CombinedOptimizer)
                 for p in opt.optimizers]
        original([*optimizers, *parts], configs)

    lightning_optimizer._validate_optimizers_attached = check
    try:
        yield
    finally:
        lightning_optimizer._validate_optimizers_attached = original


def _count_optimizers(model: pl.LightningModule) -> int | None:
    """How many optimizers ``configure_optimizers`` returns, asked before processes start.

    Best effort: a model built in ``configure_model`` has no parameters yet, and some
    ``configure_optimizers`` need the Trainer (``estimated_stepping_batches``); those are
    checked again in ``setup``, on every rank alike.
    """
    if is_overridden("configure_model", model) or not any(True for _ in model.parameters()):
        return None
    try:
        optimizers, _, _ = _configure_optimizers(model.configure_optimizers())
    except Exception:  # noqa: BLE001 - anything it needs that is not there yet: setup checks
        return None
    return len(optimizers)


class _ZeroLauncher(HydraJobLauncherMixin, _SubprocessScriptLauncher):
    """Lightning's subprocess launcher that runs one Hydra job per world (see the mixin) and
    checks the Trainer's settings before any process is started."""

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 check: Callable[[pl.Trainer, pl.LightningModule | None], None]) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._check = check

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        if trainer is not None:
            model = args[0] if args and isinstance(args[0], pl.LightningModule) else None
            self._check(trainer, model)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZeroStrategy(WorldDevice, DDPStrategy):
    """ZeRO stages 0-3 with optional CPU offload and mixed precision, through ``ZeroEngine``.

    Args:
        config: the full engine config; ``**options`` (ZeroConfig fields such as ``stage``,
            ``offload_optimizer``) override its fields. The Trainer's ``precision=`` sets
            ``config.precision`` unless the config already chose one.
        process_group_backend: "gloo" / "nccl"; by default from the device, as for DDP.
        timeout: seconds (or a timedelta) any collective may wait for the other ranks: the
            process group's timeout and ``ZeroConfig.timeout`` (default: the config's, 600 s).
        param_init_fn: initialises each module of a meta-device model as the engine
            materialises it (default ``module.reset_parameters()``), e.g. a transformers
            model's ``_init_weights``.

    Processes, ranks and collectives are DDP's (same launcher, same process group), hence the
    subclass; the model goes to the engine instead of DistributedDataParallel.
    """

    strategy_name = "zero"

    def __init__(
        self, config: ZeroConfig | None = None, *, accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
        checkpoint_io: Any = None, precision_plugin: Precision | None = None,
        process_group_backend: str | None = None, timeout: timedelta | float | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None, **options: Any,
    ) -> None:
        # Set before super().__init__, which already calls the precision setter.
        self.config = build_config(config, options, type(self).__name__, timeout)
        self._precision_explicit = precision_explicit(config, options)
        self._param_init_fn = param_init_fn
        self._engine: ZeroEngine | None = None
        self._engine_has_optimizer = False
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.config.timeout), start_method="popen",
        )

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine training the LightningModule (None before ``fit``/``validate``/...)."""
        return self._engine

    def require_engine(self, what: str) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(
                f"ZeroStrategy cannot {what} before the engine exists: it is built when "
                "trainer.fit/validate/test/predict sets the model up"
            )
        return self._engine

    # ------------------------------------------------------------------ plugins and launching
    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision(self.config.precision, self)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            owner = type(self).__name__
            name = generic_precision_name(plugin, _GENERIC_PLUGINS, owner)
            self.config = merge_precision(self.config, name, self._precision_explicit, owner,
                                          "Trainer")
            plugin = ZeroPrecision(self.config.precision, self)
        self._precision_plugin = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _ZeroLauncher(self.cluster_environment, self.num_processes,
                                       self.num_nodes, check=self.check_trainer)

    def check_trainer(self, trainer: pl.Trainer, model: pl.LightningModule | None = None) -> None:
        """Settings the engine cannot honour, refused before any process starts."""
        if model is not None and trainer.state.fn == TrainerFn.FITTING:
            count = _count_optimizers(model)
            if count is not None and count != 1:
                raise ValueError(_one_optimizer_message(count))

    # ------------------------------------------------------------------ model setup
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``configure_model`` (and ``trainer.init_module()``) at stage 3 build on the meta
        device; the engine materialises unit by unit, so no rank holds the whole model.
        ``empty_init=False`` asks for real tensors. ``meta_init`` records the construction
        order, so the weights (and the generator afterwards) are those of building the model
        eagerly on this device, as DDP does (README: "Building large models: sharded init")."""
        if self.config.stage == 3 and empty_init is not False:
            with meta_init(self.root_device, self._param_init_fn):
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        if not has_meta_tensors(self.lightning_module):
            self.lightning_module.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        slot = _slot(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._release(slot)
            self.model_to_device()
            self._engine = self._new_engine(self._fit_optimizer(trainer))
            self._engine_has_optimizer = True
        elif slot.engine is not None:  # evaluate what the last fit (or evaluation) left
            self._engine, self._engine_has_optimizer = slot.engine, slot.has_optimizer
        else:
            self.model_to_device()
            self._engine = self._new_engine(placeholder_optimizer(module))
            self._engine_has_optimizer = False
        slot.engine, slot.has_optimizer = self._engine, self._engine_has_optimizer
        if self._engine is not None:
            self.model = EngineModule(self._engine)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's, with LR schedulers allowed on the parts of a ``CombinedOptimizer``."""
        with _schedulers_on_parts():
            super().setup_optimizers(trainer)

    def _fit_optimizer(self, trainer: pl.Trainer) -> torch.optim.Optimizer:
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(_one_optimizer_message(len(self.optimizers)))
        return self.optimizers[0]

    def _new_engine(self, optimizer: torch.optim.Optimizer | None) -> ZeroEngine | None:
        if optimizer is None:  # nothing trainable to shard: evaluate the module as it is
            return None
        assert self.lightning_module is not None
        # A meta-device model (configure_model at stage 3) is materialised by the engine one
        # unit at a time on this device.
        return ZeroEngine(self.lightning_module, optimizer, self.config, device=self.root_device,
                          param_init_fn=self._param_init_fn)

    def _release(self, slot: _EngineSlot) -> None:
        """A new fit builds a new engine (new optimizer): give the module back its weights as
        ordinary tensors first, then drop the old engine's hooks."""
        engine = slot.engine
        if engine is None:
            return
        engine.close()  # whole parameters with the trained (master) values, hooks removed
        slot.engine, slot.has_optimizer = None, False

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Non-final micro-batches of an accumulation window: no gradient communication."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    def teardown(self) -> None:
        # Unlike DDP, the module is neither unwrapped nor moved to CPU: at stage 3 its
        # parameters are views into the engine's buffers, which stays alive for later
        # save_checkpoint / evaluation calls.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to receive its shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored by the engine

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # sharded: written by the engine (zero_strategy.consolidate assembles it)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # sharded: written by the engine

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done by load_checkpoint through the engine

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done by load_checkpoint through the engine

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        """Every rank writes its shard into the directory ``filepath``; rank 0 adds the
        Lightning state (loops, callbacks, schedulers, hyperparameters)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint writes through the engine: "
                            "storage_options is not supported")
        engine = self.require_engine("save a checkpoint")
        path = Path(self.broadcast(str(filepath)))
        groups = group_hyperparameters(engine.user_optimizer) if (
            self._engine_has_optimizer) else None
        lightning_state = {k: v for k, v in checkpoint.items() if k not in _NOT_SAVED}
        save_engine_checkpoint(engine, path, {"lightning": lightning_state,
                                              "param_groups": groups})

    def load_checkpoint(self, checkpoint_path: _PATH,
                        weights_only: bool | None = None) -> dict[str, Any]:
        engine = self.require_engine("load a checkpoint")
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = load_engine_checkpoint(engine, path, self._engine_has_optimizer,
                                      type(self).__name__, weights_only)
        if self._engine_has_optimizer and meta.get("param_groups") is not None:
            restore_hyperparameters(engine.user_optimizer, meta["param_groups"])
        return dict(meta["lightning"])

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, preset in PRESETS.items():
            strategy_registry.register(name, cls, description=PRESET_DESCRIPTIONS[name],
                                       override=True, **preset)


def _conversion_hint(directory: str) -> str:
    return (f"for its weights alone run `zero-strategy consolidate {directory} model.safetensors` "
            "and load them with model.load_state_dict(safetensors.torch.load_file("
            "'model.safetensors'))")


def _lightning_state(checkpoint_dir: _PATH, tag: str | None,
                     weights_only: bool | None) -> dict[str, Any]:
    """The Lightning state (loops, callbacks, hyperparameters) ``ZeroStrategy`` saved beside
    the shards; a checkpoint written by the engine, ``ZeroAccelerator`` or Fabric has none."""
    directory = str(checkpoint_dir)
    client = checkpoint_read.read_client_state(checkpoint_dir, tag)
    if not client or CLIENT_KEY not in client:
        raise ValueError(
            f"{directory!r} is a zero_strategy checkpoint without Lightning state (written by "
            "ZeroEngine.save_checkpoint or ZeroAccelerator.save_state, not by ZeroStrategy), so "
            f"LightningModule.load_from_checkpoint cannot rebuild a module from it; "
            + _conversion_hint(directory))
    meta = decode_state(client, Path(directory), "ZeroStrategy", weights_only)
    if "lightning" not in meta:
        raise ValueError(
            f"{directory!r} was written by fabric.save (ZeroFabricStrategy), which saves no "
            "LightningModule state: load it with fabric.load, or "
            + _conversion_hint(directory))
    return dict(meta["lightning"])


def consolidate_checkpoint(
    checkpoint_dir: _PATH, output_file: _PATH | None = None, *, tag: str | None = None,
    dtype: torch.dtype | None = None, weights_only: bool | None = None,
) -> dict[str, Any]:
    """A ``ZeroStrategy`` checkpoint directory as one ordinary Lightning checkpoint.

    The consolidated weights (fp32 masters, or ``dtype``) go under ``state_dict`` beside the
    saved Lightning state (hyperparameters, loops, callbacks), so
    ``LightningModule.load_from_checkpoint(output_file)`` works; written with ``torch.save``
    when ``output_file`` is given. Runs in a single process (no process group needed).
    ``weights_only`` is torch.load's, for the Lightning state (None: torch's default, True).
    ``load_from_checkpoint`` on the directory itself does this in memory (see
    ``load_zero_checkpoint``).
    """
    lightning_state = _lightning_state(checkpoint_dir, tag, weights_only)
    state_dict = checkpoint_read.consolidate(checkpoint_dir, tag=tag, dtype=dtype)
    checkpoint = {**lightning_state, "state_dict": state_dict}
    if output_file is not None:
        torch.save(checkpoint, output_file)
    return checkpoint


# ---------------------------------------------------------------------- load_from_checkpoint
def is_zero_checkpoint(path: Any) -> bool:
    """``path`` is a local directory holding a zero_strategy checkpoint (a tag directory with
    its manifest, or a root with a ``latest`` tag)."""
    if not isinstance(path, (str, os.PathLike)) or "://" in str(path):
        return False
    root = Path(path)
    return root.is_dir() and ((root / MANIFEST).exists() or (root / LATEST).exists())


def load_zero_checkpoint(path: _PATH, map_location: Any = None,
                         weights_only: bool | None = None) -> dict[str, Any]:
    """What ``torch.load`` of a consolidated ``.ckpt`` would give, read from a ``ZeroStrategy``
    checkpoint directory: consolidated in this process (every rank may call it; no
    collective), the weights on the CPU unless ``map_location`` says otherwise."""
    checkpoint = consolidate_checkpoint(path, weights_only=weights_only)
    if map_location is None or map_location is _lightning_saving._default_map_location:
        return checkpoint  # Lightning's default keeps CPU storage on the CPU
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        checkpoint["state_dict"] = {k: v.to(device) for k, v in checkpoint["state_dict"].items()}
        return checkpoint
    # A dict or a callable: torch.load's own semantics, through one in-memory round trip.
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=map_location, weights_only=weights_only is not False)


def _install_load_from_checkpoint() -> None:
    """``LightningModule.load_from_checkpoint(path)`` (and the DataModule's) read ``path``
    with ``lightning.pytorch.core.saving.pl_load``, which opens it as a file: on the sharded
    directory ``ModelCheckpoint`` reports it raised ``IsADirectoryError``. Wrapped once here,
    a zero_strategy checkpoint directory is consolidated in memory instead; every other path
    (files, URLs, other directories) goes to Lightning's loader unchanged."""
    original = getattr(_lightning_saving, "pl_load", None)
    if original is None or getattr(original, "_zero_strategy", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None,
                weights_only: bool | None = None) -> Any:
        if is_zero_checkpoint(path_or_url):
            return load_zero_checkpoint(path_or_url, map_location, weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._zero_strategy = True  # type: ignore[attr-defined]
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    _lightning_saving.pl_load = pl_load


def register() -> None:
    """Adds the presets to the Trainer's registry and routes ``load_from_checkpoint`` on our
    checkpoint directories; called by ``registration.register_strategies``."""
    _install_load_from_checkpoint()
    ZeroStrategy.register_strategies(StrategyRegistry)
