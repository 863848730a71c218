"""Unpickling other systems' checkpoint files without running their code.

DeepSpeed's ``*.pt`` files and DCP's ``.metadata`` are pickles, and unpickling a stranger's
pickle can execute anything it names. They are read with torch's ``weights_only`` unpickler,
which builds only tensors, plain containers and the globals allow-listed here. DeepSpeed's
own classes are allow-listed as inert stand-ins registered under DeepSpeed's names (a record
of the fields, nothing imported from DeepSpeed, no method of theirs runs); DCP's metadata
classes are torch's own dataclasses, built field by field. A file naming anything else is
refused with an error that names the global, the risk and the opt-in.

The opt-in (``trust_pickles=True`` where a call takes it, or ``ZERO_STRATEGY_TRUST_PICKLES=1``
for the paths a framework drives, such as ``Trainer.fit(ckpt_path=...)``) unpickles with the
full pickle machinery: only for files the user trusts as they would trust code.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from .bounds import check_archive
from .errors import CheckpointError

TRUST_ENV = "ZERO_STRATEGY_TRUST_PICKLES"


def trusted(explicit: bool | None = None) -> bool:
    """Whether full unpickling was asked for: the argument, else the environment variable."""
    if explicit is not None:
        return bool(explicit)
    return os.environ.get(TRUST_ENV, "") not in ("", "0", "false", "False")


class _Record:
    """A DeepSpeed object seen as its fields (``vars()``); built by NEWOBJ and BUILD only."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScalerRecord(_Record):
    """DeepSpeed's LossScaler/DynamicLossScaler: its ``cur_scale`` and flags."""


class DynamicLossScalerRecord(_Record):
    """DeepSpeed's DynamicLossScaler (fp16 runs): its scale, window and counters."""


def _stage_number(value: Any) -> int:
    """DeepSpeed's ZeroStageEnum(n) rebuilt as the plain number n."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
        raise ValueError(f"not a ZeRO stage: {value!r}")
    return int(value)


class FragmentAddress(_Record):
    """Where a parameter's piece sits in a DeepSpeed partition: ``numel`` and ``start``."""

# DeepSpeed 0.9 - 0.19 optimizer files name these (checked on 0.19.8's stages 1-3, fp32
# and bf16); each maps to a stand-in that holds data and runs nothing of DeepSpeed's.
DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_stage_number, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _dcp_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` names (torch 2.4 - 2.13): its own dataclasses, torch.Size,
    dtypes, layouts, memory-format codes and the checkpoint's path. Building any of them
    runs no code from the file: dataclasses get their fields, the rest are values."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    }
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                 "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[("torch", str(value).removeprefix("torch."))] = value
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's unpickler with every global looked up in an allow-list (the way the pickle
    documentation restricts globals): what is not listed is refused before it is built."""

    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return self._allowed[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def _refused(path: Path, error: Exception) -> CheckpointError:
    text = str(error)
    named = re.search(r"GLOBAL (\S+)|global (\S+) is not allowed|unrecognized function (\S+)",
                      text)
    if named:
        reason = f"it names {next(g for g in named.groups() if g)}"
    else:
        reason = text.splitlines()[0] if text else type(error).__name__
    return CheckpointError(
        f"{path}: refused to unpickle ({reason}). This file is a pickle, and unpickling a "
        "pickle can run any code it names; it was read with torch's weights_only unpickler "
        "and named something outside the allow-list. If you trust this checkpoint as you "
        f"would trust code, opt in with trust_pickles=True or {TRUST_ENV}=1")


def load_torch_file(path: Path, *, trust: bool | None = None, mmap: bool = True) -> Any:
    """A ``torch.save`` file, memory-mapped (tensors are read when touched), after its
    archive is checked record by record (``bounds.check_archive``). The format of torch
    before 1.6 (not a zip archive) is read only when trusted: its storage sizes are allocated
    as the file states them, before anything could compare them with the file."""
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if zipped:
        check_archive(path)
    elif not trusted(trust):
        raise CheckpointError(
            f"{path}: not a torch.save zip archive (torch >= 1.6 writes one); the older format "
            "allocates the sizes it states before they can be checked, so it is read only "
            f"with trust_pickles=True or {TRUST_ENV}=1")
    if trusted(trust):
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, ValueError, TypeError, AttributeError, EOFError) as e:
        if "zip archive" in str(e) or "failed finding central directory" in str(e):
            raise CheckpointError(f"{path}: not a torch.save file ({e})") from e
        raise _refused(path, e) from e
    except Exception as e:  # the unpickler's own UnpicklingError and anything it raises
        raise _refused(path, e) from e


def load_torch_bytes(data: io.IOBase, what: Path, *, trust: bool | None = None) -> Any:
    """A ``torch.save`` stream (one DCP item)."""
    try:
        if trusted(trust):
            return torch.load(data, map_location="cpu", weights_only=False)
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _refused(what, e) from e


def load_plain_pickle(path: Path, *, trust: bool | None = None) -> Any:
    """A ``pickle.dump`` file of DCP's metadata classes (``.metadata``)."""
    with open(path, "rb") as f:
        if trusted(trust):
            return pickle.load(f)
        try:
            return _RestrictedUnpickler(f, _dcp_globals()).load()
        except Exception as e:
            raise _refused(path, e) from e


__all__ = ["DEEPSPEED_GLOBALS", "TRUST_ENV", "FragmentAddress", "LossScalerRecord",
           "load_plain_pickle", "load_torch_bytes", "load_torch_file", "trusted"]
