"""Peak host memory of saving a stage-3 engine: ``engine.save_pretrained`` (streamed from the
shards) against ``engine.full_state_dict()`` (the whole model on every rank), for
tests/integration/test_save_memory.py (fresh interpreters, ``MALLOC_MMAP_THRESHOLD_`` set so
that freed tensors go back to the system and each phase's high-water mark is its own).

``ZS_SAVE_LAYERS`` sizes the GPT-2 (width 512, vocabulary 8192: 24 layers are about 330 MB
in fp32)."""

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

BUCKET = 16 * 2**20


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_growth(run: Callable[[], Any]) -> tuple[float, Any]:
    """MiB the resident set grew by at its highest while ``run`` ran (VmHWM reset first)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_mib("VmRSS")
    out = run()
    return _rss_mib("VmHWM") - base, out


def _shared(make: Callable[[], str] | None = None) -> str:
    path = [make() if dist.get_rank() == 0 and make else
            tempfile.mkdtemp(prefix="zs-save-mem-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def _folder() -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    def make() -> str:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=8192, n_positions=256, n_embd=512, n_head=8,
                            n_layer=int(os.environ.get("ZS_SAVE_LAYERS", "24")))
        path = tempfile.mkdtemp(prefix="zs-save-mem-src-")
        GPT2LMHeadModel(config).save_pretrained(path)
        return path

    return _shared(make)


@scenario
def peak_rss() -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    source = _folder()
    model = from_pretrained(GPT2LMHeadModel, source)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), zs.ZeroConfig(stage=3))
    report = engine.memory_report()
    largest = max(s.numel for u in engine.units for s in u.layout.slots) * 4
    out = Path(_shared()) / "saved"
    dist.barrier()
    saved_mib, _ = _peak_growth(lambda: engine.save_pretrained(out, bucket_bytes=BUCKET))
    dist.barrier()
    whole_mib, full = _peak_growth(engine.full_state_dict)
    # The engine has not stepped, so every rank's read of the saved folder, and the whole
    # state it consolidated, must be the source folder's weights as plain transformers
    # reads them, bit for bit (fp32 copied, never computed).
    source_state = GPT2LMHeadModel.from_pretrained(source).state_dict()
    saved_state = GPT2LMHeadModel.from_pretrained(out).state_dict()
    same = (saved_state.keys() == source_state.keys() == full.keys()
            and all(torch.equal(v, source_state[k]) and torch.equal(full[k], source_state[k])
                    for k, v in saved_state.items()))
    del full, source_state, saved_state
    dist.barrier()
    return {"saved_mib": saved_mib, "whole_mib": whole_mib, "same_weights": same,
            "model_mib": report["num_params"] * 4 / 2**20,
            "largest_tensor_mib": largest / 2**20, "bucket_mib": BUCKET / 2**20}
