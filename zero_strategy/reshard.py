"""Reading sharded checkpoints: into an engine of any world size and stage, or consolidated.

Everything is addressed by parameter name and element range, never by rank: a parameter range
of the new layout is read from whichever old shards hold it, lazily (safetensors slices), so
loading and consolidation stay bounded by the largest tensor rather than the model size.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import (
    CLIENT_FILE,
    FORMAT,
    MANIFEST,
    MODULE_FILE,
    READABLE_VERSIONS,
    VERSION,
    CheckpointError,
    _fsync_dir,
    _layout_from_json,
    _sha256,
    resolve,
    shard_file,
)

if TYPE_CHECKING:
    from .engine import ZeroEngine


Entry = tuple[str, Callable[[], torch.Tensor], tuple[int, ...], torch.dtype]

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """Element ranges of tensors in a safetensors file, read with seek + readinto.

    Not memory-mapped on purpose: pages of a mapping stay resident while it is open, so
    reading a whole checkpoint through one would grow RSS to the checkpoint's size.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > 100_000_000:
                    raise ValueError(f"header of {size} bytes")
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
        self.data_start = 8 + size
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.header:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        entry = self.header[name]
        return _DTYPES_FROM_ST[entry["dtype"]], tuple(entry["shape"])

    def read(self, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Flat elements [start, end) of tensor ``name`` (all of it by default)."""
        dtype, shape = self.info(name)
        numel = torch.Size(shape).numel()
        start, end = start or 0, numel if end is None else end
        item = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(end - start, dtype=dtype)
        begin = self.data_start + self.header[name]["data_offsets"][0] + start * item
        with open(self.path, "rb") as f:
            f.seek(begin)
            got = f.readinto(out.view(torch.uint8).numpy())
        if got != out.numel() * item:
            raise CheckpointError(f"{self.path}: tensor {name!r} is cut short (truncated file)")
        return out if start or end != numel else out.view(shape)


class CheckpointReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({e})") from e
        if (self.manifest.get("format") != FORMAT
                or self.manifest.get("version") not in READABLE_VERSIONS):
            raise CheckpointError(
                f"{path / MANIFEST}: format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}; this zero_strategy reads {FORMAT!r} v{VERSION}")
        self.layouts = [_layout_from_json(u) for u in self.manifest["units"]]
        self.where = {slot.name: (i, slot) for i, lay in enumerate(self.layouts)
                      for slot in lay.slots}
        self._handles: dict[str, SafetensorsFile] = {}

    # -------------------------------------------------------------- integrity
    def verify(self, names: list[str]) -> list[str]:
        """Problems with the given files (missing, truncated, altered), as messages."""
        problems = []
        for name in names:
            expected = self.manifest["files"].get(name)
            file = self.path / name
            if expected is None:
                problems.append(f"{file}: not listed in the manifest")
            elif not file.exists():
                problems.append(f"{file}: missing (the manifest lists it)")
            elif file.stat().st_size != expected["bytes"]:
                problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says "
                                f"{expected['bytes']} (truncated or replaced)")
            elif _sha256(file) != expected["sha256"]:
                problems.append(f"{file}: sha256 differs from the manifest (corrupted or altered)")
        return problems

    def verify_all(self) -> None:
        problems = self.verify(sorted(self.manifest["files"]))
        if problems:
            raise CheckpointError("; ".join(problems))

    def _open(self, name: str) -> SafetensorsFile:
        if name not in self._handles:
            self._handles[name] = SafetensorsFile(self.path / name)
        return self._handles[name]

    # -------------------------------------------------------------- tensor access
    def has_state(self, key: str) -> bool:
        return key in self.manifest.get("state_keys", [])

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of parameter ``name`` (flattened) of ``key`` ("master" or a
        parameter-sized optimizer state), assembled from the shards that hold them."""
        unit, slot = self.where[name]
        layout = self.layouts[unit]
        lo, hi = slot.offset + start, slot.offset + end
        n = layout.shard_numel
        parts = []
        for k in range(lo // n, (hi - 1) // n + 1):
            handle = self._open(shard_file(k if layout.num_shards > 1 else 0))
            parts.append(handle.read(f"u{unit}.{key}", max(lo, k * n) - k * n,
                                     min(hi, (k + 1) * n) - k * n))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_param(self, name: str, key: str = "master") -> torch.Tensor:
        _, slot = self.where[name]
        return self.read_range(name, key, 0, slot.numel).view(slot.shape)

    def module_keys(self) -> list[str]:
        return list(self._open(MODULE_FILE).keys())

    def module_tensor(self, key: str) -> torch.Tensor:
        return self._open(MODULE_FILE).read(key)

    def entries(self, dtype: torch.dtype | None = None) -> Iterator[Entry]:
        """(state_dict key, loader, shape, dtype) in the model's state_dict order."""
        aliases = self.manifest["aliases"]
        module = self._open(MODULE_FILE)
        for key in self.manifest["state_dict_keys"]:
            if key in aliases:
                name = aliases[key]
                shape = tuple(self.manifest["params"][name]["shape"])
                stored = getattr(torch, self.manifest["params"][name]["dtype"])
                out = dtype or stored
                yield key, (lambda n=name, o=out: self.read_param(n).to(o)), shape, out
            else:
                stored, shape = module.info(key)
                out = dtype if dtype is not None and stored.is_floating_point else stored
                yield key, (lambda k=key, o=out: self.module_tensor(k).to(o)), shape, out


# ------------------------------------------------------------------------ loading an engine
def load(engine: ZeroEngine, directory: str | os.PathLike, *, tag: str | None = None,
         load_optimizer: bool = True) -> dict[str, Any] | None:
    """Every rank calls this; returns the client state saved with the checkpoint (or None)."""
    path = resolve(directory, tag)
    reader = CheckpointReader(path)
    _check_same_model(engine, reader)
    _verify_shared(engine, reader)
    if load_optimizer and reader.manifest["optimizer"] != type(engine.user_optimizer).__name__:
        raise CheckpointError(
            f"{path / MANIFEST}: saved with optimizer {reader.manifest['optimizer']}, loading "
            f"into {type(engine.user_optimizer).__name__}; pass load_optimizer=False to load "
            "weights only")
    engine.runtime.reshard_all()
    engine.zero_grad()
    rank = engine.comm.rank if engine.plan.optimizer_shards > 1 else 0
    with torch.no_grad():
        for unit in engine.units:
            master = unit.param_store.master
            for piece in unit.layout.pieces(rank):
                master[piece.shard_start : piece.shard_start + piece.numel].copy_(
                    reader.read_range(piece.slot.name, "master", piece.slot_start,
                                      piece.slot_start + piece.numel))
        engine.refresh_compute_copies()
        for key, tensor in engine.unmanaged_state().items():
            tensor.copy_(reader.module_tensor(key))
    if load_optimizer:
        _load_optimizer_state(engine, reader, rank)
    state = reader.manifest["engine"]
    engine.global_step, engine.skipped_steps = state["global_step"], state["skipped_steps"]
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])
    engine.comm.barrier()
    return _load_client_state(path, reader.manifest)


