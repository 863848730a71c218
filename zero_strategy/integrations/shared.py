"""What the Lightning, Fabric and Accelerate adapters share, none of it tied to one framework.

The ZeRO presets (``zero1`` ... ``zero3_offload``, ``zero2_disk``, ``zero3_disk``), building a
``ZeroConfig`` from a strategy's keyword arguments and merging the framework's precision flag
into it, the module wrapper the frameworks call, and saving and loading the engine's
checkpoint with the framework's own state beside it. No sharding logic lives in any adapter:
everything that touches parameters goes through the engine.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import read as checkpoint_read
from ..config import PRECISIONS, ConfigError, PrecisionFlag, ZeroConfig, reconcile_precision
from ..engine import ZeroEngine

# Mirrors Lightning's deepspeed_stage_* presets: "_offload" moves what the stage shards to CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
    "zero2_disk": {"stage": 2, "offload_optimizer": "disk"},
    "zero3_disk": {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk"},
}
PRESET_DESCRIPTIONS: dict[str, str] = {
    "zero1": "ZeRO stage 1 (optimizer states sharded)",
    "zero2": "ZeRO stage 2 (optimizer states and gradients sharded)",
    "zero3": "ZeRO stage 3 (optimizer states, gradients and parameters sharded)",
    "zero2_offload": "ZeRO stage 2, optimizer shard and its states in CPU memory",
    "zero3_offload": "ZeRO stage 3, optimizer and parameter shards in CPU memory",
    "zero2_disk": "ZeRO stage 2, optimizer shard, its states and gradients in files "
                  "(offload_dir)",
    "zero3_disk": "ZeRO stage 3, optimizer, gradient and parameter shards in files (offload_dir)",
}
CLIENT_KEY = "zero_strategy.framework_state"
"""Key of the serialized framework state (loops, callbacks, schedulers, hyperparameters, the
user optimizer's hyperparameters) in the engine checkpoint's client state."""
CHECKPOINT_TAG = "checkpoint"
"""One path, one checkpoint: saving again to the same path replaces it (atomically)."""


# ---------------------------------------------------------------------- config and precision
def build_config(config: ZeroConfig | None, options: dict[str, Any], owner: str,
                 timeout: timedelta | float | None = None) -> ZeroConfig:
    """``config`` (default ``ZeroConfig()``) with ``options`` (ZeroConfig fields) replaced,
    checked by ``ZeroConfig.from_options`` as every entry point's options are. The strategy's
    own ``timeout=`` (a timedelta or seconds; None keeps the config's) becomes
    ``ZeroConfig.timeout``: the process group is created with it too, so the engine's
    collectives and the framework's share one limit."""
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"{owner}(config=...) must be a ZeroConfig, got {type(config).__name__}")
    if timeout is not None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        options = {**options, "timeout": seconds}
    return ZeroConfig.from_options(options, source=arguments(owner), base=config)


def arguments(owner: str) -> str:
    """How errors name a strategy's keyword arguments (``config=`` included)."""
    return f"{owner}(...) arguments"


def precision_explicit(config: ZeroConfig | None, options: dict[str, Any]) -> bool:
    """Whether the user chose a precision in the strategy itself (not left the default)."""
    return "precision" in options or (config is not None and config.precision != "32-true")


# Lightning's and Fabric's own precision names (the ones their ``precision=`` flag takes that
# the engine runs). Lightning's "-mixed" means what its DeepSpeedStrategy does (low-precision
# compute copies, fp32 masters: our "-mixed"); what its DDP does (autocast over fp32 weights)
# is our "-autocast", chosen in the strategy's config beside the same flag.
LIGHTNING_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_AUTOCAST_OF = {"bf16-mixed": ("bf16-autocast",), "16-mixed": ("16-autocast",)}


def framework_precision_name(precision: str) -> str:
    """The name Lightning and Fabric know for the engine's ``precision`` (what their
    ``trainer.precision`` / plugin reports): "-autocast" is mixed precision to them."""
    return precision.replace("-autocast", "-mixed")


def merge_precision(config: ZeroConfig, flag: str, explicit: bool, owner: str,
                    framework: str) -> ZeroConfig:
    """Combine the framework's ``precision=`` flag (``framework``: "Trainer", "Fabric") with
    the strategy's config, through ``reconcile_precision`` as every adapter does.

    The framework always passes a flag ("32-true" when the user gave none), so a config that
    chose a precision wins over "32-true"; two different explicit choices are an error.
    """
    if flag not in LIGHTNING_PRECISIONS:
        raise ConfigError(
            f"{owner} does not support precision={flag!r}; allowed: "
            f"{list(LIGHTNING_PRECISIONS)} (the engine keeps fp32 master weights for the "
            "mixed modes)"
        )
    agrees = PRECISIONS if flag == "32-true" else (flag, *_AUTOCAST_OF.get(flag, ()))
    given = PrecisionFlag(f"{framework}(precision={flag!r})", flag, agrees)
    settled = reconcile_precision(config.precision if explicit else None, given,
                                  source=arguments(owner))
    return ZeroConfig.from_options({"precision": settled} if settled != config.precision else {},
                                   source=arguments(owner), base=config)


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
            f"{type(plugin).__name__}; pass precision=... (one of {list(LIGHTNING_PRECISIONS)}) "
            "instead "
            f"of a precision plugin (accepted generic plugins: {allowed})"
        )
    return str(plugin.precision)


