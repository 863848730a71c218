"""``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` with every preset the quick tier
does not train (stages 1-2, offload, the disk tier) against DDP's run of the same module:
the checks of tests/support/lightning_checks.py and tests/support/fabric_checks.py; the
peak memory of a model built in ``configure_model`` at stage 3; and pretrained weights
streamed by ``zero_strategy.transformers.from_pretrained`` through Lightning's
``configure_model`` and Fabric against ``Model.from_pretrained`` under DDP. One pair of
processes (tests/worlds/lightning_run.py's "presets" suite)."""

from __future__ import annotations

import pytest

from tests.support.fabric_checks import test_matches_ddp as test_fabric_matches_ddp
from tests.support.fabric_checks import (
    test_no_backward_sync_skips_gradient_communication,
    test_save_and_load_resume_exactly,
)
from tests.support.lightning_checks import (
    TOL,
    parametrize_presets,
    test_accumulation_skips_gradient_communication,
    test_checkpoint_after_fit_evaluates_and_consolidates,
    test_load_from_checkpoint_on_the_path_model_checkpoint_reports,
    test_log_validate_test_predict_and_summary,
    test_matches_ddp,
    test_resume_from_model_checkpoint_is_exact,
)
from tests.worlds.lightning_launch import OTHER_PRESETS, check, suite_results

__all__ = [  # collected here, for these presets
    "test_accumulation_skips_gradient_communication",
    "test_checkpoint_after_fit_evaluates_and_consolidates", "test_fabric_matches_ddp",
    "test_load_from_checkpoint_on_the_path_model_checkpoint_reports",
    "test_log_validate_test_predict_and_summary", "test_matches_ddp",
    "test_no_backward_sync_skips_gradient_communication",
    "test_resume_from_model_checkpoint_is_exact", "test_save_and_load_resume_exactly",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_presets(metafunc, OTHER_PRESETS)


@pytest.fixture(scope="module")
def suite() -> dict:
    return suite_results("presets")


def test_configure_model_builds_sharded(suite: dict) -> None:
    """No rank ever holds the whole fp32 model: peak RSS growth from setup() to the start of
    training stays well under the model's 128 MiB; built in __init__ instead, it exceeds it."""
    for sharded, whole in zip(check(suite["memory_configure_model"]),
                              check(suite["memory_init"])):
        assert sharded["built_on_meta"]
        # ZeroStrategy(param_init_fn=...): replayed on scratch when configure_model returns
        # (construction order, for the generator), then once more as each unit materialises.
        assert sharded["init_calls"] == ["Linear"] * 64
        assert whole["init_calls"] == []  # nothing on meta: nothing to initialise
        assert sharded["summary"] == sharded["engine_numel"] == 33_587_200  # not 0 at stage 3
        full = sharded["full_mib"]
        assert sharded["state_mib"] == pytest.approx(full / 2, rel=0.01)
        assert sharded["peak_growth"] < 0.75 * full, sharded
        assert whole["peak_growth"] > 0.95 * full, ("the contrast case does not hold the "
                                                    "whole model: the check cannot tell", whole)


# ---------------------------------------------------------------------- pretrained weights
# tests/worlds/lightning_pretrained_scenarios.py: a tiny GPT-2 folder, loaded by the user's
# code with zero_strategy.transformers.from_pretrained (on meta, each rank reading its shards
# when the engine is built) or, for the DDP reference, with GPT2LMHeadModel.from_pretrained.
@pytest.mark.parametrize("scenario", [
    "pretrained_lightning_zero3", "pretrained_lightning_zero2",  # built in configure_model
    "pretrained_fabric_zero3", "pretrained_fabric_zero2",  # in init_module(empty_init=True)
    "pretrained_fabric_zero3_no_init_module",  # docs/pretrained.md: "or not"
])
def test_from_pretrained_trains_as_ddp_with_model_from_pretrained(suite: dict,
                                                                   scenario: str) -> None:
    """Built on meta (the weights reach the engine from the folder, not from a whole model),
    the consolidated weights at the start of training are DDP's bit for bit and the
    generator is where Model.from_pretrained left it (dropout is on, so every loss depends on
    it); then 3 AdamW steps: losses and weights within TOL (fp32, only the gradient summation
    order differs; why the optimizer's eps makes that hold: lightning_pretrained_scenarios.
    optimizer)."""
    for rank, r in enumerate(check(suite[scenario])):
        assert r["on_meta"], f"rank {rank}: from_pretrained did not build on meta"
        assert r["training"], "the model trained in eval mode: dropout off, the rng unchecked"
        assert r["keys_equal"], f"rank {rank}: other state dict keys than DDP's"
        assert r["initial_differ"] == [], f"rank {rank}: differ at start: {r['initial_differ']}"
        assert r["rng_equal"], f"rank {rank}: generator state differs when training starts"
        assert r["loss"][0] == r["ref_loss"][0], f"rank {rank}: first loss differs"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=TOL), f"rank {rank}"
        assert r["rel_final"] <= TOL, f"rank {rank}: weights differ by {r['rel_final']:.2e}"
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
    for reference in ("pretrained_lightning_ddp", "pretrained_fabric_ddp"):
        assert not any(r["on_meta"] for r in check(suite[reference]))
