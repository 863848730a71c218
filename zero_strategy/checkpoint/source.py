"""What every checkpoint reader offers the loader and the converters, whoever wrote the files.

A reader describes the checkpoint in the shape of our manifest (``params``, ``aliases``,
``state_dict_keys``, ``param_groups``, ``param_states``, ``engine``) and reads by parameter
name and element range: the master weights (``"master"``), each optimizer state, the buffers
and frozen parameters. ``load`` and ``convert`` are written once against this; our own
format, DeepSpeed's and DCP's differ only in how a range is found in their files.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .verify import PARAM_DTYPES

Entry = tuple[str, Callable[[], torch.Tensor], tuple[int, ...], torch.dtype]


class ReaderBase:
    """Everything but the file access, which subclasses give as ``read_range``,
    ``module_info`` and ``module_tensor``."""

    kind = "zero_strategy"
    path: Path
    manifest: dict[str, Any]

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} does not read ranges")  # overridden

    def module_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        raise TypeError(f"{type(self).__name__} holds no module tensors")  # overridden

    def module_tensor(self, key: str) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} holds no module tensors")  # overridden

    def client_state(self) -> dict[str, Any] | None:
        return None

    def holds(self, name: str) -> bool:
        """Whether the source has a value for parameter ``name`` or module key ``name``: a
        checkpoint has all of them; pretrained weights may lack a head (``pretrained.py``)."""
        return True

    def verify(self, names: list[str]) -> list[str]:
        """Other systems record no hashes: their files are checked by structure instead."""
        return []

    def verify_all(self) -> None:
        return None

    def has_state(self, key: str) -> bool:
        return any(key in r.get("tensors", []) for r in self.manifest["param_states"].values())

    def param_groups_of(self) -> dict[str, int]:
        """Each trainable parameter's optimizer param group."""
        return {name: g for g, names in enumerate(self.manifest.get("group_names") or [])
                for name in names} or dict.fromkeys(self.manifest["params"], 0)

    def read_param(self, name: str, key: str = "master") -> torch.Tensor:
        shape = tuple(self.manifest["params"][name]["shape"])
        return self.read_range(name, key, 0, torch.Size(shape).numel()).view(shape)

    def read_state(self, name: str, key: str, start: int | None, end: int | None
                   ) -> torch.Tensor:
        if start is None:
            return self.read_param(name, key)
        return self.read_range(name, key, start, end if end is not None else start)

    def entries(self, dtype: torch.dtype | None = None) -> Iterator[Entry]:
        """(state_dict key, loader, shape, dtype) in the model's state_dict order."""
        aliases = self.manifest["aliases"]
        for key in self.manifest["state_dict_keys"]:
            if key in aliases:
                name = aliases[key]
                shape = tuple(self.manifest["params"][name]["shape"])
                out = dtype or PARAM_DTYPES[self.manifest["params"][name]["dtype"]]
                yield key, (lambda n=name, o=out: self.read_param(n).to(o)), shape, out
            else:
                stored, shape = self.module_info(key)
                out = dtype if dtype is not None and stored.is_floating_point else stored
                yield key, (lambda k=key, o=out: self.module_tensor(k).to(o)), shape, out


def foreign_manifest(*, params: dict[str, tuple[int, ...]], state_dict_keys: list[str],
                     aliases: dict[str, str], param_groups: list[dict[str, Any]] | None,
                     param_states: dict[str, dict[str, Any]], global_step: int,
                     skipped_steps: int = 0, written_by: str,
                     group_names: list[list[str]] | None = None) -> dict[str, Any]:
    """Our manifest's fields for another system's checkpoint (no files: nothing to hash)."""
    return {
        "version": 2, "written_by": written_by, "optimizer": None,
        "params": {n: {"shape": list(s), "dtype": "float32"} for n, s in params.items()},
        "state_dict_keys": state_dict_keys, "aliases": aliases, "param_groups": param_groups,
        "group_names": group_names,
        "param_states": param_states, "files": {}, "client_state": True,
        "engine": {"global_step": global_step, "skipped_steps": skipped_steps,
                   "loss_scaler": None},
    }


def copy_flat(pieces: list[torch.Tensor], lo: int, hi: int, out: torch.Tensor,
              release: Callable[[torch.Tensor], None] | None = None) -> None:
    """Copy elements [lo, hi) of the concatenation of ``pieces`` into ``out`` (1-d, hi - lo
    elements), never concatenating: only the slices asked for are read, straight into
    ``out``, so the peak is ``out`` itself plus nothing the size of a piece."""
    if out.numel() != hi - lo:
        raise IndexError(f"{out.numel()} elements given for [{lo}, {hi})")
    base, filled = 0, 0
    for piece in pieces:
        n = piece.numel()
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            view = piece.reshape(-1)[a - base : b - base]
            out[filled : filled + b - a].copy_(view)
            filled += b - a
            if release is not None:
                release(view)
        base += n
        if base >= hi:
            break
    if filled != hi - lo:
        raise IndexError(f"elements [{lo}, {hi}) are outside the {base} stored")


class MappedFile:
    """Pages of a memory-mapped ``torch.load(mmap=True)`` file handed back once copied.

    A file mapping's pages count in RSS while mapped, so reading every tensor of a large
    file would grow RSS to the file's size. After a slice is copied out, its whole pages
    are dropped with ``madvise(MADV_DONTNEED)`` (they are re-read from the file if touched
    again), but only where /proc/self/maps shows the address inside a mapping of this very
    file: on anonymous memory the same call would zero live data.
    """

    _libc: Any = None

    def __init__(self, path: Path) -> None:
        self.path = str(Path(path).resolve())
        self._ranges: list[tuple[int, int]] | None = None

    def _mapped_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].strip() == self.path:
                        lo, hi = fields[0].split("-")
                        ranges.append((int(lo, 16), int(hi, 16)))
        except OSError:
            return []
        return ranges

    def release(self, view: torch.Tensor) -> None:
        if not sys.platform.startswith("linux") or view.numel() == 0:
            return
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, end // page * page  # whole pages inside the slice
        if a >= b:
            return
        if self._ranges is None or not any(lo <= a and b <= hi for lo, hi in self._ranges):
            self._ranges = self._mapped_ranges()  # the mapping exists once torch.load ran
        if not any(lo <= a and b <= hi for lo, hi in self._ranges):
            return
        if MappedFile._libc is None:
            MappedFile._libc = ctypes.CDLL(None, use_errno=True)
        MappedFile._libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a),
                                 4)  # MADV_DONTNEED


__all__ = ["Entry", "MappedFile", "ReaderBase", "copy_flat", "foreign_manifest"]
