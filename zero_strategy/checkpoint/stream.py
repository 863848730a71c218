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
    """One safetensors file, header first, then each tensor's data read and written alone
    (see ``StreamedFile``), widest dtype first."""
    layout = sorted(shard, key=lambda t: -t.dtype.itemsize)  # stable: state-dict order within
    with StreamedFile(path, shard, [t.key for t in layout], metadata) as f:
        for t in layout:
            value = tensor_value(t)
            f.write(t.key, value)
            del value


def widest_first(specs: list[Any]) -> list[Any]:
    """The data order safetensors itself writes (stable within a width): every tensor then
    starts aligned to its element size and loads as a zero-copy view."""
    return sorted(specs, key=lambda t: -t.dtype.itemsize)


class StreamedFile:
    """A safetensors file written as its tensors arrive: the header (``specs`` in their
    order, offsets from ``data_order``) first, then each tensor's bytes in ``data_order``,
    each checked against its announcement. Written under a temporary name and renamed when
    every tensor arrived (``atomic_file``); anything else leaves no file."""

    def __init__(self, path: Path, specs: list[Any], data_order: list[str],
                 metadata: dict[str, str] | None = None) -> None:
        by_key = {t.key: t for t in specs}
        if sorted(data_order) != sorted(by_key):
            raise CheckpointError(f"{path}: the data order names other tensors than the "
                                  "header")
        offsets, offset = {}, 0
        for key in data_order:
            offsets[key] = [offset, offset + by_key[key].nbytes]
            offset += by_key[key].nbytes
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        for t in specs:
            header[t.key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": offsets[t.key]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        self._header = blob + b" " * (-len(blob) % 8)  # data 8-byte aligned, as safetensors
        self._pending = [by_key[k] for k in data_order]
        self._path = path
        self._atomic: Any = None
        self._file: Any = None

    def __enter__(self) -> StreamedFile:
        self._atomic = atomic_file(self._path)
        self._file = self._atomic.__enter__()
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        return self

    def write(self, key: str, value: torch.Tensor) -> None:
        if not self._pending:
            raise CheckpointError(f"{self._path}: tensor {key!r} arrived after the last one")
        want = self._pending.pop(0)
        if (key, tuple(value.shape), value.dtype) != (want.key, tuple(want.shape), want.dtype):
            raise CheckpointError(f"{self._path}: expected {want.key!r} {want.dtype} "
                                  f"{list(want.shape)}, got {key!r} {value.dtype} "
                                  f"{list(value.shape)}")
        self._file.write(raw_bytes(value.detach().cpu().contiguous()))

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool | None:
        if kind is None and self._pending:
            error = CheckpointError(f"{self._path}: {len(self._pending)} tensors never "
                                    f"arrived (first {self._pending[0].key!r})")
            self._atomic.__exit__(CheckpointError, error, None)  # removes the partial file
            raise error
        return self._atomic.__exit__(kind, error, trace)


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


@contextlib.contextmanager
def staged_into(out: Path, stale: Callable[[str], bool]) -> Iterator[Path]:
    """Where ``save_pretrained`` writes: into ``out`` even when it holds other files (a
    Trainer's output directory). A new or empty ``out`` is ``staged_directory``; otherwise the
    files are written into a hidden temporary directory inside it and, once all are written,
    every file whose name ``stale`` accepts (an older save's weights) is removed and the new
    files are moved in (renames, the index last), so a failure leaves ``out`` as it was."""
    if not out.exists() or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        with staged_directory(out) as tmp:
            yield tmp
        return
    if not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    tmp = out / f".save-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        new = sorted(p.name for p in tmp.iterdir())
        for old in out.iterdir():
            if old.name not in new and old.is_file() and stale(old.name):
                old.unlink()
        for name in sorted(new, key=lambda n: n.endswith(".index.json")):
            os.replace(tmp / name, out / name)
        tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out)


__all__ = ["StreamedFile", "TensorOut", "check_target", "raw_bytes", "staged_directory",
           "staged_into", "tensor_value", "widest_first", "write_safetensors"]
