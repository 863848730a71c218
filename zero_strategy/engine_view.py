"""What the layers below the engine read of one: ``EngineView``, and the engine's parts they
read, declared once (``ViewParts``).

``checkpoint/`` (saving, loading, pretrained weights) and ``memory/report.py`` take an engine
to read its shards and counters. They are typed against this protocol, declared below the
engine, instead of ``ZeroEngine``: the engine imports them, so naming ``ZeroEngine`` there
would close an import cycle (even one hidden behind ``TYPE_CHECKING``), and the protocol says
in one place which of the engine's members they may rely on. The attributes are declared in
``ViewParts`` alone: ``EngineParts`` (``engine/parts.py``) inherits them and adds the parts
only the engine uses, so a part and its docstring exist once, and ``ZeroEngine`` satisfies
the view by construction (its methods are compared by tests/quick/test_import_graph.py).
Nothing here is imported at run time but the classes themselves.
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


class ViewParts(Protocol):
    """The parts of an engine the layers below it read: every one a plain attribute, set by
    ``engine/setup.py``; which modules move one afterwards is ``engine/parts.py``'s
    ``MOVED_BY``."""

    config: ZeroConfig
    plan: ZeroPlan
    module: nn.Module
    comm: Communicator
    """Every rank: what all of them must agree on (buffers, skipped steps, a load's verdict,
    the manifest's gathering)."""
    shards: Communicator
    """The ranks a unit is sharded over (``comm`` itself without hybrid sharding)."""
    replicas: Communicator | None
    """Hybrid sharding: the ranks holding the same shard (gradient shards all-reduced)."""
    units: list[Unit]
    optimizer: ShardedOptimizer
    """The user's optimizer(s) rebuilt over what this rank holds."""
    user_optimizer: torch.optim.Optimizer
    """The user's optimizer, or several combined: hyperparameters are read from it."""
    runtime: Runtime
    scaler: LossScaler | None
    """fp16: the dynamic loss scale (None at other precisions)."""
    tier: DiskTier | None
    """The disk tier's files (``offload_optimizer="disk"``), else None."""
    transfers: Transfers
    activations: Activations
    param_names: dict[int, str]
    """A managed parameter's name, by ``id`` of the parameter."""
    original_dtypes: dict[int, torch.dtype]
    """A managed parameter's dtype before the engine cast it (``close`` gives it back)."""
    num_params: int
    global_step: int
    skipped_steps: int


class EngineView(ViewParts, Protocol):
    """The members of a ``ZeroEngine`` that checkpoints and the memory report use."""

    @property
    def user_optimizers(self) -> list[torch.optim.Optimizer]: ...

    def unmanaged_state(self) -> dict[str, torch.Tensor]: ...

    def settle_tier(self) -> None: ...

    def zero_grad(self) -> None: ...

    def refresh_compute_copies(self) -> None: ...

    def close(self) -> nn.Module: ...
