"""Memory: the ZeRO formula for model states (``states.py``), the activation formula of the
shipped model families (``activations.py``), and an engine's own accounting beside them
(``report.py``, imported by the engine, not here: it reads an engine)."""

from .activations import (
    FAMILIES,
    ActivationEstimate,
    BlockActivations,
    estimate_activations,
)
from .states import MemoryEstimate, estimate_memory, storage_bytes

__all__ = [
    "FAMILIES",
    "ActivationEstimate",
    "BlockActivations",
    "MemoryEstimate",
    "estimate_activations",
    "estimate_memory",
    "storage_bytes",
]
