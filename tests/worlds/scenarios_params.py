"""Scenarios for tests/quick/test_param_stores.py: each parameter store's write and edit
operations, called as ``core/access.py`` and ``engine/state.py`` call them, against the values
they were given (N=2 and 3).

Every unit of a small model whose parameters straddle the shard bounds is exercised, on every
layout a store takes (``LAYOUTS``): the master a view of the compute copy, a separate fp32
master beside a bf16 compute copy, the master or the shard in the disk tier, the shard being
the master, and one shard per group (hybrid sharding with groups of one rank).

- ``write_param``: each parameter written (at stage 3 half while sharded, half while whole)
  reaches the master at full precision and the compute copy at compute precision;
- ``was_edited``: a change in one rank's part of the whole copy is seen by that rank alone;
- ``adopt_compute_edits``: the edited elements reach the master, the others keep their
  full-precision value;
- ``discard_compute_edits``: the compute copy equals the master again;
- ``shares_storage``, ``held_tensors``, ``after_step`` and ``gather_master``.

Values written are drawn from one generator seeded alike on every rank (``write_param``'s
contract: the same value everywhere); each rank's own master values in ``after_step`` differ by
rank, so a gather that mixed up the parts would show. Every edit is a multiple of 0.5 below
16, exact in bf16, so comparisons are exact (``torch.equal``), not within a tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from tests.support.harness import register
from zero_strategy.core.params import ParamState, ParamStore

LAYOUTS: dict[str, dict[str, Any]] = {
    # replicated, the master a view of this rank's slice of the compute copy
    "s1_fp32": {"stage": 1},
    # replicated, an fp32 master apart from the bf16 compute copy
    "s1_bf16": {"stage": 1, "precision": "bf16-mixed"},
    # replicated (stage 2: the disk tier needs sharded gradients), the fp32 master in the disk tier
    "s2_disk": {"stage": 2, "offload_optimizer": "disk"},
    # sharded, the at-rest shard is the master
    "s3_fp32": {"stage": 3},
    # sharded, a bf16 shard and an fp32 master
    "s3_bf16": {"stage": 3, "precision": "bf16-mixed"},
    # sharded, the fp32 master in the disk tier, the shard in memory
    "s3_disk": {"stage": 3, "offload_optimizer": "disk"},
    # sharded, the shard in the disk tier and the master that shard
    "s3_disk_both": {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk"},
    # sharded over groups of one rank: one shard, the whole master on each rank
    "s3_one_shard": {"stage": 3, "shard_group_size": 1},
}
STAGE3 = {"unit_numel": 40, "param_persistence_threshold": 0}
"""Several units of a few parameters each, every one of them sharded."""


class Net(nn.Module):
    """Parameter sizes (78, 13, 13, 13, 39, 3, 1, 20) that fall across shard bounds at N=2 and 3,
    a 0-dim parameter among them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 13)
        self.norm = nn.LayerNorm(13)
        self.b = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.ones(()))
        self.shift = nn.Parameter(torch.zeros(20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x))) * self.scale + self.shift[:3]


def _own_model() -> Net:
    """Initial values that differ by rank: the engine must start every rank from rank 0's."""
    torch.manual_seed(100 + torch.distributed.get_rank())
    return Net()


def _engine(layout: str) -> zs.ZeroEngine:
    options = dict(LAYOUTS[layout])
    if options["stage"] == 3:
        options.update(STAGE3)
    model = _own_model()
    return zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         zs.ZeroConfig(**options))


def _whole(store: ParamStore, comm: Any) -> None:
    if store.state is ParamState.SHARDED:
        store.start_unshard(comm)
    store.finish_unshard()


def _regather(store: ParamStore, comm: Any) -> None:
    """The compute copy afresh from the at-rest shard (a replicated copy is never freed)."""
    if store.gathers:
        store.reshard()
    _whole(store, comm)


def _inside(store: ParamStore) -> torch.Tensor:
    """Positions of the flat copy that hold parameter elements (not padding)."""
    return torch.cat([torch.arange(s.offset, s.end) for s in store.layout.slots])


def _owned(store: ParamStore, rank: int, inside: torch.Tensor) -> torch.Tensor:
    lo, hi = store.layout.shard_bounds(rank)
    return inside[(inside >= lo) & (inside < hi)]


