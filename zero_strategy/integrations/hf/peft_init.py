"""PEFT adapters added to a model on the meta device: a model from the streamed
``from_pretrained`` wrapped by ``get_peft_model`` (or by a trainer given ``peft_config``).

PEFT builds each adapter on the CPU, initialises it, and then moves it to its base layer's
device. For a streamed model that device is meta, so PEFT's values are gone. Before the
engine materialises such a model, each adapter module gets PEFT's init rule for its adapter's
``init_lora_weights``:
- ``True``: A as ``nn.Linear``'s default (``kaiming_uniform_``, a=sqrt(5)), B zero.
- ``"gaussian"``: A normal with std 1/r, B zero.
- ``False``: both as constructed.
- Embeddings: A zero, B standard normal.
B's bias, with ``lora_bias``, starts at zero.

So the model starts exactly at the base model, as PEFT's does. A is a fresh draw from the
generator when the engine is built, not the one PEFT made, so a streamed run and a run
loaded whole differ in A's values (and only there): docs/pretrained.md says this.

Refused by name: inits that need the base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...),
LoRA variants (DoRA's magnitude, ...), tuners other than LoRA, and PEFT's copies of base
modules (``modules_to_save``, trainable tokens), whose loaded values a copy on meta has lost.

Registered for every user by ``zero_strategy/__init__``; imports neither PEFT nor
transformers: a model of theirs means they are loaded already.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...core.materialize import register_preparer, set_module_init

RULES = (True, False, "gaussian")
"""The ``init_lora_weights`` values applied here, without the base weights."""


def _is_meta(item: nn.Module | torch.Tensor) -> bool:
    if isinstance(item, torch.Tensor):
        return item.is_meta
    return any(p.is_meta for p in item.parameters())


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(
        f"{where}: {what} cannot be initialised on a model streamed by "
        "zero_strategy.transformers.from_pretrained (PEFT moved it onto the meta device, "
        "where its values are lost, and the base weights are read only into the shards). "
        f"Allowed: LoRA adapters with init_lora_weights in {list(RULES)} and no variant; "
        "otherwise load the model with Model.from_pretrained before wrapping it")


def _linear_a(init: Any, r: int) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if init is True:
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif init == "gaussian":
            nn.init.normal_(module.weight, std=1 / r)
        else:
            module.reset_parameters()
    return apply


def _linear_b(init: Any) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if init is False:
            module.reset_parameters()
            return
        nn.init.zeros_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    return apply


def _embedding(rules: dict[str, Callable[[torch.Tensor], Any]]) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        for adapter, rule in rules.items():
            rule(module[adapter])
    return apply


def _init_of(where: str, adapter: str, configs: dict[str, Any]) -> Any:
    """The adapter's ``init_lora_weights`` as one of ``RULES`` (a string lower-cased), or a
    refusal naming what needs the base weights."""
    config = configs.get(adapter)
    if config is None:
        raise _refuse(f"{where} adapter {adapter!r}", "an adapter without a config in its "
                      "PeftModel")
    init = config.init_lora_weights
    if getattr(config, "use_dora", False):
        raise _refuse(f"{where} adapter {adapter!r}", "use_dora=True (DoRA's magnitude is "
                      "the base weight's norm)")
    if not any(init is rule or (isinstance(init, str) and init.lower() == rule)
               for rule in RULES):
        raise _refuse(f"{where} adapter {adapter!r}", f"init_lora_weights={init!r}")
    return init.lower() if isinstance(init, str) else init


def _meta_adapters(layer: nn.Module) -> list[str]:
    return sorted({a for attr in getattr(layer, "adapter_layer_names", ())
                   for a, item in getattr(layer, attr, {}).items() if _is_meta(item)})


def _prepare_layer(where: str, layer: nn.Module, configs: dict[str, Any], peft: Any) -> None:
    adapters = _meta_adapters(layer)
    if not adapters:
        return
    if not isinstance(layer, peft.tuners.lora.LoraLayer):
        raise _refuse(where, f"a {type(layer).__name__} adapter (a tuner other than LoRA)")
    embedding_a, embedding_b = {}, {}
    for adapter in adapters:
        init = _init_of(where, adapter, configs)
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise _refuse(f"{where} adapter {adapter!r}", f"the LoRA variant "
                          f"{type(variant).__name__}")
        if adapter in layer.lora_A:
            set_module_init([layer.lora_A[adapter]], _linear_a(init, layer.r[adapter]))
            set_module_init([layer.lora_B[adapter]], _linear_b(init))
        if adapter in layer.lora_embedding_A:
            embedding_a[adapter] = nn.init.normal_ if init is False else nn.init.zeros_
            embedding_b[adapter] = nn.init.normal_
    if embedding_a:
        set_module_init([layer.lora_embedding_A], _embedding(embedding_a))
        set_module_init([layer.lora_embedding_B], _embedding(embedding_b))


def prepare(model: nn.Module) -> None:
    """Register PEFT's init for every adapter of ``model`` on meta; refuse what has none."""
    peft = sys.modules.get("peft")
    if peft is None:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    seen: set[int] = set()
    for wrapper in (m for m in model.modules() if isinstance(m, peft.PeftModel)):
        for name, layer in wrapper.named_modules():
            if isinstance(layer, BaseTunerLayer) and id(layer) not in seen:
                seen.add(id(layer))
                _prepare_layer(name, layer, wrapper.peft_config, peft)
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper) and _is_meta(module):
            raise _refuse(name, f"PEFT's {type(module).__name__} (modules_to_save or "
                          "trainable tokens: a copy of a base module; train the module "
                          "itself with requires_grad instead)")
        if isinstance(module, BaseTunerLayer) and id(module) not in seen and \
                _meta_adapters(module):
            raise _refuse(name, "an adapter outside a PeftModel (its init_lora_weights is "
                          "unknown; wrap the model with get_peft_model)")


def register() -> None:
    register_preparer(prepare)


__all__ = ["RULES", "prepare", "register"]
