"""Writing tensors to safetensors files one at a time: the header first (every shape and
dtype is known before any data is read), then each tensor read, written and dropped, so
peak memory is the largest tensor, never the model."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .verify import ST_DTYPES
from .write import atomic_file, fsync_dir


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



def check_target(out: Path) -> None:
    """An export never overwrites: ``out`` must not exist or be an empty directory."""
    if out.is_symlink() or out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a symlink" if out.is_symlink() else (
            "not empty" if out.is_dir() else "not a directory")
        raise CheckpointError(f"{out}: out_dir exists and is {what}; give a new path or an "
                              "empty directory (nothing is overwritten)")


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into, renamed to ``out`` when the block
    completes; on any failure it is removed, so a failed export leaves nothing."""
    check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp, whose 0o700 would outlive the rename) honours the umask.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        check_target(out)  # again: something may have been written there meanwhile
        os.replace(tmp, out)  # replaces an empty directory, refuses a non-empty one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)


__all__ = ["TensorOut", "check_target", "raw_bytes", "staged_directory", "tensor_value",
           "write_safetensors"]
