"""`ZeroConfig`: the one place where every option, its default and its validation live.

The config is frozen and checked at construction, so an engine never starts from a
contradictory set of options and nothing falls back silently to another stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

STAGES = (0, 1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
REDUCE_DTYPES = ("fp32", "compute")
NONFINITE_POLICIES = ("skip", "error", "off")
QUANTIZATIONS = ("off", "int8")
OFFLOAD_TIERS = (False, True, "cpu", "disk")
ACTIVATION_TIERS = (False, "cpu", "disk")
"""Values of ``offload_activations``."""
"""Values of ``offload_optimizer`` / ``offload_params``: False (none), True or "cpu" (host
memory), "disk" (files under ``offload_dir``)."""
DEFAULT_DISK_STAGING_BYTES = 64 << 20
MIN_DISK_STAGING_BYTES = 16 << 10  # 4 slots of a page

# Stage-3-only knobs use None as "not set", so that setting one for a lower stage can be
# rejected instead of ignored. Their stage-3 defaults live here and nowhere else.
STAGE3_DEFAULTS: dict[str, Any] = {
    "unit_numel": 1_000_000,
    "param_persistence_threshold": 10_000,
    "prefetch": True,
    "unit_leaf_classes": (),
    "check_gather_order": True,
}


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for ``precision="16-mixed"`` (the knobs DeepSpeed users know)."""

    initial_scale: float = 2.0**16
    """Starting scale; a power of two so scaling and unscaling are exact."""
    growth_interval: int = 1000
    """Consecutive overflow-free steps after which the scale doubles."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the scale is halved (the counter resets on growth)."""
    min_scale: float = 1.0
    """The scale never drops below this."""
    static_scale: float | None = None
    """A fixed scale; disables growth and backoff (overflowing steps are still skipped)."""

    def __post_init__(self) -> None:
        _check_power_of_two("loss_scale.initial_scale", self.initial_scale)
        _check_positive_int("loss_scale.growth_interval", self.growth_interval)
        _check_positive_int("loss_scale.hysteresis", self.hysteresis)
        if not (_is_number(self.min_scale) and 0 < self.min_scale <= MAX_LOSS_SCALE):
            raise ValueError(f"loss_scale.min_scale must be a finite number in (0, 2**64], got "
                             f"{self.min_scale!r}")
        if self.min_scale > self.initial_scale:
            raise ValueError(
                f"loss_scale.min_scale ({self.min_scale}) must be <= loss_scale.initial_scale "
                f"({self.initial_scale})"
            )
        if self.static_scale is not None and not (
            _is_number(self.static_scale) and 0 < self.static_scale <= MAX_LOSS_SCALE
        ):
            raise ValueError(
                f"loss_scale.static_scale must be a finite number in (0, 2**64] or None, got "
                f"{self.static_scale!r} (an infinite scale would skip every step)"
            )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What the engine shards, where it keeps it and in which dtype.

    stage 0 is plain data parallelism, 1 shards optimizer states, 2 also gradients,
    3 also parameters (Rajbhandari et al., arXiv:1910.02054).
    """

    stage: int = 3
    """ZeRO stage: 0, 1, 2 or 3."""
    precision: str = "32-true"
    """Lightning's precision names: "32-true", "bf16-mixed", "16-mixed", "bf16-true"."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are communicated in: "fp32" or "compute" (the precision's compute dtype)."""
    bucket_numel: int = 5_000_000
    """Elements per communication bucket for stages 0-2 (and for stage 3's persistent params)."""
    unit_numel: int | None = None
    """Stage 3: a submodule becomes its own gather unit once it holds this many elements
    not claimed by a smaller unit (default 1,000,000)."""
    param_persistence_threshold: int | None = None
    """Stage 3: parameters with fewer elements stay whole on every rank (default 10,000;
    units gather all their parameters in one collective, so persistence saves no latency here)."""
    prefetch: bool | None = None
    """Stage 3: gather the next unit while the current one computes (default True)."""
    unit_leaf_classes: tuple[str, ...] | None = None
    """Stage 3: class names of modules gathered as one unit with everything below them, e.g.
    a mixture-of-experts layer whose experts do not all run on every rank (default none)."""
    check_gather_order: bool | str | None = None
    """Stage 3: with each gather, check with a 16-byte all-gather that every rank gathers
    the same unit, and raise ``GatherOrderError`` naming both when ranks run different
    modules (default True). True: on the host (gloo) the check blocks before the gather, so
    the wrong shards are never exchanged, and it keeps gradient reductions in step across
    ranks whose backward differs (experts under ``unit_leaf_classes``); on a GPU it is read
    once at the end of backward (no host sync per unit), so mismatched gathers run first
    and nccl may end the job (its watchdog, or ``timeout``) before the error is raised.
    "blocking": the host check on every device, for debugging such a job on a GPU (one host
    sync per gather). False: no check."""
    overlap_param_gather: bool = True
    """Stages 1-2 (and stage 3's persistent parameters): the all-gather of the updated
    parameters after ``step()`` runs in the background, and each bucket is waited for when
    something first reads one of its parameters through the module (the next forward, an
    attribute read, ``parameters()``, ``state_dict()``, the engine's own readers). A tensor
    taken from the module before ``step()`` and read after it, before such a read, may hold
    other ranks' old values: take references after ``step()``, or set False to wait in
    ``step()``."""
    offload_optimizer: bool | str = False
    """Where the fp32 master shard and optimizer states rest (stage >= 1): False on the
    device; True or "cpu" in CPU memory, stepped there (on a CPU device they are in CPU
    memory already: nothing is moved or copied); "disk" (stages 2-3) in files under
    ``offload_dir``, together with the reduced gradient shards, brought in one unit at a time
    for the step with the next unit read ahead, so host memory holds a few units' worth
    (ZeRO-Infinity's NVMe tier; no libaio or compiled ops: each unit's files are read and
    written whole with direct I/O on two background threads)."""
    offload_params: bool | str = False
    """Stage 3: where parameter shards rest between gathers: False on the device; True or
    "cpu" in CPU memory (on a CPU device: where they are already, at no cost); "disk" in files
    under ``offload_dir``, read ahead of each gather (needs ``offload_optimizer="disk"``)."""
    offload_dir: str | None = None
    """Directory for the "disk" tier's files (one subdirectory per rank, locked while an
    engine uses it, removed by ``close()``). None: a fresh directory under the system's temp
    dir, removed by ``close()``. Setting it without a "disk" tier is an error."""
    disk_staging_bytes: int | None = None
    """On a GPU, the pinned host memory the "disk" tier's copies to and from the device pass
    through (a ring of 4 buffers, allocated once): the most the tier ever pins. None: 64 MiB.
    At least 16 KiB; setting it without a "disk" tier is an error."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's module buffers at every forward, as DistributedDataParallel does."""
    nonfinite_grads: str = "skip"
    """What a step does when any gradient is inf/NaN on any rank: "skip" it everywhere
    (weights, optimizer state and step counts unchanged; ``step()`` returns False and warns),
    "error" (raise), or "off" (no check). "16-mixed" needs "skip" (its loss scaling relies on
    skipped overflow steps)."""
    elementwise_optimizer: bool = False
    """Assert that a custom optimizer's update is elementwise (each element's new value
    depends only on that element's gradient and state), so running it on flat shards is exact.
    torch's elementwise optimizers are recognised without it."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for "16-mixed"; customising it under another precision is an error."""
    shard_group_size: int | None = None
    """Hybrid sharding (FSDP's HSDP, ZeRO++'s hierarchical partitioning): shard within groups of
    this many consecutive ranks (a node's GPUs) and replicate across the groups. Gathers and
    reduce-scatters stay inside a group; each gradient shard is then all-reduced across the
    groups, the only traffic between them. Must divide the world size; None (default) shards
    over every rank. Stages 1-3."""
    quantize_weights: str = "off"
    """Stage 3: send the parameter all-gathers as block-wise int8, one fp32 scale per 256
    elements (ZeRO++'s quantized weight gather): 0.26x the bytes of fp32, 0.52x of bf16. Every
    rank computes with the same decoded weights (its own piece too); the masters the optimizer
    updates stay exact. "off" or "int8"."""
    quantize_gradients: str = "off"
    """Stages 1-3: send the gradient reduce-scatter as block-wise int8 (ZeRO++'s quantized
    gradients, as an all-to-all): each rank receives its slice of every other rank's gradient
    in int8, decodes it and sums in fp32 with its own part, which is never quantized.
    "off" or "int8"."""
    activation_checkpointing: bool | tuple[str, ...] = False
    """Recompute activations in backward instead of keeping them (every stage). True: each
    transformer layer transformers marks as checkpointable (``GradientCheckpointingLayer``:
    what ``model.gradient_checkpointing_enable()`` picks), else each module of the model's
    outermost list of two or more modules of one class (``nn.ModuleList`` / ``Sequential``:
    the blocks). A list of class names: every module of those classes, outermost first (one
    inside another checkpointed module is not checkpointed again). Each chosen module keeps
    only its inputs from forward (``torch.utils.checkpoint``, non-reentrant, RNG state
    restored, so dropout draws the same masks); at stage 3 the units it recomputes stay
    gathered from their recomputation through their backward, so a step gathers each unit
    once for forward and once for backward, as without checkpointing."""
    offload_activations: bool | str = False
    """Where the inputs the checkpointed modules keep rest until backward (needs
    ``activation_checkpointing``): False on the device; "cpu" in host memory (copied on a
    side stream from a GPU; on a CPU device they are there already: nothing moves); "disk"
    in files under ``offload_dir`` (written and read back on a background thread). Each is
    brought back ahead of the module's recomputation, the next one's while it runs."""
    timeout: float = 600.0
    """Seconds a collective the engine issues may wait for the other ranks before it raises an
    error naming the collective and the step (a stalled or lost peer). The default is torch's
    NCCL default (10 minutes); gloo's own is 30. Under nccl it applies through the process
    group's timeout, which the adapters set from this field."""

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, dict):
            object.__setattr__(self, "loss_scale", LossScaleConfig(**self.loss_scale))
        self._check_choices()
        self._check_sizes()
        self._check_stage_consistency()

    def _check_choices(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype must be one of {REDUCE_DTYPES}, got {self.reduce_dtype!r}"
            )
        for name in ("quantize_weights", "quantize_gradients"):
            if getattr(self, name) not in QUANTIZATIONS:
                raise ValueError(f"{name} must be one of {QUANTIZATIONS}, got "
                                 f"{getattr(self, name)!r}")
        if self.nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_grads must be one of {NONFINITE_POLICIES}, got "
                             f"{self.nonfinite_grads!r}")
        if self.precision == "16-mixed" and self.nonfinite_grads != "skip":
            raise ValueError(
                f"precision='16-mixed' needs nonfinite_grads='skip' (got "
                f"{self.nonfinite_grads!r}): dynamic loss scaling finds its scale by skipping "
                "the steps that overflow")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if not any(value is allowed or (isinstance(allowed, str) and value == allowed)
                       for allowed in OFFLOAD_TIERS):
                raise ValueError(f"{name} must be False, True, 'cpu' or 'disk', got {value!r}")
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str)
                                             or not self.offload_dir):
            raise ValueError(f"offload_dir must be a directory path (str) or None, got "
                             f"{self.offload_dir!r}")
        staging = self.disk_staging_bytes
        if staging is not None and (isinstance(staging, bool) or not isinstance(staging, int)
                                    or staging < MIN_DISK_STAGING_BYTES):
            raise ValueError(f"disk_staging_bytes must be an int >= {MIN_DISK_STAGING_BYTES} "
                             f"(bytes of pinned host memory) or None, got {staging!r}")
        self._check_activation_choices()
        for name in ("broadcast_buffers", "elementwise_optimizer", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be True, False or None, got {self.prefetch!r}")
        order = self.check_gather_order
        if order is not None and not isinstance(order, bool) and order != "blocking":
            raise ValueError(f"check_gather_order must be True, False, 'blocking' or None, "
                             f"got {order!r}")
        leaves = self.unit_leaf_classes
        if isinstance(leaves, list):
            leaves = tuple(leaves)
            object.__setattr__(self, "unit_leaf_classes", leaves)
        if leaves is not None and not (
            isinstance(leaves, tuple) and all(isinstance(c, str) and c for c in leaves)
        ):
            raise ValueError(
                f"unit_leaf_classes must be a list of module class names (str), got {leaves!r}")
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ValueError(
                f"loss_scale must be a LossScaleConfig or a dict, got {type(self.loss_scale)!r}"
            )

    def _check_activation_choices(self) -> None:
        chosen = self.activation_checkpointing
        if isinstance(chosen, list):
            chosen = tuple(chosen)
            object.__setattr__(self, "activation_checkpointing", chosen)
        if not (isinstance(chosen, bool) or (
                isinstance(chosen, tuple) and chosen and all(isinstance(c, str) and c
                                                             for c in chosen))):
            raise ValueError(
                f"activation_checkpointing must be True, False or a non-empty list of module "
                f"class names (str), got {chosen!r}")
        offload = self.offload_activations
        if offload is True:
            raise ValueError(
                "offload_activations must be False, 'cpu' or 'disk', got True (say where: "
                "'cpu' for host memory, 'disk' for files under offload_dir)")
        if not any(offload is allowed or (isinstance(allowed, str) and offload == allowed)
                   for allowed in ACTIVATION_TIERS):
            raise ValueError(f"offload_activations must be False, 'cpu' or 'disk', got "
                             f"{offload!r}")
        if offload and not chosen:
            raise ValueError(
                f"offload_activations={offload!r} needs activation_checkpointing (True or a "
                "list of module class names): what is offloaded are the inputs the "
                "checkpointed modules keep for their recomputation")

    def _check_sizes(self) -> None:
        _check_positive_int("bucket_numel", self.bucket_numel)
        if (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                or not 0 < self.timeout < float("inf")):
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        if self.unit_numel is not None:
            _check_positive_int("unit_numel", self.unit_numel)
        if self.shard_group_size is not None:
            _check_positive_int("shard_group_size", self.shard_group_size)
        threshold = self.param_persistence_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0
        ):
            raise ValueError(
                f"param_persistence_threshold must be an int >= 0, got {threshold!r}"
            )

    def _check_stage_consistency(self) -> None:
        if self.stage < 3:
            for name in STAGE3_DEFAULTS:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} applies to stage 3 only (parameters are not sharded at "
                        f"stage {self.stage}); leave it unset or use stage=3"
                    )
            if self.offload_params:
                raise ValueError(
                    f"offload_params requires stage=3 (got stage={self.stage}): only stage 3 "
                    "shards parameters; use offload_optimizer for stages 1-2"
                )
        if self.shard_group_size is not None and self.stage == 0:
            raise ValueError(
                f"shard_group_size={self.shard_group_size} requires stage >= 1 (stage 0 shards "
                "nothing); allowed stages: 1, 2, 3")
        if self.quantize_weights != "off" and self.stage != 3:
            raise ValueError(
                f"quantize_weights={self.quantize_weights!r} requires stage=3 (got stage="
                f"{self.stage}): only stage 3 gathers parameters; stages 0-2 keep them whole")
        if self.quantize_gradients != "off" and self.stage == 0:
            raise ValueError(
                f"quantize_gradients={self.quantize_gradients!r} requires stage >= 1 (stage 0 "
                "all-reduces gradients whole); allowed stages: 1, 2, 3")
        self._check_disk_tier()
        if self.offload_optimizer and self.stage == 0:
            raise ValueError(
                "offload_optimizer requires stage >= 1 (stage 0 keeps no optimizer shard to "
                "offload); allowed stages: 1, 2, 3"
            )
        if self.precision != "16-mixed" and self.loss_scale != LossScaleConfig():
            raise ValueError(
                f"loss_scale applies to precision='16-mixed' only, got precision="
                f"{self.precision!r}"
            )

    def _check_disk_tier(self) -> None:
        if self.params_tier == "disk" and self.optimizer_tier != "disk":
            raise ValueError(
                f"offload_params='disk' needs offload_optimizer='disk' (got "
                f"{self.offload_optimizer!r}): the masters are the larger part of what the "
                "disk tier moves out of memory; offload both, or use offload_params='cpu'")
        if self.optimizer_tier == "disk" and self.stage < 2:
            raise ValueError(
                f"offload_optimizer='disk' requires stage 2 or 3 (got stage={self.stage}): "
                "stage 1 keeps full-size gradients in memory, which the disk tier would not "
                "bound; use stage=2, or offload_optimizer='cpu'")
        if self.offload_dir is not None and "disk" not in (
                self.optimizer_tier, self.params_tier, self.offload_activations):
            raise ValueError(
                f"offload_dir={self.offload_dir!r} is set but nothing is offloaded to disk: "
                "set offload_optimizer='disk' (and offload_params='disk' at stage 3) or "
                "offload_activations='disk', or leave offload_dir unset")
        if self.disk_staging_bytes is not None and self.optimizer_tier != "disk":
            raise ValueError(
                f"disk_staging_bytes={self.disk_staging_bytes!r} is set but nothing is "
                "offloaded to disk: set offload_optimizer='disk', or leave it unset")

    @property
    def optimizer_tier(self) -> str:
        """Where the masters and optimizer states rest: "device", "cpu" or "disk"."""
        return _tier(self.offload_optimizer)

    @property
    def params_tier(self) -> str:
        """Stage 3: where parameter shards rest between gathers: "device", "cpu" or "disk"."""
        return _tier(self.offload_params)

    @property
    def staging_bytes(self) -> int:
        """The disk tier's pinned staging on a GPU, its default filled in."""
        staging = self.disk_staging_bytes
        return DEFAULT_DISK_STAGING_BYTES if staging is None else staging

    def resolved(self, name: str) -> Any:
        """A stage-3 knob with its default filled in (None below stage 3)."""
        if name not in STAGE3_DEFAULTS:
            raise KeyError(f"{name!r} is not a stage-3 option; options: {list(STAGE3_DEFAULTS)}")
        if self.stage < 3:
            return None
        value = getattr(self, name)
        return STAGE3_DEFAULTS[name] if value is None else value

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with some fields changed, validated like a new config."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> ZeroConfig:
        """Build from plain data (YAML, Hydra); unknown keys are an error naming the key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown ZeroConfig key(s) {unknown}; allowed keys: {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tier(value: bool | str) -> str:
    if value == "disk":
        return "disk"
    return "cpu" if value in (True, "cpu") else "device"


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


MAX_LOSS_SCALE = 2.0**64
"""Scales stop growing here: a larger one overflows fp16 gradients for any loss anyway, and an
infinite one could never be halved back."""


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _check_power_of_two(name: str, value: Any) -> None:
    if not _is_number(value) or not 0 < value <= MAX_LOSS_SCALE:
        raise ValueError(f"{name} must be a power of two in (0, 2**64], got {value!r}")
    mantissa = float(value)
    while mantissa >= 2.0:
        mantissa /= 2.0
    while mantissa < 1.0:
        mantissa *= 2.0
    if mantissa != 1.0:
        raise ValueError(f"{name} must be a power of two (e.g. 65536.0), got {value!r}")
