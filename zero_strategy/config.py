"""`ZeroConfig`: the one place where every option, its default and its validation live.

The config is frozen and checked at construction, so an engine never starts from a
contradictory set of options and nothing falls back silently to another stage. Every entry
point (Lightning and Fabric strategy arguments, Accelerate's plugin and its YAML files,
``ZeroTrainer``'s plugin, Hydra's ``strategy.zero``) goes through ``check_options`` and
``ZeroConfig.from_options``, so a wrong key or value reads the same from each: the entry point's
name, then one message built from the field's annotation. ``reconcile_precision`` settles a
config's precision against the one a framework was given.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal


class ConfigError(ValueError, TypeError):
    """A config key or value no ``ZeroConfig`` accepts, named with where it came from. Both a
    ValueError (a wrong value) and a TypeError (what an unknown keyword argument raises), so
    either ``except`` that a caller of an entry point wrote before keeps catching it."""


@dataclass(frozen=True)
class Rule:
    """What a field's annotation adds to its type (``Annotated[int, Rule(minimum=1)]``): a
    lower bound checked with the type, and the words an error uses for it."""

    minimum: int | None = None
    text: str | None = None
    """Replaces the type's generic description ("an int") in messages."""
    note: str = ""
    """Appended to any message about the field: why, or what to write instead."""


# ``minimum`` bounds an int's value, a str's or a list's length.
PositiveInt = Annotated[int, Rule(minimum=1, text="a positive int")]
ClassName = Annotated[str, Rule(minimum=1)]
ClassNames = Annotated[tuple[ClassName, ...], Rule(text="a list of module class names (str)")]

# Choice fields: the allowed values are the annotation's and nowhere else.
Stage = Literal[0, 1, 2, 3]
Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "bf16-autocast",
                    "16-autocast"]
ReduceDtype = Literal["fp32", "compute"]
NonfinitePolicy = Literal["skip", "error", "off"]
Quantization = Literal["off", "int8"]
OffloadTier = bool | Literal["cpu", "disk"]
"""Values of ``offload_optimizer`` / ``offload_params``: False (none), True or "cpu" (host
memory), "disk" (files under ``offload_dir``)."""
ActivationTier = Annotated[Literal[False, "cpu", "disk"], Rule(
    note=" (say where: 'cpu' for host memory, 'disk' for files under offload_dir)")]
"""Values of ``offload_activations``."""

STAGES: tuple[int, ...] = typing.get_args(Stage)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
LOSS_SCALED_PRECISIONS: tuple[str, ...] = ("16-mixed", "16-autocast")
"""The fp16 precisions: they scale the loss so that small gradients stay representable."""
REDUCE_DTYPES: tuple[str, ...] = typing.get_args(ReduceDtype)
NONFINITE_POLICIES: tuple[str, ...] = typing.get_args(NonfinitePolicy)
QUANTIZATIONS: tuple[str, ...] = typing.get_args(Quantization)
DEFAULT_DISK_STAGING_BYTES = 64 << 20
MIN_DISK_STAGING_BYTES = 16 << 10  # 4 slots of a page

