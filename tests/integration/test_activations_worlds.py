"""Activation checkpointing and offload at N=1 and N=3: every stage x the kept inputs on the
device, in host memory and on disk x GPT-2 (transformers' layers) and an MLP (the engine's
own wrapper), against the same model checkpointed by hand under DDP. N=2 and the rest:
tests/quick/test_activations.py (scenarios: tests/worlds/scenarios_activations.py)."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.support.parity import assert_parity

pytestmark = pytest.mark.integration

WORLDS = (1, 3)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"N{n}" for n in WORLDS])
def world(request: pytest.FixtureRequest) -> dict:
    return run_world("tests/worlds/scenarios_activations.py", request.param)


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("offload", ["device", "cpu", "disk"])
@pytest.mark.parametrize("kind", ["gpt2", "mlp"])
def test_checkpointed_matches_ddp_checkpointed_by_hand(world: dict, kind: str, stage: int,
                                                       offload: str) -> None:
    results = check(world[f"{kind}_s{stage}_{offload}"])
    # fp32 and the same recomputed functions on both sides: summation order only, as every
    # parity test (tests/support/parity.py argues the bound).
    assert_parity(results)
    for r in results:
        assert r["checkpointed"] == 3
        # a CPU device is the host: only the disk form moves the layers' inputs
        assert (r["offloaded_bytes"] > 0) == (offload == "disk")
        assert r["files_while_open"] == [] and r["left_after_close"] == []
