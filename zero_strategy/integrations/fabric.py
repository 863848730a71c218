"""Fabric strategy over `ZeroEngine`.

``Fabric(strategy="zero3")`` trains any ``nn.Module`` + torch optimizer through the engine:
``fabric.setup`` builds one engine per model, ``fabric.backward`` / ``clip_gradients`` /
``optimizer.step()`` go to it, ``fabric.no_backward_sync`` is ``engine.no_sync()`` and
``fabric.save`` / ``fabric.load`` write and read the engine's sharded checkpoint directory.
``fabric.setup(model, muon, adamw)`` builds one engine over several optimizers (disjoint
parameter sets); the first ``.step()`` of any of them after a backward steps them all
(``step_turns.StepTurns``). What the Lightning adapter shares with this one is in
``shared.py`` and ``hydra_launch.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH
from torch import nn

from ..config import LOSS_SCALED_PRECISIONS, ZeroConfig
from ..core.materialize import meta_init
from ..engine import ZeroEngine
from .hydra_launch import HydraJobLauncherMixin
from .shared import (
    PRESET_DESCRIPTIONS,
    PRESETS,
    EngineModule,
    WorldDevice,
    backward_kwargs,
    build_config,
    framework_precision_name,
    generic_precision_name,
    group_hyperparameters,
    has_meta_tensors,
    load_engine_checkpoint,
    merge_precision,
    placeholder_optimizer,
    precision_explicit,
    read_client_state,
    restore_hyperparameters,
    save_engine_checkpoint,
)
from .step_turns import StepTurns


class _FabricLauncher(HydraJobLauncherMixin, _SubprocessScriptLauncher):
    pass


# ---------------------------------------------------------------------- Fabric
class ZeroFabricPrecision(fabric_precision.Precision):
    """Precision is the engine's job: no autocast, no module or input casts, no GradScaler.

    The engine casts floating-point inputs to the compute dtype itself (or autocasts, under
    "-autocast") and scales the loss for fp16; this plugin only carries Fabric's name for it.
    """

    def __init__(self, precision: str) -> None:
        self.precision = framework_precision_name(precision)  # type: ignore[assignment]


_FABRIC_GENERIC = (fabric_precision.Precision, fabric_precision.MixedPrecision,
                   fabric_precision.HalfPrecision)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, EngineModule):
            raise TypeError(
                "no_backward_sync needs a model set up by fabric.setup(model, optimizer) under "
                f"ZeroFabricStrategy, got {type(module).__name__}"
            )
        return module.engine.no_sync()


class ZeroFabricStrategy(WorldDevice, DDPStrategy):
    """``Fabric(strategy="zero3")``: one ``ZeroEngine`` per ``fabric.setup(model, optimizer)``
    (or ``fabric.setup(model, opt1, opt2, ...)``: one engine over all of them).

    Args:
        config: the full engine config; ``**options`` (ZeroConfig fields) override its fields.
        precision: a ZeroConfig precision name (a string), or the plugin Fabric passes in.
        process_group_backend: "gloo" / "nccl"; default from the device, as for DDP.
        timeout: seconds (or a timedelta) any collective may wait for the other ranks: the
            process group's timeout and ``ZeroConfig.timeout`` (default: the config's, 600 s).
        param_init_fn: initialises each module of a meta-device model as the engine
            materialises it (default ``module.reset_parameters()``), e.g. a transformers
            model's ``_init_weights``.

    Processes, ranks and collectives are DDP's (same launcher, same process group); only what
    happens to the model differs, hence the subclass.
    """

    def __init__(
        self, config: ZeroConfig | None = None, *, accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
        checkpoint_io: Any = None, precision: fabric_precision.Precision | str | None = None,
        process_group_backend: str | None = None, timeout: timedelta | float | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None, **options: Any,
    ) -> None:
        if isinstance(precision, str):  # the ZeroConfig field, not Fabric's plugin argument
            options["precision"], precision = precision, None
        # Set before super().__init__, which already calls the precision setter.
        self.config = build_config(config, options, type(self).__name__, timeout)
        self._precision_explicit = precision_explicit(config, options)
        self._param_init_fn = param_init_fn
        self._modules: list[EngineModule] = []
        self._turns: dict[int, StepTurns] = {}  # by id(engine)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision=precision, process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.config.timeout), start_method="popen",
        )
        self._backward_sync_control = _ZeroBackwardSyncControl()

    # ------------------------------------------------------------------ plugins and launching
    @property
    def precision(self) -> fabric_precision.Precision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision(self.config.precision)
        return self._precision

    @precision.setter
    def precision(self, plugin: fabric_precision.Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroFabricPrecision):
            owner = type(self).__name__
            name = generic_precision_name(plugin, _FABRIC_GENERIC, owner)
            self.config = merge_precision(self.config, name, self._precision_explicit, owner,
                                          "Fabric")
            plugin = ZeroFabricPrecision(self.config.precision)
        self._precision = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _FabricLauncher(self.cluster_environment, self.num_processes,
                                         self.num_nodes)

    # ------------------------------------------------------------------ model setup
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` at stage 3 builds on the meta device; the
        engine materialises unit by unit, so no rank ever holds the whole model. ``meta_init``
        records the construction order, so the weights (and the generator afterwards) are
        those of building the model eagerly on this device (README: "Building large models:
        sharded init")."""
        if self.config.stage == 3 and empty_init:
            return meta_init(self.root_device, self._param_init_fn)
        return super().module_init_context(empty_init=empty_init)

    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # meta modules are materialised by the engine
            module.to(self.root_device)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None,
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """One engine over ``optimizers`` (several must hold disjoint parameter sets, e.g.
        Muon for the hidden matrices and AdamW for the rest); Fabric wraps each of them."""
        return self._wrap(module, optimizers), optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model set up without an optimizer (inference): sharded with a stateless one."""
        optimizer = placeholder_optimizer(module)
        return module if optimizer is None else self._wrap(module, optimizer)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError(self._err_msg_joint_setup_required())

    def _wrap(self, module: nn.Module,
              optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> EngineModule:
        engine = ZeroEngine(module, optimizer, self.config, device=self.root_device,
                            param_init_fn=self._param_init_fn)
        wrapped = EngineModule(engine)
        self._modules.append(wrapped)
        self._turns[id(engine)] = StepTurns(engine)
        return wrapped

    # ------------------------------------------------------------------ training
    def _engine_for(self, module: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None) -> ZeroEngine:
        """The engine of a set-up model or optimizer; without either (``fabric.backward(loss)``)
        the one whose forward ran last, i.e. the model that produced the loss."""
        if isinstance(module, EngineModule):
            return module.engine
        if optimizer is not None:
            for wrapped in self._modules:
                if self._turns[id(wrapped.engine)].covers(optimizer):
                    return wrapped.engine
        elif self._modules:
            return max(self._modules, key=lambda m: m.calls).engine
        raise ValueError(
            f"{type(self).__name__}: no model set up with fabric.setup(model, optimizer) "
            "matches this call"
        )

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any,
                 **kwargs: Any) -> None:
        engine = self._engine_for(module)
        self._turns[id(engine)].backward()
        engine.backward(tensor, **backward_kwargs(args, kwargs))

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The engine's step for all of the model's optimizers at the first ``.step()`` of
        any of them after a backward; the others' ``.step()`` then only take their turn."""
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"optimizer.step() options {sorted(kwargs)} are not supported")
        result = closure() if closure is not None else None
        engine = self._engine_for(optimizer=optimizer)
        self._turns[id(engine)].step(optimizer)
        return result

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | int,
        norm_type: float | int = 2.0, error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The norm over all shards; overflowing fp16 steps are skipped by the engine, so
        non-finite norms only raise when there is no loss scaling."""
        norm = self._engine_for(module, optimizer).clip_grad_norm_(float(max_norm),
                                                                    float(norm_type))
        if error_if_nonfinite and self.config.precision not in LOSS_SCALED_PRECISIONS \
                and not norm.isfinite():
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({norm}); "
                "pass error_if_nonfinite=False to clip_gradients to skip this check"
            )
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                             clip_val: float | int) -> None:
        self._engine_for(module, optimizer).clip_grad_value_(float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    def _split_state(self, state: dict[str, Any]) -> tuple[ZeroEngine, dict[str, str], dict]:
        """(the engine, {key: "module" | "optimizer"}, everything else) of a fabric state."""
        engines: dict[int, ZeroEngine] = {}
        kinds: dict[str, str] = {}
        rest: dict[str, Any] = {}
        optimizers: dict[str, torch.optim.Optimizer] = {}
        for key, obj in state.items():
            if isinstance(obj, EngineModule):
                engine, kinds[key] = obj.engine, "module"
            elif isinstance(obj, nn.Module):
                raise ValueError(f"state[{key!r}] is a model that fabric.setup did not set up "
                                 f"with {type(self).__name__}: set it up before saving/loading")
            elif isinstance(obj, torch.optim.Optimizer):
                engine, kinds[key] = self._engine_for(optimizer=obj), "optimizer"
                optimizers[key] = obj
            else:
                rest[key] = obj
                continue
            engines[id(engine)] = engine
        if len(engines) != 1:
            raise ValueError(
                f"{type(self).__name__} saves and loads one set-up model (and its optimizers) "
                f"per checkpoint; the state holds {len(engines)}: {sorted(kinds)}"
            )
        engine = next(iter(engines.values()))
        _check_all_optimizers(engine, optimizers)
        return engine, kinds, rest

    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank writes its shard into the directory ``path``; rank 0 adds the rest."""
        if storage_options is not None or filter:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint writes whole engine shards: "
                "storage_options and filter are not supported"
            )
        engine, kinds, rest = self._split_state(state)
        path = Path(self.broadcast(str(path)))
        converted = {k: v.state_dict() if _is_stateful(v) else v for k, v in rest.items()}
        save_engine_checkpoint(engine, path, {
            "state": converted, "kinds": kinds,
            "param_groups": group_hyperparameters(engine.user_optimizer)})

    def load_checkpoint(
        self, path: _PATH, state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True, weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore a directory written by ``save_checkpoint`` into ``state`` (in place);
        returns what was not restored, like Fabric's other strategies."""
        path = Path(self.broadcast(str(path)))
        if not state:
            return dict(read_client_state(path, type(self).__name__)["state"])
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):
            state = {"model" if isinstance(state, nn.Module) else "optimizer": state}
        engine, kinds, rest = self._split_state(state)
        meta = load_engine_checkpoint(engine, path, "optimizer" in kinds.values(),
                                      type(self).__name__, weights_only)
        saved = dict(meta["state"])
        if "optimizer" in kinds.values() and meta["param_groups"] is not None:
            restore_hyperparameters(engine.user_optimizer, meta["param_groups"])
        missing = [k for k in rest if k not in saved]
        if strict and missing:
            raise KeyError(f"the checkpoint {str(path)!r} has no entries {missing}; "
                           "pass strict=False to skip them")
        for key, obj in rest.items():
            if key not in saved:
                continue
            if _is_stateful(obj):
                obj.load_state_dict(saved.pop(key))
            else:
                state[key] = saved.pop(key)
        return saved

    def teardown(self) -> None:
        for wrapped in self._modules:
            wrapped.engine.close()
        self._modules.clear()
        self._turns.clear()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, preset in PRESETS.items():
            strategy_registry.register(name, cls, description=PRESET_DESCRIPTIONS[name],
                                       override=True, **preset)


def _check_all_optimizers(engine: ZeroEngine, given: dict[str, torch.optim.Optimizer]) -> None:
    """The engine checkpoints a model's optimizers together (one sharded state): a fabric state
    that holds some of them must hold all, or loading would change the ones left out."""
    if not given:
        return
    parts = engine.user_optimizers
    covered = {id(p) for opt in given.values()
               for p in (parts if opt is engine.user_optimizer else [opt])}
    missing = [f"optimizer {k} ({type(p).__name__})" for k, p in enumerate(parts)
               if id(p) not in covered]
    if missing:
        raise ValueError(
            f"the state holds the optimizer(s) {sorted(given)} but not {', '.join(missing)} of "
            "the same model: its optimizers are saved and loaded together, so put every "
            "optimizer fabric.setup returned for it in the state"
        )


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def register() -> None:
    """Adds the presets to Fabric's registry (``Fabric(strategy="zero3")``); called by
    ``registration.register_strategies``."""
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
