"""The bytes ``zero_strategy.perf`` predicts for a step are the bytes the engine sends: its
communicators' counters over one training step (after one to settle) of a tiny model shaped
like GPT-2, at N=2 for stages 0-3 and the int8 collectives, and at N=4 as 2 "nodes" of 2
for stage 3 over every rank and hybrid sharding with int8 (whose all-reduce across the
groups, the only traffic between them, is counted on its own). Also that stage 3 launches
its reductions while backward computes. Scenarios: tests/worlds/scenarios_traffic.py.
"""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.worlds.scenarios_traffic import CASES, LAUNCH_CASES
from zero_strategy.core.runtime import MAX_INFLIGHT_REDUCTIONS

# What the model leaves out: the step's small collectives, each under 2 x its bytes per rank
# (an all-reduce): the clipping norm, 4 bytes; which parameters were used, 4 bytes per
# parameter tensor (12 here); the gather-order headers, 16 bytes per rank and stage-3 gather
# (about 10 a step); and the int8 codec's padding of each shard to a block of 256 (fp32 scales: a
# few bytes). Under 1 KiB in all; the megabytes of the step are exact.
SMALL_BYTES = 1024


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[dict]]]:
    return request.param, run_world("tests/worlds/scenarios_traffic.py", request.param)


def test_the_predicted_bytes_are_the_counted_ones(
        world: tuple[int, dict[str, list[dict]]]) -> None:
    size, results = world
    ranks = check(results["step_bytes"])
    for rank, cases in enumerate(ranks):
        assert sorted(cases) == sorted(CASES[size])
        for name, case in cases.items():
            extra = case["counted"] - case["predicted"]
            assert 0 <= extra <= SMALL_BYTES, (size, rank, name, case)
            # The all-reduce across groups carries no small collective: exact, but that in
            # int8 each of its two exchanges pads every unit's piece to whole blocks of 256
            # elements (under 260 bytes a piece; a few units: under SMALL_BYTES).
            across = case["counted_across"] - case["predicted_across"]
            if name.endswith("int8"):
                assert 0 <= across <= SMALL_BYTES, (size, rank, name, case)
            else:
                assert across == pytest.approx(0, abs=1), (size, rank, name, case)


def test_stage3_launches_its_reductions_while_backward_computes(
        world: tuple[int, dict[str, list[dict]]]) -> None:
    """A reduction is launched once its unit and those before it in launch order are
    complete; only waiting for one needs every rank to have launched it. So at least the
    in-flight window's worth plus one is launched during backward, whatever the gather checks
    agreed. At prefetch depth 8 backward gathers nothing: when launches waited for a gather
    check's agreement, none was launched before the end of backward, and the whole step's
    reductions crossed the link after its compute."""
    size, results = world
    for rank, cases in enumerate(check(results["launches_in_backward"])):
        assert sorted(cases) == sorted(f"{name}_depth{d}" for name in LAUNCH_CASES[size]
                                       for d in (2, 8))
        for name, case in cases.items():
            states, trained = case["states"], case["trained_units"]
            assert len(states) == trained and set(states) <= {"backward", "post-backward"}
            during = states.count("backward")
            assert during >= min(MAX_INFLIGHT_REDUCTIONS + 1, trained), (size, rank, name,
                                                                         states)
