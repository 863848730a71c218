"""Stage-3 generation holds each unit for the call (issue 49): on 2 gloo processes, a tiny
GPT-2's ``generate()`` under the engine gives the unsharded model's tokens; its all-gather
bytes follow (N-1)/N x (held bytes + forwards x streamed bytes), where the default budget
holds the whole model (one gather per call), budget 0 streams it (one per token) and half of
it holds some units; afterwards every unit is sharded again and a training step equals an
engine's that never generated, bit for bit. Scenarios: tests/worlds/scenarios_generation.py."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.worlds.scenarios_generation import NEW_TOKENS


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_world("tests/worlds/scenarios_generation.py", 2)


@pytest.mark.parametrize("budget", ["auto", "streamed", "partial"])
def test_generate_at_stage3_equals_unsharded_and_sends_the_formula(world2: dict,
                                                                    budget: str) -> None:
    for r in check(world2["generate_budgets"]):
        g, n, total = r[budget], r["world"], r["model_bytes"]
        assert g["tokens_equal"], g
        # Streaming, every forward is a collective: the engine set synced_gpus, and every rank
        # runs as many forwards as the longest request; holding all, each its own.
        assert g["forwards"] == (g["new"] if budget == "auto" else max(NEW_TOKENS)), g
        held = g["held_bytes"]
        assert {"auto": held == total, "streamed": held == 0,
                "partial": 0 < held < total}[budget], g
        assert g["sent"] == (n - 1) / n * (held + g["forwards"] * (total - held)), (g, total)
        assert g["sharded_after"], g


def test_training_after_generation_equals_training_without(world2: dict) -> None:
    for r in check(world2["generate_budgets"]):
        assert r["step_after_equal"], r
        # the units' padding is all that separates the formula's bytes from the model's
        assert r["param_bytes"] <= r["model_bytes"] <= 1.01 * r["param_bytes"], r
        # the memory report states what holding takes and the default budget it has
        report = r["report"]
        assert report["generation_held_bytes"] == r["model_bytes"], report
        assert 0 < report["generation_budget_bytes"] < report["free_bytes"], report


def test_generation_block_is_reentrant_and_exception_safe(world2: dict) -> None:
    """Two generate() calls inside one ``engine.generation()`` block gather the model once;
    a generate() that raises in its loop leaves every unit sharded and the runtime idle."""
    for r in check(world2["generate_budgets"]):
        n = r["world"]
        assert r["twice"] == (n - 1) / n * r["model_bytes"], r
        assert "boom inside generate" in r["raised"] and r["sharded_after_raise"], r
