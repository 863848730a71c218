"""Units: the groups of parameters that are laid out, communicated and freed together.

Stages 0-2 group parameters into size-bounded buckets in reverse registration order (roughly
the order backward produces their gradients). Stage 3 groups them by submodule, so a module's
parameters are gathered just before it runs; a parameter registered in several modules (tied
embeddings) belongs to the unit of their closest common ancestor. A routed block (mixture of
experts, ``routed.py``) is one unit with everything below it, like a ``unit_leaf_classes`` class.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..offload.transfers import Copy, Transfers
from .flat import FlatLayout, make_layout
from .grads import GRAD_STORES, GradStore, max_abs, powered_norm
from .materialize import Materializer
from .params import PARAM_STORES, ParamStore, Placement
from .plan import UnitKind, ZeroPlan
from .precision import LossScaler
from .routed import routed_blocks

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class UnitSpec:
    name: str
    module: nn.Module | None
    params: NamedParams
    kind: UnitKind


class Unit:
    """One unit's parameters, their param store and grad store, and backward bookkeeping."""

    def __init__(
        self, index: int, spec: UnitSpec, layout: FlatLayout, param_store: ParamStore,
        grad_store: GradStore, params: list[nn.Parameter], offload_optimizer: bool,
        scaler: LossScaler | None = None,
    ) -> None:
        self.index = index
        self.name = spec.name
        self.module = spec.module
        self.layout = layout
        self.params = params
        self.param_store = param_store
        self.grad_store = grad_store
        self.offload_optimizer = offload_optimizer
        self.ready = 0
        """Gradients that arrived in the current backward pass."""
        self.expected = len(params)
        """Gradients the current backward pass can deliver (parameters requiring grad)."""
        self.reduced_this_pass = False
        self.used = [False] * len(params)
        """Per parameter: a gradient arrived on this rank since the last step."""
        self.trains = False
        """Some parameter required grad at a forward or backward since the last step (the
        same on every rank: ``Runtime.follow_trainability``). A unit that does not train is
        not reduced: a frozen base sends nothing and holds no gradient."""
        self.has_frozen = False
        """Some parameter is frozen now: its module's backward may still read it (for the
        gradient of the module's input), after every trainable one got its gradient."""
        self.pending_calls = 0
        """Calls of the module in this pass whose backward has not ended (its inputs required
        grad: ``autograd.register_post_backward``); the unit is freed in backward only at 0."""
        self.stepped = [True] * len(params)
        """Per parameter: some rank produced a gradient for it since the last step, so the
        optimizer updates it (a parameter no rank used is skipped, as torch and DDP do)."""
        self._master_grad: torch.Tensor | None = None
        self._master_grad_buffer: torch.Tensor | None = None
        self._grad_copy: Copy | None = None
        """The copy writing an offloaded ``master_grad``, until the host waited for it."""
        self.scaler = scaler
        """fp16: the loss scale the reduced gradient carries until the step divides it out."""
        self._summary: tuple[torch.Tensor, torch.Tensor] | None = None
        self._summary_awaits: float | None = None
        """The unscale factor ``_summary`` assumed that ``defer_unscale`` has not yet added."""
        self.pending_scales: list[torch.Tensor] = []
        """Disk tier: factors not yet multiplied into ``master_grad`` (the fp16 unscale, then
        clipping coefficients, in order): applied (``scaled_grad``, ``settled_grad``) right
        before anything reads it, the step included, so the gradient is read once per step
        instead of once per pass over it."""

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name or '<root>'!r}, numel={self.layout.numel})"

    def relabel(self, groups: dict[str, int]) -> None:
        """Parameters of this unit (by name) join optimizer ``groups`` where they lie: only
        their slots' group changes (a layout keeps its order whatever the groups), so
        neither the shards nor anything the optimizer holds moves."""
        slots = tuple(replace(s, group=groups.get(s.name, s.group)) for s in self.layout.slots)
        layout = replace(self.layout, slots=slots)
        self.layout = layout
        self.param_store.layout = layout
        self.grad_store.layout = layout

    @property
    def has_grad(self) -> bool:
        """Whether the last synchronised backward left a gradient to step: a unit no rank
        produced one for (frozen, or unused) holds none, and reading ``master_grad`` would
        allocate a shard of zeros for it."""
        return any(self.stepped)

    @property
    def master_grad(self) -> torch.Tensor:
        """The reduced gradient of this rank's shard, in the master's dtype and place."""
        if self._master_grad is None:
            self.prepare_master_grad()
        if self._grad_copy is not None:  # every host read of the gradient passes here
            self._grad_copy.wait_host()
            self._grad_copy = None
        assert self._master_grad is not None
        return self._master_grad

    def prepare_master_grad(self) -> None:
        """Start bringing the reduced shard into the master's dtype and place (a copy that
        overlaps the rest of backward when the master is offloaded)."""
        grad = self.grad_store.grad_shard
        if not self._needs_buffer():
            self._master_grad = grad
            return
        buffer = self.param_store.placement.to_overwrite(self._buffer())
        self._grad_copy = self.transfers.copy(buffer, grad)
        self._master_grad = self._master_grad_buffer

    def _needs_buffer(self) -> bool:
        """Whether the reduced shard is copied into a buffer of the master's dtype and place
        (else the master's gradient is the reduced shard itself)."""
        grad, master = self.grad_store.grad_shard, self.param_store.master
        copies = self.offload_optimizer and self.transfers.host_is_separate
        return not (grad.dtype == master.dtype and grad.device == master.device and not copies)

    def _buffer(self) -> torch.Tensor:
        if self._master_grad_buffer is None:
            master = self.param_store.master
            if self.offload_optimizer:  # kept: pinned host memory is costly to allocate
                self._master_grad_buffer = self.param_store.placement.master_grad_empty(
                    master.numel(), master.dtype, f"u{self.index}.master_grad")
            else:
                self._master_grad_buffer = torch.empty_like(master)
        return self._master_grad_buffer

    def reserve_disk(self) -> None:
        """Disk tier: create the gradient's files now (the reduced shard, the master's
        gradient), so a full disk is an error when the engine is built, not mid-backward."""
        if self._needs_buffer():
            self._buffer()

    @property
    def grad_in_flight(self) -> bool:
        """Whether a copy (from a GPU) may still be writing ``master_grad``."""
        return self._grad_copy is not None

    def rest_master_grad(self) -> None:
        """Disk tier: the reduced gradient is complete; summarise it, write it back and drop
        it from memory until the step reads it (nothing to do elsewhere). A copy still
        writing it is waited for here."""
        placement = self.param_store.placement
        if not placement.optimizer_disk or self._master_grad is None:
            return
        grad = self.master_grad  # waits for the copy
        self._summarise(grad)
        # Kept unwritten: the last gradients of backward are the step's first, and one kept
        # to the end of the step is cleared by zero_grad() without ever being written.
        placement.done_with([grad], dirty=True, keep=True)

    def _summarise(self, grad: torch.Tensor) -> None:
        """(2-norm ** 2, max-abs) of the gradient as the step will read it, divided by the
        loss scale (fp16), while it is in memory: the expressions the uncached passes
        evaluate on it once unscaled (``powered_norm``, ``max_abs``), for equal bits, so
        clipping and the non-finite check need not read it back."""
        self._summary = None
        self._summary_awaits = None if self.scaler is None else 1.0 / self.scaler.scale
        if not grad.numel():
            return
        if self._summary_awaits is None:
            self._summary = (powered_norm(grad, 2.0), max_abs([grad])[0])
            return
        inv = torch.tensor(self._summary_awaits, dtype=torch.float32)
        self._summary = (powered_norm(grad, 2.0, factor=inv), max_abs([grad])[0] * inv)

    @property
    def grad_summary(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Disk tier: (2-norm ** 2, max-abs) of ``scaled_grad()``, taken at reduction; None
        where unknown (nothing reduced, a pass changed the gradient since, a clipping
        coefficient waits) or not yet true (the fp16 unscale it assumed is not deferred yet)."""
        return self._summary if self._summary_awaits is None else None

    def defer_unscale(self, inv: float) -> None:
        """fp16: divide by the loss scale when the gradient is next read. The summary taken at
        reduction assumed this factor; with another (the scale changed since) it is dropped."""
        self.pending_scales.append(torch.tensor(inv, dtype=torch.float32))
        if self._summary_awaits != inv:
            self._summary = None
        self._summary_awaits = None

    def defer_scale(self, coef: torch.Tensor) -> None:
        """Multiply by the clipping coefficient ``coef`` when the gradient is next read."""
        self.pending_scales.append(coef)
        self._summary = None

    def scaled_grad(self) -> torch.Tensor:
        """``master_grad`` with the deferred factors applied, into a pooled buffer when there
        is any: what the step reads, leaving the gradient's file clean (nothing to write
        back for a gradient the step is about to forget). Give it back with
        ``drop_scaled``."""
        grad = self.master_grad
        if not self.pending_scales:
            return grad
        out = self.param_store.placement.pool.take(grad.numel(), grad.dtype)
        return self._scale(out.copy_(grad))

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` times each pending factor, in order (the multiplications the unscale and
        clipping in place would have made)."""
        for coef in self.pending_scales:
            grad.mul_(coef.to(grad.device).to(grad.dtype))
        return grad

    def drop_scaled(self, scaled: torch.Tensor) -> None:
        if scaled is not self._master_grad:
            self.param_store.placement.pool.give(scaled)

    def settled_grad(self) -> torch.Tensor:
        """``master_grad`` with the deferred factors applied; the caller may change it, so
        its summary is dropped."""
        grad = self._scale(self.master_grad)
        self.pending_scales = []
        self._summary = None
        return grad

    def step_tensors(self) -> list[torch.Tensor]:
        """What the optimizer step of this unit reads and writes besides optimizer state."""
        store = self.param_store
        shard = getattr(store, "shard", None)
        extra = [shard] if shard is not None and shard is not store.master else []
        return [store.master, self.master_grad, *extra]

    def fence_grad_copy(self) -> None:
        """Make the compute stream wait for the gradient copy: from the end of backward on,
        compute may change the reduced shard it reads (another backward, zero_grad)."""
        if self._grad_copy is not None:
            self._grad_copy.wait_device()

    @property
    def transfers(self) -> Transfers:
        return self.param_store.transfers

    def zero_grad(self) -> None:
        if self._grad_copy is not None:  # a pass cut short: the copy may still write
            self._grad_copy.wait_host()
            self._grad_copy = None
        self.grad_store.zero()
        self.used = [False] * len(self.params)
        self.trains = False
        self._master_grad = None
        self._summary = self._summary_awaits = None
        self.pending_scales = []
        if not self.offload_optimizer:
            self._master_grad_buffer = None


