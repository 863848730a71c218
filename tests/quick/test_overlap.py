"""Stages 1-2 (and stage 3's persistent parameters) all-gather updated parameters in the
background after step(): every read in between must see the updated values, bitwise.
Scenarios: tests/worlds/scenarios_overlap.py (2 processes)."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.worlds.scenarios_overlap import LAYOUTS, READS


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_overlap.py", 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("read", list(READS))
def test_reads_between_step_and_forward_see_the_update(world: dict, layout: str,
                                                       read: str) -> None:
    for r in check(world[f"{read}_{layout}"]):
        assert r["reads_equal"], f"{read} after step() saw parameters the gather had not written"
        assert r["losses_equal"] and r["weights_equal"]
