"""Typed schemas for the Hydra config tree: every composed config is checked against these
dataclasses, so a typo'd key, a wrong type or an unknown choice fails at compose time with the
key named (``trainer.max_steps=abc``: "Value 'abc' could not be converted to Integer")."""

from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from typing import Any, Dict, List, Optional  # noqa: UP035 (OmegaConf reads these)

from hydra.core.config_store import ConfigStore


class _Choice(str, Enum):
    def __str__(self) -> str:  # interpolations (the job name) read "gpt", not "ModelName.gpt"
        return str(self.value)


class ModelName(_Choice):
    gpt = "gpt"
    bert = "bert"
    resnet = "resnet"


class ModelSize(_Choice):
    tiny = "tiny"
    small = "small"
    base = "base"
    bench_throughput = "bench_throughput"
    bench_memory = "bench_memory"


class DataKind(_Choice):
    causal = "causal"
    masked = "masked"
    digits = "digits"
    random = "random"


@dataclass
class ModelConf:
    name: ModelName = ModelName.gpt
    size: ModelSize = ModelSize.small
    seq_len: int = 64
    """Tokens per sequence (text models)."""
    dropout: float = 0.0


@dataclass
class DataConf:
    kind: DataKind = DataKind.causal
    batch_size: int = 8
    """Samples per process per micro-batch."""
    vocab_size: int = 2048
    """BPE vocabulary trained on the fly (text); 0 for images."""
    image_size: int = 16
    samples: int = 1024
    """Sequences generated (kind=random)."""
    val_fraction: float = 0.1
    seed: int = 0


ZERO_OPTIONS = (
    "reduce_dtype", "bucket_numel", "unit_numel", "param_persistence_threshold", "prefetch",
    "prefetch_units",
    "unit_leaf_classes", "check_gather_order", "overlap_param_gather", "offload_optimizer",
    "offload_params", "offload_dir", "disk_staging_bytes", "broadcast_buffers", "nonfinite_grads",
    "elementwise_optimizer", "shard_group_size", "quantize_weights", "quantize_gradients",
    "loss_scale", "timeout", "activation_checkpointing", "offload_activations",
    "generation_gather_budget",
)
"""ZeroConfig's fields a recipe may set under ``strategy.zero`` (stage and precision have keys
of their own). Listed here, not imported, so composing needs no torch; a test keeps the list
equal to ZeroConfig's."""

# Unset (None) options keep ZeroConfig's defaults; a key not listed fails at compose time
# naming it, and the values are ZeroConfig's to check (in the Hydra process, see launch.py).
ZeroOptions = make_dataclass("ZeroOptions", [(n, Any, field(default=None)) for n in ZERO_OPTIONS])

