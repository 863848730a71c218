"""``engine.phase_bounds()`` (``zero_strategy/memory/phases.py``): each term against what the
engine really holds at stage 3 on 2 processes, for a partial fine-tune whose units nest
(tests/worlds/scenarios_phases.py). The bounds measured as RSS on every entry point and
freezing pattern: tests/integration/test_phase_memory.py."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from zero_strategy.memory.phases import SLACK_BYTES


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return check(run_world("tests/worlds/scenarios_phases.py", 2)[
        "bounds_against_what_the_engine_holds"])


def test_the_units_nest_and_one_is_frozen(runs: list[dict]) -> None:
    """What the bound must follow: the blocks' big layers are units of their own, their
    small ones and the gate make the body's unit, the head the root's; the first block's
    unit trains nothing."""
    units = runs[0]["units"]
    assert sorted(units) == ["", "body", "body.blocks.0.big", "body.blocks.1.big",
                             "body.blocks.2.big"]
    assert [units[f"body.blocks.{i}.big"][2] for i in range(3)] == [False, True, True]


def test_at_rest_the_rank_holds_its_shards(runs: list[dict]) -> None:
    for r in runs:
        assert r["terms"]["params_at_rest"] == r["params_at_rest"], r
        assert sum(s * 4 for _, s, _ in r["units"].values()) == r["params_at_rest"]


def test_gathered_term_covers_every_moment_of_the_step(runs: list[dict]) -> None:
    """The most gathered at once: a block's unit inside the body's inside the root's, and the
    next two blocks' prefetched (``prefetch_units`` 2). The term counts exactly that (not the
    root and the largest other units, which leaves out the body), and the step reaches the
    three nested ones."""
    for r in runs:
        u = r["units"]
        nested = (u[""][0] + u["body"][0] + u["body.blocks.0.big"][0]) * 4
        assert r["terms"]["gathered"] == nested + 2 * u["body.blocks.0.big"][0] * 4, r
        assert nested <= r["most_gathered"] <= r["terms"]["gathered"], r


def test_gradient_and_optimizer_terms_are_what_the_step_allocates(runs: list[dict]) -> None:
    """Gradient shards: only units holding a trainable parameter (the frozen block's unit
    has none); optimizer states: AdamW's two per trainable element of this rank's shard."""
    for r in runs:
        trained = [shard for _, shard, trains in r["units"].values() if trains]
        assert r["terms"]["gradient_shards"] == sum(trained) * 4 == r["grads_after_backward"]
        assert r["terms"]["optimizer_states"] == r["optimizer_growth"], r


def test_enclosing_units_hold_their_gradient_through_the_inner_backward(runs: list[dict]
                                                                        ) -> None:
    """The root's and the body's full-size gradients are alive when an inner block's
    gradient arrives (their own parameters' gradients came first: the head's, the gate's),
    so the bound counts both whole beside the window of inner units; and the gradient
    autograd makes of the largest trainable parameter before it is added in."""
    for r in runs:
        u, t = r["units"], r["terms"]
        assert r["held_at_inner_gradient"], "the hook on an inner block's weight never ran"
        for held in r["held_at_inner_gradient"]:
            assert {"", "body"} <= set(held), held
        assert t["enclosing_gradients"] == (u[""][0] + u["body"][0]) * 4
        assert t["autograd_gradient"] == r["largest_trainable"] * 4 == 40 * 40 * 4  # a big weight


def test_each_bound_adds_its_terms_and_the_slack(runs: list[dict]) -> None:
    t, b = runs[0]["terms"], runs[0]["bounds"]
    assert b["forward"] == t["gathered"] + t["activations"] + SLACK_BYTES
    assert t["routed_held"] == 0  # no routed block in this model
    # Two ranks: the direct reduce-scatter receives its one peer's slice into the output,
    # so no receive scratch (tests/quick/test_collectives.py checks N - 2 at three).
    assert t["reduce_scratch"] == 0
    assert b["backward"] == (b["forward"] + t["gradient_buffers"] + t["enclosing_gradients"]
                             + t["autograd_gradient"] + t["gradient_shards"])
    assert b["step"] == t["optimizer_states"] + t["step_scratch"] + SLACK_BYTES
    assert b["save"] == t["save_buckets"] + SLACK_BYTES
    with_activations = runs[0]["bounds_with_activations"]
    assert with_activations["forward"] == b["forward"] + (5 << 20)
    assert runs[0]["report_bounds"] == {f"bound_{p}_bytes": with_activations[p]
                                        for p in ("load", "forward", "backward", "step", "save")}
