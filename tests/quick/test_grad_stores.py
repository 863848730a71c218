"""The gradient stores on their own at N=2, against the mean of every rank's gradient (the
world's docstring argues why equality is exact): tests/worlds/scenarios_grads.py."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_world("tests/worlds/scenarios_grads.py", 2, timeout=120)


def test_every_store_reduces_to_the_mean_across_passes_and_steps(world2: dict) -> None:
    for r in check(world2["every_store_reduces_to_the_mean"]):
        # [one pass, two passes in a step, one pass after zero, one after a dropped pass]
        assert r == {kind: [True, True, True, True] for kind in
                     ("all_reduce", "reduce_scatter_full", "reduce_scatter_sharded")}, r


def test_hybrid_stores_sum_across_replicas_once(world2: dict) -> None:
    """A crossing skipped leaves the shard group's mean; one started twice doubles it. Polled
    while the group's reduction is out, ``advance`` must say the crossing has not started:
    the runtime then stops polling there, so every rank starts crossings in one order."""
    for r in check(world2["hybrid_stores_sum_across_replicas"]):
        for kind in ("reduce_scatter_full", "reduce_scatter_sharded"):
            # three passes, each polled twice: gloo's reduction is never in before the wait
            assert r[f"{kind}_gloo"] == {"mean": [True] * 3, "started": [False] * 6}, r
            assert r[f"{kind}_completing"] == {"mean": [True] * 3, "started": [True] * 6}, r
            assert r[f"{kind}_no_replicas"] == {"started": [True, True]}, r


def test_a_pass_cut_short_is_dropped_without_crossing_replicas(world2: dict) -> None:
    assert check(world2["a_pass_cut_short_is_not_crossed"]) == [{"mean": True}] * 2


def test_only_an_exclusive_gradient_is_reduced_in_place(world2: dict) -> None:
    for r in check(world2["sharded_store_reduces_in_place_only_what_it_owns"]):
        alone, view = r["alone"], r["view"]
        assert alone["mean"] == view["mean"] == [True, True], r
        # reduced where autograd left it, into the shard: the pool never lent a buffer
        assert alone["pool_bytes"] == [0, 0], r
        # the caller's tensor is not divided in place: a pooled copy is reduced instead
        assert view["caller_kept"], r
        assert view["pool_bytes"] == [r["buffer_bytes"]] * 2, r


def test_zero_returns_a_cut_short_reduction_s_pool_memory_and_never_the_shard(
        world2: dict) -> None:
    for r in check(world2["zero_after_a_cut_short_reduction"]):
        # the first pass reduced into the shard itself: it stays out of the pool
        assert r["first_pass"] == {"shard_in_pool": False, "shard_sized_blocks": 0,
                                   "zeros": True}, r
        # a second pass reduced into a pooled slice: back in the pool, not leaked
        assert r["second_pass"] == {"shard_in_pool": False, "shard_sized_blocks": 1,
                                    "zeros": True}, r
