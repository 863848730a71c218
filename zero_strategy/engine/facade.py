"""`ZeroEngine`: a model and its optimizer, sharded across the ranks of a process group.

The public face of the engine package: set-up is ``setup.py`` (with ``disk.py``), the step
``step.py``, state dicts and closing ``state.py``, the memory report ``memory/report.py``;
each method here says what it does and hands over.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..checkpoint import export as checkpoint_export
from ..checkpoint import pretrained as checkpoint_pretrained
from ..checkpoint import read as checkpoint_read
from ..checkpoint import write as checkpoint_write
from ..checkpoint.save_hub import save_hub
from ..config import ZeroConfig
from ..core.materialize import InitFn
from ..memory import phases as memory_phases
from ..memory import report as memory_report
from ..optim.combined import parts as optimizer_parts
from . import setup, state
from . import step as training
from .parts import EngineParts


class ZeroEngine(EngineParts):
    """Trains ``model`` with ``optimizer`` under ZeRO ``config`` on every rank of ``process_group``.

    ``optimizer`` is a torch optimizer built on the model's parameters, or several over
    disjoint parameter sets (a list, or a ``CombinedOptimizer``: Muon for the hidden matrices
    beside AdamW for the rest). The engine rebuilds each over this rank's shard (elementwise
    optimizers) or over whole parameters on owning ranks (Muon, Adafactor, any update that
    reads a parameter whole) and keeps reading hyperparameters from the user's objects, so LR
    schedulers attached to them work unchanged.

    A model built on the meta device is materialised on ``device`` (default: the current CUDA
    device under nccl, else CPU) one unit at a time, each module initialised by
    ``param_init_fn(module)`` (default ``module.reset_parameters()``), so no rank ever holds
    the whole model; rank 0's initial values are broadcast either way.
    """

    def __init__(
        self, model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        config: ZeroConfig | None = None,
        *, process_group: Any = None, device: torch.device | str | None = None,
        param_init_fn: InitFn | None = None,
    ) -> None:
        pretrained = setup.build(self, model, optimizer, config, process_group=process_group,
                                 device=device, param_init_fn=param_init_fn)
        if pretrained:  # from_pretrained's model: its folder's weights go into the shards now
            checkpoint_pretrained.load_pending(self, pretrained)

    # ------------------------------------------------------------------ training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return training.forward(self, args, kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward; outside ``no_sync()`` gradients are reduced while it runs."""
        training.backward(self, loss, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the context exits."""
        previous = self.runtime.sync
        self.runtime.sync = False
        try:
            yield
        finally:
            self.runtime.sync = previous

    @property
    def grads_pending(self) -> bool:
        """Whether reduced gradients wait for ``step()`` (a synchronising backward ran since
        the last step or ``zero_grad()``)."""
        return self.progress.grads_pending

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole gradient (over all shards); returns that norm."""
        return training.clip_grad_norm_(self, max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value]. Elementwise, so clamping
        each rank's (unscaled) shard is exactly torch.nn.utils.clip_grad_value_ on the whole."""
        training.clip_grad_value_(self, clip_value)

    def get_global_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        return training.grad_norm(self, norm_type)

    def step(self) -> bool:
        """Optimizer step on this rank's shard, then propagate and zero gradients.

        Returns False when the step was skipped: some rank had an inf/NaN gradient (an fp16
        overflow, or ``ZeroConfig.nonfinite_grads="skip"`` at any precision); weights,
        optimizer states and step counts are then unchanged on every rank.
        """
        return training.step(self)

    def refresh_compute_copies(self) -> None:
        """Propagate every unit's master shard into the copy forward reads: all-gathers
        launched in forward order (buckets hold parameters in reverse registration order),
        waited for here only without ``overlap_param_gather``; otherwise by the first read
        of each bucket (``ParamAccess``) or ``runtime.settle()``."""
        training.refresh_compute_copies(self)

    def zero_grad(self) -> None:
        """Forget every gradient of the step, also after an exception in forward, backward or
        step left a pass half done: the engine is then ready for the next micro-batch."""
        training.zero_grad(self)

    # ------------------------------------------------------------------ whole parameters
    def gathered_parameters(
        self, target: nn.Module | Any = None, *, writable: bool = False,
        modifier_rank: int | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Whole parameters of ``target`` (a submodule, an iterable of parameters, or the
        whole model) inside the context, on every rank (a collective: call it on all).

        With ``writable=True`` edits made inside reach the shards and the masters when the
        context exits (only edited elements replace the fp32 master under mixed precision);
        with ``modifier_rank=r`` rank r's values are broadcast first, so only its edit counts.
        Without ``writable``, an edit is discarded and raises.
        """
        self.check_open("gathered_parameters")
        return self.access.gathered(target, writable, modifier_rank)

    def generation(self, budget: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Generation at stage 3 (a collective: enter it on every rank): inside the block each
        unit that fits ``budget`` bytes (default ``ZeroConfig.generation_gather_budget``, or
        what memory has free) is gathered once and held whole, so the forwards of
        ``generate()`` gather only the rest (streamed, per forward); on exit everything it
        gathered is freed, gradients and optimizer state untouched. The model's own
        ``generate()`` runs inside it already; a block inside another is part of it. At
        stages 0-2 (parameters whole) it does nothing. ``budget=0``: stream every unit."""
        self.check_open("generation")
        if self.generation_mode is None:
            return contextlib.nullcontext()
        return self.generation_mode.holding(budget)

    # ------------------------------------------------------------------ state
    @property
    def user_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers: the one given, or the parts of several."""
        return optimizer_parts(self.user_optimizer)

    def settle_tier(self) -> None:
        """Disk tier: wait for its reads and write-backs before code that writes the state
        outside the step (a load): a write racing one is refused by the tier with a fault."""
        state.settle_tier(self)

    def unmanaged_state(self) -> dict[str, torch.Tensor]:
        """The module's buffers and frozen parameters, by state_dict key (kept whole)."""
        return state.unmanaged_state(self)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a full (unsharded) ``model.state_dict()`` into the engine, e.g. pretrained
        weights: managed parameters' masters get the values at full precision. Every key and
        shape is checked before anything is written."""
        return state.load_module_state(self, state_dict, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated module state dict on every rank: same keys and shapes as
        ``model.state_dict()``, managed parameters as their master (fp32) values, on CPU.

        This holds the WHOLE model on EVERY rank (a collective): for saving use
        ``save_pretrained`` and for handing weights to another engine ``hub_weights``, which
        hold one bounded bucket at a time on the receiving rank only."""
        return state.full_module_state(self)

    # ------------------------------------------------------------------ weights out
    def save_pretrained(self, save_directory: str | os.PathLike, *,
                        max_shard_size: int | str = "50GB", dtype: torch.dtype | None = None,
                        safe_serialization: bool = True, writer: int = 0,
                        bucket_bytes: int = checkpoint_export.DEFAULT_BUCKET_BYTES,
                        extra_files: dict[str, bytes] | None = None) -> Path:
        """Write what ``model.save_pretrained(save_directory)`` writes, streamed from the
        shards (a collective: call it on every rank): ``model.safetensors``, or
        ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json`` split at
        ``max_shard_size`` (bytes, or "5GB"/"500MB"/"2GiB") by huggingface_hub's rule; for a
        transformers model in the hub's layout (its weight conversions reverted, e.g. a MoE's
        fused experts back to per-expert keys), tied weights left out, ``config.json`` and
        ``generation_config.json`` beside. Weights are the masters (fp32 under mixed
        precision), floating ones cast to ``dtype`` when given. A PEFT model writes its
        adapter, as ``PeftModel.save_pretrained`` does (``adapter_model.safetensors``,
        ``adapter_config.json``); a module holding a transformers model (a LightningModule's
        ``self.model``) writes that model alone.

        Rank ``writer`` writes every file; each tensor is gathered onto it alone, a bucket
        of at most ``bucket_bytes`` (or one tensor, or one conversion group, where larger)
        at a time, written and dropped: no rank's memory grows by more than that bucket
        plus its conversion. Files go into a temporary directory moved into place when every
        rank agreed all was written; an existing folder keeps its other files, an earlier
        save's weights files are replaced. Returns the folder."""
        self.check_open("save_pretrained")
        if safe_serialization is not True:
            raise ValueError("save_pretrained: safe_serialization=False asks for pickled "
                             "pytorch_model.bin files; only safetensors are written")
        with record_function("zero::save_pretrained"):
            size = checkpoint_export.parse_size(max_shard_size)
            return save_hub(self, save_directory, max_shard_bytes=size, dtype=dtype,
                            bucket_bytes=bucket_bytes, writer=writer, extra_files=extra_files)

    def hub_weight_buckets(self, *, bucket_bytes: int = checkpoint_export.DEFAULT_BUCKET_BYTES,
                           to: int | str = 0, dtype: torch.dtype | None = None,
                           merge_lora: bool = False, layout: Any = None,
                           ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's weights in the hub's names and layout (as ``save_pretrained`` writes
        them), a bucket at a time: a list of (name, tensor) whole on rank ``to`` (or on every
        rank with ``to="all"``), an empty list on the others. A collective: every rank must
        iterate it to the end, in step. A bucket holds at most ``bucket_bytes`` (a single
        tensor or conversion group larger than that comes alone); nothing else is gathered,
        and the engine holds no reference to a bucket once the next is asked for. Tensors are
        on CPU, masters' values, floating ones cast to ``dtype`` when given. For a PEFT
        model: its adapter under PEFT's names, or with ``merge_lora=True`` the base model
        with the LoRA adapter merged into its weights (what an engine without adapters
        loads). ``layout`` (a ``checkpoint.export.HubLayout``) overrides the registered one."""
        self.check_open("hub_weight_buckets")
        return checkpoint_export.hub_weight_buckets(self, bucket_bytes=bucket_bytes, to=to,
                                                    dtype=dtype, merge_lora=merge_lora,
                                                    layout=layout)

    def hub_weights(self, *, bucket_bytes: int = checkpoint_export.DEFAULT_BUCKET_BYTES,
                    to: int | str = 0, dtype: torch.dtype | None = None,
                    merge_lora: bool = False,
                    layout: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``hub_weight_buckets`` flattened: (name, tensor) pairs, what vLLM's
        ``model.load_weights(weights)`` and ``module.load_state_dict(dict(...), strict=False)``
        take. A collective, as ``hub_weight_buckets``; a consumer that keeps every tensor
        holds the whole model, of course (load each and drop it)."""
        for bucket in self.hub_weight_buckets(bucket_bytes=bucket_bytes, to=to, dtype=dtype,
                                              merge_lora=merge_lora, layout=layout):
            while bucket:
                yield bucket.pop(0)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The user's optimizer state as an unsharded run's ``optimizer.state_dict()`` would
        hold it (same indices, keys and tensors; ``{"optimizers": [...]}`` for several, as
        ``CombinedOptimizer`` saves), assembled on every rank: a collective that materialises
        the whole optimizer state (use the sharded checkpoint to scale). The user's optimizer
        objects return this from their own ``state_dict()``."""
        self.check_open("optimizer_state_dict")
        return self.user_optimizer.state_dict()

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer format (from ``optimizer_state_dict()`` or a run without
        ZeRO) into the shards; also what the user's ``optimizer.load_state_dict()`` does."""
        self.check_open("load_optimizer_state_dict")
        self.settle_tier()
        self.user_optimizer.load_state_dict(state_dict)

    def close(self) -> nn.Module:
        """Give the module back as a plain ``nn.Module`` holding the trained weights (whole,
        in the dtypes it had, from the masters), with every hook and class swap removed.
        A collective: call it on every rank."""
        self._forget_failed_pass()
        return state.close(self)

    def _forget_failed_pass(self) -> None:
        """A pass an exception cut short and nobody ``zero_grad()``-ed (a batch-size finder
        caught it, then closes or reloads): its reductions are matched with the peers' and
        this rank's failure report cleared before the collectives that follow."""
        if self.progress.reported and not self._closed:
            self.zero_grad()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | os.PathLike, *, tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own shards of a new tag under ``directory`` (atomically)."""
        # A closed engine has no shards left: what it wrote would hold no parameters and load
        # nowhere. The plain module saves itself (``torch.save(module.state_dict(), ...)``).
        self.check_open("save_checkpoint")
        self.runtime.settle()
        with record_function("zero::save_checkpoint"):
            return checkpoint_write.save(self, directory, tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: str | os.PathLike, *, tag: str | None = None,
                        load_optimizer: bool = True,
                        trust_pickles: bool | None = None) -> dict[str, Any] | None:
        """Resume from a checkpoint written on any world size and stage, by this engine, by
        DeepSpeed (ZeRO stages 1-3) or with torch.distributed.checkpoint (FSDP); returns the
        client state saved with it. Other systems' files are pickles, read with torch's
        weights_only unpickler unless ``trust_pickles=True`` (see ``checkpoint/pickles.py``)."""
        self.check_open("load_checkpoint")
        self._forget_failed_pass()
        if self.tier is not None and self.tier.failed is not None:
            self.tier.recover()  # the files a failed write-back left are about to be replaced
        with record_function("zero::load_checkpoint"):
            client = checkpoint_read.load(self, directory, tag=tag,
                                          load_optimizer=load_optimizer,
                                          trust_pickles=trust_pickles)
        if load_optimizer:  # weights and optimizer states are one step's again
            self.progress.to("reload")
        return client

    def load_pretrained(self, path: str | os.PathLike, *, strict: bool = True,
                        key_map: checkpoint_pretrained.KeyMap | None = None) -> Any:
        """Load a Hugging Face ``save_pretrained`` folder into the shards, each rank reading
        only its own ranges, everything checked before anything changes; returns the missing
        and unexpected keys, as ``load_state_dict``. ``key_map`` defaults to the one
        ``from_pretrained`` built the model with (docs/pretrained.md)."""
        self.check_open("load_pretrained")
        with record_function("zero::load_pretrained"):
            return checkpoint_pretrained.load(self, path, key_map=key_map, strict=strict)

    # ------------------------------------------------------------------ observability
    def memory_report(self, activation_bytes: int | None = None
                      ) -> dict[str, int | float | str | None]:
        """Model-state bytes this rank holds now, beside the ZeRO formula's prediction, and
        what the last measured forward kept for backward (``measure_activations``). Given the
        activations' peak of a step (``zero_strategy.estimate_activations(...).peak_bytes``),
        also each phase's bound on this rank's growth (``bound_<phase>_bytes``: load,
        forward, backward, step, save; ``phase_bounds``)."""
        report = memory_report.report(self)
        if activation_bytes is not None:
            bounds = self.phase_bounds(activation_bytes=activation_bytes)
            report.update({f"bound_{p}_bytes": bounds.of(p) for p in memory_phases.PHASES})
        return report

    def phase_bounds(self, *, activation_bytes: int, loaded_whole: bool = False,
                     bucket_bytes: int = checkpoint_export.DEFAULT_BUCKET_BYTES
                     ) -> memory_phases.PhaseBounds:
        """How far each phase of a training job may raise this rank's memory, by the ZeRO
        formula for this engine's units, the parameters that train now and its precision,
        with every term (``memory/phases.py``). ``activation_bytes``: the activations' peak
        of a step; ``loaded_whole``: the model was loaded whole before the engine sharded it
        (``Model.from_pretrained``), not streamed; ``bucket_bytes``: the streamed save's."""
        return memory_phases.phase_bounds(self, activation_bytes=activation_bytes,
                                          loaded_whole=loaded_whole, bucket_bytes=bucket_bytes)

    def predicted_memory(self) -> Any:
        return memory_report.predicted(self)

    @contextlib.contextmanager
    def measure_activations(self) -> Iterator[None]:
        """Count what the next forward inside this block keeps for backward (the first
        training forward is counted anyway); ``memory_report()["activation_bytes"]``."""
        with self.activations.measuring():
            yield

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent so far, per collective, and their total. With hybrid
        sharding also ``within_groups`` (gathers and reduce-scatters in the shard group) and
        ``across_groups`` (the all-reduce of gradient shards between replicas); the rest of
        the total is what every rank agrees on (flags, norms, buffers)."""
        comms = [self.comm] + ([self.shards, self.replicas] if self.replicas is not None
                               else [])
        out: dict[str, int] = {}
        for comm in comms:
            for op, n in comm.bytes_sent.items():
                out[op] = out.get(op, 0) + n
        out["total"] = sum(out.values())
        if self.replicas is not None:
            out["within_groups"] = self.shards.snapshot()["total"]
            out["across_groups"] = self.replicas.snapshot()["total"]
        return out

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)
