"""Fabric strategy over `ZeroEngine`, and what the Lightning adapter shares with it.

``Fabric(strategy="zero3")`` trains any ``nn.Module`` + torch optimizer through the engine:
``fabric.setup`` builds one engine per model, ``fabric.backward`` / ``clip_gradients`` /
``optimizer.step()`` go to it, ``fabric.no_backward_sync`` is ``engine.no_sync()`` and
``fabric.save`` / ``fabric.load`` write and read the engine's sharded checkpoint directory.
``fabric.setup(model, muon, adamw)`` builds one engine over several optimizers (disjoint
parameter sets); the first ``.step()`` of any of them after a backward steps them all
(``stepping.StepTurns``).

Fabric is the lower layer of Lightning (``lightning.pytorch`` imports ``lightning.fabric``), so
the pieces both adapters need live here: presets, config and precision merging, the module
wrapper the frameworks call, and the Hydra-aware process launcher. No sharding logic lives in
either adapter: everything that touches parameters goes through the engine.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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

from . import collectives, reshard
from .config import PRECISIONS, ZeroConfig
from .engine import ZeroEngine
from .materialize import meta_init
from .stepping import StepTurns

# Mirrors Lightning's deepspeed_stage_* presets: "_offload" moves what the stage shards to CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}
PRESET_DESCRIPTIONS: dict[str, str] = {
    "zero1": "ZeRO stage 1 (optimizer states sharded)",
    "zero2": "ZeRO stage 2 (optimizer states and gradients sharded)",
    "zero3": "ZeRO stage 3 (optimizer states, gradients and parameters sharded)",
    "zero2_offload": "ZeRO stage 2, optimizer shard and its states in CPU memory",
    "zero3_offload": "ZeRO stage 3, optimizer and parameter shards in CPU memory",
}
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))
CLIENT_KEY = "zero_strategy.framework_state"
"""Key of the serialized framework state (loops, callbacks, schedulers, hyperparameters, the
user optimizer's hyperparameters) in the engine checkpoint's client state."""
CHECKPOINT_TAG = "checkpoint"
"""One path, one checkpoint: saving again to the same path replaces it (atomically)."""


# ---------------------------------------------------------------------- config and precision
def build_config(config: ZeroConfig | None, options: dict[str, Any], owner: str) -> ZeroConfig:
    """``config`` (default ``ZeroConfig()``) with ``options`` (ZeroConfig fields) replaced."""
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"{owner}(config=...) must be a ZeroConfig, got {type(config).__name__}")
    unknown = sorted(set(options) - set(CONFIG_FIELDS))
    if unknown:
        raise TypeError(
            f"{owner} got unknown option(s) {unknown}; allowed: config=ZeroConfig(...), "
            "process_group_backend, timeout, param_init_fn, or ZeroConfig fields "
            f"{list(CONFIG_FIELDS)}"
        )
    base = config if config is not None else ZeroConfig()
    return dataclasses.replace(base, **options) if options else base


def with_timeout(config: ZeroConfig, timeout: timedelta | float | None) -> ZeroConfig:
    """``config`` with the strategy's ``timeout=`` (a timedelta or seconds) as its
    ``ZeroConfig.timeout``; None keeps the config's. The process group is created with the
    result too, so the engine's collectives and the framework's share one limit."""
    if timeout is None:
        return config
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    return dataclasses.replace(config, timeout=seconds)


def precision_explicit(config: ZeroConfig | None, options: dict[str, Any]) -> bool:
    """Whether the user chose a precision in the strategy itself (not left the default)."""
    return "precision" in options or (config is not None and config.precision != "32-true")


def merge_precision(config: ZeroConfig, flag: str, explicit: bool, owner: str) -> ZeroConfig:
    """Combine the framework's ``precision=`` flag with the strategy's config.

    The framework always passes a flag ("32-true" when the user gave none), so a config that
    chose a precision wins over "32-true"; two different explicit choices are an error.
    """
    if flag not in PRECISIONS:
        raise ValueError(
            f"{owner} does not support precision={flag!r}; allowed: {list(PRECISIONS)} "
            "(the engine keeps fp32 master weights for the mixed modes)"
        )
    if flag == config.precision:
        return config
    if not explicit:
        return dataclasses.replace(config, precision=flag)
    if flag == "32-true":
        return config
    raise ValueError(
        f"precision conflict: the framework was given precision={flag!r} but "
        f"{owner}(config=...) has precision={config.precision!r}; set it in one place"
    )


def generic_precision_name(plugin: Any, generic: tuple[type, ...], owner: str) -> str:
    """The precision name of a plugin the framework built from its ``precision=`` flag.

    Lightning and Fabric replace the plugin of a strategy they do not know with their own
    (AMP autocast, GradScaler, torch clipping); we take its name and do the work in the engine.
    Any other plugin would change numerics behind the engine's back, so it is refused.
    """
    if type(plugin) not in generic:
        allowed = ", ".join(t.__name__ for t in generic)
        raise TypeError(
            f"{owner} handles precision itself and cannot use the plugin "
            f"{type(plugin).__name__}; pass precision=... (one of {list(PRECISIONS)}) instead "
            f"of a precision plugin (accepted generic plugins: {allowed})"
        )
    return str(plugin.precision)


# ---------------------------------------------------------------------- engine helpers
_FORWARD_COUNTER = itertools.count(1)


class EngineModule(nn.Module):
    """What the frameworks call as "the model": ``forward`` goes through the engine.

    The user's module is registered as ``module`` so ``train()``/``eval()`` reach it. Lightning
    redirects ``training_step`` and friends through this ``forward``, so every step runs inside
    the engine's forward (buffer broadcast, input casts, stage-3 gathers).
    """

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine
        self.calls = 0
        """Value of a process-wide counter at the last forward (which model ran last)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls = next(_FORWARD_COUNTER)
        return self.engine(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():
            yield


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def placeholder_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """Evaluation-only engines still need an optimizer: plain SGD keeps no state at all."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.0) if params else None


def backward_kwargs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``Tensor.backward``'s positional arguments by name (``engine.backward`` takes kwargs)."""
    names = ("gradient", "retain_graph", "create_graph", "inputs")
    if len(args) > len(names):
        raise TypeError(f"backward takes at most {len(names)} positional options {names}")
    return {**dict(zip(names, args)), **kwargs}


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The user optimizer's hyperparameters (lr, betas, ...), without the parameters.

    The engine reads them at every step; a resume must restore them before LR schedulers
    continue, as DDP does by loading the optimizer state dict.
    """
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def check_group_count(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} param groups, the current one has "
            f"{len(optimizer.param_groups)}: build the optimizer the way it was built when saving"
        )


def restore_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    check_group_count(optimizer, groups)
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)


def save_engine_checkpoint(engine: ZeroEngine, path: Path, state: dict[str, Any]) -> None:
    """The engine's shards plus the framework's ``state`` in its client state, one atomic tag.

    ``state`` (loops, callbacks, hyperparameters, ...) holds arbitrary objects while the engine
    reads its client state with ``weights_only=True``, so it travels as serialized bytes.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    engine.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state={CLIENT_KEY: payload})


def load_engine_checkpoint(engine: ZeroEngine, path: Path, with_optimizer: bool, owner: str,
                           weights_only: bool | None = None) -> dict[str, Any]:
    """Restore the engine from ``path``; returns the framework state saved beside it.

    The framework state is decoded and checked before the engine changes, so a checkpoint
    refused for any reason leaves the model and optimizer as they were. Evaluation-only
    engines carry a placeholder optimizer whose state must not be loaded.
    """
    if path.is_file():
        raise ValueError(
            f"{owner} resumes from the checkpoint directories it saves, but {str(path)!r} is a "
            "file. To start from a consolidated or DDP checkpoint, load its state dict into "
            "the model before training starts"
        )
    decoded: dict[str, Any] = {}

    def check(client: dict[str, Any] | None) -> None:  # every rank, before the engine changes
        decoded.update(decode_state(client, path, owner, weights_only))
        groups = decoded.get("param_groups")
        if with_optimizer and groups is not None:
            check_group_count(engine.user_optimizer, groups)

    reshard.load(engine, path, load_optimizer=with_optimizer, before_commit=check)
    return decoded


def decode_state(client: dict[str, Any] | None, path: Path, owner: str,
                 weights_only: bool | None = None) -> dict[str, Any]:
    if not client or CLIENT_KEY not in client:
        raise ValueError(
            f"{str(path)!r} is a zero_strategy checkpoint without {owner}'s state (saved with "
            "ZeroEngine.save_checkpoint directly?): load it with engine.load_checkpoint"
        )
    data = io.BytesIO(client[CLIENT_KEY].numpy().tobytes())
    # Passed through as Lightning does for local .ckpt files: None leaves it to torch, whose
    # default is weights_only=True, so a checkpoint cannot run code unless the user says so.
    try:
        return torch.load(data, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # the unpickler refused a type, or the bytes are damaged
        raise ValueError(
            f"{str(path)!r}: {owner}'s saved state cannot be loaded with weights_only="
            f"{weights_only!r} ({e}); if you trust this checkpoint, pass weights_only=False "
            "(e.g. trainer.fit(..., weights_only=False))"
        ) from e


def read_client_state(path: _PATH, owner: str, tag: str | None = None) -> dict[str, Any]:
    """The framework state of a checkpoint directory, read in one process (no engine)."""
    return decode_state(reshard.read_client_state(path, tag), Path(path), owner)


# ---------------------------------------------------------------------- Hydra-aware launching
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_HYDRA_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Hydra overrides the children set themselves, or that only mean something to a sweep.
_CHILD_OWNED = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.sweeper", "hydra.launcher",
                "hydra.job.name", "hydra.output_subdir", "hydra.job.num", "hydra.job.id")


def _hydra_job_dir() -> str | None:
    """The running Hydra job's output directory, or None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    return str(HydraConfig.get().runtime.output_dir)


def _script_command(absolute: Callable[[str], str] = os.path.abspath) -> list[str]:
    import __main__  # imported late: the main module of the process that launches

    if __main__.__spec__ is None:
        return [sys.executable, absolute(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def _hydra_cli_flags(argv: list[str]) -> list[str]:
    """--config-path/--config-name/--config-dir from the command line; overrides come from
    Hydra itself (sys.argv still holds the whole sweep in a multirun)."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _HYDRA_FLAGS and i + 1 < len(argv):
            kept += argv[i : i + 2]
            i += 2
            continue
        if arg.split("=", 1)[0] in _HYDRA_FLAGS and "=" in arg:
            kept.append(arg)
        i += 1
    return kept


def child_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command line (and cwd) that runs rank ``local_rank`` of the current job.

    Outside Hydra: this script with its arguments, as Lightning does. Under Hydra: this job's
    resolved overrides in RUN mode, writing into this job's output directory. Lightning
    re-runs ``sys.argv``, which in a ``-m`` multirun re-runs the whole sweep in every child.
    """
    if _hydra_job_dir() is None:
        return _script_command() + sys.argv[1:], None
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    cfg = HydraConfig.get()
    hydra_overrides = [o for o in cfg.overrides.hydra
                       if not str(o).split("=", 1)[0].lstrip("+~").startswith(_CHILD_OWNED)]
    # The job may have changed directory (hydra.job.chdir): resolve from where it started.
    command = _script_command(to_absolute_path) + _hydra_cli_flags(sys.argv[1:])
    command += [str(o) for o in cfg.overrides.task] + [str(o) for o in hydra_overrides]
    command += [
        f'hydra.run.dir="{cfg.runtime.output_dir}"',
        f"hydra.job.name={cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",  # the rank-0 process already wrote this job's config
        "hydra.mode=RUN",  # even if the primary config asks for MULTIRUN
    ]
    return command, get_original_cwd()


@dataclasses.dataclass
class _LaunchedWorld:
    """Children a launcher started for one Hydra job, and the environment before it."""

    job: str
    procs: list[subprocess.Popen]
    env_before: dict[str, str | None]

    def end(self, timeout: float = 300.0) -> None:
        for proc in self.procs:
            proc.wait(timeout=timeout)  # they finish the job the parent has just finished
        collectives.destroy_default_group()
        for key, value in self.env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_CURRENT_WORLD: _LaunchedWorld | None = None


class HydraJobLauncherMixin:
    """Makes Lightning's/Fabric's subprocess launchers run one Hydra job per world.

    Children get the current job's overrides (see ``child_command``). In a multirun the parent
    process runs the jobs one after another; when the next job launches, the previous job's
    world is ended first (children awaited, process group destroyed, launch variables
    restored), otherwise ``LOCAL_RANK`` left in the environment would make the next job think
    its processes were created externally and wait forever for peers that never start.
    """

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    procs: list[subprocess.Popen]

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        global _CURRENT_WORLD
        if _CURRENT_WORLD is not None and _CURRENT_WORLD.job != _hydra_job_dir():
            _CURRENT_WORLD.end()
            _CURRENT_WORLD = None
        return super().launch(function, *args, **kwargs)  # type: ignore[misc]

    def _call_children_scripts(self) -> None:
        global _CURRENT_WORLD
        self._check_can_spawn_children()  # type: ignore[attr-defined]
        env_before = {key: os.environ.get(key) for key in _LAUNCH_ENV}
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        self.procs = []
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            command, cwd = child_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))
        job = _hydra_job_dir()
        if job is not None:
            _CURRENT_WORLD = _LaunchedWorld(job, list(self.procs), env_before)


class _FabricLauncher(HydraJobLauncherMixin, _SubprocessScriptLauncher):
    pass


# ---------------------------------------------------------------------- Fabric
class ZeroFabricPrecision(fabric_precision.Precision):
    """Precision is the engine's job: no autocast, no module or input casts, no GradScaler.

    The engine casts floating-point inputs to the compute dtype itself and scales the loss
    for "16-mixed"; this plugin only carries the name.
    """

    def __init__(self, precision: str) -> None:
        self.precision = precision  # type: ignore[assignment]


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


class ZeroFabricStrategy(DDPStrategy):
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
        self.config = with_timeout(build_config(config, options, type(self).__name__), timeout)
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
            self.config = merge_precision(self.config, name, self._precision_explicit, owner)
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
        if error_if_nonfinite and self.config.precision != "16-mixed" and not norm.isfinite():
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
        if "optimizer" in kinds.values():
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


ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)

# Lightning was imported by this module: register the Trainer names too (see _registration).
from ._registration import install as _install_strategy_names  # noqa: E402

_install_strategy_names(ready=__name__)
