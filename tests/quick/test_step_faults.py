"""Faults in the middle of a step, caught, then training on (issue 51), at N=1 and N=2:
a full disk under ``offload_activations="disk"`` and under the disk tier raises the tier's
``DiskFullError`` (errno 28) naming the folder, what was being written and the bytes; the
failed step's files and descriptors are given back; the next steps equal an engine that
never ran the failed step, bit for bit (or, where an optimizer step was cut short, the
engine refuses until the last checkpoint is loaded). A fault on one rank only: the other
rank's timeout names it. Scenarios: tests/worlds/scenarios_step_faults.py (the rest of the
grid: tests/integration/test_step_faults.py). The injector's named points (forward, recompute,
backward, reduce, clip, optimizer step before and after its update, activation save and load)
at stage 3, and a step cut short after the update at every stage. Only rank 0's disk tier
full at N=2: the ranks agree (every rank raises and recovers, or every rank refuses until the
reload). A checkpoint write cut short on rank 0 (N=1 and 2), and a checkpoint from before the
first step loaded after training."""

from __future__ import annotations

import pytest

from tests.support.faults import (
    POINTS,
    assert_activation_fault_recovered,
    assert_checkpoint_write_fault_handled,
    assert_mixed_refusal,
    assert_one_rank_tier_fault_agreed,
    assert_peer_names_failed_rank,
    assert_point_fault_handled,
    assert_tier_fault_handled,
)
from tests.support.harness import check, run_world


@pytest.fixture(scope="module")
def one() -> dict:
    return run_world("tests/worlds/scenarios_step_faults.py", 1)


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world("tests/worlds/scenarios_step_faults.py", 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_full_disk_under_activations_n1(one: dict, stage: int) -> None:
    # the last block's input (backward reads it first): 4 x 33 fp32
    for r in check(one[f"activations_disk_full_s{stage}"]):
        assert_activation_fault_recovered(r, "blocks.2", 4 * 33 * 4)


def test_full_disk_under_activations_n2(two: dict) -> None:
    for r in check(two["activations_disk_full_s2"]):
        assert_activation_fault_recovered(r, "blocks.2", 4 * 33 * 4)


def test_a_full_disk_on_one_rank_is_named_by_the_other(two: dict) -> None:
    assert_peer_names_failed_rank(*check(two["one_rank_disk_full"]))


@pytest.mark.parametrize("name", ["s2_0", "s3_50"])
def test_ranks_agree_on_one_ranks_tier_failure_n2(two: dict, name: str) -> None:
    """Rank 0's write-back fails: before the update every rank raises and recovers; in the
    step (rank 0 cut short, rank 1 stepped) every rank refuses until the reload."""
    assert_one_rank_tier_fault_agreed(*check(two[f"tier_disk_full_one_rank_{name}"]))


@pytest.mark.parametrize("name", ["s2_0", "s2_50", "s2_90", "s3_90"])
def test_full_disk_under_the_tier_is_named_then_recovered_or_refused(one: dict,
                                                                     name: str) -> None:
    assert_tier_fault_handled(check(one[f"tier_disk_full_{name}"])[0])


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_at_each_point_of_a_stage3_step_n1(one: dict, point: str) -> None:
    assert_point_fault_handled(check(one[f"point_{point}_s3"])[0], point)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("point", ["backward", "optimizer_step", "optimizer_step_after"])
def test_a_fault_with_offloaded_states_n1(one: dict, point: str, offload: str) -> None:
    """"optimizer_step" raises before any update: with the disk tier the rank's vote is
    "recoverable", so it trains on without a reload; "optimizer_step_after" must reload."""
    assert_point_fault_handled(check(one[f"point_{point}_s3_{offload}"])[0], point)


@pytest.mark.parametrize("stage", range(4))
def test_a_step_cut_short_refuses_until_reload_n2(two: dict, stage: int) -> None:
    for r in check(two[f"point_optimizer_step_after_s{stage}"]):
        assert_point_fault_handled(r, "optimizer_step_after")


def test_one_rank_cut_short_after_its_update_makes_every_rank_refuse(two: dict) -> None:
    """Disk tier: rank 0 raised after updating, rank 1 before; both refuse until the reload
    (rank 1 would otherwise train on from a state rank 0 no longer shares), then match a
    reference that skipped the step."""
    assert_mixed_refusal("mixed_cut_disk_s2", check(two["mixed_cut_disk_s2"]))


def test_one_rank_raising_before_its_update_makes_a_rank_that_stepped_refuse(two: dict
                                                                              ) -> None:
    """Disk tier: rank 0 stepped, rank 1 raised before updating: rank 0 raises PeerCutShort
    naming rank 1, and both refuse until the reload (their shards are of different steps)."""
    assert_mixed_refusal("mixed_stepped_disk_s2", check(two["mixed_stepped_disk_s2"]))


@pytest.mark.parametrize("size", [1, 2])
def test_a_checkpoint_write_cut_short_on_rank0(one: dict, two: dict, size: int) -> None:
    assert_checkpoint_write_fault_handled(check((one, two)[size - 1]["checkpoint_write_s3"]))


@pytest.mark.parametrize("size", [1, 2])
def test_a_checkpoint_from_before_the_first_step_drops_the_optimizer_state(
        one: dict, two: dict, size: int) -> None:
    for r in check((one, two)[size - 1]["reload_before_first_step_s3"]):
        assert r["losses"] == r["ref_losses"]
        assert r["same"] == {"weights": True, "optimizer": True}