def _lca(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _owners(model: nn.Module, managed: NamedParams) -> dict[str, NamedParams]:
    """Module path -> the managed parameters whose closest common registering module it is."""
    ids = {id(p) for _, p in managed}
    registered: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            if id(p) in ids:
                registered.setdefault(id(p), []).append(mod_name)
    owners: dict[str, NamedParams] = {}
    for name, p in managed:
        owners.setdefault(_lca(registered[id(p)]), []).append((name, p))
    return owners


def module_specs(
    model: nn.Module, managed: NamedParams, unit_numel: int, kind: UnitKind,
    leaf_classes: tuple[str, ...] = (), leaf_modules: frozenset[int] = frozenset(),
) -> list[UnitSpec]:
    """Post-order walk: a module whose unclaimed parameters reach ``unit_numel`` becomes a unit;
    a module of a leaf class, or one of ``leaf_modules`` (ids: the routed blocks), becomes one
    unit with everything below it; the root takes whatever is left."""
    owners = _owners(model, managed)
    specs: list[UnitSpec] = []
    seen: set[int] = set()

    def visit(path: str, module: nn.Module, inside_leaf: bool) -> NamedParams:
        leaf = type(module).__name__ in leaf_classes or id(module) in leaf_modules
        pending = list(owners.get(path, []))
        for child_name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = f"{path}.{child_name}" if path else child_name
            pending += visit(child_path, child, inside_leaf or leaf)
        # Containers are never called, so their forward hooks would never gather.
        callable_module = not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        big = sum(p.numel() for _, p in pending) >= unit_numel
        wanted = path == "" or (callable_module and not inside_leaf and (leaf or big))
        if pending and wanted:
            specs.append(UnitSpec(path, module, pending, kind))
            return []
        return pending

    visit("", model, False)
    return specs


def bucket_specs(managed: NamedParams, bucket_numel: int, kind: UnitKind) -> list[UnitSpec]:
    specs: list[UnitSpec] = []
    current: NamedParams = []
    size = 0
    for name, p in reversed(managed):
        if current and size + p.numel() > bucket_numel:
            specs.append(UnitSpec(f"bucket{len(specs)}", None, current, kind))
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        specs.append(UnitSpec(f"bucket{len(specs)}", None, current, kind))
    return specs


def plan_specs(model: nn.Module, managed: NamedParams, plan: ZeroPlan) -> list[UnitSpec]:
    layout = plan.layout
    if layout.grouping == "buckets":
        return bucket_specs(managed, plan.bucket_numel, layout.main)
    assert plan.unit_numel is not None and plan.persistence_threshold is not None
    small = [(n, p) for n, p in managed if p.numel() < plan.persistence_threshold]
    small_ids = {id(p) for _, p in small}
    large = [(n, p) for n, p in managed if id(p) not in small_ids]
    specs = module_specs(model, large, plan.unit_numel, layout.main, plan.unit_leaf_classes,
                         routed_blocks(model))
    assert layout.persistent is not None
    specs += bucket_specs(small, plan.bucket_numel, layout.persistent)
    return specs


@dataclass(frozen=True)
class UnitComms:
    """Who a unit communicates with: ``shards`` (gathers, reduce-scatters), ``world`` (every
    rank: the initial values are rank 0's) and, with hybrid sharding, ``replicas`` (the ranks
    holding the same shard, across which gradient shards are all-reduced)."""

    shards: Communicator
    world: Communicator
    replicas: Communicator | None = None


def build_units(
    model: nn.Module, managed: NamedParams, group_of: dict[int, int], plan: ZeroPlan,
    comms: UnitComms, placement: Placement,
    materializer: Materializer | None = None, first_index: int = 0,
    scaler: LossScaler | None = None,
) -> list[Unit]:
    device, pool = placement.device, placement.pool
    policy = plan.policy
    shard_rank = comms.shards.rank if plan.optimizer_shards > 1 else 0
    units = []
    for index, spec in enumerate(plan_specs(model, managed, plan), start=first_index):
        entries = [(name, p.shape, group_of[id(p)]) for name, p in spec.params]
        layout = make_layout(entries, plan.optimizer_shards)
        by_name = dict(spec.params)
        params = [by_name[slot.name] for slot in layout.slots]
        if materializer is not None:  # only now: one unit's full values exist at a time
            materializer.ensure(params)
        pstore = PARAM_STORES[spec.kind.params](
            params, layout, shard_rank, policy, placement, comms.world, name=f"u{index}",
            module=spec.name,
        )
        gstore = GRAD_STORES[spec.kind.grads](layout, shard_rank, policy.reduce_dtype, device,
                                              pool, policy.int8_reductions, comms.replicas)
        gstore.use_shard_memory(placement.grad_shard_memory(f"u{index}.grad"))
        unit = Unit(index, spec, layout, pstore, gstore, params, placement.offload_optimizer,
                    scaler)
        if placement.optimizer_disk:
            unit.reserve_disk()
        units.append(unit)
    return units
