"""Writing tensors to safetensors files one at a time: the header first (every shape and
dtype is known before any data is read), then each tensor read, written and dropped, so
peak memory is the largest tensor, never the model."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .verify import ST_DTYPES
from .write import CheckpointError, atomic_file


@dataclass(frozen=True)
class TensorOut:
    key: str
    """Its name in the export (the state-dict key less the prefix)."""
    load: Callable[[], torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def tensor_value(tensor: TensorOut) -> torch.Tensor:
    """The tensor's data, checked against what the reader announced: the header was written
    from the announcement, so a loader giving anything else would corrupt the file."""
    value = tensor.load().detach().cpu().contiguous()
    if tuple(value.shape) != tensor.shape or value.dtype != tensor.dtype:
        raise CheckpointError(f"tensor {tensor.key!r}: the reader announced {tensor.dtype} "
                              f"{list(tensor.shape)}, its loader gave {value.dtype} "
                              f"{list(value.shape)}")
    return value


def raw_bytes(value: torch.Tensor) -> memoryview:
    return value.reshape(-1).view(torch.uint8).numpy().data


def write_safetensors(path: Path, shard: list[TensorOut],
                      metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, header first, then each tensor's data read and written alone.
    The header lists tensors in state-dict order; the data is laid out widest dtype first
    (as safetensors itself does), so every tensor starts aligned to its element size and
    loads as a zero-copy view."""
    layout = sorted(shard, key=lambda t: -t.dtype.itemsize)  # stable: state-dict order within
    offsets, offset = {}, 0
    for t in layout:
        offsets[t.key] = [offset, offset + t.nbytes]
        offset += t.nbytes
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    for t in shard:
        header[t.key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": offsets[t.key]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data 8-byte aligned, as safetensors writes it
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in layout:
            value = tensor_value(t)
            f.write(raw_bytes(value))
            del value



__all__ = ["TensorOut", "raw_bytes", "tensor_value", "write_safetensors"]
