"""Activation checkpointing and offload at N=2 (every stage; the kept inputs on the device,
in host memory and on disk) against the same model checkpointed by hand under DDP, the
stage-3 gathers of the recomputation, the engine's measurement of what a forward keeps, and
the refusals. Scenarios: tests/worlds/scenarios_activations.py (N=1 and N=3:
tests/integration/test_activations_worlds.py)."""

from __future__ import annotations

import pytest

import zero_strategy as zs
from tests.support.harness import check, run_world
from tests.support.parity import assert_parity


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_activations.py", 2)


def assert_checkpointed_parity(results: list[dict], modules: int = 3) -> None:
    # fp32, and the same functions recomputed on both sides: only the reduction's summation
    # order differs from DDP, as in every parity test (argued in tests/support/parity.py).
    assert_parity(results)
    for r in results:
        assert r["checkpointed"] == modules


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("offload", ["device", "disk"])
def test_gpt2_checkpointed_matches_ddp_checkpointed_by_hand(world: dict, stage: int,
                                                            offload: str) -> None:
    name = f"gpt2_s{stage}" + ("_disk" if offload == "disk" else "")
    results = check(world[name])
    assert_checkpointed_parity(results)
    for r in results:
        if offload == "disk":
            # Each of the 3 layers' input (batch 4 x 12 tokens x 32 wide, fp32) went to disk
            # once per forward: the measurement is the first forward's.
            assert r["offloaded_bytes"] == 3 * 4 * 12 * 32 * 4
            assert r["files_while_open"] == [] and r["left_after_close"] == []
        else:
            assert r["offloaded_bytes"] == 0


def test_host_offload_on_a_cpu_device_moves_nothing(world: dict) -> None:
    for r in check(world["mlp_s3_cpu"]):
        assert r["offloaded_bytes"] == 0  # the host is the device: nothing to move
    assert_checkpointed_parity(check(world["mlp_s3_cpu"]))


def test_class_names_choose_the_modules(world: dict) -> None:
    assert_checkpointed_parity(check(world["mlp_s2_names"]))


def test_checkpointing_keeps_the_arithmetic_of_plain_ddp(world: dict) -> None:
    # The reference keeps every activation: recomputation (with the forward's dropout
    # masks) must give DDP's own gradients, not merely those of another checkpointed model.
    assert_checkpointed_parity(check(world["gpt2_s3_vs_plain_ddp"]))


def test_stage3_gathers_the_recomputation_once_and_ahead(world: dict) -> None:
    for r in check(world["gathers_once"]):
        plain, checkpointed = r["False"], r["True"]
        # A unit is gathered for forward and once more for its recomputation, which it
        # stays whole through until its gradients arrive: the bytes of a plain step.
        assert checkpointed["bytes"] == plain["bytes"] > 0
        needed = checkpointed["needed"]
        assert len(needed) >= 3  # the three layers' units at least
        # Steady step: backward follows the last backward's order, so every unit it needs
        # is already gathering or whole but the first one.
        assert [state for _, state in needed[1:]].count("sharded") == 0, needed


def test_engine_measures_what_a_forward_keeps(world: dict) -> None:
    for r in check(world["measured"]):
        plain, ckpt, disk, cpu = r["plain"], r["checkpointed"], r["disk"], r["cpu"]
        assert plain["losses"] == ckpt["losses"] == disk["losses"] == cpu["losses"]
        assert plain["bytes"] > 4 * ckpt["bytes"] > 0
        # On disk, the layers' inputs leave what the device keeps, byte for byte.
        assert disk["offloaded"] == 3 * 4 * 12 * 32 * 4
        assert disk["bytes"] == ckpt["bytes"] - disk["offloaded"]
        assert cpu["bytes"] == ckpt["bytes"] and cpu["offloaded"] == 0
        for case in (plain, ckpt, disk):
            assert case["again"] == case["bytes"]  # measure_activations() measures again


def test_bad_choices_are_refused_by_name(world: dict) -> None:
    errors = check(world["refusals"])[0]
    assert "NoSuchBlock" in errors["unknown_class"] and "Sequential" in errors["unknown_class"]
    assert "found no layers" in errors["no_blocks"] and "Linear" in errors["no_blocks"]
    assert "gradient_checkpointing" in errors["twice"] and "twice" in errors["twice"]


def test_an_input_changed_in_place_is_refused(world: dict) -> None:
    for name, error in check(world["in_place_change_refused"])[0].items():
        assert error is not None and "modified by an inplace operation" in error, name


def test_close_gives_the_model_back_unwrapped(world: dict) -> None:
    r = check(world["closed_model_is_plain"])[0]
    assert r["during"] == [True] * 3 and r["after"] == [False] * 3
    assert r["model_flag_after"] is False
    assert r["wrapped"] == [True] * 3 and r["unwrapped"] == [False] * 3


@pytest.mark.parametrize(("options", "words"), [
    ({"activation_checkpointing": "yes"}, ["activation_checkpointing", "class names"]),
    ({"activation_checkpointing": []}, ["activation_checkpointing", "non-empty"]),
    ({"offload_activations": "cpu"}, ["offload_activations", "needs activation_checkpointing"]),
    ({"activation_checkpointing": True, "offload_activations": True}, ["'cpu'", "'disk'"]),
    ({"activation_checkpointing": True, "offload_activations": "nvme"}, ["offload_activations"]),
])
def test_config_refuses_what_it_cannot_do(options: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        zs.ZeroConfig(stage=2, **options)
    for word in words:
        assert word in str(info.value)


def test_offload_dir_is_accepted_for_activations_alone() -> None:
    config = zs.ZeroConfig(stage=1, activation_checkpointing=["GPT2Block"],
                           offload_activations="disk", offload_dir="/tmp/x")
    assert config.activation_checkpointing == ("GPT2Block",)
