"""A transformers model config for ``zero-strategy estimate --model-config`` (and ``link``):
read from a ``config.json`` (or the folder holding one), and the model it builds on the meta
device, so that nothing is allocated."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoConfig
from transformers.utils import logging as hf_logging


def load_config(path: str) -> Any:
    hf_logging.set_verbosity_error()  # a config's token ids outside a small vocabulary
    return AutoConfig.from_pretrained(path)


def build_meta_model(config: Any, model_class: str) -> torch.nn.Module:
    """Transformers' ``model_class`` built from ``config`` on the meta device."""
    with torch.device("meta"):
        return getattr(transformers, model_class)(config)


def count_parameters(config: Any, model_class: str) -> int:
    """The parameter count of transformers' ``model_class`` built from ``config``."""
    return sum(p.numel() for p in build_meta_model(config, model_class).parameters())