def _check_same_model(engine: ZeroEngine, reader: CheckpointReader) -> None:
    saved = {n: tuple(v["shape"]) for n, v in reader.manifest["params"].items()}
    current = {slot.name: slot.shape for u in engine.units for slot in u.layout.slots}
    saved_module = set(reader.manifest["state_dict_keys"]) - set(reader.manifest["aliases"])
    kinds = {
        "trainable parameters of this model missing from the checkpoint":
            [n for n in current if n not in saved],
        "checkpoint parameters this model does not train":
            [n for n in saved if n not in current],
        "shapes that differ (checkpoint vs model)":
            [f"{n} {list(saved[n])} vs {list(current[n])}" for n in current
             if n in saved and saved[n] != current[n]],
        "buffers or frozen parameters missing from the checkpoint":
            [k for k in engine.unmanaged_state() if k not in saved_module],
    }
    problems = [f"{len(v)} {kind} (e.g. {', '.join(v[:3])})" for kind, v in kinds.items() if v]
    if problems:
        raise CheckpointError(f"{reader.path}: checkpoint of a different model: "
                              + "; ".join(problems))


def _verify_shared(engine: ZeroEngine, reader: CheckpointReader) -> None:
    """Each file is hashed by one rank; every rank raises if any file is bad."""
    files = sorted(reader.manifest["files"])
    mine = [f for i, f in enumerate(files) if i % engine.comm.world_size == engine.comm.rank]
    problems = [p for part in engine.comm.all_gather_object(reader.verify(mine))
                for p in part]  # type: ignore[union-attr]
    if problems:
        raise CheckpointError("; ".join(problems))