# ---------------------------------------------------------------------- processes and devices
def process_device(devices: list[torch.device] | None, local_rank: int) -> torch.device:
    """This process's device, for a Lightning or Fabric strategy.

    DDP takes ``devices[local_rank]``: a launcher that starts a node's processes for Lightning
    (torchrun, SLURM, Lightning's own) leaves one device per local rank in the list. A launcher
    that places each worker on its device itself and numbers local ranks across a node's
    workers (Ray Train, whose ``RayLightningEnvironment`` reports them) leaves fewer: the
    worker sees only its own device (``devices="auto"`` on a CPU is one), and the launcher has
    made it the current CUDA device before the training function runs. That device, then."""
    assert devices is not None, "the strategy's devices are set by the Trainer or Fabric"
    if local_rank < len(devices):
        return devices[local_rank]
    kind = devices[0].type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def sampler_kwargs(world_size: int, global_rank: int) -> dict[str, Any]:
    """``DistributedSampler``'s arguments: one replica per process of the world. DDP counts
    ``num_nodes * num_processes`` (its device list), which under a launcher that gives each
    worker one device (Ray Train) is 1 per node and would hand every worker all the data."""
    return {"num_replicas": world_size, "rank": global_rank}


class WorldDevice:
    """Mixed into the Lightning and the Fabric strategy ahead of DDP's: the device and the
    sampler's replicas taken from the world (``process_device``, ``sampler_kwargs``)."""

    parallel_devices: list[torch.device] | None
    local_rank: int
    world_size: int
    global_rank: int

    @property
    def root_device(self) -> torch.device:
        return process_device(self.parallel_devices, self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.world_size, self.global_rank)


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

    def check(client: dict[str, Any] | None, kind: str) -> None:  # every rank, before changes
        decoded.update(decode_state(client, path, owner, weights_only, kind))
        groups = decoded.get("param_groups")
        if with_optimizer and groups is not None:
            check_group_count(engine.user_optimizer, groups)

    checkpoint_read.load(engine, path, load_optimizer=with_optimizer, before_commit=check)
    return decoded


LIGHTNING_MARK = "pytorch-lightning_version"
"""A key every checkpoint dict Lightning writes has: tells its state in another system's file."""


def foreign_state(client: dict[str, Any] | None, path: Path, owner: str,
                  kind: str) -> dict[str, Any]:
    """What a DeepSpeed or DCP checkpoint holds for an adapter: the client state as it is
    (Lightning's loops and schedulers when Lightning wrote it) and no param groups of ours
    (the engine restored the file's own)."""
    client = dict(client or {})
    lightning = client if LIGHTNING_MARK in client else None
    if owner == "ZeroStrategy" and lightning is None:
        raise ValueError(
            f"{str(path)!r} is a {kind} checkpoint not written by Lightning (no loop or "
            "scheduler state), so Trainer.fit(ckpt_path=...) cannot resume it; load its "
            "weights and optimizer with engine.load_checkpoint, or convert it first "
            f"(zero-strategy convert {path} OUT --to zero)")
    return {"lightning": lightning, "state": client, "param_groups": None, "kinds": {}}


def decode_state(client: dict[str, Any] | None, path: Path, owner: str,
                 weights_only: bool | None = None, kind: str = "zero_strategy"
                 ) -> dict[str, Any]:
    if kind != "zero_strategy":
        return foreign_state(client, path, owner, kind)
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


def read_client_state(path: str | os.PathLike, owner: str,
                      tag: str | None = None) -> dict[str, Any]:
    """The framework state of a checkpoint directory, read in one process (no engine)."""
    return decode_state(checkpoint_read.read_client_state(path, tag), Path(path), owner)


