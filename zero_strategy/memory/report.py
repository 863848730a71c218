"""An engine's own memory accounting, beside the ZeRO formula's prediction for it: the
model states it holds (by storage, each once), the disk tier's files, pinned host memory,
and what its last measured forward kept for backward (activations)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.generation import gathered_bytes
from ..optim.owner import OwnerPart
from .free import free_bytes, generation_budget
from .states import MemoryEstimate, estimate_memory, storage_bytes

if TYPE_CHECKING:
    from ..engine_view import EngineView


def report(engine: EngineView) -> dict[str, Any]:
    seen: set[int] = set()
    held = [u.param_store.held_tensors() for u in engine.units]
    params = storage_bytes([t for h in held for t in h["params"]], seen)
    grads = storage_bytes([t for u in engine.units for t in u.grad_store.held_tensors()], seen)
    masters = [t for h in held for t in h["master"]]
    optim = storage_bytes(masters + engine.optimizer.state_tensors(), seen)
    expected = predicted(engine)
    padding = sum(u.layout.padded_numel - u.layout.numel for u in engine.units)
    total = params + grads + optim
    activations = engine.activations
    return {
        "stage": engine.plan.stage,
        "world_size": engine.comm.world_size,
        "rank": engine.comm.rank,
        "precision": engine.plan.policy.name,
        "num_params": engine.num_params,
        "padding_elements": padding,
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": optim,
        "total_bytes": total,
        "predicted_params_bytes": expected.params_bytes,
        "predicted_grads_bytes": expected.grads_bytes,
        "predicted_optimizer_bytes": expected.optimizer_bytes,
        "predicted_total_bytes": expected.total_bytes,
        "predicted_host_bytes": expected.host_bytes,
        "disk_bytes": engine.tier.disk_bytes() if engine.tier is not None else 0,
        "predicted_disk_bytes": expected.disk_bytes,
        "predicted_resident_bytes": expected.resident_bytes,
        # the disk tier's pinned ring (GPU only): its whole pinned footprint
        "pinned_staging_bytes": (engine.transfers.staging.pinned_bytes
                                 if engine.transfers.staging is not None else 0),
        # the pinned arena of offloaded host buffers (GPU only), chunks whole
        "pinned_bytes": engine.transfers.pinned_bytes,
        "ratio_to_formula": total / expected.total_bytes if expected.total_bytes else 1.0,
        # what the last measured forward kept on the device for backward (None: no training
        # forward yet), and what it moved off it (offload_activations)
        "activation_bytes": activations.saved_bytes,
        "offloaded_activation_bytes": activations.offloaded_bytes,
        "checkpointed_modules": len(activations.modules),
        **_generation(engine),
    }


def _generation(engine: EngineView) -> dict[str, int | None]:
    """Stage-3 generation: what this rank has free now, the budget a ``generate()`` call
    would get from it (or from the config), and what holding every unit takes."""
    device = engine.comm.device
    configured = engine.config.generation_gather_budget
    gathering = [u for u in engine.units if u.param_store.gathers]
    return {
        "free_bytes": free_bytes(device),
        "generation_budget_bytes": (None if not gathering else configured
                                    if configured is not None else generation_budget(device)),
        "generation_held_bytes": sum(gathered_bytes(u) for u in gathering),
    }


def predicted(engine: EngineView) -> MemoryEstimate:
    owner_parts = [p for p in engine.optimizer.parts if isinstance(p, OwnerPart)]
    config = engine.config
    return estimate_memory(
        engine.num_params, stage=engine.plan.stage, world_size=engine.shards.world_size,
        precision=config.precision, optimizer_states=engine.optimizer.states_per_param(),
        reduce_dtype=config.reduce_dtype, offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params,
        host_is_device=not engine.transfers.host_is_separate,
        largest_unit_numels=tuple(sorted((u.layout.shard_numel for u in engine.units),
                                         reverse=True)[:2]),
        placed_params=sum(p.placed_numel() for p in owner_parts),
        owned_params=sum(p.owned_numel() for p in owner_parts),
        placed_states=max((p.states_per_param() for p in owner_parts), default=0),
        elementwise_here=sum(seg.view.numel() for p in engine.optimizer.parts
                             for seg in p.segments) if owner_parts else None,
    )
