"""The differential harness's fixed seed beyond the quick tier's cases: with
tests/quick/test_space.py, CI_CASES generated cases per world size (150 in all) against
single-process training. Failures print as case dicts to paste into the quick tier's
regressions."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.space import (
    CI_CASES,
    CI_SEED,
    QUICK_CASES,
    assert_generated_cases_pass,
    run_cases,
)

SEED = int(os.environ.get("ZS_SPACE_SEED", CI_SEED))


def _later(world: int) -> tuple[int, int]:
    """The seeds the quick tier does not run: (first, count)."""
    return SEED + QUICK_CASES[world], CI_CASES[world] - QUICK_CASES[world]


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict[str, dict[str, Any]]]:
    return {n: run_cases(n, _later(n)) for n in CI_CASES}


@pytest.mark.parametrize("world", sorted(CI_CASES))
def test_generated_cases_match_single_process_training(worlds: dict, world: int) -> None:
    assert_generated_cases_pass(worlds[world], *_later(world), world)
