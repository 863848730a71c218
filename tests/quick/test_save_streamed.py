"""``engine.save_pretrained``: a transformers folder written from the shards, a bucket at a
time, at every stage and N=1, 2, against plain ``save_pretrained`` of the same weights and
read back by transformers and by our streamed loader (tests/worlds/scenarios_save.py, one
process group per world size). Every comparison is bit for bit: the files hold the masters'
fp32 values copied, never recomputed."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.harness import check
from tests.support.save_worlds import world

pytest.importorskip("transformers")

SAVES = [f"gpt2_stage{s}" for s in range(4)] + [f"gpt2_indexed_stage{s}" for s in range(4)]
SAVES += ["moe_stage3", "moe_indexed_stage1"]


@pytest.fixture(scope="module")
def world2() -> dict:
    return world(2)


@pytest.fixture(scope="module")
def world1() -> dict:
    return world(1)


def _assert_saved(name: str, results: list[Any]) -> None:
    for rank, r in enumerate(check(results)):
        where = f"{name} rank {rank}"
        assert r["files"] == r["ref_files"], where
        assert r["differ_files"] == [], where
        assert r["differ_transformers"] == [], where
        # Our streamed loader reads it back through transformers' conversions (MoE too).
        assert r["differ_streamed"] == [], f"{where}: {r['differ_streamed']}"
        assert r["config_dtype"] == "float32", where
        if "weight_map_equal" in r:
            ours, theirs = r["metadata"]
            assert ours["total_parameters"] == theirs["total_parameters"], where
            if not name.startswith("moe"):  # see test_moe_keys_are_per_expert
                assert r["weight_map_equal"] and ours == theirs, where


@pytest.mark.parametrize("name", SAVES)
def test_saved_folder_is_save_pretrained_s(world2: dict, name: str) -> None:
    _assert_saved(name, world2[name])


@pytest.mark.parametrize("name", ["gpt2_stage3", "gpt2_indexed_stage1", "moe_stage3"])
def test_saved_folder_on_one_rank(world1: dict, name: str) -> None:
    _assert_saved(name, world1[name])


def test_indexed_save_splits_as_save_pretrained(world2: dict) -> None:
    for r in check(world2["gpt2_indexed_stage3"]):
        shards = [f for f in r["files"] if f.startswith("model-")]
        assert len(shards) > 2 and "model.safetensors.index.json" in r["files"]


def test_moe_keys_are_per_expert(world2: dict) -> None:
    """The fused 3-D experts go out as transformers' hub keys: the same key set and tensors
    as plain save_pretrained (file split aside: save_pretrained counts the fused tensor's
    storage once for all its per-expert views and keeps them in one file)."""
    for r in check(world2["moe_stage3"]):
        assert r["differ_files"] == [] and r["files"] == r["ref_files"]


def test_failure_leaves_nothing(world2: dict, world1: dict) -> None:
    for r in check(world2["failure_leaves_nothing"]) + check(
            world1["failure_leaves_nothing"]):
        assert "nothing was saved" in r["raised"] and "rank 0" in r["raised"]
        assert r["left"] == []


def test_save_into_existing_folder_replaces_weights_only(world2: dict) -> None:
    for r in check(world2["save_into_existing_folder"]):
        assert r["files"] == ["config.json", "generation_config.json", "model.safetensors",
                              "trainer_state.json"]
        assert r["names_equal"] and r["differ"] == []


def test_accelerate_save_model_streams_the_state_dict(world2: dict) -> None:
    for r in check(world2["accelerate_save_model"]):
        assert r["keys"] == r["expected"] and r["differ"] == [] and r["indexed"]


def test_a_wrapped_transformers_model_is_exported_alone(world2: dict) -> None:
    for r in check(world2["wrapped_model_save"]):
        assert r["keys_equal"] and r["differ"] == []


def test_dtype_casts_and_the_config_records_it(world2: dict) -> None:
    for r in check(world2["save_as_bf16"]):
        assert r["config_dtype"] == "bfloat16" and r["dtypes"] == ["torch.bfloat16"]
        assert r["differ"] == []
