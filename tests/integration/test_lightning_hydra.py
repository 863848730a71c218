"""A Hydra app whose jobs run ``Trainer(strategy=..., devices=2)`` as a ``-m`` sweep
(tests/worlds/lightning_hydra_app.py): each job runs once, with both ranks in the job's
directory, and Lightning's rank 1 is started anew for each job. The single run is in
tests/quick/test_lightning.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worlds.lightning_launch import hydra_run


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return {"multirun": hydra_run(["-m", "lr=0.1,0.2", "out=OUT", "hydra.sweep.dir=OUT/sweep"])}


def test_hydra_multirun_runs_each_job_once_with_two_ranks(runs: dict) -> None:
    records, log = runs["multirun"]
    seen = sorted((r["lr"], r["rank"]) for r in records)
    assert seen == [(0.1, 0), (0.1, 1), (0.2, 0), (0.2, 1)], (seen, log[-4000:])
    assert all(r["world_size"] == 2 for r in records)
    by_lr = {lr: {r["rank"]: r for r in records if r["lr"] == lr} for lr in (0.1, 0.2)}
    for ranks in by_lr.values():
        assert ranks[1]["job_dir"] == ranks[0]["job_dir"], "rank 1 wrote into another job"
        assert "-m" not in ranks[1]["argv"] and ranks[1]["mode"] == "RunMode.RUN"
    assert by_lr[0.1][0]["pid"] == by_lr[0.2][0]["pid"], "the sweep ran jobs in one process"
    assert by_lr[0.1][1]["pid"] != by_lr[0.2][1]["pid"], "each job needs its own rank 1"
