"""zero_strategy: ZeRO (arXiv:1910.02054) written from scratch on PyTorch's collectives.

The public API is what this module exports, plus the framework entry points
``zero_strategy.lightning``, ``zero_strategy.fabric`` and ``zero_strategy.accelerate``.
Layers, top to bottom (``docs/architecture.md``): ``integrations`` -> ``engine`` ->
``checkpoint`` / ``optim`` / ``offload`` -> ``core`` -> ``comm`` -> ``config``.
"""

from .checkpoint.convert import convert
from .checkpoint.errors import CheckpointError
from .checkpoint.read import consolidate, open_reader, write_consolidated
from .config import LossScaleConfig, ZeroConfig
from .core.gather_order import GatherOrderError
from .core.materialize import meta_init
from .engine import ZeroEngine
from .integrations.hf import activations as _hf_activations
from .integrations.hf import peft_init as _hf_peft_init
from .integrations.hf import peft_layout as _hf_layouts
from .integrations.registration import register_if_lightning_imported, register_strategies
from .memory import (
    ActivationEstimate,
    BlockActivations,
    MemoryEstimate,
    estimate_activations,
    estimate_memory,
)
from .optim.combined import CombinedOptimizer

# Lightning has no entry point for strategy names: if this process has imported Lightning,
# zero1 ... zero3_offload are registered for Trainer and Fabric now; otherwise by importing
# zero_strategy.lightning / .fabric or calling register_strategies() (registration.py).
register_if_lightning_imported()
# transformers' layers checkpoint through their own switch; the core learns of them here, for
# every user, without importing transformers (integrations/hf/activations.py).
_hf_activations.register()
# ... and its hub layout (reverse weight conversions, tied weights) reaches the export here.
_hf_layouts.register()
# PEFT's adapters added to a model on meta (a streamed from_pretrained) get PEFT's init.
_hf_peft_init.register()

__all__ = [
    "ActivationEstimate", "BlockActivations", "CheckpointError", "CombinedOptimizer",
    "GatherOrderError", "LossScaleConfig",
    "MemoryEstimate", "ZeroConfig", "ZeroEngine",
    "consolidate", "convert", "estimate_activations", "estimate_memory", "meta_init",
    "open_reader",
    "register_strategies", "write_consolidated",
]
__version__ = "0.1.0"
