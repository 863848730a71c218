"""What a checkpoint's metadata claims, checked against what its files store, before anything
is allocated or read: the one validation path every reader goes through.

Every format describes its tensors with numbers someone else wrote: a safetensors header's
shape and ``data_offsets``, DCP's ``.metadata`` (a tensor's global size, its chunks, the byte
window of each chunk in a ``*.distcp`` file), DeepSpeed's ``param_shapes`` and partition
sizes, the records of a ``torch.save`` archive. Trusting any of them before comparing it with
the files is how a 200-byte forgery asks for terabytes (``torch.empty(size)``), reads past
the end of a file, or leaves part of a tensor uninitialised. The rule, for every reader:

- a shape is a short sequence of non-negative ints (``shape``), whose bytes, before anything
  is allocated for it, are at most the bytes stored for it (``fits``), so every allocation is
  bounded by the files on disk, not by what the metadata says;
- a byte range lies inside its file (``byte_range``) and the ranges of different items do not
  share bytes (``disjoint``): one stored tensor cannot back many claimed ones;
- the chunks of a tensor cover it exactly (``exact_cover``): inside its size, no element
  twice, none missing;
- a ``torch.save`` archive is checked record by record (``check_archive``): stored uncompressed,
  inside the file, and its CRC-32 right, so damage to DeepSpeed's and DCP's files, which carry
  no checksums of their own, is caught before unpickling instead of loading other weights.

Each failure is a CheckpointError naming the file, the key and what is allowed.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .errors import CheckpointError

MAX_DIMS = 64
"""More dimensions than any tensor a model holds (torch allows 64 as well)."""
MAX_ELEMENTS = 1 << 48
"""A sanity bound on any claimed element count (256 T elements), before the real bound:
the bytes stored for it."""
MAX_CHUNK_COMPARISONS = 10_000_000
"""Work allowed to prove a tensor's chunks disjoint; real layouts (FSDP's rows, TP's
columns) need about one comparison per chunk."""
_BLOCK = 1 << 20


def fail(file: Path | str, key: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{file}: {key}: {problem}")


def count(file: Path | str, key: str, value: Any, what: str, *, low: int = 0,
          high: int | None = None) -> int:
    """``value`` as an int in [low, high] (a bool or a float is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(file, key, f"{what} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise fail(file, key, f"{what} must be {limit}, got {value}")
    return int(value)


def shape(file: Path | str, key: str, value: Any, what: str = "size") -> tuple[int, ...]:
    """``value`` (a list, tuple or torch.Size) as a shape: at most ``MAX_DIMS`` sizes, each an
    int >= 0, holding at most ``MAX_ELEMENTS`` elements."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIMS:
        raise fail(file, key, f"{what} must be a list of at most {MAX_DIMS} sizes, "
                   f"got {_short(value)}")
    dims = tuple(count(file, key, d, f"every dimension of {what}") for d in value)
    if math.prod(dims) > MAX_ELEMENTS:
        raise fail(file, key, f"{what} {list(dims)} holds {math.prod(dims)} elements, more "
                   f"than the {MAX_ELEMENTS} any checkpoint is allowed")
    return dims


def dtype(file: Path | str, key: str, value: Any) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise fail(file, key, f"dtype must be a torch dtype, got {_short(value)}")
    return value


def nbytes(dims: Sequence[int], of: torch.dtype) -> int:
    return math.prod(dims) * of.itemsize


def fits(file: Path | str, key: str, claimed: int, stored: int, what: str) -> None:
    """``claimed`` bytes of ``what`` are backed by at most ``stored`` bytes on disk."""
    if claimed > stored:
        raise fail(file, key, f"{what} claims {claimed} bytes, but only {stored} are stored "
                   "for it (a forged or damaged size)")


def byte_range(file: Path | str, key: str, offset: Any, length: Any, size: int, *,
               within: str = "file") -> tuple[int, int]:
    """[offset, offset + length) as ints inside a file (or a part of one) of ``size``
    bytes."""
    start = count(file, key, offset, "the byte offset")
    span = count(file, key, length, "the byte length")
    if start + span > size:
        raise fail(file, key, f"bytes [{start}, {start + span}) lie outside the {within}'s "
                   f"{size} (truncated, or a forged offset)")
    return start, start + span


def disjoint(file: Path | str, ranges: Iterable[tuple[int, int, str]]) -> None:
    """Byte ranges ``(start, end, key)`` of one file share no byte."""
    previous: tuple[int, int, str] | None = None
    for start, end, key in sorted(r for r in ranges if r[1] > r[0]):
        if previous is not None and start < previous[1]:
            raise fail(file, key, f"its bytes [{start}, {end}) overlap those of "
                       f"{previous[2]!r} [{previous[0]}, {previous[1]}): one stored item "
                       "cannot back two")
        previous = (start, end, key)


def exact_cover(file: Path | str, key: str, size: tuple[int, ...],
                chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Chunks ``(offsets, sizes)`` lie inside ``size`` and cover each element exactly once."""
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise fail(file, key, f"chunk at {list(offsets)} of size {list(sizes)} lies "
                       f"outside the tensor's size {list(size)}")
    held = sum(math.prod(s) for _, s in chunks)
    if held != math.prod(size):
        raise fail(file, key, f"the chunks hold {held} elements, the size {list(size)} has "
                   f"{math.prod(size)} (each element must be saved exactly once)")
    _no_overlap(file, key, [c for c in chunks if math.prod(c[1]) > 0])


def _no_overlap(file: Path | str, key: str,
                chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """A sweep along the first dimension: only chunks whose rows meet are compared."""
    if not chunks or not chunks[0][0]:
        return  # 0-dim: one non-empty chunk (the count above allows no second)
    boxes = sorted(chunks)
    work = 0
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1:]:
            if other[0] >= offsets[0] + sizes[0]:
                break
            work += 1
            if work > MAX_CHUNK_COMPARISONS:
                raise fail(file, key, f"{len(boxes)} chunks laid out too irregularly to "
                           "check in bounded time")
            if all(a < b + t and b < a + s for a, s, b, t in zip(offsets, sizes, other,
                                                                   other_sizes)):
                raise fail(file, key, f"chunks at {list(offsets)} and {list(other)} overlap")


# ---------------------------------------------------------------------------- torch.save files
class Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own."""

    def __init__(self, f: BinaryIO, offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = min(max(0, base + pos), self._len)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._len - self._pos)
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n]) or 0
        self._pos += got
        return got


def check_archive(file: Path, key: str = "the torch.save archive", offset: int = 0,
                  length: int | None = None) -> None:
    """The ``torch.save`` zip archive at bytes [offset, offset + length) of ``file`` (all of
    it by default): every record stored uncompressed inside it with its CRC-32 right. torch
    itself checks neither, and unpickles whatever the bytes say."""
    size = os.stat(file).st_size
    length = size - offset if length is None else length
    byte_range(file, key, offset, length, size)
    with open(file, "rb") as f:
        window = io.BufferedReader(Window(f, offset, length), _BLOCK)
        try:
            with zipfile.ZipFile(window) as archive:
                records = archive.infolist()
                for record in records:
                    _check_record(file, key, archive, record, length)
        except CheckpointError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError,
                NotImplementedError, RuntimeError) as e:
            raise fail(file, key, f"not an intact torch.save archive ({e})") from e
    if not any(r.filename.endswith("data.pkl") for r in records):
        raise fail(file, key, "not a torch.save archive (no data.pkl record)")


def _check_record(file: Path, key: str, archive: zipfile.ZipFile, record: zipfile.ZipInfo,
                  length: int) -> None:
    name = f"record {record.filename!r}"
    if record.compress_type != zipfile.ZIP_STORED:
        raise fail(file, key, f"{name} is compressed; torch.save stores every record as it is")
    if record.header_offset + record.compress_size > length:
        raise fail(file, key, f"{name} claims {record.compress_size} bytes at "
                   f"{record.header_offset}, past the archive's {length}")
    try:
        with archive.open(record) as data:  # zipfile checks the CRC-32 at the end
            while data.read(_BLOCK):
                pass
    except zipfile.BadZipFile as e:
        raise fail(file, key, f"{name} is damaged ({e})") from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["MAX_DIMS", "MAX_ELEMENTS", "Window", "byte_range", "check_archive", "count",
           "disjoint", "dtype", "exact_cover", "fail", "fits", "nbytes", "shape"]
