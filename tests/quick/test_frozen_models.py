"""A model prepared for evaluation only beside the trained one (``ZeroAccelerator.prepare_model(
model, evaluation_mode=True)``, how TRL's GRPO, RLOO, online DPO, DPO and KTO prepare their
reference and reward models): at stage 3 a frozen engine of its own holds 1/N of it per rank,
with no gradient, no optimizer state and nothing trainable, and its forward and ``generate()``
equal the unsharded model's; below stage 3 it stays whole, as TRL's ``prepare_deepspeed``
keeps it at stages 1-2. Scenarios: tests/worlds/scenarios_frozen.py (2 gloo processes); the
trainers themselves: tests/integration/test_trl_online.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import check, run_world
from zero_strategy.config import ZeroConfig
from zero_strategy.integrations.accelerate.frozen import build_frozen, frozen_config


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_world("tests/worlds/scenarios_frozen.py", 2)


def test_reference_is_sharded_and_frozen_at_stage3(world2: dict) -> None:
    for r in check(world2["frozen_reference_at_stage3"]):
        assert r["type"] == "ZeroFrozenModel", r
        # The tiny GPT-2's flat units need no padding over 2 ranks: exactly half each.
        assert r["params_bytes"] * r["world"] == r["whole_bytes"], r
        assert (r["grads_bytes"], r["optimizer_bytes"], r["states"]) == (0, 0, 0), r
        # No whole copy left in the module: each parameter is a placeholder of one element
        # (a NaN scalar expanded to its shape) between gathers.
        assert r["module_storage_bytes"] <= 4 * r["param_tensors"], r
        assert r["trainable"] == 0 and not r["training_mode"], r


def test_reference_forward_and_generate_equal_the_unsharded_model(world2: dict) -> None:
    """The gathered weights are the unsharded model's, bit for bit, so the logits are the
    same computation; only the gathered buffer's alignment may steer the CPU kernel to
    another summation order (a few ulps: 1e-6 relative bounds it). Greedy tokens: equal."""
    for r in check(world2["frozen_reference_at_stage3"]):
        assert r["logits_max_diff"] <= 1e-6 * r["logits_scale"], r
        assert not r["logits_grad"], r
        assert r["tokens_equal"], r
        assert r["state_dict_equal"] and r["config_read"] and r["unwrapped"], r
        assert r["again_same"] and r["trained_again"], r


def test_reference_stays_whole_below_stage3(world2: dict) -> None:
    for r in check(world2["reference_below_stage3_stays_whole"]):
        assert not r["frozen"] and r["type"] == "GPT2LMHeadModel", r
        assert r["storage_bytes"] >= r["whole_bytes"], r


def test_placing_a_model_loaded_whole_copies_no_weight(world2: dict) -> None:
    """Accelerate names the CPU "cpu:0"; ``.to("cpu:0")`` on CPU tensors (which report
    "cpu") copies every parameter, which held a model loaded whole twice while its engine
    was built (issue 58: 96 MiB more for a 241 MiB GPT-2 under ZeroTrainer). Both the trained
    model and a reference are placed without a copy."""
    for r in check(world2["placement_copies_nothing"]):
        assert r["accelerator_device"] == "cpu:0", r  # what makes the case
        assert len(r["placed"]) == 2, r
        assert all(p["device"] == "cpu" and not p["copied"] for p in r["placed"]), r


def test_frozen_config_keeps_what_a_frozen_model_uses() -> None:
    """No optimizer states: the master shard is not offloaded unless the parameters rest on
    disk (whose tier needs both); a disk tier gets its own directory (each engine locks its
    own); nothing is checkpointed for a backward."""
    cpu = ZeroConfig(stage=3, offload_optimizer=True, offload_params=True,
                     activation_checkpointing=True, offload_activations="cpu")
    frozen = frozen_config(cpu, 0)
    assert (frozen.offload_optimizer, frozen.offload_params) == (False, True)
    assert not frozen.activation_checkpointing and not frozen.offload_activations
    assert frozen.stage == 3 and frozen.precision == cpu.precision
    disk = ZeroConfig(stage=3, offload_optimizer="disk", offload_params="disk",
                      offload_dir="/tmp/zs-offload")
    frozen = frozen_config(disk, 1)
    assert (frozen.offload_optimizer, frozen.offload_params) == ("disk", "disk")
    assert frozen.offload_dir == "/tmp/zs-offload/frozen1"
    assert frozen_config(ZeroConfig(stage=3, offload_optimizer="disk", offload_params="disk"),
                         0).offload_dir is None  # a fresh temporary directory of its own


def test_a_meta_model_without_weights_to_load_is_refused() -> None:
    """A frozen model is never trained: initialising a meta model (as the engine does for a
    trained one) would give a reference with random weights. Refused before any engine (or
    collective) exists; a deepcopy of a streamed model is the way to get one."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device with no pretrained weights"):
        build_frozen(model, ZeroConfig(stage=3), 0, None)
    assert model.weight.requires_grad  # refused before anything changed
