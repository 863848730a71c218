"""Parameter stores, exercised directly on every layout they take, against the values given
(tests/worlds/scenarios_params.py; N=2 and 3).

These are the operations a training step never calls: writes from ``load_state_dict``, edits
made inside ``gathered_parameters()`` and adopted or discarded, the consolidated master of
``full_state_dict`` and ``close``. Every expected value is what was written (or each rank's own
master values, laid end to end), never the store's own answer. All comparisons are exact:
written values are compared in the dtype they were stored in, edits are multiples of 0.5
(exact in bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import check, run_world
from tests.worlds.scenarios_params import LAYOUTS

VIEW = {"s1_fp32"}
"""The master is this rank's slice of the compute copy itself: an edit is the master."""
MASTER_IS_SHARD = {"s3_fp32", "s3_one_shard", "s3_disk_both"}
"""Stage 3 with the at-rest shard and the master one tensor."""
ONE_SHARD = {"s3_one_shard"}


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def world(request: pytest.FixtureRequest) -> tuple[int, dict]:
    return request.param, run_world("tests/worlds/scenarios_params.py", request.param)


def _held(layout: str, whole: bool) -> dict[str, list[list[str]]]:
    if not layout.startswith("s3"):
        return {"params": [["full"]], "master": [] if layout in VIEW else [["master"]]}
    shard = ["master", "shard"] if layout in MASTER_IS_SHARD else ["shard"]
    return {"params": [shard] + ([["full"]] if whole else []),
            "master": [] if layout in MASTER_IS_SHARD else [["master"]]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stores_write_adopt_discard_and_gather_the_values_given(
        world: tuple[int, dict], layout: str) -> None:
    n, results = world
    ranks = check(results[layout])
    sharded = layout.startswith("s3")
    shards = 1 if layout in ONE_SHARD else n
    # the engine starts every rank from rank 0's values, whatever each rank built
    assert ranks[0]["own"] != ranks[1]["own"]
    for r in ranks:
        assert r["initial"] == ranks[0]["own"]  # exact: lists of the same floats
    for rank, r in enumerate(ranks):
        units = r["units"]
        assert units and {u["kind"] for u in units} == {
            "ShardedParams" if sharded else "ReplicatedParams"}
        # the layout is worth testing: some parameter falls across two ranks' shards
        assert shards == 1 or any(u["straddles"] for u in units), units
        assert r["disk"] == ("disk" in layout)
        # generation holds gathered units: stage 3's, every element of each once (fp32 or
        # bf16 compute copies of the padded flat buffers); at stages 1-2 nothing
        held = sum(u["padded"] * (2 if "bf16" in layout else 4) for u in units)
        assert r["generation"] == ([True, held] if sharded else [False, 0]), r["generation"]
        for u in units:
            _check_unit(layout, rank, shards, sharded, u)


def _check_unit(layout: str, rank: int, shards: int, sharded: bool, u: dict) -> None:
    where = f"{layout} rank {rank} unit {u['name']!r}"
    assert u["num_shards"] == shards and u["rank"] == (rank if shards > 1 else 0), where
    assert u["master_dtype"] == "torch.float32", where
    assert u["compute_dtype"] == ("torch.bfloat16" if "bf16" in layout else "torch.float32")
    w = u["write"]
    assert w["master"] and all(w["master"]), (where, w)  # full precision, not rounded
    assert w["compute"] and all(w["compute"]), (where, w)
    # written while whole: visible at once (stage 3: the second half of the parameters)
    assert len(w["exposed"]) == len(w["master"]) - (len(w["master"]) // 2 if sharded else 0)
    assert all(w["exposed"]), (where, w)

    e = u["edits"]
    view = layout in VIEW
    assert e["fresh"] is False and e["restored"] is False, (where, e)
    # only the rank owning the changed element sees it (never where the master is the copy)
    assert e["by_owner"] == [None if seen is None else (r == u["rank"] and not view)
                             for r, seen in enumerate(e["by_owner"])], (where, e)
    assert any(seen is not None for seen in e["by_owner"]), where
    assert e["edited"] is (e["owns_edit"] and not view), (where, e)
    assert e["adopt_master"] and e["untouched_exact"] and e["adopt_compute"], (where, e)
    assert e["edited_after_adopt"] is False, (where, e)
    assert e["edited_before_discard"] is (e["owns_edit"] and not view), (where, e)
    d = e["discard"]
    assert d["state"] == "unsharded" and d["equals_master"] and d["edited"] is False, (where, d)
    # a discard puts back the adopted values, unless the edit was made in the master itself
    assert d["edits_gone"] is (not view), (where, d)
    if sharded:
        assert e["sharded_noop"] == {"state": "sharded", "edited": False, "master": True}, where

    s = u["sharing"]
    assert s["held_whole"] == _held(layout, whole=True), (where, s)
    # a view of a gathered copy may be given back with it; a replicated copy never is
    assert s["shares_whole"] == [sharded, False], (where, s)
    if sharded:
        assert s["held_sharded"] == _held(layout, whole=False), (where, s)
        assert s["shares_sharded"] is False, (where, s)
        assert s["placeholders"] and all(s["placeholders"]), (where, s)

    a = u["after_step"]
    # replicated: the gather of every rank's slice runs on after the call
    assert a["state"] == ("sharded" if sharded else "gathering" if shards > 1
                          else "unsharded"), (where, a)
    assert a["compute"] and a["master"] and a["gather_is_a_copy"], (where, a)
    assert u["end_state"] == ("sharded" if sharded else "unsharded"), where
    assert u.get("sends_shard_itself") is (True if sharded else None), where
    # the shard itself in the disk tier (its master too): clean gathers write nothing, and
    # the second of two gathers finds the shard still resident
    assert ("tier" in u) is (layout == "s3_disk_both"), where
    if "tier" in u:
        t = u["tier"]
        assert t["direct"] and t["file"] > 0, (where, t)
        assert t["written"] == 0 and t["read"] == t["file"], (where, t)


# ------------------------------------------------------------------ the placement table
class _Transfers:
    """Host memory apart from the device (a GPU) or not (a CPU run); records host buffers."""

    def __init__(self, apart: bool) -> None:
        self.host_is_separate, self.made = apart, []

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.made.append("host")
        return torch.empty(numel, dtype=dtype)


class _Tier:
    """Records what the placement asks of the disk tier."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.calls: list[tuple[str, tuple]] = []

    def empty(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        self.made.append(name)
        return torch.zeros(numel, dtype=dtype)

    def __getattr__(self, op: str):  # prefetch, load, ready, release, zero_range, holds
        return lambda *args: self.calls.append((op, args[1:])) or True


# device, host apart, offload_optimizer, offload_params, tier, optimizer_disk, params_disk
# -> offload_optimizer, offload_params, optimizer_disk, params_disk, master_is_shard,
#    where the master, the shard and the master's gradient are made, and whether a stage 2-3
#    reduced gradient shard lives in the tier. "meta" stands for a GPU (a device apart from
#    host memory); None: the argument left at its default.
PLACEMENTS = {
    "cpu_none": (("cpu", False, False, False, False, False, False),
                 (False, False, False, False, True, "device", "device", "host", False)),
    # host offloading on a CPU device would be a second copy in the same memory: ignored
    "cpu_host_both": (("cpu", False, True, True, False, False, False),
                      (False, False, False, False, True, "device", "device", "host", False)),
    "gpu_host_optimizer": (("meta", True, True, False, False, False, False),
                           (True, False, False, False, False, "host", "device", "host", False)),
    "gpu_host_params": (("meta", True, False, True, False, False, False),
                        (False, True, False, False, False, "device", "host", "host", False)),
    # both in host memory, still two tensors: the shard in compute precision for the gathers
    "gpu_host_both": (("meta", True, True, True, False, False, False),
                      (True, True, False, False, False, "host", "host", "host", False)),
    "cpu_disk_optimizer": (("cpu", False, True, False, True, True, False),
                           (True, False, True, False, False, "tier", "device", "tier", True)),
    "cpu_disk_both": (("cpu", False, True, True, True, True, True),
                      (True, True, True, True, True, "tier", "tier", "tier", True)),
    # the disk asked for, but no tier made: nothing is offloaded
    "cpu_disk_without_tier": (("cpu", False, True, False, False, True, False),
                              (False, False, False, False, True, "device", "device", "host",
                               False)),
    "gpu_disk_optimizer_host_params": (("meta", True, True, True, True, True, False),
                                       (True, True, True, False, False, "tier", "host", "tier",
                                        False)),
    "gpu_disk_params": (("meta", True, False, True, True, False, True),
                        (False, True, False, True, False, "device", "tier", "host", False)),
    # a tier, the disk flags left at their defaults: nothing goes to it
    "cpu_tier_defaults": (("cpu", False, False, False, True, None, None),
                          (False, False, False, False, True, "device", "device", "host", False)),
}


def _made(transfers: _Transfers, tier: _Tier | None, tensor: torch.Tensor) -> str:
    if tier is not None and tier.made:
        tier.made.clear()
        return "tier"
    if transfers.made:
        transfers.made.clear()
        return "host"
    return "device" if tensor.device.type in ("cpu", "meta") else "?"


@pytest.mark.parametrize("name", PLACEMENTS)
def test_placement_puts_each_tensor_where_its_tier_says(name: str) -> None:
    from zero_strategy.core.params import Placement

    (device, apart, opt, par, has_tier, opt_disk, par_disk), expected = PLACEMENTS[name]
    transfers, tier = _Transfers(apart), (_Tier() if has_tier else None)
    disk = {k: v for k, v in (("optimizer_disk", opt_disk), ("params_disk", par_disk))
            if v is not None}
    p = Placement(torch.device(device), opt, par, transfers, None, tier=tier, **disk)
    flags = (p.offload_optimizer, p.offload_params, p.optimizer_disk, p.params_disk,
             p.master_is_shard)
    made = (_made(transfers, tier, p.master_empty(4, torch.float32)),
            _made(transfers, tier, p.shard_empty(4, torch.float32)),
            _made(transfers, tier, p.master_grad_empty(4, torch.float32, "g")))
    assert (*flags, *made, p.grad_shard_memory("g") is not None) == expected, name


def test_placement_hands_the_tier_each_call_and_nothing_without_one() -> None:
    from zero_strategy.core.params import Placement

    t = torch.zeros(3)
    for tier in (_Tier(), None):
        p = Placement(torch.device("cpu"), True, True, _Transfers(False), None, tier=tier,
                      optimizer_disk=True, params_disk=True)
        p.read_ahead([t])
        p.before_read([t])
        p.before_write([t])
        p.done_with([t], dirty=True)  # keep: False unless asked
        p.done_with([t], dirty=False, keep=True)
        assert p.to_overwrite(t) is t
        if tier is not None:
            ops = [(op, args) for op, args in tier.calls]
            assert [op for op, _ in ops] == ["prefetch", "load", "ready", "release", "release",
                                             "holds", "zero_range"], ops
            assert ops[3][1] == (True, False) and ops[4][1] == (False, True), ops
