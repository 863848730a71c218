"""Mixed precision, fp16 loss scaling and CPU offload on 2 gloo processes."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_precision.py", 2)


@pytest.mark.parametrize("name", ["offload_optimizer_stage1", "offload_optimizer_stage2",
                                  "offload_optimizer_stage3", "offload_params_stage3"])
def test_offload_is_bit_identical_in_fp32(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["losses_equal"] and r["weights_equal"], name
        # On a CPU device the host is the device: offloading keeps no second copy (fp32: the
        # master is the compute buffer itself), so it holds exactly the plain engine's bytes.
        assert r["master_devices"] == ["cpu"] and not r["master_separate"]
        assert r["extra_bytes"] == 0, r["report"]


@pytest.mark.parametrize("name", ["delayed_offload_optimizer_stage1",
                                  "delayed_offload_optimizer_stage2",
                                  "delayed_offload_optimizer_stage3",
                                  "delayed_offload_params_stage3",
                                  "delayed_offload_params_stage3_no_prefetch"])
def test_offload_waits_for_every_copy(world: dict, name: str) -> None:
    """Every host<->device copy delayed until waited on (what a slow GPU copy does): a read
    before the wait would see NaN or stale values and change the result, and a host write
    into a buffer a copy may still read is counted as a race."""
    for r in check(world[name]):
        assert r["delayed_copies"] > 0
        assert r["races"] == 0, "a host buffer changed while a copy could still be reading it"
        assert r["losses_equal"] and r["weights_equal"], name
        # host memory apart from the device's (as on a GPU): the master is its own host tensor
        assert r["master_separate"] and r["extra_bytes"] > 0


def test_fp16_gradients_are_divided_before_they_are_summed(world: dict) -> None:
    for r in check(world["fp16_sum_would_overflow"]):
        assert r["stepped"], "the reduction overflowed: gradients were summed before dividing"
        assert r["weight"] == r["expected"]


# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2 % per operation). Autocast
# computes matmuls in bf16 but keeps fp32 weights, LayerNorm and loss; our bf16-mixed runs the
# whole forward on bf16 weights. Both differ from the fp32 run by rounding alone, so we require
# our update (weights after - before) to be as close to autocast's as autocast's is to fp32
# (plus 2 percentage points), and losses to agree within 2 %.
@pytest.mark.parametrize("name", ["bf16_stage0", "bf16_stage1", "bf16_stage2", "bf16_stage3",
                                  "bf16_gpt2_stage3"])
def test_bf16_mixed_tracks_ddp_autocast(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["master_dtypes"] == ["torch.float32"]
        assert r["state_dtypes"] == ["torch.float32"]
        assert r["module_param_dtypes"] == ["torch.bfloat16"]
        assert r["update_rel_to_autocast"] <= r["autocast_rel_to_fp32"] + 0.02, r
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert a == pytest.approx(b, rel=0.02)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reduce_dtype", ["fp32", "compute"])
def test_mixed_precision_memory_formula(world: dict, stage: int, reduce_dtype: str) -> None:
    for r in check(world[f"memory_bf16_{reduce_dtype}_stage{stage}"]):
        est = r["estimate"]
        assert (est["param_bytes_per_param"], est["optimizer_bytes_per_param"]) == (2, 12)
        assert est["grad_bytes_per_param"] == (4 if reduce_dtype == "fp32" else 2)
        _assert_matches_formula(r, stage, (2, est["grad_bytes_per_param"], 12))


# Bytes per parameter (weights, gradients, optimizer) each layout must hold under ZeRO's
# formula, written out: bf16-true keeps Adam's two states in bf16 and no master (2, 2, 4);
# autocast and fp32 train fp32 weights that are their own masters (4, 4, 8); on the CPU
# offloading changes nothing, so offloaded bf16-mixed with bf16 reduction is (2, 2, 12).
OTHER_LAYOUTS = {"memory_bf16_true_stage3": (3, (2, 2, 4)), "memory_offload_stage2": (2, (4, 4, 8)),
                 "memory_offload_stage3": (3, (2, 2, 12)),
                 "memory_autocast_stage2": (2, (4, 4, 8)), "memory_autocast_stage3": (3, (4, 4, 8))}


@pytest.mark.parametrize("name", list(OTHER_LAYOUTS))
def test_other_layouts_memory_formula(world: dict, name: str) -> None:
    stage, per_param = OTHER_LAYOUTS[name]
    for r in check(world[name]):
        est = r["estimate"]
        assert (est["param_bytes_per_param"], est["grad_bytes_per_param"],
                est["optimizer_bytes_per_param"]) == per_param
        _assert_matches_formula(r, stage, per_param)
        if "offload" in name:  # on the CPU offloading moves nothing and adds nothing
            assert est["host_bytes"] == 0 == r["predicted_host_bytes"]
            assert est["total_bytes"] == r["estimate_plain"]["total_bytes"]


# mixed_memory's MLP(d_in=64, hidden=255, d_out=7): inp, 3 blocks, LayerNorm, out
MLP_PARAMS = (64 + 1) * 255 + 3 * (255 + 1) * 255 + 2 * 255 + (255 + 1) * 7


def _assert_matches_formula(r: dict, stage: int, per_param: tuple[int, int, int]) -> None:
    """The engine's prediction is ZeRO's formula (Rajbhandari et al.: weights sharded from
    stage 3, gradients from 2, optimizer states from 1, over N=2), computed here; what it
    holds is that prediction within 5 % plus its padding."""
    assert r["num_params"] == MLP_PARAMS
    p, g, k = per_param
    formula = {"params": MLP_PARAMS * p / (2 if stage >= 3 else 1),
               "grads": MLP_PARAMS * g / (2 if stage >= 2 else 1),
               "optimizer": MLP_PARAMS * k / (2 if stage >= 1 else 1)}
    formula["total"] = sum(formula.values())
    for part, bytes_ in formula.items():
        # Shards are whole elements: the odd count rounds each sharded part down by at most
        # one element's bytes of each kind.
        assert abs(r[f"predicted_{part}_bytes"] - bytes_) <= p + g + k, (part, bytes_, r)
    per_element = p + g + k
    padding = r["padding_elements"] * per_element
    for part in ("params", "grads", "optimizer", "total"):
        held, predicted = r[f"{part}_bytes"], r[f"predicted_{part}_bytes"]
        assert abs(held - predicted) <= 0.05 * predicted + padding, (part, r)


@pytest.mark.parametrize("name", ["fp16_overflow_stage0", "fp16_overflow_stage1",
                                  "fp16_overflow_stage2", "fp16_overflow_stage3",
                                  "fp16_overflow_autocast_stage3"])
def test_fp16_overflow_on_one_rank_skips_everywhere(world: dict, name: str) -> None:
    results = check(world[name])
    assert results[0]["events"] == results[1]["events"], "ranks disagree on a skip or the scale"
    events = {e["step"]: e for e in results[0]["events"]}
    assert [s for s, e in events.items() if not e["stepped"]] == [3, 4]
    for step in (3, 4):
        assert events[step]["unchanged"], "a skipped step changed weights or optimizer states"
    assert all(not e["unchanged"] for s, e in events.items() if s not in (3, 4))
    assert all(e["finite"] for e in events.values())
    # growth_interval=3: clean steps 1-2 keep 1024; hysteresis=2: overflow at 3 is tolerated,
    # the one at 4 halves; then 3 clean steps (5-7) double it back, 3 more (8-10) again.
    assert [events[s]["scale"] for s in range(1, 11)] == [
        1024, 1024, 1024, 512, 512, 512, 1024, 1024, 1024, 2048]
    assert results[0]["skipped"] == 2
    assert results[0]["master_dtypes"] == ["torch.float32"]


def test_fp16_trains_like_fp32(world: dict) -> None:
    for r in check(world["fp16_trains_stage2"]):
        assert r["skipped"] == 0 and r["scale"] == 1024.0
        # fp16 rounds weights and activations to 11 significant bits; AdamW at lr 1e-2 turns
        # that into update differences of a few percent (bf16 autocast vs fp32 shows ~7 %).
        assert r["update_rel_to_fp32"] < 0.05, r
        assert r["losses"][0] == pytest.approx(r["ref_losses"][0], rel=1e-3)
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert a == pytest.approx(b, rel=0.03)
