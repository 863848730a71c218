"""Peak host memory of building a stage-3 engine from a Qwen3-MoE folder whose experts are
saved one by one (transformers fuses them when it loads): streamed, each rank reading only the
experts' slices of its shards (``from_pretrained``), against ``Model.from_pretrained`` then the
engine; for tests/integration/test_pretrained_conversions_memory.py (fresh interpreters,
``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors go back to the system and each build's
high-water mark is its own).

``ZS_MOE_LAYERS`` sizes the model: 16 experts of 512 x 512 per projection, about 51 MB of
fp32 experts per layer."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import scenario


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_growth(build: Callable[[], zs.ZeroEngine]) -> tuple[float, zs.ZeroEngine]:
    """MiB the resident set grew by at its highest while ``build`` ran (VmHWM reset first)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_mib("VmRSS")
    engine = build()
    return _rss_mib("VmHWM") - base, engine


def _config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                          moe_intermediate_size=512, num_hidden_layers=int(
                              os.environ.get("ZS_MOE_LAYERS", "3")),
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          num_experts=16, num_experts_per_tok=2, max_position_embeddings=128)


def _folder() -> str:
    from transformers import Qwen3MoeForCausalLM

    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        path[0] = tempfile.mkdtemp(prefix="zs-pretrained-moe-mem-")
        Qwen3MoeForCausalLM(_config()).save_pretrained(path[0], max_shard_size="60MB")
    dist.broadcast_object_list(path, src=0)
    assert path[0] is not None
    return path[0]


def _shard_sum(engine: zs.ZeroEngine) -> float:
    return float(sum(u.param_store.master.double().sum() for u in engine.units))


@scenario
def peak_rss() -> dict[str, Any]:
    from transformers import Qwen3MoeForCausalLM

    from zero_strategy.checkpoint.pretrained import PretrainedFolder
    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = _folder()
    config = zs.ZeroConfig(stage=3)
    folder = PretrainedFolder(path)
    largest_source = max(torch.Size(folder.info(k)[1]).numel() for k in folder.keys())
    gc.collect()

    def streamed() -> zs.ZeroEngine:
        model = from_pretrained(Qwen3MoeForCausalLM, path)
        return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), config)

    def whole() -> zs.ZeroEngine:
        model = Qwen3MoeForCausalLM.from_pretrained(path)
        return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), config)

    streamed_mib, engine = _peak_growth(streamed)
    report = engine.memory_report()
    units = max(u.layout.padded_numel for u in engine.units)
    checksum = _shard_sum(engine)
    del engine
    dist.barrier()
    whole_mib, engine = _peak_growth(whole)
    same = checksum == _shard_sum(engine)
    del engine
    dist.barrier()
    return {
        "streamed_mib": streamed_mib, "whole_mib": whole_mib, "same_weights": same,
        "model_mib": report["num_params"] * 4 / 2**20,
        "shard_mib": report["total_bytes"] / 2**20,
        "largest_unit_mib": units * 4 / 2**20,
        "largest_source_mib": largest_source * 4 / 2**20,
        "files": len(folder.files),
    }
