"""Devices named one way, and small host values sent to a device without stopping the host.

``torch.device("cuda") != torch.device("cuda:0")``, yet every tensor created on the first
reports the second. An engine that kept the name without an index would find none of its
tensors on "its" device: gradients autograd produced would be copied instead of adopted, and
the records ``meta_init`` keeps for sharded init would never match. So every device the
engine is given passes through ``canonical_device`` once.

``torch.tensor(values, device=gpu)`` copies from pageable memory, which makes the host wait
until the GPU has run everything queued before it: one such scalar per unit turns the
prefetching of stage 3 back into lockstep. ``from_host`` stages the values in pinned memory
(torch's pinned host allocator keeps the block until the copy has run) and copies them
asynchronously; a scalar the host knows is better made with ``torch.full`` on the device.
"""

from __future__ import annotations

import torch

_UNINDEXED = ("cpu", "meta")
"""Device types whose tensors report no index: their name is already canonical."""


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with the index its tensors will report: an accelerator named without one
    is the current device of its type (``torch.cuda.current_device()``)."""
    device = torch.device(device)
    if device.type in _UNINDEXED:
        return torch.device(device.type)  # "cpu:0" too: CPU tensors report plain "cpu"
    if device.index is not None:
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
    current = getattr(backend, "current_device", None)
    if current is not None:
        return torch.device(device.type, current())
    return torch.empty(0, device=device).device


def from_host(values: list[float] | list[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``, without waiting for the device."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)
