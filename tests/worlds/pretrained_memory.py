"""Peak host memory of building a stage-3 engine from pretrained weights: streamed into the
shards (``zero_strategy.integrations.hf.pretrained.from_pretrained``) against
``Model.from_pretrained`` then the engine, for tests/quick/test_pretrained.py (run in fresh
interpreters by tests/support/harness.py, ``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors
go back to the system and the high-water mark of each build is its own).

``ZS_PRETRAINED_LAYERS`` sizes the GPT-2 (8 layers of width 512: 118 MB in fp32; the
integration tier runs a bigger one)."""

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
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    base = _rss_mib("VmRSS")
    engine = build()
    return _rss_mib("VmHWM") - base, engine


def _folder() -> str:
    """A GPT-2 saved by save_pretrained on rank 0, its path agreed on by every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers = int(os.environ.get("ZS_PRETRAINED_LAYERS", "8"))
    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=8192, n_positions=256, n_embd=512, n_layer=layers,
                            n_head=8)
        path[0] = tempfile.mkdtemp(prefix="zs-pretrained-mem-")
        GPT2LMHeadModel(config).save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    assert path[0] is not None
    return path[0]


def _shard_sum(engine: zs.ZeroEngine) -> float:
    """This rank's masters, summed in a fixed order: equal for two engines of one layout
    holding the same weights (tests/quick/test_pretrained.py compares them bit for bit)."""
    return float(sum(u.param_store.master.double().sum() for u in engine.units))


@scenario
def peak_rss() -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = _folder()
    config = zs.ZeroConfig(stage=3)
    gc.collect()

    def streamed() -> zs.ZeroEngine:
        model = from_pretrained(GPT2LMHeadModel, path)
        return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), config)

    def whole() -> zs.ZeroEngine:
        model = GPT2LMHeadModel.from_pretrained(path)
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
    }
