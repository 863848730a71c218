"""`ZeroEngine`: a model and its optimizer, sharded across the ranks of a process group."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing.util
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from . import engine_memory
from .checkpoint import pretrained as checkpoint_pretrained
from .checkpoint import read as checkpoint_read
from .checkpoint import write as checkpoint_write
from .comm.collectives import Communicator, default_device
from .config import ZeroConfig
from .core.access import ParamAccess
from .core.activations import Activations
from .core.buffers import BufferPool
from .core.devices import canonical_device
from .core.hooks import HookSet, ModulePatches
from .core.materialize import InitFn, Materializer, has_meta
from .core.params import Placement
from .core.plan import make_plan
from .core.precision import LossScaler
from .core.runtime import Runtime
from .core.units import NamedParams, UnitComms, build_units
from .offload.disk import DiskFullError, DiskTier
from .offload.transfers import Transfers
from .optim.combined import CombinedOptimizer
from .optim.combined import parts as optimizer_parts
from .optim.sharded import ShardedOptimizer, placement, states_to_reserve
from .optim.state import UserOptimizerPatch, full_state_dict, load_full_state_dict


class ZeroEngine:
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
        self.config = config if config is not None else ZeroConfig()
        if not isinstance(self.config, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(self.config).__name__}")
        self.comm = Communicator(process_group, timeout=self.config.timeout,
                                 step=lambda: self.global_step)
        """Every rank: what all of them must agree on (buffers, skipped steps, checkpoints)."""
        self.module = model
        self.device = _single_device(model, device, self.comm.backend)
        self.comm.use_device(self.device)
        _use_cuda_device(self.device)
        # Chosen (and refused) before anything is built; installed last.
        self.activations = Activations(model, self.config, self.device, self.comm.rank)
        self.pool = BufferPool(self.device)
        self.comm.use_scratch(self.pool.take, self.pool.give)
        self.shards, self.replicas = self._shard_groups()
        materializer = Materializer(model, self.device, param_init_fn) if has_meta(model) else None
        pretrained = checkpoint_pretrained.pending(model)  # weights to stream in, last
        self.plan = make_plan(self.config, self.shards.world_size)
        optimizer = _as_one_optimizer(optimizer)
        existing = _existing_states(optimizer)
        managed, group_of = _managed_parameters(model, optimizer)
        for part in optimizer_parts(optimizer):  # refusals before anything is built
            placement(part, self.config.elementwise_optimizer)
        self.param_names = {id(p): n for n, p in managed}
        self.num_params = sum(p.numel() for _, p in managed)
        self._original_dtypes = {id(p): p.dtype for _, p in managed}
        self.user_optimizer = optimizer
        self._optimizer_signature = _signature(optimizer)
        self.transfers = Transfers.for_device(self.device)
        self.tier = self._disk_tier(optimizer)
        if self.tier is not None:
            self.transfers.use_staging(self.config.staging_bytes, self.tier.holds)
        self.placement = Placement(self.device, self.plan.offload_optimizer,
                                   self.plan.offload_params, self.transfers, self.pool,
                                   tier=self.tier,
                                   optimizer_disk=self.config.optimizer_tier == "disk",
                                   params_disk=self.config.params_tier == "disk")
        try:
            self.units = build_units(model, managed, group_of, self.plan, self._unit_comms(),
                                     self.placement, materializer)
        except BaseException:
            if self.tier is not None:
                self.tier.close()
            raise
        if materializer is not None:
            materializer.finish()
        self._prepare_unmanaged(model, {id(p) for _, p in managed})
        self.optimizer = ShardedOptimizer(
            optimizer, self.units, self.shards, self.plan.optimizer_shards,
            self.config.elementwise_optimizer, exchange_numel=self.plan.bucket_numel,
            tier=self.tier)
        self._reserve_disk_states()
        self.runtime = Runtime(self.units, self.shards, model, self.plan.prefetch,
                               self.plan.check_gather_order, world=self.comm,
                               blocking_order_check=self.plan.blocking_order_check)
        self.hooks = HookSet()
        self.hooks.install(self.units, self.runtime)
        self.access = ParamAccess(self.units, self.runtime, self.shards, self.param_names,
                                  self.plan.overlap_param_gather, world=self.comm)
        self.patches = ModulePatches(self.access, watch=bool(self.access.watched))
        self.patches.install(model)
        self.optimizer_patches = [
            UserOptimizerPatch(part.user, self._part_state_dict(k), self._part_loader(k))
            for k, part in enumerate(self.optimizer.parts)]
        self._take_over_states(existing)
        self.scaler = LossScaler(self.config.loss_scale) if self.plan.policy.scales_loss else None
        self._unscaled = False
        self._norm: torch.Tensor | None = None
        self._closed = False
        self.global_step = 0
        self.skipped_steps = 0
        self._buffers = [b for b in model.buffers() if b is not None]
        self.activations.install(self.transfers)
        if pretrained:  # from_pretrained's model: its folder's weights go into the shards now
            checkpoint_pretrained.load_pending(self, pretrained)

    # ------------------------------------------------------------------ setup helpers
    def _shard_groups(self) -> tuple[Communicator, Communicator | None]:
        """The ranks a unit is sharded over, and (hybrid sharding) the ranks holding the same
        shard, across which gradient shards are all-reduced."""
        size = self.config.shard_group_size
        if size is None or size == self.comm.world_size:
            return self.comm, None
        return self.comm.split(size)

    def _disk_tier(self, optimizer: torch.optim.Optimizer) -> DiskTier | None:
        """The disk tier's files for this rank (config.offload_dir), after checking that its
        filesystem has the bytes the ZeRO formula says this rank will keep there."""
        if self.config.optimizer_tier != "disk":
            return None
        for part in optimizer_parts(optimizer):
            if placement(part, self.config.elementwise_optimizer) != "shard":
                raise ValueError(
                    f"offload_optimizer='disk' steps optimizers on flat shard pieces, one unit "
                    f"at a time; {type(part).__name__} updates whole parameters on owning "
                    "ranks: use offload_optimizer='cpu' with it")
        problem: BaseException | None = None
        tier: DiskTier | None = None
        try:
            tier = DiskTier(self.config.offload_dir, self.comm.rank)
            tier.check_space(*self._disk_bytes(optimizer))
        except (OSError, ValueError) as e:
            problem = e
        self._agree_on_disk(problem, tier)
        assert tier is not None
        # An engine never closed still removes its directory: when collected, at interpreter
        # exit, and at the exit of a forked worker (multiprocessing skips atexit there).
        weakref.finalize(self, tier.close)
        multiprocessing.util.Finalize(self, tier.close, exitpriority=10)
        return tier

    def _reserve_disk_states(self) -> None:
        """Disk tier: every optimizer state's file created now, agreed across ranks."""
        if self.tier is None:
            return
        problem = None
        try:
            self.optimizer.reserve_states()
        except OSError as e:
            problem = e
        self._agree_on_disk(problem, self.tier)

    def _agree_on_disk(self, problem: BaseException | None, tier: DiskTier | None) -> None:
        """Every rank raises when one cannot use its offload_dir (the others would wait for
        it in the next collective)."""
        failed = self.comm.agree_max(int(problem is not None))
        if not failed:
            return
        if tier is not None:
            tier.close()
        if problem is not None:
            raise problem
        raise DiskFullError(errno.EIO, "offload_dir: another rank cannot use its disk tier "
                            "(its error names the directory and the bytes); nothing was built")

    def _disk_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, str]:
        policy = self.plan.policy
        shard = -(-self.num_params // self.plan.optimizer_shards)
        states = max((states_to_reserve(part) for part in optimizer_parts(optimizer)),
                     default=0)
        master = policy.master_dtype.itemsize
        total = shard * master * (1 + states)
        what = f"fp32 masters and {states} optimizer state(s) per parameter"
        if self.device.type == "cpu":
            total += shard * policy.reduce_dtype.itemsize
            what += ", reduced gradients"
        if self.config.params_tier == "disk" and policy.separate_master:
            total += shard * policy.compute_dtype.itemsize
            what += ", parameter shards"
        return total, what

    def _unit_comms(self) -> UnitComms:
        return UnitComms(shards=self.shards, world=self.comm, replicas=self.replicas)

    def _prepare_unmanaged(self, model: nn.Module, managed_ids: set[int]) -> None:
        """Frozen parameters and buffers stay whole: cast to the compute dtype, rank 0's copy."""
        compute = self.plan.policy.compute_dtype
        tensors = [p for p in model.parameters() if id(p) not in managed_ids]
        tensors += [b for b in model.buffers() if b is not None]
        with torch.no_grad():
            for t in tensors:
                if torch.is_floating_point(t) and t.dtype != compute:
                    t.data = t.data.to(compute)
        if tensors:
            self.comm.broadcast_coalesced(tensors)

    def _take_over_states(self, existing: dict[int, dict[str, Any]]) -> None:
        """State the user's optimizers held before wrapping (``load_state_dict`` of a plain
        run, steps taken without the engine) moves into the shards (or to the owners), as if
        loaded after wrapping; the user's objects then hold none, as for every wrapped
        optimizer (the pieces live in the inner ones)."""
        for k, state_dict in existing.items():
            part = self.optimizer.parts[k]
            load_full_state_dict(part, self.param_names, state_dict)
            part.user.state.clear()

    # ------------------------------------------------------------------ training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("forward")
        self._follow_trainability()
        self.runtime.begin_forward()
        if self.plan.broadcast_buffers and self._buffers:
            with torch.no_grad(), record_function("zero::broadcast_buffers"):
                self.comm.broadcast_coalesced(self._buffers)
        args, kwargs = self.plan.policy.cast_inputs(args, kwargs)
        with record_function("zero::forward"), self.activations.forward_pass():
            output = self.module(*args, **kwargs)
        self.runtime.end_forward()
        return output

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward; outside ``no_sync()`` gradients are reduced while it runs."""
        self.hooks.ensure_grad_hooks(self.units, self.runtime)  # unfrozen since the forward
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        with record_function("zero::backward"):
            try:
                loss.backward(**kwargs)
            except BaseException:
                self.runtime.interrupted = True  # zero_grad() matches the peers' reductions
                raise

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the context exits."""
        previous = self.runtime.sync
        self.runtime.sync = False
        try:
            yield
        finally:
            self.runtime.sync = previous

    def _unscale(self) -> None:
        if self.scaler is None or self._unscaled:
            return
        inv = 1.0 / self.scaler.scale
        for g in self.optimizer.master_grads():
            g.mul_(inv)
        self._unscaled = True

    def _require_reduced_grads(self, what: str) -> None:
        if not self.runtime.grads_pending_step:
            raise RuntimeError(
                f"{what} needs reduced gradients: call engine.backward(loss) outside no_sync() "
                "first (the last micro-batch of an accumulation window must synchronise)"
            )

    @property
    def grads_pending(self) -> bool:
        """Whether reduced gradients wait for ``step()`` (a synchronising backward ran since
        the last step or ``zero_grad()``)."""
        return bool(self.runtime.grads_pending_step)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole gradient (over all shards); returns that norm."""
        self._require_reduced_grads("clip_grad_norm_")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        self._unscale()
        with record_function("zero::clip_grad_norm"):
            norm = self.optimizer.clip_grad_norm_(max_norm, norm_type)
        self._norm = norm  # step() reads finiteness from it instead of another collective
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value]. Elementwise, so clamping
        each rank's (unscaled) shard is exactly torch.nn.utils.clip_grad_value_ on the whole."""
        self._require_reduced_grads("clip_grad_value_")
        if not clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value!r}")
        self._unscale()
        with record_function("zero::clip_grad_value"):
            for g in self.optimizer.master_grads():
                g.clamp_(-clip_value, clip_value)

    def get_global_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        self._require_reduced_grads("get_global_grad_norm")
        self._unscale()
        return self.optimizer.grad_norm(norm_type)

    def _nonfinite(self) -> bool:
        """Whether any rank holds an inf/NaN gradient: the clipping norm when this step
        computed one (already global, no extra collective), else one scalar all-reduce over a
        flag built on the device (a single host sync per step)."""
        if self.config.nonfinite_grads == "off" and self.scaler is None:
            return False
        if self._norm is not None:
            return not bool(torch.isfinite(self._norm))
        local = self.optimizer.nonfinite_local(self.device)
        return bool(self.comm.all_reduce_max_to_host(local.reshape(1))[0])

    def step(self) -> bool:
        """Optimizer step on this rank's shard, then propagate and zero gradients.

        Returns False when the step was skipped: some rank had an inf/NaN gradient (an fp16
        overflow, or ``ZeroConfig.nonfinite_grads="skip"`` at any precision); weights,
        optimizer states and step counts are then unchanged on every rank.
        """
        self._check_open("step")
        self._require_reduced_grads("step")
        self._refuse_stray_grads()
        self.runtime.settle()  # fp32 masters are views of compute copies a gather may write
        self._unscale()
        nonfinite = self._nonfinite()
        if self.scaler is not None:
            self.scaler.update(nonfinite)
        if nonfinite:
            self.skipped_steps += 1
            self.zero_grad()
            self._report_nonfinite()
        else:
            self.optimizer.step()
            self.global_step += 1
            self.zero_grad()
            self.refresh_compute_copies()
        # torch's LR schedulers warn unless the optimizer they wrap was stepped; the engine
        # steps its inner copy (or skips), so record the call on the user's object.
        for opt in {id(o): o for o in [self.user_optimizer, *self.user_optimizers]}.values():
            opt._opt_called = True  # type: ignore[attr-defined]
        return not nonfinite

    def _report_nonfinite(self) -> None:
        scale = f" (fp16 loss scale now {self.scaler.scale:g})" if self.scaler else ""
        message = (f"non-finite gradients at global step {self.global_step} on at least one "
                   f"rank: step skipped on every rank{scale}; {self.skipped_steps} skipped so far")
        if self.config.nonfinite_grads == "error":
            raise FloatingPointError(
                message.replace("step skipped", "nothing was updated")
                + " (ZeroConfig(nonfinite_grads='skip') skips such steps instead)")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def refresh_compute_copies(self) -> None:
        """Propagate every unit's master shard into the copy forward reads: all-gathers
        launched in forward order (buckets hold parameters in reverse registration order),
        waited for here only without ``overlap_param_gather``; otherwise by the first read
        of each bucket (``ParamAccess``) or ``runtime.settle()``."""
        with record_function("zero::update_params"):
            for unit in reversed(self.units):
                unit.param_store.after_step(self.shards)
            if not self.plan.overlap_param_gather:
                self.runtime.settle()

    def unmanaged_state(self) -> dict[str, torch.Tensor]:
        """The module's buffers and frozen parameters, by state_dict key (kept whole)."""
        managed = {id(p) for u in self.units for p in u.params}
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items()
                if id(v) not in managed}

    # ------------------------------------------------------------------ trainability
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine was closed; the module is a plain "
                               "nn.Module again (build a new ZeroEngine to keep training)")

    def _follow_trainability(self) -> None:
        """Before a forward: take over parameters the user added to the optimizer
        (``add_param_group``). Gradient hooks for unfrozen parameters are added in
        ``backward()``, the one place every gradient passes."""
        signature = _signature(self.user_optimizer)
        if signature != self._optimizer_signature:
            self._adopt_new_parameters()
            self._optimizer_signature = signature

    def _adopt_new_parameters(self) -> None:
        self.optimizer.check_adoptable()
        managed, group_of = _managed_parameters(self.module, self.user_optimizer, strict=False)
        new = [(n, p) for n, p in managed if id(p) not in self.param_names]
        if not new:
            return
        if self.runtime.grads_pending_step or any(u.used.count(True) for u in self.units):
            raise RuntimeError(
                f"parameters {[n for n, _ in new][:5]} were added to the optimizer in the "
                "middle of a step (gradients are pending): add param groups between "
                "engine.step() and the next forward")
        stale = [n for n, p in new if p.grad is not None]
        if stale:
            raise RuntimeError(f"parameters {stale[:5]} added to the optimizer already hold a "
                               ".grad from before; set it to None first (optimizer.zero_grad())")
        self.runtime.settle()
        self.runtime.reshard_all()
        units = build_units(self.module, new, group_of, self.plan, self._unit_comms(),
                            self.placement, first_index=len(self.units))
        self.units.extend(units)
        for name, p in new:
            self.param_names[id(p)] = name
            self._original_dtypes[id(p)] = p.dtype
        self.num_params += sum(p.numel() for _, p in new)
        self.optimizer.add_units(units)
        self.hooks.install(units, self.runtime)
        self.access.add_units(units)
        self._buffers = [b for b in self.module.buffers() if b is not None]

    def _refuse_stray_grads(self) -> None:
        """A managed parameter with a ``.grad`` got it outside the engine's hooks (unfrozen
        after the forward): stepping without it would silently ignore it."""
        stray = [self.param_names[id(p)] for u in self.units for p in u.params
                 if p.grad is not None]
        if stray:
            raise RuntimeError(
                f"parameters {stray[:5]} hold a .grad that did not go through the engine's "
                "reduction (given by hand, or produced by a backward not run through "
                "engine.backward() after they were unfrozen); stepping would ignore it. Run "
                "backward through engine.backward(), and set .grad to None before step()")

    def zero_grad(self) -> None:
        """Forget every gradient of the step, also after an exception in forward, backward or
        step left a pass half done: the engine is then ready for the next micro-batch."""
        self.runtime.reset()
        for unit in self.units:
            unit.zero_grad()
            for p in unit.params:
                p.grad = None
        self._unscaled = False
        self._norm = None

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
        self._check_open("gathered_parameters")
        return self.access.gathered(target, writable, modifier_rank)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a full (unsharded) ``model.state_dict()`` into the engine, e.g. pretrained
        weights: managed parameters' masters get the values at full precision. Every key and
        shape is checked before anything is written."""
        self._check_open("load_state_dict")
        self.settle_tier()
        expected = {k: (self.access.place[id(v)][0].layout.slots[self.access.place[id(v)][1]]
                        .shape if id(v) in self.access.place else tuple(v.shape))
                    for k, v in self.module.state_dict(keep_vars=True).items()}
        problems = [f"size mismatch for {k}: {tuple(v.shape)} given, {expected[k]} expected"
                    for k, v in state_dict.items()
                    if k in expected and tuple(v.shape) != tuple(expected[k])]
        if strict:
            problems += [f"missing key {k!r}" for k in expected if k not in state_dict]
            problems += [f"unexpected key {k!r}" for k in state_dict if k not in expected]
        if problems:
            raise RuntimeError("engine.load_state_dict: nothing was loaded: "
                               + "; ".join(problems[:10]))
        self.runtime.settle()
        self.runtime.reshard_all()
        return self.module.load_state_dict(state_dict, strict=strict)

    def close(self) -> nn.Module:
        """Give the module back as a plain ``nn.Module`` holding the trained weights (whole,
        in the dtypes it had, from the masters), with every hook and class swap removed.
        A collective: call it on every rank."""
        if self._closed:
            return self.module
        self.runtime.settle()
        self.runtime.reshard_all()
        with torch.no_grad():
            for unit in self.units:
                flat = unit.param_store.gather_master(self.shards)
                for slot, p in zip(unit.layout.slots, unit.params):
                    value = flat[slot.offset : slot.end].view(slot.shape)
                    p.data = self._closed_copy(value, self._original_dtypes[id(p)], slot.name)
        self.hooks.remove()
        self.patches.remove()
        self.activations.remove()
        for patch in self.optimizer_patches:
            patch.remove()
        self._closed = True
        self.units = []
        self.optimizer.segments = []
        if self.tier is not None:
            self.tier.close()
        return self.module

    def settle_tier(self) -> None:
        """Disk tier: wait for its reads and write-backs before code that writes the state
        outside the step (a load): a write racing one is refused by the tier with a fault."""
        if self.tier is not None:
            self.tier.drain()

    def _closed_copy(self, value: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
        """A parameter's value for the plain module ``close`` gives back. With the disk tier
        the model may not fit in memory, so the value goes into a file of the tier, mapped:
        the mapping outlives the file's directory entry, which ``close`` removes, and its
        pages are read on use and reclaimable, like a checkpoint loaded with ``mmap=True``."""
        if self.tier is None:
            return value.to(dtype, copy=True)
        try:
            out = self.tier.empty(value.numel(), dtype, f"closed.{name}").view(value.shape)
        except DiskFullError:  # the weights must come back: in memory, then
            return value.to(dtype, copy=True)
        out.copy_(value)
        self.tier.release([out], dirty=True)
        return out

    # ------------------------------------------------------------------ state
    @property
    def user_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers: the one given, or the parts of several."""
        return optimizer_parts(self.user_optimizer)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The user's optimizer state as an unsharded run's ``optimizer.state_dict()`` would
        hold it (same indices, keys and tensors; ``{"optimizers": [...]}`` for several, as
        ``CombinedOptimizer`` saves), assembled on every rank: a collective that materialises
        the whole optimizer state (use the sharded checkpoint to scale). The user's optimizer
        objects return this from their own ``state_dict()``."""
        self._check_open("optimizer_state_dict")
        return self.user_optimizer.state_dict()

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer format (from ``optimizer_state_dict()`` or a run without
        ZeRO) into the shards; also what the user's ``optimizer.load_state_dict()`` does."""
        self._check_open("load_optimizer_state_dict")
        self.settle_tier()
        self.user_optimizer.load_state_dict(state_dict)

    def _part_state_dict(self, k: int) -> Any:
        def save() -> dict[str, Any]:
            self._check_open("optimizer.state_dict")
            return full_state_dict(self.optimizer.parts[k], self.param_names, self.shards)
        return save

    def _part_loader(self, k: int) -> Any:
        def load(state_dict: dict[str, Any]) -> None:
            self._check_open("optimizer.load_state_dict")
            self.settle_tier()
            load_full_state_dict(self.optimizer.parts[k], self.param_names, state_dict)
        return load

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated module state dict on every rank: same keys and shapes as
        ``model.state_dict()``, managed parameters as their master (fp32) values, on CPU."""
        values: dict[int, torch.Tensor] = {}
        self.runtime.settle()
        for unit in self.units:
            flat = unit.param_store.gather_master(self.shards).cpu()
            for slot, p in zip(unit.layout.slots, unit.params):
                values[id(p)] = flat[slot.offset : slot.end].view(slot.shape).clone()
        out = {}
        for key, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) in values:
                out[key] = values[id(tensor)]
            else:
                out[key] = tensor.detach().cpu().clone()
        return out

    def save_checkpoint(self, directory: str | os.PathLike, *, tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own shards of a new tag under ``directory`` (atomically)."""
        # A closed engine has no shards left: what it wrote would hold no parameters and load
        # nowhere. The plain module saves itself (``torch.save(module.state_dict(), ...)``).
        self._check_open("save_checkpoint")
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
        self._check_open("load_checkpoint")
        with record_function("zero::load_checkpoint"):
            return checkpoint_read.load(self, directory, tag=tag, load_optimizer=load_optimizer,
                                        trust_pickles=trust_pickles)

    def load_pretrained(self, path: str | os.PathLike, *, strict: bool = True,
                        key_map: checkpoint_pretrained.KeyMap | None = None) -> Any:
        """Load a Hugging Face ``save_pretrained`` folder into the shards, each rank reading
        only its own ranges, everything checked before anything changes; returns the missing
        and unexpected keys, as ``load_state_dict``. ``key_map`` defaults to the one
        ``from_pretrained`` built the model with (docs/pretrained.md)."""
        self._check_open("load_pretrained")
        with record_function("zero::load_pretrained"):
            return checkpoint_pretrained.load(self, path, key_map=key_map, strict=strict)

    def memory_report(self) -> dict[str, int | float | str | None]:
        """Model-state bytes this rank holds now, beside the ZeRO formula's prediction, and
        what the last measured forward kept for backward (``measure_activations``)."""
        return engine_memory.report(self)

    def predicted_memory(self) -> Any:
        return engine_memory.predicted(self)

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



