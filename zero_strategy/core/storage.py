"""The two private torch storage operations the engine relies on, each behind one function.

- ``swap_memory``: exchanging two storages' memory (``UntypedStorage._swap_data_ptr_``). The
  buffer pool lends memory to a stage-3 unit's gathered buffer without replacing the storage
  object autograd's saved tensors alias. Used on host memory only: on CUDA the caching
  allocator already makes ``resize_(0)`` / ``resize_(n)`` cheap, which is what FSDP2 does.
- ``alias_count``: how many tensors and storages share one storage (``_storage_Use_Count``),
  which detects a tensor taken out of ``gathered_parameters()`` before it can read freed memory.

``tests/quick/test_storage.py`` pins what each promises on the installed torch, so a torch that
changes either fails there, loudly, instead of corrupting memory in a training run.
"""

from __future__ import annotations

import torch

from .. import compat


def swaps_memory(device: torch.device) -> bool:
    """Whether the pool lends memory by swapping on ``device`` (host memory, on a torch that
    has the swap: 2.12 on, ``compat.STORAGE_SWAP``); elsewhere it resizes the unit's own
    storage."""
    return device.type == "cpu" and hasattr(torch.UntypedStorage, compat.STORAGE_SWAP.name)


def swap_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """``a`` gets ``b``'s memory and size and ``b`` gets ``a``'s; both objects stay what they
    are, so every tensor viewing ``a`` now reads ``b``'s former bytes."""
    a._swap_data_ptr_(b)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def alias_count(storage: torch.UntypedStorage) -> int | None:
    """References to ``storage``'s memory held by tensors and storage objects (views count);
    None on a torch without the count (the detection it serves is then skipped)."""
    return None if _USE_COUNT is None else _USE_COUNT(storage._cdata)