def _write(store: ParamStore, comm: Any, gen: torch.Generator) -> dict[str, Any]:
    layout, policy = store.layout, store.policy
    # fp32 values a bf16 copy cannot hold exactly: the master must keep them unrounded
    values = [torch.randn(s.shape, generator=gen) / 3 + 1 / 3 for s in layout.slots]
    exposed = []
    for i, value in enumerate(values):
        if store.gathers and i == len(values) // 2:
            _whole(store, comm)  # the first half written sharded, the rest whole
        store.write_param(i, value)
        if store.state is ParamState.UNSHARDED:
            slot = layout.slots[i]
            exposed.append(torch.equal(store.full[slot.offset : slot.end],
                                       value.reshape(-1).to(policy.compute_dtype)))
    master = store.gather_master(comm)
    out = {"exposed": exposed, "master": [
        torch.equal(master[s.offset : s.end], v.reshape(-1).to(policy.master_dtype))
        for s, v in zip(layout.slots, values)]}
    _regather(store, comm)
    out["compute"] = [torch.equal(store.full[s.offset : s.end],
                                  v.reshape(-1).to(policy.compute_dtype))
                      for s, v in zip(layout.slots, values)]
    return out


def _seen_by_owner(store: ParamStore) -> dict[str, Any]:
    """was_edited after a change in each rank's part of the whole copy in turn."""
    inside = _inside(store)
    out: dict[str, Any] = {"fresh": store.was_edited(), "by_owner": []}
    for r in range(store.layout.num_shards):
        owned = _owned(store, r, inside)
        if not len(owned):
            out["by_owner"].append(None)
            continue
        pos = int(owned[0])
        old = store.full[pos].clone()
        store.full[pos] = old + 1
        out["by_owner"].append(store.was_edited())
        store.full[pos] = old
    out["restored"] = store.was_edited()
    return out


