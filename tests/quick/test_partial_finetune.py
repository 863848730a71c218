"""Partial fine-tunes at stage 3 keep the ZeRO promise (issue 58): with only some parameters
trainable, and the optimizer built over those alone, no rank holds the frozen rest whole,
gathers more than the units in flight, reduces a frozen unit or keeps a gradient for it; and
training equals one process on the global batch. Scenarios: tests/worlds/scenarios_partial.py
(2 gloo processes); the memory of every entry point against the per-phase bound:
tests/integration/test_phase_memory.py."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world
from tests.worlds.scenarios_partial import LAYERS, PATTERNS

# fp32, SGD with momentum: the engine reduce-scatters the ranks' mean gradients where the
# reference backpropagates the global batch's mean loss, so gradients differ in summation
# order only (a few ulps, ~1e-7 relative); SGD passes that to the weights scaled by lr
# (0.1) over 3 steps, ~1e-7 of max|w|. 1e-5 leaves a margin of 100, while a gradient lost or
# doubled, or a frozen weight moved, changes weights by ~lr * |grad| ~ 1e-3 or more.
TOL = 1e-5


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_world("tests/worlds/scenarios_partial.py", 2)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_partial_finetune_trains_like_one_process(world2: dict, pattern: str) -> None:
    for r in check(world2[f"partial_{pattern}"]):
        assert r["moved"] > 1e-3, "the reference did not train: parity would be vacuous"
        assert r["rel"] <= TOL, (pattern, r["rel"])
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL), pattern


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_no_rank_holds_the_frozen_model(world2: dict, pattern: str) -> None:
    """Frozen parameters outside the optimizer are sharded like the rest: each rank's
    parameter bytes are half the model's (every unit's flat buffer splits evenly in two up
    to the alignment padding), and the module's own tensors are placeholders of one element."""
    for r in check(world2[f"partial_{pattern}"]):
        assert r["params_bytes"] <= r["whole_bytes"] / 2 * 1.05, (pattern, r)
        assert r["module_storage_bytes"] <= 4 * r["param_tensors"], (pattern, r)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_only_trained_units_are_reduced_and_hold_gradients(world2: dict, pattern: str) -> None:
    """Reduce-scatter sends each trained unit's buffer once per step by the formula, and
    nothing for a unit no parameter of which trains (they used to be reduced as zeros, and
    their gradient shards kept: a second copy of the frozen model's shards)."""
    for r in check(world2[f"partial_{pattern}"]):
        assert r["reduce_scatter_bytes"] == [r["reduce_scatter_formula"]] * len(
            r["reduce_scatter_bytes"]), (pattern, r)
        assert r["grads_bytes"] == r["grads_formula"], (pattern, r)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_units_are_freed_as_forward_and_backward_go(world2: dict, pattern: str) -> None:
    """After forward only the root unit is whole (its parameters, the tied embedding and
    head, are read at the end of forward and the start of backward), and the forward's last
    ``prefetch_units`` units, which backward needs first. During backward at most
    the root, the unit computing and the one prefetched are whole: a frozen unit whose
    module's backward ended is freed then, not kept to the end of backward."""
    for r in check(world2[f"partial_{pattern}"]):
        assert r["root"], "the tiny GPT-2 has a root unit (embeddings, ln_f)"
        for names in r["after_forward"]:
            # the root, and the forward's last unit (prefetch_units=1) that backward needs
            # first, when backward reaches it: kept whole for it
            assert set(names) <= {"<root>", "transformer.ln_f"}, (pattern, names)
        assert r["most_in_backward"] <= 3, (pattern, r["most_in_backward"], r["units"])
        if pattern == "head_only":  # backward reaches no block: none is gathered for it
            assert set(r["seen_in_backward"]) <= {"<root>", "transformer.ln_f"}, r


def test_checkpoints_load_across_stages_with_frozen_parameters(world2: dict) -> None:
    for r in check(world2["frozen_checkpoint_across_stages"]):
        assert r == {"3->2": 0.0, "2->3": 0.0}, r


def test_ranks_that_freeze_differently_are_refused_by_name(world2: dict) -> None:
    """requires_grad decides which units are reduced, so ranks must agree on it: a rank that
    unfroze another block is refused at the first backward, naming the parameters, on every
    rank. The agreement is not a collective: the step where the first block is unfrozen sends
    what the step before sent plus exactly that block's reduce-scatter and the backward
    gathers of blocks 0-2, which backward now crosses (ring, fp32)."""
    for r in check(world2["trainability_disagreement"]):
        assert "ranks disagree on which parameters require grad" in r["refusal"], r["refusal"]
        assert "transformer.h.0." in r["refusal"], r["refusal"]
        _, first, second, third = r["sent"]  # the engine's first step keeps nothing
        assert first == second, (first, second)
        grown = {k: third[k] - second[k] for k in third}
        ring = r["ring_bytes"]
        assert grown["reduce_scatter"] == ring["transformer.h.0"], grown
        # Each stage-3 gather on gloo also sends its order header: 2 int64 per rank, of
        # which a rank sends (N-1)/N of the gathered 2 * 8 * N bytes.
        header = 2 * 8 * (r["world"] - 1)
        blocks = sum(ring[f"transformer.h.{i}"] + header for i in range(3))
        assert grown["all_gather"] == blocks, grown
        assert grown["all_reduce"] == grown["broadcast"] == 0, grown


def test_prefetch_units_gathers_that_many_ahead(world2: dict) -> None:
    """``prefetch_units=k``: as each of the 4 blocks starts its forward, the next k blocks
    (as many as are left) are gathered or gathering, and of those behind it only the ones
    kept whole for backward: the forward's last k units (its order: wpe, the 4 blocks,
    ln_f), which backward needs first. The results are the same bit for bit (only when
    gathers are issued changes)."""
    for r in check(world2["prefetch_depths"]):
        for depth in (1, 2, 3):
            kept = range(LAYERS - (depth - 1), LAYERS)  # ln_f is the last of the k
            assert r[str(depth)]["ahead"] == [min(depth, LAYERS - 1 - i) for i in range(LAYERS)], \
                (depth, r[str(depth)]["ahead"])
            assert r[str(depth)]["behind"] == [sum(1 for j in kept if j < i)
                                                for i in range(LAYERS)], (depth, r[str(depth)])
            assert r[str(depth)]["losses"] == r["1"]["losses"]
