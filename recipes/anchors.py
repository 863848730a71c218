"""The anchors: Lightning's own FSDPStrategy and DeepSpeedStrategy, built as Lightning ships
them, so a sweep measures them beside zero_strategy on the same jobs; and what the report
reads from them (their name and stage, the model-state bytes they hold).

Both refuse a CPU accelerator before anything runs (Lightning's FSDP check in the accelerator
connector, DeepSpeedStrategy.setup_environment), although torch FSDP and DeepSpeed's CPU
accelerator (``DS_ACCELERATOR=cpu``) train on CPU with gloo. The two subclasses below lift
exactly that check on a CPU accelerator and change nothing else.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

DEEPSPEED_PIN = "deepspeed==0.19.8"
"""The version the anchors were run with (pyproject's ``anchors`` extra)."""


class CpuFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy. The accelerator connector refuses an instance whose type
    is exactly FSDPStrategy on a CPU accelerator (a subclass passes), and Lightning hands
    FSDP ``device_id=root_device.index``, None on a CPU, which FSDP reads as "the
    accelerator" and refuses when there is none: on a CPU the model is wrapped here with
    ``device_id=cpu`` and the same arguments, and Lightning does the rest as for a model
    the user wrapped."""

    _root: torch.nn.Module | None = None

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        if self._root is not None and self._root.module is model:
            # A later run (validate after fit) hands back the bare module, whose own
            # parameters now live in the root's shards: the root wrapping is reused.
            model = self._root
        elif not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=self.root_device,
                **self.kwargs)
            self._root = model
        # Lightning warns that the policy is ignored for a wrapped model and drops it: it
        # was applied above.
        policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            return super()._setup_model(model)
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy

    def _full_state_dict_context(self) -> Any:
        """Lightning's full-state-dict context with ``offload_to_cpu=False``: its
        ``offload_to_cpu=True`` copies tensors that are already on the CPU, and FSDP's clone
        of the unsharded parameters then crashed the process (SIGSEGV, torch 2.13, CPU)."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.api import FullOptimStateDictConfig

        return FSDP.state_dict_type(
            self.model, StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        with self._full_state_dict_context():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        with self._full_state_dict_context():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter id, as Lightning stores it
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID,
                                                    self.model)
            return state


def _deepspeed_strategy_class() -> type:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class CpuDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy; on a CPU accelerator its CUDA-only check is skipped
        (DeepSpeed picks its CPU accelerator from ``DS_ACCELERATOR=cpu``) and the CPU devices
        get the local ranks as indices: Lightning checks that device indices equal local
        ranks and hands DeepSpeed ``device_rank=root_device.index``, which DeepSpeed
        compares with 0 (a bare CPU device's index is None; torch treats ``cpu:1`` as
        ``cpu``)."""

        def setup_environment(self) -> None:
            if not isinstance(self.accelerator, CPUAccelerator):
                super().setup_environment()
                return
            self.parallel_devices = [torch.device("cpu", i)
                                     for i in range(len(self.parallel_devices or []))]
            DDPStrategy.setup_environment(self)

    return CpuDeepSpeedStrategy


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed anchors cannot run here (None: they can). Checked without importing
    deepspeed (seconds of imports in the Hydra process)."""
    if importlib.util.find_spec("deepspeed") is None:
        return (f"the deepspeed package is not installed; install the optional extra: "
                f"pip install -e '.[anchors]' (or pip install {DEEPSPEED_PIN})")
    return None


def block_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The repeated blocks of a recipe model (GPT-2 and BERT layers, ResNet stages): FSDP's
    wrapping units, as a Lightning user passes them in ``auto_wrap_policy``."""
    names = {"GPT2Block", "BertLayer", "ResNetStage"}
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def clip_through_fsdp_root(module: L.LightningModule) -> None:
    """Trainer(gradient_clip_val=...) under FSDP: Lightning's FSDPPrecision refuses norm
    clipping (it holds no reference to the root FSDP module, whose ``clip_grad_norm_``
    reduces the norm over the shards); the module's clipping hook asks the root instead.
    Set on this instance only, so other strategies keep Lightning's own clipping."""

    def configure_gradient_clipping(optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        if gradient_clip_val:
            module.trainer.strategy.model.clip_grad_norm_(float(gradient_clip_val))

    module.configure_gradient_clipping = configure_gradient_clipping  # type: ignore[method-assign]


def make_anchor_strategy(cfg: Any, module: L.LightningModule) -> L.pytorch.strategies.Strategy:
    s = cfg.strategy
    if str(s.impl) == "fsdp":
        from torch.distributed.fsdp import CPUOffload

        clip_through_fsdp_root(module)
        model = module.model
        return CpuFSDPStrategy(
            # sharded: each rank writes its shards with torch.distributed.checkpoint (DCP), as
            # Lightning recommends for large models, and a zero* job can resume them
            state_dict_type="sharded",
            sharding_strategy="FULL_SHARD" if int(s.stage) == 3 else "SHARD_GRAD_OP",
            auto_wrap_policy=block_classes(model),
            cpu_offload=CPUOffload(offload_params=True) if s.offload else None)
    if cfg.trainer.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    module.adamw_class = adamw_class(cfg)
    cls = _deepspeed_strategy_class()
    offload = bool(s.offload)
    return cls(stage=int(s.stage), offload_optimizer=offload,
               offload_parameters=offload and int(s.stage) == 3)


def adamw_class(cfg: Any) -> type[torch.optim.Optimizer]:
    """DeepSpeed refuses a torch optimizer under ZeRO-Offload (its CPU Adam is the supported
    one; a JIT-built C++ op): the offload anchors train with DeepSpeedCPUAdam in AdamW mode,
    the others with torch's AdamW."""
    if str(cfg.strategy.impl) == "deepspeed" and cfg.strategy.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam
    return torch.optim.AdamW


def anchor_label(strategy: Any) -> tuple[str, int] | None:
    """(name, ZeRO stage) of an anchor strategy object, None for anything else."""
    if isinstance(strategy, FSDPStrategy):
        sharding = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
        stage = 3 if sharding == "FULL_SHARD" else 2
        offload = bool(getattr(strategy.cpu_offload, "offload_params", False))
        name = "fsdp" if sharding == "FULL_SHARD" else f"fsdp_{sharding.lower()}"
        return name + ("_offload" if offload else ""), stage
    if type(strategy).__name__.endswith("DeepSpeedStrategy"):
        zero = strategy.config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        offload = "offload_optimizer" in zero
        return f"deepspeed_stage_{stage}" + ("_offload" if offload else ""), stage
    return None


def anchor_offload(strategy: Any) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded), for the formula."""
    if isinstance(strategy, FSDPStrategy):
        on = bool(getattr(strategy.cpu_offload, "offload_params", False))
        return on, on
    zero = (getattr(strategy, "config", None) or {}).get("zero_optimization") or {}
    return "offload_optimizer" in zero, "offload_param" in zero


# ------------------------------------------------------------------ model-state census
def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's shard
    return to_local() if callable(to_local) else t


class Census:
    """Bytes of tensor storage by category, each storage counted once at its allocated
    size (flat buffers with their padding), the first category to claim it keeping it."""

    def __init__(self) -> None:
        self.bytes = {"params": 0, "grads": 0, "optim": 0, "other": 0}
        self.labels: dict[str, int] = {}
        self._seen: set[int] = set()

    def add(self, category: str, label: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
            return
        self._seen.add(storage.data_ptr())
        self.bytes[category] += storage.nbytes()
        key = f"{category}:{label}"
        self.labels[key] = self.labels.get(key, 0) + storage.nbytes()

    def add_optimizer(self, opt: torch.optim.Optimizer, label: str) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self.add("optim", f"{label}.param", p)  # DeepSpeed's fp32 partitions
        for state in opt.state.values():
            for key, value in state.items():
                self.add("optim", f"{label}.state.{key}", value)

    @property
    def model_states(self) -> int:
        return self.bytes["params"] + self.bytes["grads"] + self.bytes["optim"]


def _ds_category(name: str) -> str:
    """A DeepSpeed ZeRO optimizer attribute's role, from its name: communication buckets and
    staging buffers are not model states; gradient partitions, fp32 master partitions and the
    low-precision (or fp32) flat parameter groups are."""
    n = name.lower()
    if any(k in n for k in ("ipg", "bucket", "temp", "pin", "buffer_for", "muon_allgather")):
        return "other"
    if "grad" in n:
        return "grads"
    if "fp32" in n or "single_partition" in n or "master" in n:
        return "optim"
    if any(k in n for k in ("bit16", "fp16", "lp_param", "param")):
        return "params"
    return "other"


def _walk(census: Census, obj: Any, name: str, depth: int = 0) -> None:
    if depth > 3:
        return
    if isinstance(obj, torch.Tensor):
        census.add(_ds_category(name), name, obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(census, value, name, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(census, value, name, depth + 1)


def census(module: torch.nn.Module, optimizers: list[Any]) -> Census:
    """What DDP, FSDP or DeepSpeed holds now, read from its tensors: module parameters
    (FSDP's flat shards under the views it gives the module, DeepSpeed stage 3's
    ``ds_tensor`` partitions), their gradients, optimizer states; for DeepSpeed also its
    ZeRO optimizer's own partitions (fp32 masters count as optimizer state, as in the ZeRO
    paper's K), found by attribute."""
    c = Census()
    params = list(module.parameters())
    for p in params:
        c.add("params", "module.param", getattr(p, "ds_tensor", None))
        c.add("params", "module.param", p)
    for opt in optimizers:
        inner = getattr(opt, "optimizer", None)
        c.add_optimizer(inner if isinstance(inner, torch.optim.Optimizer) else opt,
                        "optimizer")
    for p in params:
        c.add("grads", "module.grad", p.grad)
    for opt in optimizers:
        if type(opt).__module__.startswith("deepspeed"):
            for key, value in vars(opt).items():
                _walk(c, value, key.split("__")[-1])
    return c


def full_state_dict(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (a collective: call on every rank)."""
    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):  # whole, whatever format it checkpoints in
        if isinstance(strategy, CpuFSDPStrategy) and strategy.root_device.type == "cpu":
            context = strategy._full_state_dict_context()
        else:
            from lightning.pytorch.strategies.fsdp import _get_full_state_dict_context

            context = _get_full_state_dict_context(strategy.model,
                                                   world_size=strategy.world_size)
        with context:
            return strategy.model.state_dict()
    if type(strategy).__name__.endswith("DeepSpeedStrategy") and getattr(
            strategy, "zero_stage_3", False):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.state_dict()
