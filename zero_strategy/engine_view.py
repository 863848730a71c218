"""What the layers below the engine read of one: ``EngineView``.

``checkpoint/`` (saving, loading, pretrained weights) and ``memory/report.py`` take an engine
to read its shards and counters. They are typed against this protocol, declared below the
engine, instead of ``ZeroEngine``: the engine imports them, so naming ``ZeroEngine`` there
would close an import cycle (even one hidden behind ``TYPE_CHECKING``), and the protocol says
in one place which of the engine's members they may rely on. ``ZeroEngine`` satisfies it
structurally; nothing here is imported at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .comm.collectives import Communicator
    from .config import ZeroConfig
    from .core.activations import Activations
    from .core.plan import ZeroPlan
    from .core.precision import LossScaler
    from .core.runtime import Runtime
    from .core.units import Unit
    from .offload.disk import DiskTier
    from .offload.transfers import Transfers
    from .optim.sharded import ShardedOptimizer


class EngineView(Protocol):
    """The members of a ``ZeroEngine`` that checkpoints and the memory report use."""

    config: ZeroConfig
    plan: ZeroPlan
    module: nn.Module
    comm: Communicator
    """Every rank: what all of them agree on (a load's verdict, the manifest's gathering)."""
    shards: Communicator
    """The ranks a unit is sharded over (all of them without hybrid sharding)."""
    replicas: Communicator | None
    """Hybrid sharding: the ranks holding the same shard."""
    units: list[Unit]
    optimizer: ShardedOptimizer
    user_optimizer: torch.optim.Optimizer
    runtime: Runtime
    scaler: LossScaler | None
    tier: DiskTier | None
    transfers: Transfers
    activations: Activations
    param_names: dict[int, str]
    """A managed parameter's name, by ``id`` of the parameter."""
    original_dtypes: dict[int, torch.dtype]
    """A managed parameter's dtype before the engine took it over, by ``id``."""
    num_params: int
    global_step: int
    skipped_steps: int

    @property
    def user_optimizers(self) -> list[torch.optim.Optimizer]: ...

    def unmanaged_state(self) -> dict[str, torch.Tensor]: ...

    def settle_tier(self) -> None: ...

    def zero_grad(self) -> None: ...

    def refresh_compute_copies(self) -> None: ...

    def close(self) -> nn.Module: ...
