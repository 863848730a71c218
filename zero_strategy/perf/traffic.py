"""What one training step sends: the collectives of each ZeRO stage and option, the bytes
each rank sends for them, and the bytes that cross each node's link.

A step's collectives follow the engine (``core/plan.py``, ``core/params.py``,
``core/grads.py``), per unit of parameters:

- stage 0: an all-reduce of the gradients over every rank;
- stages 1-2: a reduce-scatter of the gradients and, after the optimizer step, an all-gather
  of the updated parameters, both within the shard group;
- stage 3: an all-gather of each unit before its forward and again before its backward
  (but the root unit's and the forward's last ``prefetch_units``, which stay whole from
  their forward to their backward), and a
  reduce-scatter of its gradients; small parameters (``param_persistence_threshold``) stay
  whole on every rank and are reduced and gathered as at stage 2;
- hybrid sharding (``shard_group_size=G``): the groups of G consecutive ranks do the above
  among themselves, then each rank's gradient shard is all-reduced across the ranks holding
  the same shard (the replicas), in int8 too with int8 gradients;
- int8 (``quantize_weights``, ``quantize_gradients``): a stage-3 gather, or a reduce-scatter
  (sent as an all-to-all), carries 1 byte per element plus an fp32 scale per 256.

Bytes a rank sends follow the ring convention of ``Communicator.bytes_sent``: an all-gather
or reduce-scatter of a buffer of S bytes over g ranks sends S (g - 1) / g from each rank, an
all-reduce twice that. Bytes that cross a node's link depend on how the collective is
carried out. Direct exchanges (ours over gloo on the host: each rank sends each peer its
piece) send every piece meant for a rank on another node across the link: P ranks x (g - m)
peers off the node x S / g, where m of the group's g ranks share the node. A ring over ranks
in order (gloo's all-reduce, nccl's collectives) leaves a node once per group: one rank's
share, S (g - 1) / g (twice for an all-reduce), per group with ranks on the node.

Left out: the step's small collectives (the clipping norm, the non-finite check, the
gather-order tags: bytes, not megabytes), the initial broadcast, and transport overhead
(TCP/IP headers; interface counters count them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..comm.int8 import BLOCK
from ..config import ZeroConfig
from ..core.flat import make_layout
from ..core.plan import make_plan
from ..core.units import plan_specs

Kind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
Group = Literal["world", "shard", "replica", "node"]
Algorithm = Literal["direct", "ring"]
Phase = Literal["forward", "backward", "after_step"]

INT8_BYTES = 1 + 4 / BLOCK
"""Bytes per element of an int8 collective: the value, and its block's fp32 scale."""


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: ``nodes`` machines of ``per_node`` processes each, ranks
    numbered node by node (torchrun's order); ``shard_group`` consecutive ranks shard the
    model (the world when None)."""

    nodes: int
    per_node: int
    shard_group: int | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {value!r}")
        g = self.shard_group
        if g is not None:
            aligned = g % self.per_node == 0 or self.per_node % g == 0
            if not isinstance(g, int) or g < 1 or self.world % g or not aligned:
                raise ValueError(
                    f"Layout.shard_group={g!r} must divide the world size {self.world} and "
                    f"either divide the {self.per_node} processes of a node or be a multiple "
                    "of them (groups aligned with nodes)")

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def shards(self) -> int:
        return self.shard_group or self.world

    def size(self, group: Group) -> int:
        return {"world": self.world, "shard": self.shards, "replica": self.world // self.shards,
                "node": self.per_node}[group]

    def on_one_node(self, group: Group) -> int:
        """How many ranks of one such group share a node."""
        if group == "replica":  # ranks ``shards`` apart
            return max(1, self.per_node // self.shards)
        return min(self.size(group), self.per_node)


@dataclass(frozen=True)
class Collective:
    """One collective a step issues (summed over units): ``numel`` elements of the whole
    buffer (the gathered output, the input to reduce), ``element_bytes`` each on the wire."""

    name: str
    kind: Kind
    numel: int
    element_bytes: float
    group: Group
    algorithm: Algorithm
    phase: Phase

    @property
    def nbytes(self) -> float:
        return self.numel * self.element_bytes

    def rank_bytes(self, layout: Layout) -> float:
        """What one rank sends (``Communicator.bytes_sent``'s convention)."""
        g = layout.size(self.group)
        times = 2 if self.kind == "all_reduce" else 1
        return times * self.nbytes * (g - 1) / g

    def node_bytes(self, layout: Layout) -> float:
        """What leaves one node over its link (the same arrives)."""
        g, m = layout.size(self.group), layout.on_one_node(self.group)
        if g == m:  # the whole group is on one node
            return 0.0
        if self.algorithm == "direct":
            return layout.per_node * (g - m) * self.nbytes / g
        return (layout.per_node // m) * self.rank_bytes(layout)


@dataclass(frozen=True)
class ModelUnits:
    """A model as the engine groups it: the flat (padded) sizes of its units."""

    units: tuple[int, ...]
    """Elements of each communicated unit (stage 3: the gathered ones; else the buckets)."""
    kept: int = 0
    """Stage 3: elements gathered once for forward and backward: the root unit's and those of
    the last ``prefetch_units`` units of the forward, which backward needs first."""
    persistent: tuple[int, ...] = ()
    """Stage 3: elements of each bucket of small parameters that stay whole."""

    @classmethod
    def plain(cls, numel: int) -> ModelUnits:
        """A model known by its parameter count alone: one unit, nothing kept or persistent
        (the ZeRO paper's formulas)."""
        return cls(units=(numel,))

    @property
    def numel(self) -> int:
        return sum(self.units) + sum(self.persistent)


def model_units(model: torch.nn.Module, config: ZeroConfig, layout: Layout) -> ModelUnits:
    """The engine's units of ``model`` under ``config`` (a model on the meta device will
    do): each laid out over the shard group as the engine lays it out, padding included."""
    plan = make_plan(config, layout.shards)
    managed = [(n, p) for n, p in model.named_parameters()]
    sizes, root, gathered, persistent = [], 0, [], []
    shards = plan.optimizer_shards
    for spec in plan_specs(model, managed, plan):
        flat = make_layout([(n, p.shape, 0) for n, p in spec.params], shards).padded_numel
        if spec.kind == plan.layout.persistent and spec.module is None:
            persistent.append(flat)
        else:
            sizes.append(flat)
            if spec.name == "":
                root = flat
            else:
                gathered.append(flat)
    # Whole from forward to backward: the root, and the last units the forward gathers
    # (``Runtime._backward_head``: backward's first; here in registration order, which is
    # the forward's in the models predicted)
    last = gathered[len(gathered) - plan.units_ahead:]
    return ModelUnits(tuple(sizes), root + sum(last) if plan.stage == 3 else 0,
                      tuple(persistent))


@dataclass(frozen=True)
class Options:
    """What decides a step's collectives besides the stage."""

    stage: int
    param_bytes: float = 4.0
    """Bytes per element of the compute copy that stage 3 gathers (4: fp32, 2: bf16)."""
    grad_bytes: float = 4.0
    """Bytes per element of the reduced gradients (``reduce_dtype``)."""
    quantize_weights: bool = False
    quantize_gradients: bool = False
    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo on the host: gathers, reduce-scatters and all-to-alls are direct exchanges,
    all-reduces a ring; nccl: rings, all-to-alls direct."""
    extra: tuple[Collective, ...] = field(default=())

    @classmethod
    def from_config(cls, config: ZeroConfig, backend: Literal["gloo", "nccl"] = "gloo"
                    ) -> Options:
        from ..core.precision import make_policy

        policy = make_policy(config)
        size = torch.empty((), dtype=policy.compute_dtype).element_size()
        grads = torch.empty((), dtype=policy.reduce_dtype).element_size()
        return cls(stage=config.stage, param_bytes=size, grad_bytes=grads,
                   quantize_weights=config.quantize_weights == "int8",
                   quantize_gradients=config.quantize_gradients == "int8", backend=backend)


def step_collectives(units: ModelUnits, options: Options, layout: Layout) -> list[Collective]:
    """Every collective of one training step (one micro-batch, no accumulation)."""
    o = options
    if o.stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {o.stage!r}")
    direct: Algorithm = "direct" if o.backend == "gloo" else "ring"
    weights = INT8_BYTES if o.quantize_weights and o.stage == 3 else o.param_bytes
    grads = INT8_BYTES if o.quantize_gradients else o.grad_bytes
    reduce: Kind = "all_to_all" if o.quantize_gradients else "reduce_scatter"
    reduce_alg: Algorithm = "direct" if reduce == "all_to_all" else direct
    total = sum(units.units)
    if o.stage == 0:
        return [Collective("gradient all-reduce", "all_reduce", units.numel, o.grad_bytes,
                           "world", "ring", "backward"), *o.extra]
    if o.stage in (1, 2):
        out = [Collective("gradient reduce-scatter", reduce, total, grads, "shard", reduce_alg,
                          "backward"),
               Collective("parameter all-gather", "all_gather", total, o.param_bytes, "shard",
                          direct, "after_step")]
        shard_total = total
    else:
        persistent = sum(units.persistent)
        out = [Collective("forward all-gather", "all_gather", total, weights, "shard", direct,
                          "forward"),
               Collective("backward all-gather", "all_gather", total - units.kept, weights,
                          "shard", direct, "backward"),
               Collective("gradient reduce-scatter", reduce, total + persistent, grads, "shard",
                          reduce_alg, "backward")]
        if persistent:
            out.append(Collective("small parameters' all-gather", "all_gather", persistent,
                                  o.param_bytes, "shard", direct, "after_step"))
        shard_total = total + persistent
    if layout.shards < layout.world:  # hybrid: the gradient shards across the replicas
        out += _across_replicas(shard_total // layout.shards, o)
    return out + list(o.extra)


def _across_replicas(numel: int, o: Options) -> list[Collective]:
    """Hybrid sharding's all-reduce of each rank's gradient shard across the replicas:
    a ring all-reduce, or with int8 gradients (ZeRO++'s qgZ across nodes) an int8
    reduce-scatter (an all-to-all) and an int8 all-gather of the summed piece, both direct
    (``Communicator.all_reduce_int8``)."""
    if not o.quantize_gradients:
        return [Collective("gradient shards' all-reduce across groups", "all_reduce", numel,
                           o.grad_bytes, "replica", "ring", "backward")]
    return [Collective("gradient shards' int8 reduce-scatter across groups", "all_to_all",
                       numel, INT8_BYTES, "replica", "direct", "backward"),
            Collective("gradient shards' int8 all-gather across groups", "all_gather", numel,
                       INT8_BYTES, "replica", "direct", "backward")]


def rank_bytes(collectives: Iterable[Collective], layout: Layout) -> float:
    return sum(c.rank_bytes(layout) for c in collectives)


def node_bytes(collectives: Iterable[Collective], layout: Layout) -> float:
    return sum(c.node_bytes(layout) for c in collectives)


def by_phase(collectives: Sequence[Collective], layout: Layout) -> dict[str, float]:
    """Bytes leaving a node per phase of the step."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.phase] = out.get(c.phase, 0.0) + c.node_bytes(layout)
    return out
