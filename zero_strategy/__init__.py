"""zero_strategy: ZeRO (arXiv:1910.02054) from scratch on torch.distributed."""

from .config import LossScaleConfig, ZeroConfig
from .engine import ZeroEngine
from .memory import MemoryEstimate, estimate_memory

__all__ = ["LossScaleConfig", "MemoryEstimate", "ZeroConfig", "ZeroEngine", "estimate_memory"]
__version__ = "0.1.0"