def zero_options(node: Any) -> Dict[str, Any]:  # noqa: UP006
    """The options set under ``strategy.zero`` (a config node or a dict), as ZeroConfig
    keyword arguments."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(node) if OmegaConf.is_config(node) else dict(node)
    return {k: v for k, v in values.items() if v is not None}


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
"""The precisions the recipes run (ZeroConfig's list; DDP runs them too)."""


class StrategyImpl(_Choice):
    """Which implementation trains: zero_strategy's engine, or one of Lightning's own."""

    zero = "zero"
    ddp = "ddp"
    fsdp = "fsdp"
    deepspeed = "deepspeed"


@dataclass
class StrategyConf:
    name: str = "zero3"
    """The preset's name (conf/strategy/<name>.yaml): ddp, zero1, zero2, zero3, zero2_offload,
    zero3_offload, zero2_disk, zero3_disk, and the anchors fsdp, deepspeed_stage_1/2/3,
    deepspeed_stage_2/3_offload."""
    impl: StrategyImpl = StrategyImpl.zero
    """zero: zero_strategy's ZeroStrategy; ddp, fsdp, deepspeed: Lightning's DDPStrategy,
    FSDPStrategy, DeepSpeedStrategy (the anchors every comparison is read against)."""
    stage: Optional[int] = None  # noqa: UP045
    """ZeRO stage (None for ddp; fsdp: 3 is FULL_SHARD, 2 SHARD_GRAD_OP)."""
    offload: bool = False
    """Anchors only: DeepSpeed's offload_optimizer (and offload_param at stage 3), FSDP's
    CPUOffload. zero_strategy's offload is set under ``zero`` (offload_optimizer, ...)."""
    zero: ZeroOptions = field(default_factory=ZeroOptions)  # type: ignore[valid-type]
    """Extra ZeroConfig fields (bucket_numel, unit_numel, offload_optimizer, ...); impl=zero
    only."""


@dataclass
class PrecisionConf:
    name: str = "32-true"
    """Lightning's precision name; checked against ZeroConfig's list before any process starts."""


OPTIMIZERS = ("adamw", "muon")

DATA_FOR_MODEL = {"gpt": ("causal", "masked", "random"), "bert": ("causal", "masked", "random"),
                  "resnet": ("digits",)}
"""The data kinds each model reads: the text models take token ids of any kind, the image
model the digits."""

OBJECTIVES = ("val_loss", "val_acc", "train_loss")
"""What ``optimized_metric`` may name: metrics.json fields measured on the final model
(``val_acc`` for model=resnet only)."""


@dataclass
class OptimConf:
    name: str = "adamw"
    """"adamw": AdamW on every parameter; "muon": Muon on the hidden 2-D weights (every
    Linear / Conv1D but the output head), AdamW on the rest (embeddings, norms, biases, head)."""
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # noqa: UP006
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConf:
    accelerator: str = "cpu"
    devices: int = 2
    """Processes per node."""
    num_nodes: int = 1
    """Machines the job spans, each running ``devices`` processes (world size devices x
    num_nodes). Every node runs the same command; with more than one, ``rdzv_endpoint`` says
    where they meet (recipes/rendezvous.py)."""
    rdzv_endpoint: Optional[str] = None  # noqa: UP045
    """HOST:PORT of the node serving torch.distributed.run's c10d rendezvous, the same on
    every node; required when num_nodes > 1, refused when 1. A sweep's jobs meet on PORT and
    PORT+1 in turn, each under an id derived from the job (its name and number)."""
    max_steps: int = 300
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    val_check_interval: int = 100
    limit_val_batches: int = 20
    log_every_n_steps: int = 10
    progress_bar: bool = True
    seed: int = 0
    timeout_s: int = 1800
    """A job that runs longer is stopped and reported as failed."""
    max_restarts: int = 3
    """When a worker fails (a process or node lost), torch.distributed.run restarts all of
    them up to this many times; they resume from the last checkpoint. 0 disables restarts."""
    preload: bool = True
    """Fork each job's torch.distributed.run agent and workers from the Hydra process, which
    imports torch, Lightning, transformers and zero_strategy and prepares the data once
    (recipes/agent.py); false: start them as new interpreters (python -m
    torch.distributed.run). Either way every job is a new set of processes and a new world."""
    checkpoint_every: int = 100
    """Save the job's full state every this many optimizer steps (0: never) into
    <job dir>/checkpoints/last.ckpt, replaced atomically; restarted workers resume from it."""
    resume_from: Optional[str] = None  # noqa: UP045
    """Start from another job's checkpoint: its job directory (its checkpoints/last.ckpt) or
    a checkpoint path, written by any strategy here (zero*, deepspeed_stage_*, fsdp): a sweep
    that found a faster strategy switches a running job to it. The job's own checkpoint, once
    it has one, takes precedence (a restarted worker resumes where this job got to)."""


class LauncherName(_Choice):
    torchrun = "torchrun"
    ray = "ray"


@dataclass
class LauncherConf:
    name: LauncherName = LauncherName.torchrun
    """torchrun: the Hydra process starts each job's workers (recipes/agent.py); ray: each job
    is a Ray Train job (recipes/ray_job.py)."""
    address: Optional[str] = None  # noqa: UP045
    """ray: an existing cluster's address (``ray.init(address=...)``); None starts a local
    Ray in the Hydra process, for every job of a sweep."""
    num_cpus: Optional[int] = None  # noqa: UP045
    object_store_mb: int = 200
    temp_dir: Optional[str] = None  # noqa: UP045
    cpus_per_worker: int = 1
    storage_path: Optional[str] = None  # noqa: UP045
    """Where Ray keeps each run's reported checkpoints; None: ``<job dir>/ray``."""


@dataclass
class Config:
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    strategy: StrategyConf = field(default_factory=StrategyConf)
    precision: PrecisionConf = field(default_factory=PrecisionConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    optim: OptimConf = field(default_factory=OptimConf)
    launcher: LauncherConf = field(default_factory=LauncherConf)
    name: str = "default"
    optimized_metric: Optional[str] = None  # noqa: UP045
    """The measurement a job returns to the sweeper (``hparams_search`` sets it): one of
    OBJECTIVES. A job without a finite value of it fails, naming the metric and why."""


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
