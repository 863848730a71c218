"""``engine.hub_weight_buckets`` / ``hub_weights``: the model's weights in the hub's names and
layout, a bounded bucket at a time, whole on the receiving rank(s) only: loaded into a plain
model with ``load_state_dict(strict=False)`` they equal the trained weights bit for bit
(tests/worlds/scenarios_save.py, in the worlds test_save_streamed.py also uses)."""

from __future__ import annotations

import pytest

from tests.support.harness import check
from tests.support.save_worlds import world

pytest.importorskip("transformers")

CASES = ["iter_gpt2_stage3_rank0", "iter_gpt2_stage2_all", "iter_gpt2_stage0_rank0",
         "iter_moe_stage3_all"]


@pytest.mark.parametrize(("name", "size"), [(name, 2) for name in CASES] + [
    ("iter_gpt2_stage3_rank0", 1), ("iter_moe_stage3_all", 1)])
def test_receivers_load_the_trained_weights(name: str, size: int) -> None:
    for rank, r in enumerate(check(world(size)[name])):
        where = f"{name} N={size} rank {rank}"
        if not r["mine"]:  # nothing gathered onto a rank that does not receive
            assert r["received"] == 0, where
            continue
        assert r["names_equal"], where  # exactly the keys plain save_pretrained writes
        # ... holding exactly the values it writes for the consolidated masters (for the MoE,
        # the per-expert tensors transformers' own conversion splits the fused ones into)
        assert r["hub_differ"] == [], (where, r["hub_differ"])
        if "loaded_differ" in r:
            assert r["loaded_differ"] == [] and r["unexpected"] == [], where
            # what save_pretrained leaves out: the tied head, re-tied by the model
            assert r["missing"] in ([], ["lm_head.weight"]), where
        # Over the limit only where a bucket is one tensor larger than it (GPT-2's
        # embedding, 96 x 32 fp32 = 12288 bytes) or one conversion group (a fused MoE
        # projection's per-expert weights: one layer's experts, one projection).
        for names in r["over"]:
            assert len(names) == 1 or len({_group(n) for n in names}) == 1, (where, names)
        assert r["buckets"] > 1, where


def _group(name: str) -> str:
    """``model.layers.0.mlp.experts.3.gate_proj.weight`` -> ``model.layers.0.mlp.experts``
    (the fused tensor it came from: gate and up are one, ``gate_up_proj``)."""
    head, _, tail = name.partition(".experts.")
    return head + (".down" if "down_proj" in tail else ".gate_up")


def test_only_the_named_rank_receives() -> None:
    for rank, r in enumerate(check(world(2)["iter_to_last_rank"])):
        assert (r["count"] > 0) == r["is_last"], f"rank {rank}"


def test_lora_adapter_saved_as_peft_and_merged_as_merge_and_unload() -> None:
    for rank, r in enumerate(check(world(2)["peft_adapter_and_merged"])):
        where = f"rank {rank}: {r}"
        assert r["lora_trained"], where  # B is zero at init: the merge would be trivial
        assert r["files"] == ["adapter_config.json", "adapter_model.safetensors"], where
        assert r["adapter_differ"] == [] and r["config_equal"], where
        assert r["merged_differ"] == [], where
