"""Building an engine: its device, its communicators, the parameters it manages and their
optimizer groups, the user's optimizer normalised and rebuilt over the shards, the disk tier,
the hooks; then the state the user's optimizer already held is taken over.

``build`` runs the steps in the one order that works (each needs the ones before it) and
refuses what it can before anything is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..checkpoint import pretrained as checkpoint_pretrained
from ..comm.collectives import Communicator
from ..comm.groups import default_device
from ..config import ZeroConfig
from ..core.access import ParamAccess
from ..core.activations import Activations
from ..core.buffers import BufferPool
from ..core.devices import canonical_device
from ..core.flat import FROZEN_GROUP
from ..core.generation import GenerationMode
from ..core.hooks import GenerationContext, HookSet, ModulePatches
from ..core.materialize import InitFn, Materializer, has_meta
from ..core.params import Placement
from ..core.plan import make_plan
from ..core.precision import LossScaler
from ..core.progress import StepProgress
from ..core.runtime import Runtime
from ..core.units import NamedParams, build_units
from ..memory.free import generation_budget
from ..offload.transfers import Transfers
from ..optim.combined import CombinedOptimizer
from ..optim.combined import parts as optimizer_parts
from ..optim.sharded import ShardedOptimizer, placement
from ..optim.state import load_full_state_dict
from . import disk, state
from .parts import EngineParts

Pending = list[tuple[str, checkpoint_pretrained.PretrainedSpec]]
"""Pretrained models in the module whose folders still have to be streamed in."""


def build(parts: EngineParts, model: nn.Module,
          optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
          config: ZeroConfig | None, *, process_group: Any,
          device: torch.device | str | None, param_init_fn: InitFn | None) -> Pending:
    """Set up every collaborator of ``parts`` for ``model`` and ``optimizer``; returns the
    pretrained folders to load once the engine is whole (the load may close it)."""
    parts.config = config if config is not None else ZeroConfig()
    if not isinstance(parts.config, ZeroConfig):
        raise TypeError(f"config must be a ZeroConfig, got {type(parts.config).__name__}")
    _connect(parts, model, process_group, device)
    materializer = Materializer(model, parts.device, param_init_fn) if has_meta(model) else None
    pretrained = checkpoint_pretrained.pending(model)  # weights to stream in, last
    parts.plan = make_plan(parts.config, parts.shards.world_size)
    parts.forward_context = parts.plan.policy.forward_context(parts.device)
    user = as_one_optimizer(optimizer)
    existing = _existing_states(user)
    managed, group_of = managed_parameters(model, user, frozen_too=parts.plan.shards_params)
    for part in optimizer_parts(user):  # refusals before anything is built
        placement(part, parts.config.elementwise_optimizer)
    parts.param_names = {id(p): n for n, p in managed}
    parts.num_params = sum(p.numel() for _, p in managed)
    parts.original_dtypes = {id(p): p.dtype for _, p in managed}
    parts.user_optimizer = user
    parts._optimizer_signature = signature(user)
    _place(parts, user)
    # Before the units: a unit's summary at reduction divides by the scale (disk tier).
    parts.scaler = LossScaler(parts.config.loss_scale) if parts.plan.policy.scales_loss else None
    _build_units(parts, managed, group_of, materializer)
    _prepare_unmanaged(parts, {id(p) for _, p in managed})
    parts.optimizer = ShardedOptimizer(
        user, parts.units, parts.shards, parts.plan.optimizer_shards,
        parts.config.elementwise_optimizer, exchange_numel=parts.plan.bucket_numel,
        tier=parts.tier)
    disk.reserve_states(parts)
    _install(parts, model)
    _take_over_states(parts, existing)
    parts._closed = False
    parts.global_step = 0
    parts.skipped_steps = 0
    parts._buffers = [b for b in model.buffers() if b is not None]
    parts.activations.install(parts.transfers)
    return pretrained


def _connect(parts: EngineParts, model: nn.Module, process_group: Any,
             device: torch.device | str | None) -> None:
    """The communicators, the device, and what is chosen (and refused) before any tensor is
    made: the activation policy (installed last) and the pool lending collectives scratch."""
    parts.comm = Communicator(process_group, timeout=parts.config.timeout,
                              step=lambda: parts.global_step)
    parts.module = model
    parts.device = _single_device(model, device, parts.comm.backend)
    parts.comm.use_device(parts.device)
    _use_cuda_device(parts.device)
    parts.activations = Activations(model, parts.config, parts.device, parts.comm.rank)
    parts.pool = BufferPool(parts.device)
    parts.comm.use_scratch(parts.pool.take, parts.pool.give)
    parts.shards, parts.replicas = _shard_groups(parts)


def _shard_groups(parts: EngineParts) -> tuple[Communicator, Communicator | None]:
    """The ranks a unit is sharded over, and (hybrid sharding) the ranks holding the same
    shard, across which gradient shards are all-reduced."""
    size = parts.config.shard_group_size
    if size is None or size == parts.comm.world_size:
        return parts.comm, None
    return parts.comm.split(size)


def _place(parts: EngineParts, optimizer: torch.optim.Optimizer) -> None:
    """Where each copy lives: device, host buffers, the disk tier (agreed by every rank)."""
    parts.transfers = Transfers.for_device(parts.device)
    parts.tier = disk.open_tier(parts, optimizer)
    if parts.tier is not None:
        parts.transfers.use_staging(parts.config.staging_bytes, parts.tier.holds)
    config, plan = parts.config, parts.plan
    parts.placement = Placement(parts.device, plan.offload_optimizer, plan.offload_params,
                                parts.transfers, parts.pool, tier=parts.tier,
                                optimizer_disk=config.optimizer_tier == "disk",
                                params_disk=config.params_tier == "disk")


def _build_units(parts: EngineParts, managed: NamedParams, group_of: dict[int, int],
                 materializer: Materializer | None) -> None:
    try:
        parts.units = build_units(parts.module, managed, group_of, parts.plan,
                                  parts.unit_comms(), parts.placement, materializer,
                                  scaler=parts.scaler)
    except BaseException:
        if parts.tier is not None:
            parts.tier.close()
        raise
    if materializer is not None:
        materializer.finish()


def _install(parts: EngineParts, model: nn.Module) -> None:
    """The runtime and everything that reaches into the user's objects: hooks on the model,
    class swaps for reads outside forward, the optimizer's ``state_dict`` through the engine."""
    plan = parts.plan
    parts.progress = StepProgress()
    parts.runtime = Runtime(parts.units, parts.shards, model,
                            plan.units_ahead,
                            plan.check_gather_order, world=parts.comm,
                            blocking_order_check=plan.blocking_order_check,
                            progress=parts.progress)
    parts.hooks = HookSet()
    parts.hooks.install(parts.units, parts.runtime)
    parts.access = ParamAccess(parts.units, parts.runtime, parts.shards, parts.param_names,
                               plan.overlap_param_gather, world=parts.comm)
    parts.generation_mode = _generation_mode(parts)
    parts.patches = ModulePatches(parts.access, watch=bool(parts.access.watched),
                                  generation=_generation_context(parts))
    parts.patches.install(model)
    parts.optimizer_patches = state.patch_user_optimizers(parts)


