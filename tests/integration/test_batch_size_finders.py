"""The batch-size finders users catch out-of-memory errors with (issue 51 part 3), over a model
that runs out of memory above 8 rows a rank (``tests.support.faults.HungryMLP``), in its
forward or its backward, 2 CPU processes: Lightning's ``BatchSizeFinder`` (mode="power", from
2; tests/worlds/lightning_batch_size.py) and Accelerate's ``find_executable_batch_size`` with
``ZeroAccelerator`` (from 16, x0.9; tests/worlds/accelerate_batch_size.py). Under ZeRO each
finds DDP's batch size and then trains on as DDP does at that size: same per-step losses and
final weights within fp32 summation order (the usual parity bound)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.support.faults import LIMIT
from tests.worlds.accelerate_launch import ROOT, Job, Outcome, run_jobs
from tests.worlds.lightning_launch import check, run_suite

TOL = 1e-5  # fp32: only summation order differs from DDP


def _rel(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) / max(max(map(abs, b[k])), 1e-12)
               for k in b)


def _same_training(r: dict, ref: dict) -> None:
    assert r["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7)
    assert _rel(r["weights"], ref["weights"]) <= TOL
    assert _rel(r["weights"], {k: [0.0] * len(v) for k, v in ref["weights"].items()}) > 0


@functools.cache
def lightning() -> dict[str, list]:
    return run_suite("tests/worlds/lightning_batch_size.py", "all", timeout=500)


@pytest.mark.parametrize("name", ["zero3_forward", "zero3_backward", "zero2_backward"])
def test_lightning_batch_size_finder_finds_ddps_size_and_trains_on(name: str) -> None:
    refs, results = check(lightning()["ddp_forward"]), check(lightning()[name])
    for r, ref in zip(results, refs):
        assert ref["found"] == ref["batch_size"] == LIMIT  # 2, 4, 8 train; 16 fails
        assert r["found"] == r["batch_size"] == ref["found"]
        assert r["rows"] == [LIMIT] * len(ref["loss"]) and len(r["loss"]) == 6
        assert r["leftovers"] == []  # the finder's checkpoint directory is removed
        _same_training(r, ref)


RUNS = [("ddp", "forward"), ("zero3", "forward"), ("zero3", "backward"), ("zero2", "backward")]


@functools.cache
def accelerate() -> dict[str, Outcome]:
    script, work = ROOT / "tests" / "worlds" / "accelerate_batch_size.py", Path(
        __import__("tempfile").mkdtemp(prefix="zs-accel-bs-"))
    return run_jobs([Job(f"{mode}_{where}", ["--mode", mode, "--where", where],
                         work / f"{mode}_{where}", script=script) for mode, where in RUNS],
                    parallel=2)


def _ranks(outcome: Outcome) -> list[dict]:
    assert outcome.returncode == 0, outcome.log[-4000:]
    assert [r["rank"] for r in outcome.ranks] == [0, 1], outcome.log[-4000:]
    return outcome.ranks


@pytest.mark.parametrize("name", ["zero3_forward", "zero3_backward", "zero2_backward"])
def test_accelerate_find_executable_batch_size_with_zero(name: str) -> None:
    refs, results = _ranks(accelerate()["ddp_forward"]), _ranks(accelerate()[name])
    for r, ref in zip(results, refs):
        assert ref["tried"] == [16, 14, 12, 10, 9, 8] and ref["batch_size"] == LIMIT
        assert r["tried"] == ref["tried"] and r["batch_size"] == ref["batch_size"]
        _same_training(r, ref)
