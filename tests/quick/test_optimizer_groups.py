"""Optimizers of any shape, at stages 0-3, N=1 and N=2, against plain torch (scenarios:
tests/worlds/scenarios_optgroups.py): empty param groups first, last or all but one, groups
added between steps, a trainable parameter in no group, what is refused, and checkpoints of
such optimizers resumed at world size 1."""

from __future__ import annotations

import ast
import re

import pytest

from tests.support.harness import check, run_world
from tests.worlds.scenarios_optgroups import LATE_TO_OWNERS, SHAPES, STAGES

# N=2: the reference averages the ranks' losses before one backward, the engine averages their
# gradients; each step's gradients differ by a few ulps, which AdamW's normalised update
# passes through about unchanged: ~1e-7 after 3-6 steps of lr 0.02 (the argument of
# tests/support/parity.py). 1e-5 leaves a margin of 100 while a skipped, doubled or
# misgrouped update (wrong lr or weight decay) moves weights by ~lr = 2e-2. N=1: the same
# arithmetic as the fused reference, so bit-equal.
TOL = 1e-5


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"N{n}")
def world(request: pytest.FixtureRequest) -> dict:
    return run_world("tests/worlds/scenarios_optgroups.py", request.param)


def _listed(message: str) -> list[str]:
    """The parameter names a refusal lists ("parameters [...] were added ...")."""
    return ast.literal_eval(re.search(r"parameters (\[.*?\])", message).group(1))


def _matches_torch(r: dict, world_size: int) -> None:
    assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
    if world_size == 1:
        assert r["bit_equal"], f"N=1 is torch's arithmetic, yet differs by {r['rel']:.2e}"
    assert r["rel"] <= TOL, f"weights differ from plain torch by {r['rel']:.2e}"
    assert r["groups_equal"], "optimizer.state_dict()['param_groups'] differ from torch's"
    assert r["state_indices_equal"], "optimizer.state_dict()['state'] indices differ"


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_empty_groups_train_as_torch(world: dict, shape: str, stage: int) -> None:
    results = check(world[f"empty_{shape}_stage{stage}"])
    for r in results:
        _matches_torch(r, len(results))
        assert r["lrs_equal"], "a per-group LambdaLR gave other learning rates"
        assert 0 in r["user_groups"], "the empty group is gone from the user's optimizer"
    assert len({r["rel"] for r in results}) == 1, "ranks disagree"


@pytest.mark.parametrize("stage", list(STAGES))
def test_groups_added_between_steps(world: dict, stage: int) -> None:
    results = check(world[f"late_stage{stage}"])
    for r in results:
        _matches_torch(r, len(results))
        assert r["user_groups"][2] == 0 and r["user_groups"][3] == 2, r["user_groups"]
        assert r["mix_untouched"], "a parameter in no group was changed by the step"
        assert r["head_moved"] > 1e-3, "the parameters of the added group did not train"


@pytest.mark.parametrize("stage", list(STAGES))
def test_what_cannot_be_trained_is_refused_by_name(world: dict, stage: int) -> None:
    r = check(world[f"refusals_stage{stage}"])[0]
    assert r["all_empty"].startswith("ValueError") and "2 param groups are all empty" \
        in r["all_empty"], r["all_empty"]
    assert r["left_out"].startswith("ValueError") and "emb.weight" in r["left_out"] \
        and "missing from the optimizer" in r["left_out"], r["left_out"]
    assert r["foreign_added"].startswith("ValueError") and "param group 2" \
        in r["foreign_added"] and "not a parameter of the model" in r["foreign_added"]
    assert r["first_of_two_grown"].startswith("ValueError") and "['head.weight']" in \
        r["first_of_two_grown"] and "SGD, optimizer 0 of 2" in r["first_of_two_grown"]
    assert r["first_of_two_added"].startswith("ValueError") and "added to SGD, optimizer 0 of 2" \
        in r["first_of_two_added"], r["first_of_two_added"]
    # emb.weight was appended to SGD 0, the other five to SGD 1: the message names the
    # optimizer of the first parameter it lists, and lists five of the six
    grown = r["two_of_three_grown"]
    assert grown.startswith("ValueError"), grown
    listed = _listed(grown)
    assert len(listed) == 5 and set(listed) < set(LATE_TO_OWNERS), grown
    owner = 0 if listed[0] == "emb.weight" else 1
    assert f"SGD, optimizer {owner} of 3" in grown, grown


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_last_of_two_optimizers_gains_a_group_as_torch(world: dict, stage: int) -> None:
    """Parameters added to the last optimizer train with its arithmetic (AdamW), not the
    first's (SGD): an SGD step of lr 0.1 on ``head`` would differ from AdamW's by ~1e-2."""
    results = check(world[f"last_of_two_grows_stage{stage}"])
    for r in results:
        assert r["moved"] > 1e-3 and r["head_moved"] > 1e-3, r
        if len(results) == 1:
            assert r["bit_equal"], f"N=1 is torch's arithmetic, yet differs by {r['rel']:.2e}"
        assert r["rel"] <= TOL, f"weights differ from plain torch by {r['rel']:.2e}"


@pytest.mark.parametrize("stage", list(STAGES))
def test_parameters_appended_to_an_empty_group_in_place(world: dict, stage: int) -> None:
    """``param_groups[0]["params"].extend(...)``: torch's step reads the list as it is."""
    results = check(world[f"grown_in_place_stage{stage}"])
    for r in results:
        _matches_torch(r, len(results))
        assert r["head_moved"] > 1e-3, "the appended parameters did not train"


def test_owner_placed_optimizer_with_empty_groups(world: dict) -> None:
    results = check(world["owner_placed_stage3"])
    for r in results:
        _matches_torch(r, len(results))
        listed = _listed(r["refused"])
        assert len(listed) == 5 and set(listed) < set(LATE_TO_OWNERS), r["refused"]
        assert "were added to Adafactor" in r["refused"] and "owning ranks" in r["refused"], \
            r["refused"]


@pytest.mark.parametrize("case", ["first_empty", "all_but_one"])
def test_checkpoint_with_empty_groups_resumes_at_world_size_one(world: dict, case: str) -> None:
    for r in check(world[f"resume_alone_{case}"]):
        assert r["world"] == 1
        assert r["weights_equal"] and r["state_equal"] and r["groups_equal"], r
