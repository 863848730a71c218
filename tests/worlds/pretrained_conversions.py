"""Folders that transformers converts when it loads them (MoE experts saved one by one and
fused in the model, fused projections split), streamed into the shards by
``zero_strategy.integrations.hf.pretrained.from_pretrained`` against ``Model.from_pretrained``
+ the same engine; for tests/quick/test_pretrained_conversions.py (tests/support/harness.py
runs it at N=1, 2 and 3, ``ZS_ONLY`` picking the scenarios).

Comparisons are bit for bit: both sides read the same bytes and only rearrange and cast them
(the same cast, elementwise), so there is no tolerance to argue.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import register, scenario

_FOLDERS: dict[str, str] = {}


def _config(stage: int, precision: str = "32-true") -> zs.ZeroConfig:
    if stage == 3:  # small units: each fused expert tensor split over ranks and units
        return zs.ZeroConfig(stage=3, precision=precision, unit_numel=2000,
                             param_persistence_threshold=0)
    return zs.ZeroConfig(stage=stage, precision=precision, bucket_numel=3000)


def _save_all(root: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    qwen = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                             moe_intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=6, num_experts_per_tok=2, max_position_embeddings=64)
    model = tf.Qwen3MoeForCausalLM(qwen)
    model.save_pretrained(root / "qwen3moe")
    model.save_pretrained(root / "qwen3moe_indexed", max_shard_size="20KB")
    mixtral = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=40,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=5,
                               num_experts_per_tok=2, max_position_embeddings=64)
    tf.MixtralForCausalLM(mixtral).save_pretrained(root / "mixtral", max_shard_size="30KB")
    hrm = tf.HrmTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64)
    tf.HrmTextForCausalLM(hrm).save_pretrained(root / "hrm")


def folders() -> dict[str, str]:
    """Every folder, written once by rank 0, its path agreed on by every rank."""
    if not _FOLDERS:
        root = [None]
        if dist.get_rank() == 0:
            root[0] = tempfile.mkdtemp(prefix="zs-pretrained-conv-")
            _save_all(Path(root[0]))
        dist.broadcast_object_list(root, src=0)
        assert root[0] is not None
        _FOLDERS.update({p.name: str(p) for p in Path(root[0]).iterdir()})
    return _FOLDERS


def _engine(model: nn.Module, config: zs.ZeroConfig) -> zs.ZeroEngine:
    return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in b if k not in a or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k], b[k]))


def parity(folder: str, cls: str, stage: int, precision: str = "32-true",
           **kwargs: Any) -> dict[str, Any]:
    import transformers as tf

    from zero_strategy.checkpoint.conversions import Node
    from zero_strategy.checkpoint.pretrained import module_entries, resolve, spec_of
    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path, model_class = folders()[folder], getattr(tf, cls)
    ref, ref_info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    model, info = from_pretrained(model_class, path, output_loading_info=True, **kwargs)
    spec = spec_of(model)
    assert spec is not None
    converted = sum(isinstance(v, Node) for v in resolve(
        module_entries(model), spec.folder, spec.key_map).sources.values())
    plain = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    theirs = _engine(ref, _config(stage, precision)).full_state_dict()
    ours = _engine(model, _config(stage, precision)).full_state_dict()
    return {
        "converted": converted, "files": len(spec.folder.files), "loaded": spec.loaded,
        "keys_equal": sorted(ours) == sorted(theirs), "differ": _differ(ours, theirs),
        "differ_plain": sorted(k for k in plain
                               if not torch.equal(ours[k], plain[k].to(ours[k].dtype))),
        "missing": sorted(info["missing_keys"]), "ref_missing": sorted(ref_info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "ref_unexpected": sorted(ref_info["unexpected_keys"]),
    }


for _stage in range(4):
    register(f"qwen3moe_stage{_stage}", parity, folder="qwen3moe",
             cls="Qwen3MoeForCausalLM", stage=_stage)
    register(f"qwen3moe_indexed_stage{_stage}", parity, folder="qwen3moe_indexed",
             cls="Qwen3MoeForCausalLM", stage=_stage)
    register(f"mixtral_stage{_stage}", parity, folder="mixtral", cls="MixtralForCausalLM",
             stage=_stage)
    register(f"hrm_stage{_stage}", parity, folder="hrm", cls="HrmTextForCausalLM",
             stage=_stage)
register("qwen3moe_base_from_head", parity, folder="qwen3moe", cls="Qwen3MoeModel", stage=3)
register("qwen3moe_indexed_bf16_stage3", parity, folder="qwen3moe_indexed",
         cls="Qwen3MoeForCausalLM", stage=3, precision="bf16-true", dtype=torch.bfloat16)


@scenario
def load_pretrained_into_engine() -> dict[str, Any]:
    """``engine.load_pretrained`` over an engine holding other weights (the staged path, not
    the read into place): every converted range replaces what was there."""
    import transformers as tf

    from zero_strategy.integrations.hf.pretrained import key_map_for

    path = folders()["qwen3moe_indexed"]
    ref = tf.Qwen3MoeForCausalLM.from_pretrained(path)
    torch.manual_seed(5)
    fresh = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig.from_pretrained(path))
    engine = _engine(fresh, _config(3))
    before = engine.full_state_dict()
    result = engine.load_pretrained(path, key_map=key_map_for(fresh))
    ours = engine.full_state_dict()
    theirs = {k: v.detach() for k, v in ref.state_dict().items()}
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "differ": _differ(ours, theirs),
            "changed": sum(not torch.equal(before[k], ours[k]) for k in ours)}