# Stage-3-only knobs use None as "not set", so that setting one for a lower stage can be
# rejected instead of ignored. Their stage-3 defaults live here and nowhere else.
STAGE3_DEFAULTS: dict[str, Any] = {
    "unit_numel": 1_000_000,
    "param_persistence_threshold": 10_000,
    "prefetch": True,
    "prefetch_units": 2,
    "unit_leaf_classes": (),
    "check_gather_order": True,
    "generation_gather_budget": None,  # None at stage 3 too: what memory has free
}


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for ``precision="16-mixed"`` or ``"16-autocast"`` (the knobs
    DeepSpeed users know)."""

    initial_scale: float = 2.0**16
    """Starting scale; a power of two so scaling and unscaling are exact."""
    growth_interval: PositiveInt = 1000
    """Consecutive overflow-free steps after which the scale doubles."""
    hysteresis: PositiveInt = 2
    """Overflowing steps tolerated before the scale is halved (the counter resets on growth)."""
    min_scale: float = 1.0
    """The scale never drops below this."""
    static_scale: float | None = None
    """A fixed scale; disables growth and backoff (overflowing steps are still skipped)."""

    def __post_init__(self) -> None:
        _check_fields(self, prefix="loss_scale.")  # it is only ever ZeroConfig.loss_scale
        _check_power_of_two("loss_scale.initial_scale", self.initial_scale)
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

    stage: Stage = 3
    """ZeRO stage: 0, 1, 2 or 3."""
    precision: Precision = "32-true"
    """How each copy of the weights is kept and what the forward computes in:

    - "32-true": fp32 everywhere.
    - "bf16-mixed" / "16-mixed": low-precision compute copies of the weights (what stage 3
      gathers, what the forward and the gradients see) beside fp32 masters in the optimizer,
      as DeepSpeed's bf16/fp16 and Lightning's ``DeepSpeedStrategy`` keep them.
    - "bf16-autocast" / "16-autocast": fp32 weights, gradients and masters; the forward runs
      under ``torch.autocast`` in that dtype, which is what ``transformers.Trainer``
      (``bf16=True``/``fp16=True``), Accelerate's ``mixed_precision`` and Lightning's DDP
      mean by mixed precision. Twice the parameter memory and gather traffic of "-mixed".
    - "bf16-true": bf16 everywhere, no fp32 master (Lightning's meaning).

    The fp16 modes scale the loss (``loss_scale``)."""
    reduce_dtype: ReduceDtype = "fp32"
    """Dtype gradients are communicated in: "fp32" or "compute" (the precision's compute dtype:
    the compute copy's, so fp32 under the "-autocast" precisions)."""
    bucket_numel: PositiveInt = 5_000_000
    """Elements per communication bucket for stages 0-2 (and for stage 3's persistent params)."""
    unit_numel: PositiveInt | None = None
    """Stage 3: a submodule becomes its own gather unit once it holds this many elements
    not claimed by a smaller unit (default 1,000,000)."""
    param_persistence_threshold: Annotated[int, Rule(minimum=0)] | None = None
    """Stage 3: parameters with fewer elements stay whole on every rank (default 10,000;
    units gather all their parameters in one collective, so persistence saves no latency here)."""
    prefetch: bool | None = None
    """Stage 3: gather the next units while the current one computes (default True)."""
    prefetch_units: PositiveInt | None = None
    """Stage 3, with ``prefetch``: how many units ahead are gathered while one computes
    (default 2). Across a link slower than the compute, one gather at a time leaves the link
    idle between them (each transfer starts on an empty pipe: on a 1 Gbit/s link, 2 MiB
    gathers one after the other took 1.5x the time of the same gathers queued); two keep
    it busy. Each unit ahead holds its gathered buffer: 1 gives the least memory."""
    unit_leaf_classes: ClassNames | None = None
    """Stage 3: class names of modules gathered as one unit with everything below them, e.g.
    a mixture-of-experts layer whose experts do not all run on every rank (default none)."""
    check_gather_order: bool | Literal["blocking"] | None = None
    """Stage 3: with each gather, check with a 16-byte all-gather that every rank gathers
    the same unit, and raise ``GatherOrderError`` naming both when ranks run different
    modules (default True). True: on the host (gloo) each gather sends a header without
    waiting, on connections of its own, read before the unit's rows are waited for (each
    unit's rows on a channel of their own, so mismatched gathers never exchange rows), and
    the headers keep gradient reductions in step across ranks whose backward differs
    (experts under ``unit_leaf_classes``); on a GPU it is read
    once at the end of backward (no host sync per unit), so mismatched gathers run first
    and nccl may end the job (its watchdog, or ``timeout``) before the error is raised.
    "blocking": the host check on every device, for debugging such a job on a GPU (one host
    sync per gather). False: no check."""
    generation_gather_budget: Annotated[int, Rule(minimum=0, text="a number of bytes >= 0")] \
        | None = None
    """Stage 3: inside a ``generate()`` call of the model (made automatic by the engine, so
    Trainer's evaluation, ``Seq2SeqTrainer(predict_with_generate=True)`` and TRL's
    ``unwrap_model_for_generation`` get it) or ``engine.generation()``, the units whose whole
    compute copies fit this many bytes are gathered once and held for the call instead of
    once per generated token; the rest are gathered per forward as in training (streamed,
    with prefetch), which costs (N-1)/N of their bytes per token. The smallest budget over
    the ranks decides. None (default): what this rank has free when the call starts (a GPU:
    ``torch.cuda.mem_get_info`` plus the caching allocator's unused reserve; a CPU:
    /proc/meminfo's MemAvailable or the cgroup's room, the smaller), less a quarter kept for
    the generation's own activations and cache. 0: always streamed."""
    overlap_param_gather: bool = True
    """Stages 1-2 (and stage 3's persistent parameters): the all-gather of the updated
    parameters after ``step()`` runs in the background, and each bucket is waited for when
    something first reads one of its parameters through the module (the next forward, an
    attribute read, ``parameters()``, ``state_dict()``, the engine's own readers). A tensor
    taken from the module before ``step()`` and read after it, before such a read, may hold
    other ranks' old values: take references after ``step()``, or set False to wait in
    ``step()``."""
    offload_optimizer: OffloadTier = False
    """Where the fp32 master shard and optimizer states rest (stage >= 1): False on the
    device; True or "cpu" in CPU memory, stepped there (on a CPU device they are in CPU
    memory already: nothing is moved or copied); "disk" (stages 2-3) in files under
    ``offload_dir``, together with the reduced gradient shards, brought in one unit at a time
    for the step with the next unit read ahead, so host memory holds a few units' worth
    (ZeRO-Infinity's NVMe tier; no libaio or compiled ops: each unit's files are read and
    written whole with direct I/O on two background threads)."""
    offload_params: OffloadTier = False
    """Stage 3: where parameter shards rest between gathers: False on the device; True or
    "cpu" in CPU memory (on a CPU device: where they are already, at no cost); "disk" in files
    under ``offload_dir``, read ahead of each gather (needs ``offload_optimizer="disk"``)."""
    offload_dir: Annotated[str, Rule(minimum=1, text="a directory path (str)")] | None = None
    """Directory for the "disk" tier's files (one subdirectory per rank, locked while an
    engine uses it, removed by ``close()``). None: a fresh directory under the system's temp
    dir, removed by ``close()``. Setting it without a "disk" tier is an error."""
    disk_staging_bytes: Annotated[int, Rule(minimum=MIN_DISK_STAGING_BYTES)] | None = None
    """On a GPU, the pinned host memory the "disk" tier's copies to and from the device pass
    through (a ring of 4 buffers, allocated once): the most the tier ever pins. None: 64 MiB.
    At least 16 KiB; setting it without a "disk" tier is an error."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's module buffers at every forward, as DistributedDataParallel does."""
    nonfinite_grads: NonfinitePolicy = "skip"
    """What a step does when any gradient is inf/NaN on any rank: "skip" it everywhere
    (weights, optimizer state and step counts unchanged; ``step()`` returns False and warns),
    "error" (raise), or "off" (no check). The fp16 precisions need "skip" (their loss scaling
    relies on skipped overflow steps)."""
    elementwise_optimizer: bool = False
    """Assert that a custom optimizer's update is elementwise (each element's new value
    depends only on that element's gradient and state), so running it on flat shards is exact.
    torch's elementwise optimizers are recognised without it."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for the fp16 precisions ("16-mixed", "16-autocast"); customising it
    under another precision is an error."""
    shard_group_size: PositiveInt | None = None
    """Hybrid sharding (FSDP's HSDP, ZeRO++'s hierarchical partitioning): shard within groups of
    this many consecutive ranks (a node's GPUs) and replicate across the groups. Gathers and
    reduce-scatters stay inside a group; each gradient shard is then all-reduced across the
    groups, the only traffic between them. Must divide the world size; None (default) shards
    over every rank. Stages 1-3."""
    quantize_weights: Quantization = "off"
    """Stage 3: send the parameter all-gathers as block-wise int8, one fp32 scale per 256
    elements (ZeRO++'s quantized weight gather): 0.26x the bytes of fp32, 0.52x of bf16. Every
    rank computes with the same decoded weights (its own piece too); the masters the optimizer
    updates stay exact. "off" or "int8"."""
    quantize_gradients: Quantization = "off"
    """Stages 1-3: send the gradient reduce-scatter as block-wise int8 (ZeRO++'s quantized
    gradients, as an all-to-all): each rank receives its slice of every other rank's gradient
    in int8, decodes it and sums in fp32 with its own part, which is never quantized.
    "off" or "int8"."""
    activation_checkpointing: bool | Annotated[tuple[ClassName, ...], Rule(
        minimum=1, text="a non-empty list of module class names (str)")] = False
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
    offload_activations: ActivationTier = False
    """Where the inputs the checkpointed modules keep rest until backward (needs
    ``activation_checkpointing``): False on the device; "cpu" in host memory (copied on a
    side stream from a GPU; on a CPU device they are there already: nothing moves); "disk"
    in files under ``offload_dir`` (written and read back on a background thread). Each is
    brought back ahead of the module's recomputation, the next one's while it runs."""
    timeout: Annotated[float, Rule(text="a number of seconds > 0")] = 600.0
    """Seconds a collective the engine issues may wait for the other ranks before it raises an
    error naming the collective and the step (a stalled or lost peer). The default is torch's
    NCCL default (10 minutes); gloo's own is 30. Under nccl it applies through the process
    group's timeout, which the adapters set from this field."""

    def __post_init__(self) -> None:
        _check_fields(self)  # types, choices and bounds, from the annotations above
        if self.precision in LOSS_SCALED_PRECISIONS and self.nonfinite_grads != "skip":
            raise ValueError(
                f"precision={self.precision!r} needs nonfinite_grads='skip' (got "
                f"{self.nonfinite_grads!r}): dynamic loss scaling finds its scale by skipping "
                "the steps that overflow")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                f"offload_activations={self.offload_activations!r} needs "
                "activation_checkpointing (True or a list of module class names): what is "
                "offloaded are the inputs the checkpointed modules keep for their recomputation")
        if not 0 < self.timeout < float("inf"):
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        self._check_stage_consistency()

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
        if self.precision not in LOSS_SCALED_PRECISIONS and self.loss_scale != LossScaleConfig():
            raise ValueError(
                f"loss_scale applies to the fp16 precisions {list(LOSS_SCALED_PRECISIONS)} "
                f"only, got precision="
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
    def from_options(cls, options: Mapping[str, Any], *, source: str,
                     base: ZeroConfig | None = None) -> ZeroConfig:
        """``base`` (default: every default) with ``options`` set: the way in for every entry
        point. Unknown keys, types and values are checked; any error is a ``ConfigError`` whose
        message starts with ``source`` (a file, a strategy's arguments, a Hydra key) and goes on
        with the same words from every entry point."""
        check_options(options, source=source)
        if base is not None and not options:
            return base
        try:
            return dataclasses.replace(base, **options) if base is not None else cls(**options)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> ZeroConfig:
        """Build from plain data (YAML, Hydra): ``from_options`` over the defaults."""
        return cls.from_options(values, source=source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tier(value: bool | str) -> str:
    if value == "disk":
        return "disk"
    return "cpu" if value in (True, "cpu") else "device"


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


# ---------------------------------------------------------------------- precision
@dataclass(frozen=True)
class PrecisionFlag:
    """A framework's own precision setting, as it bears on ``ZeroConfig.precision``."""

    setting: str
    """As the user wrote it, for messages: "Trainer(precision='bf16-true')"."""
    means: str
    """The precision it stands for where the config chose none."""
    agrees: tuple[str, ...]
    """The precisions a config may choose beside it (the config's choice then wins)."""


def reconcile_precision(chosen: str | None, flag: PrecisionFlag, *, source: str) -> str:
    """The precision to train in: ``chosen`` (set in the config, None if left unset) beside
    a framework's ``flag``. Every adapter settles precision here, so a contradiction reads
    the same from each, naming both settings; a value no config accepts is left for the
    config's own check to name."""
    if chosen is None:
        return flag.means
    if chosen in flag.agrees or chosen not in PRECISIONS:
        return chosen
    raise ConfigError(
        f"{source}: precision conflict: precision={chosen!r} contradicts {flag.setting}; set it "
        f"in one place, or make them agree ({flag.setting} allows {list(flag.agrees)}, not "
        f"{chosen!r})")


# ---------------------------------------------------------------------- keys and types
def check_options(values: Mapping[str, Any], *, source: str, cls: type | None = None) -> None:
    """Unknown keys (naming each, the closest known one and all of them) and every value's
    type, choices and bounds as ``cls``'s annotations state them (default ``ZeroConfig``),
    without building a config: what an entry point checks of its own part before the parts
    are merged. Errors are ``ConfigError`` starting with ``source``."""
    try:
        _check_mapping(values, ZeroConfig if cls is None else cls, prefix="")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _check_mapping(values: Any, cls: type, prefix: str) -> None:
    if not isinstance(values, Mapping):
        raise ConfigError(f"expected a mapping of {cls.__name__} fields, got "
                          f"{type(values).__name__}")  # a nested one is refused by _accept
    hints = _hints(cls)
    unknown = sorted(str(key) for key in values if key not in hints)
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(hints), n=1)
        guess = f" (did you mean {prefix + close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown {cls.__name__} key(s) {[prefix + key for key in unknown]}{guess}; "
            f"allowed keys: {sorted(prefix + key for key in hints)}")
    for key, value in values.items():
        _checked(f"{prefix}{key}", value, hints[key])


def _check_fields(config: Any, prefix: str = "") -> None:
    """Each field of a config under construction against its annotation; a YAML list becomes
    a tuple and a mapping a nested config, so the frozen result holds the declared types."""
    for name, hint in _hints(type(config)).items():
        value = getattr(config, name)
        checked = _checked(f"{prefix}{name}", value, hint)
        if checked is not value:
            object.__setattr__(config, name, checked)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_REFUSED = object()


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the field keeps it, or a ``ConfigError`` saying what ``name`` takes."""
    accepted = _accept(name, value, hint)
    if accepted is _REFUSED:
        raise ConfigError(f"{name} must be {_describe(hint)}, got {value!r}{_rule(hint).note}")
    return accepted


def _accept(name: str, value: Any, hint: Any) -> Any:
    base, rule = _unannotated(hint), _rule(hint)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin in (typing.Union, types.UnionType):
        for member in args:
            accepted = _accept(name, value, member)
            if accepted is not _REFUSED:
                return accepted
        return _REFUSED
    if origin is Literal:  # bool is an int: True is not 1 here, nor 1 True
        same = any(isinstance(value, bool) == isinstance(choice, bool)
                   and isinstance(value, type(choice)) and value == choice for choice in args)
        return value if same else _REFUSED
    if origin is tuple:  # tuple[X, ...]: a list in YAML
        if not isinstance(value, (list, tuple)) or len(value) < (rule.minimum or 0):
            return _REFUSED
        items = tuple(_accept(name, item, args[0]) for item in value)
        return items if _REFUSED not in items else _REFUSED
    if dataclasses.is_dataclass(base):
        if isinstance(value, base):
            return value
        if not isinstance(value, Mapping):
            return _REFUSED
        _check_mapping(value, base, prefix=f"{name}.")
        return base(**value)
    return value if _plain(value, base, rule) else _REFUSED


def _plain(value: Any, base: Any, rule: Rule) -> bool:
    if base is type(None):
        return value is None
    if isinstance(value, bool) or base is bool:
        return base is bool and isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float))
    if base is int:
        return isinstance(value, int) and (rule.minimum is None or value >= rule.minimum)
    if base is str:
        return isinstance(value, str) and len(value) >= (rule.minimum or 0)
    raise TypeError(f"no check for annotation {base!r}")  # a new field's type: add one here


def _describe(hint: Any) -> str:
    """What a field takes, in the words of its annotation: "one of (0, 1, 2, 3)",
    "True, False, 'blocking' or None", "a positive int or None"."""
    base = _unannotated(hint)
    if _rule(hint).text is None and typing.get_origin(base) is Literal:
        return f"one of {typing.get_args(base)!r}"
    parts = _parts(hint)
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _parts(hint: Any) -> list[str]:
    base, rule = _unannotated(hint), _rule(hint)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if rule.text is not None:
        return [rule.text]
    if origin in (typing.Union, types.UnionType):
        return [part for member in args for part in _parts(member)]
    if origin is Literal:
        return [repr(choice) for choice in args]
    if origin is tuple:
        return [f"a list of {_describe(args[0])}"]
    if dataclasses.is_dataclass(base):
        return [f"a {base.__name__} or a mapping"]
    bound = f" >= {rule.minimum}" if rule.minimum is not None else ""
    words = {type(None): ["None"], bool: ["True", "False"], int: [f"an int{bound}"],
             float: ["a number"], str: ["a str"]}
    return words[base]


def _unannotated(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _rule(hint: Any) -> Rule:
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Rule)), Rule())
    return Rule()
