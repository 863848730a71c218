"""PEFT models in the engine's export (``checkpoint/export.py``): the adapter alone, as
``PeftModel.save_pretrained`` writes it, or the base model with its LoRA adapter merged into
the weights (``hub_weights(merge_lora=True)``: what an inference engine without adapter
support loads), then in transformers' hub layout (``hub_layout.py``).

Registered for every user by ``zero_strategy/__init__``; imports neither PEFT nor
transformers: a model of theirs means they are loaded already.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

from ...checkpoint.export import Group, HubLayout, Output, register_layout
from .hub_layout import TransformersLayout, _Traced, find_model

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


class PeftAdapterLayout:
    """The ``HubLayout`` of a PEFT model's adapter: PEFT's own selection and names."""

    prefix = ""
    weights_name = ADAPTER_WEIGHTS

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


class MergedLoraLayout:
    """A PEFT model's base transformers model with the active LoRA adapter merged into its
    weights, as ``merge_and_unload()`` computes it (``W + transpose(B @ A, fan_in_fan_out)
    * scaling``, at the masters' precision), then in transformers' hub layout."""

    def __init__(self, peft_model: nn.Module) -> None:
        adapter = peft_model.active_adapter
        if not isinstance(adapter, str):
            raise ValueError(f"merge_lora: several active adapters {adapter!r}; activate one "
                             "with model.set_adapter(name)")
        base = peft_model.base_model.model
        self.prefix = next(f"{n}." for n, m in peft_model.named_modules() if m is base)
        self.adapter = adapter
        self.inner = TransformersLayout(base, "")
        self.layers = _lora_layers(base, adapter)
        self._merged: dict[str, tuple[str, ...]] = {}

    def plan(self, tensors: dict[str, torch.Tensor]) -> list[Group]:
        merged: dict[str, torch.Tensor] = {}
        self._merged = {}
        for key, value in tensors.items():
            if "lora_" in key:
                continue  # folded into its base weight below (or another adapter's)
            name = key.replace(".base_layer.", ".")
            module = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
            if module in self.layers and key.endswith(".base_layer.weight"):
                self._merged[name] = (key, f"{module}.lora_A.{self.adapter}.weight",
                                      f"{module}.lora_B.{self.adapter}.weight")
            else:
                self._merged[name] = (key,)
            merged[name] = value
        return [Group(tuple(k for n in g.inputs for k in self._merged[n]), g.outputs)
                for g in self.inner.plan(merged)]

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged = {}
        for name, keys in self._merged.items():
            if keys[0] not in tensors:
                continue
            if len(keys) == 1:
                merged[name] = tensors[keys[0]]
                continue
            weight, a, b = (tensors[k] for k in keys)
            fan_in_fan_out, scaling = self.layers[keys[0].rsplit(".base_layer.", 1)[0]]
            delta = b @ a
            merged[name] = weight + (delta.T if fan_in_fan_out else delta) * scaling
        return self.inner.convert(merged)

    def aliases_to_drop(self, aliases: list[list[str]]) -> set[str]:
        renamed = [[k.replace(".base_layer.", ".") for k in keys] for keys in aliases]
        dropped = self.inner.aliases_to_drop(renamed)
        return {k for keys in aliases for k in keys if k.replace(".base_layer.", ".") in dropped}

    def extra_files(self, dtype: torch.dtype | None) -> dict[str, bytes]:
        return self.inner.extra_files(dtype)


def _lora_layers(model: nn.Module, adapter: str) -> dict[str, tuple[bool, float]]:
    """{module name: (fan_in_fan_out, scaling)} of the LoRA layers carrying ``adapter``;
    what a plain merge cannot reproduce is refused by name."""
    from peft.tuners.lora import layer as lora

    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, lora.LoraLayer) or adapter not in module.scaling:
            continue
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if (not isinstance(module, lora.Linear) or module.use_dora.get(adapter)
                or module.lora_bias.get(adapter) or variant is not None):
            raise ValueError(f"merge_lora: {name} is a {type(module).__name__} with "
                             f"adapter {adapter!r} (DoRA, a LoRA bias, an embedding or "
                             "convolution LoRA); only plain LoRA on Linear/Conv1D layers is "
                             "merged here: call hub_weights() without merge_lora and merge "
                             "on the receiving side")
        found[name] = (bool(module.fan_in_fan_out), float(module.scaling[adapter]))
    return found


def layout(module: nn.Module, merge_lora: bool = False) -> HubLayout | None:
    """PEFT's layouts for a PEFT model (its adapter, or merged with ``merge_lora``),
    transformers' for one of its models, else None."""
    if is_peft_model(module):
        if merge_lora:
            return MergedLoraLayout(module)
        return PeftAdapterLayout(module, _active(module))
    if merge_lora:
        return None
    found = find_model(module)
    return TransformersLayout(*found) if found is not None else None


def _active(model: nn.Module) -> str:
    adapter = model.active_adapter
    if not isinstance(adapter, str):
        raise ValueError(f"several active adapters {adapter!r}; activate one with "
                         "model.set_adapter(name)")
    return adapter


def register() -> None:
    """Make PEFT's and transformers' layouts known to the export (imports neither)."""
    register_layout(layout)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MergedLoraLayout", "PeftAdapterLayout",
           "is_peft_model", "layout", "register"]
