"""The checks of one Fabric preset against ``Fabric(strategy="ddp")``, shared by both tiers:
each test module that imports them gives ``name`` its presets (``pytest_generate_tests``) and
a ``suite`` fixture with the results of tests/worlds/lightning_run.py."""

from __future__ import annotations

import pytest

from tests.worlds.lightning_launch import check

TOL = 1e-5
K = 3  # tests/worlds/lightning_fabric_scenarios.py: save at step K of 2K


def test_matches_ddp(suite: dict, name: str) -> None:
    """Per-micro-batch losses, pre-clip norms, LR schedule and final weights; accumulation 2
    through no_backward_sync, clip_gradients(max_norm=1.0)."""
    for rank, (r, ref) in enumerate(zip(check(suite[f"fabric_{name}"]),
                                        check(suite["fabric_ddp"]))):
        assert r["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7), f"rank {rank}"
        assert r["norm"] == pytest.approx(ref["norm"], rel=TOL), f"rank {rank}"
        assert min(ref["norm"]) > 1.0, "clipping at 1.0 never engaged"
        assert r["lr"] == ref["lr"] and len(set(ref["lr"])) == 4
        assert r["rel_vs_ddp"] <= TOL, f"rank {rank}: weights differ by {r['rel_vs_ddp']:.2e}"


def test_no_backward_sync_skips_gradient_communication(suite: dict, name: str) -> None:
    for r in check(suite[f"fabric_{name}"]):
        assert r["reduce"][0::2] == [0] * (2 * K)
        assert all(b > 0 for b in r["reduce"][1::2])


def test_save_and_load_resume_exactly(suite: dict, name: str) -> None:
    """fabric.save at step K; a fresh model, optimizer and scheduler loaded with fabric.load
    continue to 2K exactly as the uninterrupted run (losses, norms, LR, weights)."""
    for r in check(suite[f"fabric_{name}"]):
        assert r["is_dir"] and r["remainder"] == {"step": K}
        assert r["resume_loss"] == pytest.approx(r["loss"][2 * K:], rel=TOL, abs=1e-7)
        assert r["resume_norm"] == pytest.approx(r["norm"][K:], rel=TOL)
        assert r["resume_lr"] == r["lr"][K:]
        assert r["resume_rel"] <= TOL
