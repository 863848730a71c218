"""Saving a transformers or PEFT model trained by the engine, streamed from the shards: what
``Trainer.save_model``, ``Accelerator.save_model`` and their checkpoints write, through the
engine's ``save_pretrained`` (``checkpoint/save_hub.py``).

A PEFT model saves what ``PeftModel.save_pretrained`` saves: its adapter's weights in
``adapter_model.safetensors`` under PEFT's names (``get_peft_model_state_dict``, run on meta
tensors to learn the names, so the adapter is gathered a bucket at a time like any model) and
``adapter_config.json``; any other model what ``save_pretrained`` saves (the hub's layout,
``hub_layout.py``), or for a plain ``nn.Module`` its state dict as ``model.safetensors``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...checkpoint.export import DEFAULT_BUCKET_BYTES
from ...checkpoint.save_hub import save_hub
from .peft_layout import ADAPTER_WEIGHTS, PeftAdapterLayout, is_peft_model


def save_model(engine: Any, folder: str | os.PathLike, *, writer: int = 0,
               max_shard_size: int | str = "50GB",
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """The engine's model into ``folder`` as its own ``save_pretrained`` writes it (a
    collective; rank ``writer`` writes)."""
    if is_peft_model(engine.module):
        return save_adapter(engine, folder, writer=writer, bucket_bytes=bucket_bytes)
    return engine.save_pretrained(folder, max_shard_size=max_shard_size, writer=writer,
                                  bucket_bytes=bucket_bytes)


def save_adapter(engine: Any, folder: str | os.PathLike, *, writer: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """The active adapter of the engine's PEFT model, as ``PeftModel.save_pretrained``
    writes it into ``folder`` (one file, unsharded, as PEFT writes it)."""
    model = engine.module
    adapter = model.active_adapter
    if not isinstance(adapter, str):
        raise ValueError(f"save_adapter: several active adapters {adapter!r}; activate one "
                         "with model.set_adapter(name)")
    engine.check_open("save_pretrained")
    return save_hub(engine, folder, max_shard_bytes=2**62, bucket_bytes=bucket_bytes,
                    writer=writer, layout=PeftAdapterLayout(model, adapter),
                    weights=ADAPTER_WEIGHTS)


__all__ = ["save_adapter", "save_model"]
