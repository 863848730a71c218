"""The engine's consolidated weights, losses and gradient norms against DDP's, shared by the
parity tests of every tier (the scenarios: tests/worlds/scenarios_engine.py)."""

from __future__ import annotations

import pytest

TOL = 1e-5  # fp32: only summation order differs from DDP (bucketed all-reduce, shard norms)


def assert_parity(results: list[dict], clip: float = 0.05) -> None:
    for rank, r in enumerate(results):
        assert r["keys"] and r["shapes"], f"rank {rank}: state dict keys/shapes differ from DDP's"
        assert r["dtypes"] == ["torch.float32"]
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= TOL, f"rank {rank}: consolidated params differ by {r['rel']:.2e}"
        # Elements whose AdamW denominator fell to the eps scale (GPT-2's key bias, whose true
        # gradient is zero, and elements whose ranks' gradients cancel) turn rounding-level
        # gradient differences into weight differences of up to TOL * gain: compared relative
        # to max|w| + gain, argued in tests/worlds/scenarios_engine.py's AdamWGain.
        assert r["rel_eps_bound"] <= TOL, \
            f"rank {rank}: eps-bound elements differ by {r['rel_eps_bound']:.2e} of max|w| + gain"
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert a == pytest.approx(b, rel=TOL, abs=1e-7), f"rank {rank} step {step} loss"
        for step, (a, b) in enumerate(zip(r["norm"], r["ref_norm"])):
            assert a == pytest.approx(b, rel=TOL), f"rank {rank} step {step} grad norm"
        assert max(r["ref_norm"]) > clip, "clipping never engaged: the test would not cover it"
    assert results[0]["rel"] == results[-1]["rel"], "ranks disagree on consolidated weights"


# fp32: the reference sums the ranks' losses before one backward, the engine averages the
# ranks' gradients in a reduce-scatter/all-reduce; each step's gradients then differ by a few
# ulps (N * 2^-24 ~ 1e-7 relative). AdamW's normalised update passes such relative errors
# through about unchanged, so after 3-6 steps of lr 0.02 the weights agree to ~1e-6; 1e-5
# leaves a margin of 10 while any real divergence (a missed or doubled gradient, a skipped
# or extra update) moves weights by ~lr = 2e-2.
MODEL_CODE_TOL = 1e-5


def assert_global_batch_parity(results: list[dict]) -> None:
    """The engine against one process training on the global batch (user model code,
    tests/worlds/scenarios_model_code.py)."""
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= MODEL_CODE_TOL, \
            f"rank {rank}: weights differ from the reference by {r['rel']:.2e}"
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert a == pytest.approx(b, rel=MODEL_CODE_TOL, abs=1e-7), \
                f"rank {rank} step {step} loss"