def _as_one_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """One optimizer object: the one given, or several combined (checked disjoint)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        return optimizer[0] if len(optimizer) == 1 else CombinedOptimizer(optimizer)
    raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got "
                    f"{type(optimizer).__name__}")


def _existing_states(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Each of the user's optimizers that already holds state, in torch's format, read before
    the engine replaces their ``state_dict``."""
    return {k: part.state_dict() for k, part in enumerate(optimizer_parts(optimizer))
            if len(part.state)}


def _single_device(model: nn.Module, wanted: torch.device | str | None,
                   backend: str) -> torch.device:
    """The one device the model lives on (meta tensors are materialised there later)."""
    devices: dict[torch.device, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_meta:
            devices.setdefault(t.device, name)
    if wanted is not None:
        devices.setdefault(canonical_device(wanted), "device=")
    if len(devices) > 1:
        found = ", ".join(f"{d} (e.g. {n!r})" for d, n in devices.items())
        raise ValueError(
            f"the model's parameters and buffers must all be on one device, found: {found}; "
            "move the model with model.to(device) before building the ZeroEngine"
        )
    if devices:
        return next(iter(devices))
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters or buffers: nothing to train")
    return default_device(backend)


def _use_cuda_device(device: torch.device) -> None:
    """Make the model's GPU the current one: nccl's object collectives and barriers, pinned
    allocations and new streams all use the current device, and a user who moved the model
    to cuda:r without ``torch.cuda.set_device(r)`` would otherwise put every rank's on cuda:0."""
    if device.type == "cuda" and device.index is not None \
            and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def _managed_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True
) -> tuple[NamedParams, dict[int, int]]:
    """The parameters the optimizer holds (deduplicated, registration order; frozen ones too,
    so unfreezing them later needs nothing but their gradient) and their optimizer group.
    ``strict``: a trainable parameter outside the optimizer is an error (it would never be
    updated, and the user most likely forgot it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that "
                    "is not a parameter of the model: build the optimizer on model.parameters()"
                )
            group_of[id(p)] = gi
    managed = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing and strict:
        raise ValueError(
            f"trainable parameters missing from the optimizer: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; add them to the optimizer or freeze them "
            "with requires_grad_(False)"
        )
    if not managed:
        raise ValueError("the optimizer holds no parameter of the model: nothing to train")
    _check_dtypes(managed)
    return managed, group_of


_TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtypes(managed: NamedParams) -> None:
    """The engine keeps parameters in ZeroConfig.precision's dtypes (fp32 masters); a dtype it
    would silently change (complex, fp64) is refused."""
    for name, p in managed:
        if p.dtype not in _TRAINABLE_DTYPES:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}: the engine trains float32, bfloat16 "
                "and float16 parameters (kept in ZeroConfig.precision's dtypes, fp32 masters) "
                f"and would change a {p.dtype} one. Keep it out of the optimizer (frozen "
                "parameters of any dtype stay exact), or represent it in float32 (a complex "
                "parameter as torch.view_as_real)")


def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Changes when parameters are added to the optimizer (``add_param_group``)."""
    return tuple(len(g["params"]) for g in optimizer.param_groups)
