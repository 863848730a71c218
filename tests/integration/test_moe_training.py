"""Mixture-of-experts training at stages 2, 3 and 3 with CPU offload: tiny Qwen3-MoE (router
load-balancing loss on) and Mixtral, written with ``save_pretrained`` and loaded back with
``from_pretrained``, under ``ZeroTrainer`` against plain ``Trainer`` (DDP), and Qwen3-MoE
under Lightning's ``ZeroStrategy`` (stage 3, and the ``zero2`` and ``zero3_offload`` presets)
against Lightning's DDP. Each rank reads its
own half of the vocabulary, so the ranks route tokens to different experts; every test
asserts that some expert got no token on one rank while the other rank used it.

Tolerance (``RTOL`` = 1e-5, tests/support/trainer_checks.py): every run is fp32 on CPU with
the same data, seeds and routing on the same ranks. At N=2 the averaged gradients are
bit-identical (a sum of two halves either way); what differs is the order of the clipping
norm's sums (per shard and unit here, per tensor in torch), a few ulps of the norm (~1e-7
relative; stage 2 sums each rank's flat shard of ~30k elements at once, within
log2(3e4) ~ 15 ulps ~ 2e-6, the largest measured), hence of the clipping factor. AdamW's
update is invariant to a common scale of the gradient, so after 3 steps the weights agree
to ~1e-6 of their tensors' largest; 1e-5 leaves a margin while a lost expert gradient, a
missing aux loss or a skipped step moves weights by ~lr = 1e-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import trainer_checks as C
from tests.worlds.lightning_launch import check, run_suite

FAMILIES = ["qwen3moe", "mixtral"]
MODES = ["z2", "z3", "z3off"]
SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "worlds" / "moe_run.py"
SCENARIOS = [f"{f}_{m}" for f in FAMILIES for m in ("ddp", *MODES)] + [
    "mixtral_eager_ddp", "mixtral_eager_z3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return C.launch(tmp_path_factory.mktemp("moe"), SCENARIOS, script=SCRIPT)


def assert_some_expert_idle_on_one_rank(routes: list[Any]) -> None:
    """routes[rank][forward][layer][expert]: tokens routed there."""
    idle_here_used_there = 0
    for per_forward in zip(*routes):
        for per_layer in zip(*per_forward):
            for counts in zip(*per_layer):
                idle_here_used_there += min(counts) == 0 < max(counts)
    assert idle_here_used_there > 0, routes


def assert_trainer_matches_ddp(ddp: dict, zero: dict, name: str) -> None:
    C.ok(ddp), C.ok(zero)
    assert len(zero["loss"]) == 3, zero
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(ddp[key], zero[key], f"{name} {key}")
    ours, theirs = C.weights(zero["final"]), C.weights(ddp["final"])
    diff = C.max_rel_diff(theirs, ours)
    assert diff <= C.RTOL, f"{name}: saved weights differ from DDP's by {diff:.2e} relative"
    moved = C.max_rel_diff(C.weights(ddp["pretrained"]), ours)
    assert moved > 1e-3, f"{name}: training did not move the weights: parity would be vacuous"
    # The same routing, token for token, in every forward: a top-k near-tie flipped by
    # ulp-level differences would be a discrete change no tolerance covers (and is named so).
    assert zero["routes"] == ddp["routes"], f"{name}: a router's choice differs from DDP's"
    assert_some_expert_idle_on_one_rank(zero["routes"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_trainer_matches_ddp(runs: dict, family: str, mode: str) -> None:
    ddp, zero = runs[f"{family}_ddp"], runs[f"{family}_{mode}"]
    assert_trainer_matches_ddp(ddp, zero, f"{family} {mode}")
    # transformers' default experts on CPU (torch >= 2.9): one grouped matmul over every
    # expert's slice of the 3-D weights, gathered from the unit's flat buffer at stage 3.
    assert zero["experts_implementation"] == "grouped_mm", zero["experts_implementation"]


def test_eager_experts_at_stage3_match_ddp(runs: dict) -> None:
    """transformers' per-expert loop over the experts that received tokens (indexing the
    gathered 3-D weights)."""
    zero = runs["mixtral_eager_z3"]
    assert_trainer_matches_ddp(runs["mixtral_eager_ddp"], zero, "mixtral eager z3")
    assert zero["experts_implementation"] == "eager"


@pytest.fixture(scope="module")
def lightning() -> dict:
    return run_suite("tests/worlds/lightning_moe.py", "moe", timeout=400)


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_lightning_matches_ddp(lightning: dict, strategy: str) -> None:
    """zero3: ZeroStrategy(stage=3) with every module its own unit; the others by name."""
    pairs = zip(check(lightning["ddp"]), check(lightning[strategy]))
    for rank, (ref, ours) in enumerate(pairs):
        assert len(ours["loss"]) == 6, ours  # 3 steps x accumulation 2
        for i, (a, b) in enumerate(zip(ref["loss"], ours["loss"])):
            assert a == pytest.approx(b, rel=C.RTOL), f"rank {rank} micro-batch {i}"
        for i, (a, b) in enumerate(zip(ref["norm"], ours["norm"])):
            assert a == pytest.approx(b, rel=C.RTOL), f"rank {rank} step {i} grad norm"
        assert min(ref["norm"]) > 1.0, "clipping at 1.0 never engaged"
        assert ours["moved"] > 1e-3, "training did not move the weights"
        assert ours["routes"] == ref["routes"], f"rank {rank}: a router's choice differs"
        diff = C.max_rel_diff(torch.load(ref["weights"]), torch.load(ours["weights"]))
        assert diff <= C.RTOL, f"rank {rank}: weights differ from DDP's by {diff:.2e}"
    assert_some_expert_idle_on_one_rank([r["routes"] for r in check(lightning[strategy])])
