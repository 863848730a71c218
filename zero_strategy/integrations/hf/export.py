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

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...checkpoint.export import DEFAULT_BUCKET_BYTES, Group, Output
from ...checkpoint.save_hub import save_hub
from .hub_layout import _Traced

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def save_model(engine: Any, folder: str | os.PathLike, *, writer: int = 0,
               max_shard_size: int | str = "50GB",
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """The engine's model into ``folder`` as its own ``save_pretrained`` writes it (a
    collective; rank ``writer`` writes)."""
    if is_peft_model(engine.module):
        return save_adapter(engine, folder, writer=writer, bucket_bytes=bucket_bytes)
    return engine.save_pretrained(folder, max_shard_size=max_shard_size, writer=writer,
                                  bucket_bytes=bucket_bytes)


class PeftAdapterLayout:
    """The ``HubLayout`` of a PEFT model's adapter: PEFT's own selection and names."""

    prefix = ""

    def __init__(self, model: nn.Module, adapter: str) -> None:
        self.model = model
        self.adapter = adapter
        self._names: dict[str, str] = {}

    def plan(self, tensors: dict[str, torch.Tensor]) -> list[Group]:
        from peft.utils import get_peft_model_state_dict

        traced = {k: _Traced(t, frozenset([k])) for k, t in tensors.items()}
        picked = get_peft_model_state_dict(self.model, state_dict=traced,
                                           adapter_name=self.adapter)
        groups = []
        for name, value in picked.items():
            (source,) = value.sources
            self._names[source] = name
            groups.append(Group((source,), (Output(name, tuple(value.shape), value.dtype),)))
        return groups

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self._names[k]: v for k, v in tensors.items()}

    def aliases_to_drop(self, aliases: list[list[str]]) -> set[str]:
        return set()  # PEFT writes a tied adapter weight under each name

    def extra_files(self, dtype: torch.dtype | None) -> dict[str, bytes]:
        """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it."""
        config = copy.deepcopy(self.model.peft_config[self.adapter])
        if config.base_model_name_or_path is None:
            base = self.model.base_model if config.is_prompt_learning \
                else self.model.base_model.model
            config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
        config.inference_mode = True
        out = config.to_dict()
        if config.task_type is None:
            base_class = self.model._get_base_model_class(
                is_prompt_tuning=config.is_prompt_learning)
            out["auto_mapping"] = {"base_model_class": base_class.__name__,
                                   "parent_library": base_class.__module__}
        out = {k: list(v) if isinstance(v, set) else v for k, v in out.items()}
        return {ADAPTER_CONFIG: json.dumps(out, indent=2, sort_keys=True).encode()}


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


__all__ = ["PeftAdapterLayout", "is_peft_model", "save_adapter", "save_model"]
