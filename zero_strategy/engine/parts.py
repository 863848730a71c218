"""``EngineParts``: what one engine is made of, declared in one place.

``setup.build`` creates every collaborator onto it in order; ``step.py`` and ``state.py`` are
functions over it; ``ZeroEngine`` is its public face. They share this class rather than the
facade so that none of them imports ``ZeroEngine`` (no cycle), and every part stays a plain
attribute: the forward and backward read them with no property or call in between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.units import UnitComms

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    import torch
    from torch import nn

    from ..comm.collectives import Communicator
    from ..config import ZeroConfig
    from ..core.access import ParamAccess
    from ..core.activations import Activations
    from ..core.buffers import BufferPool
    from ..core.generation import GenerationMode
    from ..core.hooks import HookSet, ModulePatches
    from ..core.params import Placement
    from ..core.plan import ZeroPlan
    from ..core.precision import LossScaler
    from ..core.progress import StepProgress
    from ..core.runtime import Runtime
    from ..core.units import Unit
    from ..offload.disk import DiskTier
    from ..offload.transfers import Transfers
    from ..optim.sharded import ShardedOptimizer
    from ..optim.state import UserOptimizerPatch


class EngineParts:
    """The collaborators of one engine and the counters its steps move."""

    config: ZeroConfig
    comm: Communicator
    """Every rank: what all of them must agree on (buffers, skipped steps, checkpoints)."""
    shards: Communicator
    """The ranks a unit is sharded over (``comm`` itself without hybrid sharding)."""
    replicas: Communicator | None
    """Hybrid sharding: the ranks holding the same shard (gradient shards all-reduced)."""
    module: nn.Module
    device: torch.device
    plan: ZeroPlan
    forward_context: Callable[[], AbstractContextManager[Any]]
    """What the module's forward runs inside: autocast under the "-autocast" precisions."""
    activations: Activations
    pool: BufferPool
    transfers: Transfers
    tier: DiskTier | None
    placement: Placement
    units: list[Unit]
    optimizer: ShardedOptimizer
    """The user's optimizer(s) rebuilt over what this rank holds."""
    user_optimizer: torch.optim.Optimizer
    """The user's optimizer, or several combined: hyperparameters are read from it."""
    optimizer_patches: list[UserOptimizerPatch]
    runtime: Runtime
    hooks: HookSet
    access: ParamAccess
    patches: ModulePatches
    generation_mode: GenerationMode | None
    """Stage 3: holds units for a ``generate()`` call (None where nothing is gathered)."""
    scaler: LossScaler | None
    param_names: dict[int, str]
    """A managed parameter's name, by ``id`` of the parameter."""
    original_dtypes: dict[int, torch.dtype]
    """A managed parameter's dtype before the engine cast it (``close`` gives it back)."""
    num_params: int
    global_step: int
    skipped_steps: int
    progress: StepProgress
    """The step's phase (reduced, unscaled, clipped, updating, failed, cut short...): moved
    by the runtime at the end of a synchronised backward, by step.py, and by
    ``ZeroEngine.load_checkpoint`` (a reload ends a step cut short)."""
    # Bookkeeping moved only by step.py (buffers, signature: refreshed when parameters are
    # adopted) and state.py (closed).
    _closed: bool
    _buffers: list[torch.Tensor]
    _optimizer_signature: tuple[int, ...]

    def check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine was closed; the module is a plain "
                               "nn.Module again (build a new ZeroEngine to keep training)")

    def check_trainable(self, what: str) -> None:
        self.check_open(what)
        reason = self.progress.reason
        if reason is not None:
            raise RuntimeError(
                f"engine.{what}(): {reason}; the weights and optimizer states are "
                "no longer those of one step, so the engine will not train on them: reload "
                "the last checkpoint (engine.load_checkpoint(directory)) first")

    def unit_comms(self) -> UnitComms:
        return UnitComms(shards=self.shards, world=self.comm, replicas=self.replicas)