def _adopt(store: ParamStore, comm: Any, edit: torch.Tensor,
           new: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """``new`` written at ``edit`` in the whole copy, alike on every rank (as after a broadcast
    from one), then adopted; returns the master expected after it."""
    inside = _inside(store)
    before = store.gather_master(comm)
    store.full[edit] = new
    out: dict[str, Any] = {"owns_edit": bool(len(_owned(store, store.rank, edit))),
                           "edited": store.was_edited()}
    store.adopt_compute_edits()
    after = store.gather_master(comm)
    expect = before.clone()
    expect[edit] = new.to(expect.dtype)
    out["adopt_master"] = torch.equal(after[inside], expect[inside])
    # untouched elements kept their full-precision master values, not the compute rounding
    untouched = inside[~torch.isin(inside, edit)]
    out["untouched_exact"] = torch.equal(after[untouched], before[untouched])
    _regather(store, comm)
    out["adopt_compute"] = torch.equal(store.full[inside],
                                       expect[inside].to(store.policy.compute_dtype))
    out["edited_after_adopt"] = store.was_edited()
    return out, expect


def _discard(store: ParamStore, comm: Any, edit: torch.Tensor, new: torch.Tensor,
             expect: torch.Tensor) -> dict[str, Any]:
    inside, compute = _inside(store), store.policy.compute_dtype
    store.full[edit] = new
    out: dict[str, Any] = {"edited_before_discard": store.was_edited()}
    store.discard_compute_edits(comm)
    master = store.gather_master(comm)
    out["discard"] = {"state": store.state.value,
                      "equals_master": torch.equal(store.full[inside], master[inside].to(compute)),
                      "edits_gone": torch.equal(store.full[inside], expect[inside].to(compute)),
                      "edited": store.was_edited()}
    if store.gathers:  # sharded: nothing is exposed, so adopting and discarding do nothing
        store.reshard()
        store.adopt_compute_edits()
        store.discard_compute_edits(comm)
        out["sharded_noop"] = {"state": store.state.value, "edited": store.was_edited(),
                               "master": torch.equal(store.gather_master(comm), master)}
        _whole(store, comm)
    return out


def _edits(store: ParamStore, comm: Any) -> dict[str, Any]:
    """was_edited, adopt_compute_edits and discard_compute_edits on the whole copy."""
    out = _seen_by_owner(store)
    edit = _inside(store)[::3]  # every third element, on every rank's part
    new = (torch.arange(len(edit)) % 31 * 0.5).to(store.policy.compute_dtype)
    adopted, expect = _adopt(store, comm, edit, new)
    out.update(adopted)
    out.update(_discard(store, comm, edit, new + 1, expect))
    return out


def _names(store: ParamStore) -> dict[str, list[list[str]]]:
    """``held_tensors`` by identity: each held tensor as the store's names for it."""
    named = [("full", store.full), ("master", store.master),
             ("shard", getattr(store, "shard", None))]
    return {category: [[n for n, t in named if t is held] for held in tensors]
            for category, tensors in store.held_tensors().items()}


def _sharing(store: ParamStore, comm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"held_whole": _names(store)}
    view = store.full[1:3]
    out["shares_whole"] = [store.shares_storage(view), store.shares_storage(torch.zeros(3))]
    if store.gathers:
        store.reshard()
        out["held_sharded"] = _names(store)
        out["shares_sharded"] = store.shares_storage(view)
        # resharded, each parameter holds a NaN placeholder of its shape, never a view of
        # the freed buffer
        out["placeholders"] = [list(p.shape) == list(slot.shape) and bool(p.isnan().all())
                               and p.untyped_storage().data_ptr() != view.data_ptr()
                               for p, slot in zip(store.params, store.layout.slots)]
        _whole(store, comm)
    return out


def _after_step(store: ParamStore, comm: Any) -> dict[str, Any]:
    """The master set as an optimizer step would (each rank its own values), then carried
    into every rank's compute copy."""
    n, rank = store.master.numel(), store.rank
    mine = ((torch.arange(n) % 5 + 5 * rank) * 0.5).to(store.master.dtype)
    store.wait_host_copies()
    store.placement.before_read([store.master])
    store.master.copy_(mine)
    store.placement.done_with([store.master], dirty=True)
    if store.gathers:
        store.reshard()  # the step runs with every unit sharded
    store.after_step(comm)
    out = {"state": store.state.value}
    _whole(store, comm)
    whole = torch.cat([((torch.arange(n) % 5 + 5 * r) * 0.5)
                       for r in range(store.layout.num_shards)])
    inside = _inside(store)
    out["compute"] = torch.equal(store.full[inside],
                                 whole[inside].to(store.policy.compute_dtype))
    gathered = store.gather_master(comm)
    out["master"] = torch.equal(gathered[inside], whole[inside].to(gathered.dtype))
    gathered.add_(1)  # the result is the caller's: changing it leaves the master alone
    out["gather_is_a_copy"] = torch.equal(store.gather_master(comm)[inside],
                                          whole[inside].to(gathered.dtype))
    return out


def _tier_traffic(tier: Any, store: ParamStore, comm: Any) -> dict[str, Any]:
    """Disk-tier bytes of gathers that change nothing: a clean shard is never written back,
    and one released as the pass ends stays resident for the gather that follows (``keep``),
    so two gathers read its file once."""
    store.reshard()
    tier.drain()  # kept files written back and dropped: the first gather reads
    written, read, budget = tier.written_bytes, tier.read_bytes, tier.keep_bytes
    # the budget the engine sets counts elements, not the page-sized files of these tiny
    # shards: room for this one, so what is asked is whether the store asks to keep it
    tier.keep_bytes = 2 * tier.file_bytes([store.shard])
    for _ in range(2):
        _whole(store, comm)
        store.reshard()
    tier.drain()
    tier.keep_bytes = budget
    return {"written": tier.written_bytes - written, "read": tier.read_bytes - read,
            "file": tier.file_bytes([store.shard]), "direct": tier.direct}


def stores(layout: str) -> dict[str, Any]:
    engine = _engine(layout)
    comm = engine.shards
    first = engine.units[0].param_store
    out: dict[str, Any] = {
        "initial": {n: p.tolist() for n, p in engine.full_state_dict().items()},
        "own": {n: p.tolist() for n, p in _own_model().state_dict().items()},
        "units": [],
    }
    gen = torch.Generator().manual_seed(5)
    for unit in engine.units:
        store = unit.param_store
        bounds = [store.layout.shard_bounds(r)[1] for r in range(store.layout.num_shards - 1)]
        info: dict[str, Any] = {
            "name": unit.name, "kind": type(store).__name__, "rank": store.rank,
            "num_shards": store.layout.num_shards, "padded": store.layout.padded_numel,
            "straddles": any(s.offset < b < s.end for s in store.layout.slots for b in bounds),
            "master_dtype": str(store.policy.master_dtype),
            "compute_dtype": str(store.policy.compute_dtype),
        }
        info["write"] = _write(store, comm, gen)
        info["edits"] = _edits(store, comm)
        info["sharing"] = _sharing(store, comm)
        info["after_step"] = _after_step(store, comm)
        if store.gathers:
            # a CPU device: the at-rest shard is sent as it is, even from the disk tier (a
            # staged copy would cost a fresh allocation and a copy of every gathered byte)
            info["sends_shard_itself"] = store._device_shard() is store.shard
        if engine.tier is not None and store.gathers and engine.tier.holds(store.shard):
            info["tier"] = _tier_traffic(engine.tier, store, comm)
        if store.gathers:
            store.reshard()
        info["end_state"] = store.state.value
        out["units"].append(info)
    out["disk"] = engine.tier is not None
    report = engine.memory_report()  # only gathering stores are held for generation
    out["generation"] = [report["generation_budget_bytes"] is not None,
                         report["generation_held_bytes"]]
    out["first_is_view"] = getattr(first, "master_is_view", None)
    return out


for _layout in LAYOUTS:
    register(_layout, stores, layout=_layout)
