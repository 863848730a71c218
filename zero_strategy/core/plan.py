"""The stage turned into a plan once: what each unit shards, where it lives, in which dtype.

Everything stage-dependent is looked up here at engine construction; the hot paths then call
the store objects the plan chose and never test the stage number.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig
from .precision import PrecisionPolicy, make_policy


@dataclass(frozen=True)
class UnitKind:
    """How one unit keeps its state: keys into ``params.PARAM_STORES`` / ``grads.GRAD_STORES``."""

    params: str
    grads: str


@dataclass(frozen=True)
class StageLayout:
    shards_optimizer: bool
    main: UnitKind
    grouping: str
    """"buckets": size-bounded runs of parameters in reverse registration order (stages 0-2);
    "modules": one unit per sufficiently large submodule (stage 3)."""
    persistent: UnitKind | None = None
    """Stage 3: the unit of small parameters that stay whole on every rank."""


STAGE_LAYOUTS: dict[int, StageLayout] = {
    0: StageLayout(False, UnitKind("replicated", "all_reduce"), "buckets"),
    1: StageLayout(True, UnitKind("replicated", "reduce_scatter_full"), "buckets"),
    2: StageLayout(True, UnitKind("replicated", "reduce_scatter_sharded"), "buckets"),
    3: StageLayout(
        True,
        UnitKind("sharded", "reduce_scatter_sharded"),
        "modules",
        persistent=UnitKind("replicated", "reduce_scatter_sharded"),
    ),
}


@dataclass(frozen=True)
class ZeroPlan:
    stage: int
    world_size: int
    layout: StageLayout
    policy: PrecisionPolicy
    bucket_numel: int
    unit_numel: int | None
    persistence_threshold: int | None
    prefetch: bool
    prefetch_units: int
    """Units gathered ahead of the one computing (``ZeroConfig.prefetch_units``)."""
    unit_leaf_classes: tuple[str, ...]
    check_gather_order: bool
    blocking_order_check: bool
    """The gather-order check blocks before each gather on every device (else only where
    the group communicates host tensors)."""
    overlap_param_gather: bool
    offload_optimizer: bool
    offload_params: bool
    broadcast_buffers: bool

    @property
    def units_ahead(self) -> int:
        """Units the runtime gathers ahead of the one computing, and keeps whole at the end
        of forward for the backward (0 without prefetch)."""
        return self.prefetch_units if self.prefetch else 0

    @property
    def optimizer_shards(self) -> int:
        return self.world_size if self.layout.shards_optimizer else 1

    def describe(self) -> str:
        sharded = ["optimizer states"] if self.layout.shards_optimizer else []
        if self.layout.main.grads == "reduce_scatter_sharded":
            sharded.append("gradients")
        if self.layout.main.params == "sharded":
            sharded.append("parameters")
        what = ", ".join(sharded) or "nothing (data parallel)"
        return (
            f"ZeRO stage {self.stage} over {self.world_size} ranks: shards {what}; "
            f"precision {self.policy.name}"
            + (", optimizer offloaded to CPU" if self.offload_optimizer else "")
            + (", parameters offloaded to CPU" if self.offload_params else "")
        )

    @property
    def shards_params(self) -> bool:
        """Stage 3: parameters live as shards, frozen ones outside the optimizer included."""
        return self.layout.main.params == "sharded"


def make_plan(config: ZeroConfig, world_size: int) -> ZeroPlan:
    return ZeroPlan(
        stage=config.stage,
        world_size=world_size,
        layout=STAGE_LAYOUTS[config.stage],
        policy=make_policy(config),
        bucket_numel=config.bucket_numel,
        unit_numel=config.resolved("unit_numel"),
        persistence_threshold=config.resolved("param_persistence_threshold"),
        prefetch=bool(config.resolved("prefetch")),
        prefetch_units=int(config.resolved("prefetch_units") or 0),
        unit_leaf_classes=tuple(config.resolved("unit_leaf_classes") or ()),
        check_gather_order=bool(config.resolved("check_gather_order")),
        blocking_order_check=config.resolved("check_gather_order") == "blocking",
        overlap_param_gather=config.overlap_param_gather,
        offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params,
        broadcast_buffers=config.broadcast_buffers,
    )
