"""Models prepared for evaluation only beside the trained one (``accelerator.prepare_model(
model, evaluation_mode=True)``): TRL's reference models, reward models and teachers.

At stage 3 such a model is sharded like the trained one, by an engine of its own that never
steps: every parameter frozen (``requires_grad=False``), held by a placeholder optimizer
(SGD at lr 0, which keeps no state) only because the engine shards what an optimizer holds,
so each rank keeps 1/N of the weights, no gradient and no optimizer state. Its forward runs
under ``torch.no_grad()`` and gathers unit by unit as the trained model's does; its
``generate()`` runs in the engine's generation mode. This is what TRL's ``prepare_deepspeed``
does under DeepSpeed (a ZeRO-3 engine without optimizer for the reference model at stage 3,
a plain replica at stages 1-2), and stages 0-2 here leave the model to Accelerate (whole on
every rank, as the trained model's parameters are).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from ...checkpoint import pretrained as checkpoint_pretrained
from ...config import ZeroConfig
from ...core.devices import canonical_device
from ...engine import ZeroEngine
from .models import ZeroFrozenModel


def frozen_config(config: ZeroConfig, index: int) -> ZeroConfig:
    """The trained model's options for a frozen one: stage 3 as given, less what only
    training uses. No optimizer states exist, so the master shard is not offloaded (unless
    the parameters rest on disk, which needs the disk tier of both); a disk tier gets a
    directory of its own (each engine locks its directory); no activation checkpointing
    (nothing is kept for a backward)."""
    disk = config.offload_params == "disk"
    offload_dir = config.offload_dir
    if disk and offload_dir is not None:
        offload_dir = os.path.join(offload_dir, f"frozen{index}")
    return dataclasses.replace(
        config, offload_optimizer=config.offload_optimizer if disk else False,
        offload_dir=offload_dir, activation_checkpointing=False, offload_activations=False)


def build_frozen(model: nn.Module, config: ZeroConfig, index: int,
                 device: torch.device | None) -> ZeroFrozenModel:
    """``model`` frozen, in eval mode, sharded by an engine of its own (see the module)."""
    if not any(True for _ in model.parameters()):
        raise ValueError(f"prepare_model(evaluation_mode=True) got a {type(model).__name__} "
                         "without parameters: nothing to shard")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not checkpoint_pretrained.pending(model):
        # The engine would initialise it (reset_parameters): a reference or reward model with
        # random weights, silently. E.g. a deepcopy of a model streamed by from_pretrained
        # (TRL's create_reference_model) is on meta without its folder.
        raise ValueError(
            f"prepare_model(evaluation_mode=True) got a {type(model).__name__} on the meta "
            "device with no pretrained weights to load: build it with "
            "zero_strategy.transformers.from_pretrained (not a copy of such a model), or "
            "with real weights")
    model.requires_grad_(False)
    model.eval()
    placeholder = torch.optim.SGD(model.parameters(), lr=0.0)
    if device is not None and not on_meta:
        model.to(canonical_device(device))  # "cpu:0" would copy every weight (accelerator.py)
    engine = ZeroEngine(model, placeholder, frozen_config(config, index))
    wrapper = ZeroFrozenModel(engine)
    wrapper._is_accelerate_prepared = True
    return wrapper


__all__ = ["ZeroFrozenModel", "build_frozen", "frozen_config"]
