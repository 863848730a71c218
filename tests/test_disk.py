"""The disk tier (ZeroConfig offload_optimizer/offload_params="disk") on 2 gloo processes."""

from __future__ import annotations

import pytest

from tests.harness import check, run_world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("disk")
    return run_world("tests/scenarios_disk.py", 2, env={"ZS_DISK_ROOT": str(root)})


@pytest.mark.parametrize("name", ["parity_stage2", "parity_stage3", "parity_stage3_accumulate",
                                  "parity_stage3_bf16"])
def test_disk_tier_equals_host_tier_bit_for_bit(world: dict, name: str) -> None:
    """Only where the bytes rest differs, so every loss, weight and gradient norm is equal:
    clipping from the summaries taken at reduction, deferred into the step, included."""
    for r in check(world[name]):
        assert r["losses_equal"] and r["weights_equal"], name
        host, disk = r["norms"]
        assert host == disk
        assert r["closed_equal"], "close() must give back the trained weights"
        assert r["files"] > 0 and r["listed"] == 0 and not r["left_after_close"]
        # Every model state of the tier in files: the formula's disk bytes, plus padding
        # and the small parameters kept whole at stage 3 (a few KiB on these models).
        assert r["predicted_disk_bytes"] <= r["disk_bytes"] <= 1.1 * r["predicted_disk_bytes"]


@pytest.mark.parametrize("name", ["delayed_stage2", "delayed_stage3"])
def test_disk_tier_waits_for_every_copy(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["copies"] > 0 and r["races"] == 0
        assert r["equal"], name
        # Pinned host memory (what Transfers.host_empty allocates on a GPU): the host tier
        # pins every master and gradient shard; the disk tier pins none, its host side is
        # the files' pages (DeepSpeed's NVMe users run out of pinned buffers: #3000, #3062).
        host, disk = r["host_buffers"]
        assert host > 0 and disk == 0


@pytest.mark.parametrize("name", ["checkpoints_stage2", "checkpoints_stage3"])
def test_disk_tier_checkpoints_are_ordinary(world: dict, name: str) -> None:
    for r in check(world[name]):
        for route in ("disk->False", "False->disk"):
            assert r[route] == r["reference"], route
            assert r[f"{route} weights"], route


def test_unusable_directories_are_refused(world: dict) -> None:
    for r in check(world["refusals"]):
        assert "in use by another engine" in r["shared"] and "offload_dir=" in r["shared"]
        assert r["stale_removed"] == "True"
        assert "offload_dir=" in r["unwritable"] and "not writable" in r["unwritable"]
        assert "offload_optimizer='disk'" in r["muon"] and "Muon" in r["muon"]


def test_full_disk(world: dict) -> None:
    results = check(world["full_disk"])
    if "skipped" in results[0]:
        pytest.skip(results[0]["skipped"])
    small = results[0]["small"]
    assert "offload_dir=" in small and "needs" in small and "free" in small, small
    assert "another rank" in results[1]["small"], results[1]["small"]
    for r in results:
        assert r["equal_when_full"] and r["closed_equal"]


def test_a_users_optimizer_the_probe_cannot_step(world: dict) -> None:
    """Its states are adopted into files when the first step creates them."""
    for r in check(world["custom_optimizer"]):
        assert r["cpu"] == r["disk"]
        assert r["disk_in_files"]
