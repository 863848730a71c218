"""Model code as users write it, at stages 0-3 (stage 3 as one unit and per module), N=2 and
N=3: parity with the same model trained on the global batch, or an error naming the
limitation and what to use instead. Scenarios: tests/worlds/scenarios_model_code.py.
"""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.support.parity import assert_global_batch_parity
from tests.support.user_models import LOSSES
from tests.worlds.scenarios_model_code import LAYOUTS

WORLDS = [2, 3]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"N{n}")
def world(request: pytest.FixtureRequest) -> dict:
    return run_world("tests/worlds/scenarios_model_code.py", request.param)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_parameters_used_outside_forward(world: dict, loss: str, layout: str) -> None:
    # plain; an L2 term on model.blk.lin.weight after forward; a tied head applied by the
    # caller (engine(ids) @ model.emb.weight.T); the model driven through model.encode().
    # Net also returns a parameter from a submodule's forward and reads self.mix.weight
    # in the parent's forward.
    assert_global_batch_parity(check(world[f"parity_{loss}_{layout}"]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_close_gives_back_a_plain_trained_module(world: dict, layout: str) -> None:
    for r in check(world[f"close_{layout}"]):
        assert r["close_equal"], "the closed module does not hold the trained weights"
        assert r["close_plain_class"] and r["close_no_hooks"]
        for message, call in zip(r["close_refusals"], ("save_checkpoint", "load_checkpoint")):
            assert f"engine.{call}(): the engine was closed" in message, message
        assert r["close_runs"]
    assert_global_batch_parity(check(world[f"close_{layout}"]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_state_dict_after_wrapping_and_refused_conversions(world: dict, layout: str) -> None:
    results = check(world[f"load_convert_{layout}"])
    assert_global_batch_parity(results)  # the conversions were refused before changing anything
    for r in results:
        for name, message in r["messages"].items():
            assert "ZeroConfig(precision=" in message and "nothing was changed" in message, name
            assert "engine.close()" in message


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gathered_parameters_edits_and_engine_load_state_dict(world: dict, layout: str) -> None:
    assert_global_batch_parity(check(world[f"gathered_edit_{layout}"]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_read_only_gather_and_module_state_dict(world: dict, layout: str) -> None:
    for r in check(world[f"read_only_{layout}"]):
        assert r["gathered_sd_equal"], "state_dict() inside gathered_parameters() is not whole"
        if layout.startswith("s3"):
            assert "without writable=True" in r["message"] and r["unchanged"]
            assert "engine.full_state_dict()" in r["state_dict_message"]
        else:
            # stages 0-2 in fp32 without offload: the module's parameters *are* the master,
            # so an edit sticks (documented) and the module's own state_dict is whole.
            assert r["message"] == "no error" and not r["unchanged"]
            assert r["state_dict_message"] == "no error"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "kind", ["freeze_at_2", "every_step", "unfreeze_add_group", "unfreeze_no_group",
             "unfreeze_part_in_group"])
def test_requires_grad_changes_after_wrapping(world: dict, kind: str, layout: str) -> None:
    # unfreeze_part_in_group: blk unfrozen, only its weight added to a group; its bias
    # trains in no group (a .grad as in torch, never stepped), which is not an error.
    results = check(world[f"trainability_{kind}_{layout}"])
    assert_global_batch_parity(results)
    if kind not in ("unfreeze_no_group", "unfreeze_part_in_group"):
        assert all(r["blk_grad_none"] for r in results)  # else .grad as in torch
    assert all(r["close_equal"] for r in results), "close() lost a parameter taken over"


# fp32 against DDP on the same per-rank batches: the weights differ by the gradient
# reduction's summation order (~1e-7 relative), which moves the next batch statistics, and
# so the running buffers, by as little; 1e-5 leaves a margin of 10 or more, while a buffer
# broadcast (or not) against the setting moves a rank's running mean by its batches'
# difference, ~1e-1 (flag_gap).
BUFFER_TOL = 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_broadcast_buffers_as_ddp(world: dict, broadcast: bool,
                                                 layout: str) -> None:
    for rank, r in enumerate(check(world[f"buffers_{broadcast}_{layout}"])):
        assert r["buffers_rel"] <= BUFFER_TOL, (rank, r)
        assert r["weights_rel"] <= BUFFER_TOL, (rank, r)
        if rank > 0:  # rank 0 is the source: both settings leave it as it is
            assert r["flag_gap"] >= 1e-3, "the scenario cannot tell the settings apart"
        # extra joined the optimizer after step 1: two AdamW steps of lr 0.02 toward 1
        assert all(0.03 < x < 0.05 for x in r["extra"]), r["extra"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_param_groups_added_mid_step_are_refused(world: dict, layout: str) -> None:
    for r in check(world[f"adoption_refusals_{layout}"]):
        for when in ("accumulating", "accumulating_again", "reduced"):
            assert "were added to the optimizer in the middle of a step" in r[when], r
        assert "['blk.lin.weight']" in r["accumulating"], r["accumulating"]
        assert "['blk.lin.bias']" in r["reduced"], r["reduced"]
        assert "['blk.lin.bias'] added to the optimizer already hold a .grad" in r["stale"], r
        assert r["adopted_steps"] is True and r["then_steps"] is True


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grad_outside_the_engine_is_refused(world: dict, layout: str) -> None:
    for r in check(world[f"stray_grad_{layout}"]):
        assert "['head.bias'] hold a .grad that did not go through" in r["message"], r
        assert r["then_steps"] is True, "zero_grad() after the error leaves the engine ready"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dtypes(world: dict, layout: str) -> None:
    for r in check(world[f"dtypes_{layout}"]):
        assert "'z' has dtype torch.complex64" in r["complex"], r["complex"]
        assert "'w64' has dtype torch.float64" in r["fp64"], r["fp64"]
        assert r["exact"], "an integer/bool buffer or frozen integer parameter changed"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_experts_unused_on_some_ranks(world: dict, layout: str) -> None:
    # s3fine: the MoE block (a gate Linear beside a ModuleList of experts) is recognised as
    # routed and gathered as one unit without unit_leaf_classes (core/routed.py).
    assert_global_batch_parity(check(world[f"moe_{layout}"]))


def test_experts_under_a_named_leaf_class(world: dict) -> None:
    assert_global_batch_parity(check(world["moe_s3fine_leaf"]))


@pytest.mark.parametrize("mode", ["headers", "uneven", "blocking", "deferred"])
def test_ranks_gathering_different_units_raise_before_the_step(world: dict, mode: str) -> None:
    """"uneven": units of different sizes meet, which would abort a process were their rows
    exchanged; after the error and zero_grad() the ranks' exchanges are matched again and a
    step equals one process's (AdamW's first step, fp32, two ranks on one batch: the
    gradient's average differs in the last bits, and the update's sign-like first step
    carries that to ~1e-7 of lr 0.02; 1e-6 leaves a margin of 10)."""
    for r in check(world[f"swapped_order_{mode}"]):
        assert r["raised"] is not None and "ranks are gathering different units" in r["raised"]
        assert "'a'" in r["raised"] and "'b'" in r["raised"], r["raised"]
        assert r["unchanged"], "weights changed although the ranks gathered different units"
        assert r["then_trains"] <= 1e-6, r
