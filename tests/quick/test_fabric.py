"""``Fabric(strategy="zero*")`` against ``Fabric(strategy="ddp")``.

The Fabric scenarios (tests/worlds/lightning_fabric_scenarios.py) run inside
tests/worlds/lightning_run.py's processes, shared with tests/quick/test_lightning.py;
construction-time checks run here.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from tests.support import several_optimizers as so
from tests.support.fabric_checks import (
    test_matches_ddp,
    test_no_backward_sync_skips_gradient_communication,
    test_save_and_load_resume_exactly,
)
from tests.support.lightning_checks import parametrize_presets
from tests.worlds.lightning_launch import QUICK_PRESETS, check, suite_results
from zero_strategy.fabric import PRESETS, ZeroFabricPrecision, ZeroFabricStrategy

__all__ = [  # the shared preset checks, collected here for the stage-3 presets
    "test_matches_ddp", "test_no_backward_sync_skips_gradient_communication",
    "test_save_and_load_resume_exactly",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The shared preset checks (tests/support/fabric_checks.py) for the stage-3 presets; the
    others run in tests/integration/test_lightning_presets.py."""
    parametrize_presets(metafunc, QUICK_PRESETS)


@pytest.fixture(scope="module")
def suite() -> dict:
    return suite_results()


def test_load_refuses_forged_checkpoints_before_changing_anything(suite: dict) -> None:
    """A framework-state payload (refused by weights_only) and a ``latest`` that leaves the
    directory: fabric.load raises, the model is unchanged, the payload never ran."""
    expected = {"framework_payload": "cannot be loaded with weights_only",
                "traversal": "is not a plain file or directory name"}
    for r in check(suite["fabric_zero3"]):
        for name, text in expected.items():
            got = r["hostile"][name]
            assert got["raised"] is not None and text in got["raised"], (name, got)
            assert got["untouched"] and not got["marker"], (name, got)


def test_several_optimizers_match_single_process_training(suite: dict) -> None:
    """``fabric.setup(model, muon, adamw)`` at stage 3 trained as ``muon.step();
    adamw.step()``: one engine step per pair, the weights of one process training on the global
    batch, the LambdaLR on the Muon part changing its lr only."""
    for r in check(suite["fabric_several_optimizers"]):
        assert r["engine_steps"] == so.STEPS, "the second part's step() must only take its turn"
        assert r["rel"] <= so.TOL, f"weights differ by {r['rel']}"
        assert r["moved"] > 1e-2
        assert r["lr"] == r["ref_lr"] == [[so.MUON_LR * so.muon_factor(i + 1), so.ADAMW_LR]
                                          for i in range(so.STEPS)]


def test_several_optimizers_double_step_save_and_load(suite: dict) -> None:
    """Muon stepped twice after one backward is refused (AdamW's turn still comes); fabric.save
    of both, loaded into fresh objects, restores weights and lrs, and replaying the step (AdamW
    first) gives the same weights; a state with one of the two optimizers is refused; after a
    no_sync backward, the optimizer not yet stepped cannot use a turn left from before it."""
    for r in check(suite["fabric_several_optimizers"]):
        assert "optimizer 0 (Fp32Muon) was stepped twice without a backward" in r["double_step"]
        assert r["loaded_rel"] == 0.0 and r["replayed_rel"] == 0.0
        assert r["loaded_lr"] == r["lr"][-1]
        assert r["partial_save"].startswith("ValueError") and "['muon']" in r["partial_save"]
        assert "optimizer 1 (AdamW)" in r["partial_save"]
        assert "engine.step() needs reduced gradients" in r["after_no_sync"], r["after_no_sync"]


def test_registered_names_and_precision() -> None:
    for name, preset in PRESETS.items():
        assert name in STRATEGY_REGISTRY, name
        fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
        assert isinstance(fabric.strategy, ZeroFabricStrategy)
        for field, value in preset.items():
            assert getattr(fabric.strategy.config, field) == value, (name, field)
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-mixed")
    assert fabric.strategy.config.precision == "bf16-mixed"
    assert isinstance(fabric.strategy.precision, ZeroFabricPrecision)
    with pytest.raises(ValueError, match="precision='16-true'.*allowed"):
        Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="16-true")
    with pytest.raises(ValueError, match="precision conflict"):
        Fabric(strategy=ZeroFabricStrategy(precision="bf16-mixed"), accelerator="cpu",
               devices=2, precision="bf16-true")


def test_bad_input_is_refused_before_launch() -> None:
    with pytest.raises(TypeError, match="unknown ZeroConfig key.*'offload'.*allowed"):
        ZeroFabricStrategy(offload=True)
    strategy = ZeroFabricStrategy(stage=2)
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="setup_module_and_optimizers"):
        strategy.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_activation_checkpointing_through_the_strategy(suite: dict) -> None:
    """ZeroFabricStrategy(activation_checkpointing=True, offload_activations="disk"): the same
    losses, norms and weights as DDP (no dropout: recomputation repeats the arithmetic), and
    it saves and resumes like the preset."""
    test_matches_ddp(suite, "zero3_checkpointed")
    test_save_and_load_resume_exactly(suite, "zero3_checkpointed")
