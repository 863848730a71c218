"""Host-memory placement for offloaded state: pinned buffers and asynchronous copies.

On a CPU-only run the host *is* the device, yet offloaded state still goes through these
functions (separate buffers, explicit copies), so the CPU test suite exercises the same path a
GPU run takes.
"""

from __future__ import annotations

import torch


def host_empty(numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
    """A host buffer; pinned when the compute device is CUDA so copies can be asynchronous."""
    pin = compute_device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src (cast and move); non-blocking when either side is pinned host memory."""
    non_blocking = dst.device.type != src.device.type and (dst.is_pinned() or src.is_pinned())
    return dst.copy_(src, non_blocking=non_blocking)


def synchronize(device: torch.device) -> None:
    """Wait for non-blocking host<->device copies before the host reads what they wrote."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
