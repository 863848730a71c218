"""Sharded checkpoints: exact resume, loading on other world sizes and stages, damage."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = {"ZS_CKPT_ROOT": str(tmp_path_factory.mktemp("ckpt"))}
    out = {}
    for n in (2, 3, 1):  # 2 writes, 3 and 1 read what 2 wrote
        out.update(run_world("tests/worlds/scenarios_checkpoint.py", n, env=env))
    return out


@pytest.mark.parametrize("name", ["resume_stage1", "resume_stage2", "resume_stage3",
                                  "resume_stage3_offload", "resume_stage2_bf16",
                                  "resume_stage1_fp16"])
def test_resume_is_bit_exact(worlds: dict, name: str) -> None:
    for r in check(worlds[name]):
        assert r["resumed"] == r["losses"], "resumed losses differ from the uninterrupted run"
        assert r["weights_equal"], "resumed weights differ from the uninterrupted run"
        assert r["client"] == {"epoch": 3, "note": "hello"}
        assert r["global_step"] == 6 and r["latest"] == "step-00000003"


@pytest.mark.parametrize("name", ["load_n3_stage2", "load_n3_stage3", "load_n1_stage0",
                                  "load_n1_stage3"])
def test_checkpoint_loads_on_other_world_size_and_stage(worlds: dict, name: str) -> None:
    check(worlds["write_cross"])
    for r in check(worlds[name]):
        assert r["weights_equal"], "weights after loading differ from the saved ones"
        assert r["states_equal"], "Adam states after loading differ from the saved ones"
        assert r["global_step"] == 5 and all(x == x for x in r["losses"])


@pytest.mark.parametrize("name", ["load_v2_n3_stage1", "load_v2_n1_stage3"])
def test_format_v2_checkpoints_still_load(worlds: dict, name: str) -> None:
    """Format 3 aligned every rank's shard to 64 bytes; a v2 checkpoint (unaligned shard
    sizes) still loads exactly on another world size and stage."""
    assert all(r["unaligned_units"] > 0 for r in check(worlds["write_v2"])), \
        "the v2 checkpoint would not exercise the old layout"
    for r in check(worlds[name]):
        assert r["weights_equal"] and r["states_equal"]
        assert r["global_step"] == 5 and all(x == x for x in r["losses"])


def test_damaged_checkpoints_name_the_problem(worlds: dict) -> None:
    out = check(worlds["damaged"])[0]
    assert "damaged-truncated/shard-00001.safetensors" in out["truncated"]
    assert "truncated" in out["truncated"]
    assert "damaged-corrupted/shard-00000.safetensors" in out["corrupted"]
    assert "sha256" in out["corrupted"]
    assert "shard-00001.safetensors: missing" in out["missing"]
    msg = out["other_model"]
    assert "different model" in msg and "damaged-other_model" in msg
    assert "12 sharded parameters of this model missing from the checkpoint" in msg
    assert "checkpoint parameters this model does not have (e.g. transformer." in msg
    assert "manifest.json" in out["no_manifest"]
