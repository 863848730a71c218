"""Faults in the middle of a step (issue 51), the grid tests/quick/test_step_faults.py leaves
out (stage 3 at N=2, the tier's earlier points at stage 3), and the issue's report itself on a
real 4 MiB tmpfs: a batch that fills it raises a DiskFullError naming the folder, gives every
byte and descriptor back, and batch-1 steps train on as a reference that skipped it."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile

import pytest

from tests.support.faults import (
    assert_activation_fault_recovered,
    assert_checkpoint_write_fault_handled,
    assert_mixed_refusal,
    assert_one_rank_tier_fault_agreed,
    assert_peer_names_failed_rank,
    assert_point_fault_handled,
    assert_tier_fault_handled,
)
from tests.support.harness import check, run_world

MODULE = "tests/worlds/scenarios_step_faults.py"


@pytest.mark.parametrize("size", [1, 2])
def test_the_whole_grid(size: int) -> None:
    results = run_world(MODULE, size, env={"ZS_STEP_FAULTS": "all"})
    for name, per_rank in results.items():
        if name.startswith("activations_disk_full"):
            for r in check(per_rank):
                assert_activation_fault_recovered(r, "blocks.2", 4 * 33 * 4)
        elif name.startswith("checkpoint_write"):
            assert_checkpoint_write_fault_handled(check(per_rank))
        elif name.startswith("reload_before_first_step"):
            for r in check(per_rank):
                assert r["losses"] == r["ref_losses"] and all(r["same"].values())
        elif name.startswith("tier_disk_full_one_rank"):
            assert_one_rank_tier_fault_agreed(*check(per_rank))
        elif name.startswith("tier_disk_full"):
            assert_tier_fault_handled(check(per_rank)[0])
        elif name.startswith("mixed_"):
            assert_mixed_refusal(name, check(per_rank))
        elif name == "one_rank_disk_full":
            assert_peer_names_failed_rank(*check(per_rank))
        elif name.startswith("one_rank_"):
            failed, peer = check(per_rank)
            assert failed["raised"] == "InjectedFault", failed
            assert peer["raised"] in ("CollectiveTimeout", "CollectiveError"), peer
            assert "rank 0 failed: InjectedFault in " in peer["message"], peer["message"]
        else:
            point = name.removeprefix("point_").rsplit("_s", 1)[0]
            for r in check(per_rank):
                assert_point_fault_handled(r, point)
    points = [n for n in results if n.startswith("point_")]
    # every point at every stage; three points under each of the two offloads
    assert len(points) == 9 * 4 + 6, sorted(results)


@pytest.fixture
def tmpfs() -> str:
    folder = tempfile.mkdtemp(prefix="zs-tmpfs-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", folder], check=True)
    os.rmdir(folder)


def test_a_batch_that_fills_a_real_tmpfs(tmpfs: str) -> None:
    r = check(run_world(MODULE, 1, env={"ZS_TMPFS": tmpfs, "ZS_STEP_FAULTS": "none"})
              ["real_tmpfs"])[0]
    assert r["raised"] == "DiskFullError" and r["errno"] == errno.ENOSPC, r
    assert f"offload_dir={tmpfs!r}" in r["message"] and "bytes needed" in r["message"], r
    assert "activation input of module 'transformer.h." in r["message"], r["message"]
    assert r["after"] == r["before"], (r["before"], r["after"])  # files, descriptors, bytes
    assert r["losses"] == r["ref_losses"]
    assert r["same"] == {"weights": True, "optimizer": True}
    assert r["left"] == []
