"""``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` with every preset the quick tier
does not train (stages 1-2, offload, the disk tier) against DDP's run of the same module:
the checks of tests/support/lightning_checks.py and tests/support/fabric_checks.py; and the
peak memory of a model built in ``configure_model`` at stage 3. One pair of processes
(tests/worlds/lightning_run.py's "presets" suite)."""

from __future__ import annotations

import pytest

from tests.support.fabric_checks import test_matches_ddp as test_fabric_matches_ddp
from tests.support.fabric_checks import (
    test_no_backward_sync_skips_gradient_communication,
    test_save_and_load_resume_exactly,
)
from tests.support.lightning_checks import (
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
