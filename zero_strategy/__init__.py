"""zero_strategy: ZeRO (arXiv:1910.02054) written from scratch on PyTorch's collectives."""

from ._registration import install as _install_strategy_names
from .checkpoint import CheckpointError
from .combined import CombinedOptimizer
from .config import LossScaleConfig, ZeroConfig
from .engine import ZeroEngine
from .memory import MemoryEstimate, estimate_memory
from .reshard import consolidate, write_consolidated
from .runtime import GatherOrderError

_install_strategy_names()  # zero1 ... zero3_offload for Lightning's Trainer and Fabric

__all__ = [
    "CheckpointError", "CombinedOptimizer", "GatherOrderError", "LossScaleConfig",
    "MemoryEstimate", "ZeroConfig", "ZeroEngine",
    "consolidate", "estimate_memory", "write_consolidated",
]
__version__ = "0.1.0"