def _param_states(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per parameter name: {"scalars": {...}, "tensors": [...]} (v1 checkpoints recorded
    scalars per param group, every parameter of a group with the same state)."""
    if "param_states" in manifest:
        return manifest["param_states"]
    groups = manifest.get("scalar_states", {})
    keys = manifest.get("state_keys", [])
    out = {}
    for layout in manifest["units"]:
        for name, _, _, _, group in layout["slots"]:
            scalars = groups.get(str(group), {})
            if scalars or keys:
                out[name] = {"scalars": scalars, "tensors": keys}
    return out


def _load_optimizer_state(engine: ZeroEngine, reader: CheckpointReader, rank: int) -> None:
    states = _param_states(reader.manifest)
    if not states:
        return  # saved before the first step: nothing to restore
    inner = engine.optimizer.inner
    state_dict = inner.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    new_state: dict[int, dict[str, Any]] = {}
    for seg in engine.optimizer.segments:
        slot = seg.unit.layout.slots[seg.index]
        saved = states.get(slot.name)
        if saved is None:
            continue  # the parameter had no optimizer state when saved
        offset = seg.start - _piece_start(seg, rank)
        entry: dict[str, Any] = {
            key: reader.read_range(slot.name, key, offset, offset + seg.end - seg.start)
            .to(torch.float32) for key in saved["tensors"]
        }
        for key, value in saved["scalars"].items():
            entry[key] = torch.tensor(value, dtype=torch.float32)
        new_state[index[id(seg.view)]] = entry
    state_dict["state"] = new_state
    inner.load_state_dict(state_dict)


def _piece_start(seg: Any, rank: int) -> int:
    """Where the segment's parameter starts relative to the shard (negative when it began on
    an earlier rank's shard): shard offset minus offset inside the parameter."""
    slot = seg.unit.layout.slots[seg.index]
    lo, _ = seg.unit.layout.shard_bounds(rank)
    return slot.offset - lo


def read_client_state(directory: str | os.PathLike, tag: str | None = None
                      ) -> dict[str, Any] | None:
    """The client state saved with a checkpoint (None if none was), without an engine."""
    path = resolve(directory, tag)
    return _load_client_state(path, CheckpointReader(path).manifest)


def _load_client_state(path: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    if not manifest.get("client_state"):
        return None
    file = path / manifest["client_state"]
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling refused or a damaged file
        raise CheckpointError(f"{file}: cannot be loaded with weights_only=True ({e})") from e


# ------------------------------------------------------------------------ consolidation


def consolidate(directory: str | os.PathLike, *, tag: str | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint as a plain ``model.state_dict()`` (loads with ``strict=True``)."""
    reader = CheckpointReader(resolve(directory, tag))
    reader.verify_all()
    return {key: load_fn() for key, load_fn, _, _ in reader.entries(dtype)}


def write_consolidated(directory: str | os.PathLike, out: str | os.PathLike, *,
                       tag: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Stream the consolidated state dict into a safetensors file, one tensor at a time: peak
    memory is the largest tensor, not the model."""
    reader = CheckpointReader(resolve(directory, tag))
    reader.verify_all()
    entries = list(reader.entries(dtype))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(reader.path)}}
    offset = 0
    for key, _, shape, dt in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        header[key] = {"dtype": _ST_DTYPES[dt], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data 8-byte aligned, as safetensors writes it
    target = Path(out)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, load_fn, _, _ in entries:
            tensor = load_fn().contiguous()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target


__all__ = ["CLIENT_FILE", "CheckpointReader", "consolidate", "load", "write_consolidated"]
