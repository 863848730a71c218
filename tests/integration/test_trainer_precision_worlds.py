"""The "-autocast" engine at every stage against one process under torch.autocast, and the
dtypes each precision computes in (tests/worlds/scenarios_trainer_precision.py, 2 gloo
processes). In the integration tier: one world runs a dozen parity scenarios (about a
minute here); which precision a Trainer user gets is checked in the quick tier
(tests/quick/test_trainer_precision.py)."""
from __future__ import annotations

import pytest

from tests.support.harness import check, run_world

# Why the "-autocast" engine may differ from the reference at all, and by how much.
#
# The reference is one process with fp32 weights whose forward runs under
# torch.autocast("cpu", bf16); it backpropagates each rank's micro-batch loss / N into .grad.
# The engine's forward runs the same module on bit-identical fp32 weights (stage 3 gathers
# fp32; offload only moves them) under the same autocast, so every bf16 cast of a weight,
# every bf16 matmul and every fp32 LayerNorm/loss is the same arithmetic on the same
# operands, and each rank's gradient equals the reference's term for that micro-batch. What
# is left is fp32 summation order: the engine averages the ranks' terms in a reduction
# ((g0 + g1) / 2, bucketed/flattened), the reference adds g0/2 and g1/2 into .grad, which
# differ by at most an ulp of fp32 (2^-24 relative), and AdamW's normalised update passes
# such relative errors through about unchanged: after 4 steps a few ulps (measured: 1.4e-7
# relative to each tensor's largest weight). A 1-ulp weight difference can also, rarely,
# flip one weight's bf16 rounding in a later forward (one weight moving by a bf16 ulp,
# 2^-8 relative), which changes the gradients it touches by at most that relative amount;
# AdamW then moves those weights by at most lr * 2^-8 = 4e-5 per step, i.e. < 1e-4 of
# weights of size ~1 over the steps left. TOL = 1e-4 therefore holds whatever the order,
# while the compute-copy mode ("bf16-mixed": bf16 weights, bf16 gradients) lands about 9e-2
# away: a missed autocast, a bf16 weight copy or a bf16 gradient would fail it by 900x.
TOL = 1e-4
LOSS_TOL = 1e-6  # the forward is the same arithmetic; only the first step's is exactly equal


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_trainer_precision.py", 2)


@pytest.mark.parametrize("name", ["autocast_stage0", "autocast_stage1", "autocast_stage2",
                                  "autocast_stage3", "autocast_stage2_offload",
                                  "autocast_stage3_offload", "autocast_stage3_ckpt"])
def test_autocast_engine_equals_one_process_under_autocast(world: dict, name: str) -> None:
    results = check(world[name])
    for rank, r in enumerate(results):
        assert r["precision"] == "bf16-autocast"
        assert r["dtypes"] == r["master_dtypes"] == ["torch.float32"]
        assert r["moved"] > 1e-2, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= TOL, f"rank {rank}: weights differ by {r['rel']:.2e}"
        for step, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
            assert a == pytest.approx(b, rel=LOSS_TOL), f"rank {rank} step {step} loss"
    assert results[0]["rel"] == results[1]["rel"], "ranks disagree on consolidated weights"


@pytest.mark.parametrize("stage", [0, 3])
def test_compute_copies_are_a_different_arithmetic(world: dict, stage: int) -> None:
    """The same comparison for "bf16-mixed": it is what the test above would catch."""
    for r in check(world[f"mixed_stage{stage}"]):
        assert r["precision"] == "bf16-mixed" and r["master_dtypes"] == ["torch.float32"]
        assert r["rel"] > 100 * TOL


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_precision_computes_in_the_dtypes_it_claims(world: dict, stage: int) -> None:
    autocast = check(world[f"dtypes_bf16-autocast_stage{stage}"])[0]
    # fp32 weights (as gathered), the op itself autocast to bf16, fp32 gradients for the
    # weight; the autocast ends with the forward (backward and step run outside it)
    assert autocast == {"weight": "torch.float32", "autocast": True,
                        "autocast_dtype": "torch.bfloat16", "input": "torch.bfloat16",
                        "output": "torch.bfloat16", "grad": "torch.float32",
                        "autocast_after": False}
    copies = check(world[f"dtypes_bf16-mixed_stage{stage}"])[0]
    assert {k: copies[k] for k in ("weight", "autocast", "output", "grad")} == {
        "weight": "torch.bfloat16", "autocast": False, "output": "torch.bfloat16",
        "grad": "torch.bfloat16"}


@pytest.mark.parametrize("stage", [0, 3])
def test_generate_runs_in_the_forwards_autocast(world: dict, stage: int) -> None:
    for r in check(world[f"generate_stage{stage}"]):
        assert r["autocast_seen"] == [True]
        assert r["equal"], "greedy tokens differ from the plain model under autocast"


def test_frozen_tensors_keep_their_dtype_under_autocast(world: dict) -> None:
    for r in check(world["frozen_stage0"]):
        assert r == {"bf16-autocast": "torch.bfloat16", "32-true": "torch.float32"}