def _generation_context(parts: EngineParts) -> GenerationContext | None:
    """What a model's ``generate`` runs inside: stage 3's generation mode, and under the
    "-autocast" precisions the forward's autocast too (Accelerate autocasts the model's
    ``forward`` itself, so a plain Trainer's ``generate`` runs under it as well)."""
    holding = parts.generation_mode.holding if parts.generation_mode is not None else None
    if parts.plan.policy.autocast_dtype is None:
        return holding
    forward_context = parts.forward_context

    @contextlib.contextmanager
    def generating() -> Iterator[bool]:
        with forward_context(), (holding() if holding is not None
                                 else contextlib.nullcontext(False)) as synced:
            yield synced

    return generating


def _generation_mode(parts: EngineParts) -> GenerationMode | None:
    """Stage 3's generation mode (None where no unit gathers: nothing to hold)."""
    if not any(u.param_store.gathers for u in parts.units):
        return None
    configured = parts.config.generation_gather_budget
    device = parts.device

    def budget() -> int:
        return generation_budget(device) if configured is None else configured

    return GenerationMode(parts.units, parts.runtime, parts.comm, budget)


def _prepare_unmanaged(parts: EngineParts, managed_ids: set[int]) -> None:
    """Frozen parameters and buffers stay whole: cast to the compute dtype, rank 0's copy.
    Under autocast they keep the dtype they came in, as under Accelerate (autocast casts
    per op; a bf16 frozen base stays bf16)."""
    compute = parts.plan.policy.compute_dtype
    cast = parts.plan.policy.autocast_dtype is None
    tensors = [p for p in parts.module.parameters() if id(p) not in managed_ids]
    tensors += [b for b in parts.module.buffers() if b is not None]
    with torch.no_grad():
        for t in tensors:
            if cast and torch.is_floating_point(t) and t.dtype != compute:
                t.data = t.data.to(compute)
    if tensors:
        parts.comm.broadcast_coalesced(tensors)


def _take_over_states(parts: EngineParts, existing: dict[int, dict[str, Any]]) -> None:
    """State the user's optimizers held before wrapping (``load_state_dict`` of a plain
    run, steps taken without the engine) moves into the shards (or to the owners), as if
    loaded after wrapping; the user's objects then hold none, as for every wrapped
    optimizer (the pieces live in the inner ones)."""
    for k, state_dict in existing.items():
        part = parts.optimizer.parts[k]
        load_full_state_dict(part, parts.param_names, state_dict)
        part.user.state.clear()


def as_one_optimizer(optimizer: Any) -> torch.optim.Optimizer:
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


def managed_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True,
    frozen_too: bool = False,
) -> tuple[NamedParams, dict[int, int]]:
    """The parameters the optimizer holds (deduplicated, registration order; frozen ones too,
    so unfreezing them later needs nothing but their gradient) and their optimizer group.
    ``frozen_too`` (stage 3): frozen parameters outside the optimizer as well, in no group
    (``FROZEN_GROUP``), so that a frozen base is sharded like the rest and no rank holds it
    whole; those of a dtype the engine would change (fp64, complex) stay whole and exact.
    ``strict``: a trainable parameter outside the optimizer is an error (it would never be
    updated, and the user most likely forgot it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not any(group["params"] for group in optimizer.param_groups):
        # torch accepts such an optimizer (its step does nothing); an engine would train nothing
        count = len(optimizer.param_groups)
        which = "its only param group is" if count == 1 else f"its {count} param groups are all"
        raise ValueError(
            f"the optimizer holds no parameter: {which} empty, so there is nothing to train; "
            "build it over the model's trainable parameters (empty groups beside non-empty "
            "ones are fine)")
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
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if frozen_too:
        for _, p in model.named_parameters():
            if id(p) not in group_of and not p.requires_grad and p.dtype in _TRAINABLE_DTYPES:
                group_of[id(p)] = FROZEN_GROUP
    managed = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]
    if missing and strict:
        raise ValueError(
            f"trainable parameters missing from the optimizer: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; add them to the optimizer or freeze them "
            "with requires_grad_(False)"
        )
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


def signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Changes when parameters are added to the optimizer (``add_param_group``)."""
    return tuple(len(g["params"]) for g in optimizer.param_groups)
