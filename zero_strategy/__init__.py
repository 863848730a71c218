"""zero_strategy: ZeRO (arXiv:1910.02054) from scratch on torch.distributed."""

from .checkpoint import CheckpointError
from .config import LossScaleConfig, ZeroConfig
from .engine import ZeroEngine
from .memory import MemoryEstimate, estimate_memory
from .reshard import consolidate, write_consolidated

__all__ = [
    "CheckpointError", "LossScaleConfig", "MemoryEstimate", "ZeroConfig", "ZeroEngine",
    "consolidate", "estimate_memory", "write_consolidated",
]
__version__ = "0.1.0"
