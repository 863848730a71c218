"""Models compiled with ``torch.compile`` before or after wrapping, at stages 0, 2 and 3
(one unit and per module), N=2 and N=3: parity with the same model trained on the global
batch. The scenarios of tests/worlds/scenarios_model_code.py that compile, in worlds of their
own (``ZS_COMPILED=1``): inductor takes seconds a scenario on 2 cores."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.support.parity import assert_global_batch_parity


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def world(request: pytest.FixtureRequest) -> dict:
    return run_world("tests/worlds/scenarios_model_code.py", request.param,
                     env={"ZS_COMPILED": "1"})


@pytest.mark.parametrize("layout", ["s0", "s2", "s3coarse", "s3fine"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_torch_compile_before_or_after_wrapping(world: dict, when: str, layout: str) -> None:
    assert_global_batch_parity(check(world[f"compiled_{when}_{layout}"]))
