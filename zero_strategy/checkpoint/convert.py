"""Converting a checkpoint (ours, DeepSpeed's or DCP's: anything ``open_reader`` reads) into
another system's format, streamed one tensor at a time:

- ``dcp``: a torch.distributed.checkpoint directory holding ``{"model": state_dict,
  "optimizer": {"state": {name: {...}}, "param_groups": [...]}}`` as
  ``get_state_dict(model, optimizer)`` lays them out, so FSDP2 (or any DCP user) loads it
  with ``dcp.load`` and ``set_state_dict``;
- ``hf``: a ``save_pretrained`` directory (``hf.py``);
- ``zero``: our own format, one process's layout (it loads on any world size and stage).

Every target is written into a temporary sibling and renamed into place when complete
(``stream.staged_directory``), so a failed conversion leaves nothing that looks like a
checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ..core.flat import FROZEN_GROUP, shard_numel_for
from .errors import CheckpointError
from .read import open_reader
from .source import ReaderBase
from .stream import TensorOut, staged_directory, write_safetensors
from .write import (
    CLIENT_FILE,
    FORMAT,
    LATEST,
    MANIFEST,
    MODULE_FILE,
    VERSION,
    atomic_file,
    file_sha256,
    shard_file,
    write_atomic,
)

TARGETS = ("dcp", "hf", "zero")
CONVERTED_TAG = "converted"


def convert(source: str | os.PathLike, target: str | os.PathLike, to: str, *,
            tag: str | None = None, trust_pickles: bool | None = None,
            config: Any = None, prefix: str | None = None,
            dtype: torch.dtype | None = None) -> Path:
    """Write the checkpoint at ``source`` as format ``to`` (one of ``TARGETS``) at
    ``target``, which must not exist or be empty; returns ``target``."""
    if to not in TARGETS:
        raise CheckpointError(f"--to must be one of {list(TARGETS)}, got {to!r}")
    reader = open_reader(source, tag, trust=trust_pickles)
    reader.verify_all()
    if to == "hf":
        from .hf import write_hf

        return write_hf(reader, target, config=config, prefix=prefix, dtype=dtype)
    if config is not None or prefix is not None:
        raise CheckpointError(f"config and prefix apply to --to hf only, not {to!r}")
    if to == "zero" and dtype is not None:
        raise CheckpointError("dtype does not apply to --to zero: our format keeps fp32 "
                              "masters (cast when consolidating instead)")
    with staged_directory(Path(target)) as tmp:
        if to == "dcp":
            write_dcp(reader, tmp, dtype)
        else:
            write_zero(reader, tmp)
    return Path(target)


# ------------------------------------------------------------------------ DCP
def _group_names(reader: ReaderBase) -> list[list[str]]:
    groups = reader.manifest.get("param_groups") or [{}]
    names: list[list[str]] = [[] for _ in groups]
    for name, group in reader.param_groups_of().items():
        if group == FROZEN_GROUP:  # frozen, in no param group: DCP lists none for it
            continue
        if group >= len(names):
            raise CheckpointError(f"{reader.path}: parameter {name!r} is in param group "
                                  f"{group}, the checkpoint records {len(groups)}")
        names[group].append(name)
    return names


def write_dcp(reader: ReaderBase, out: Path, dtype: torch.dtype | None = None) -> None:
    """DCP's ``FileSystemWriter`` layout written directly, one item at a time: every tensor
    a ``torch.save`` stream in ``__0_0.distcp``, ``.metadata`` describing them."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    items: dict[str, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    storage: dict[Any, Any] = {}
    data = out / "__0_0.distcp"

    with atomic_file(data) as f:
        def put(path: tuple[Any, ...], value: Any) -> None:
            flat = ".".join(str(p) for p in path)
            start = f.tell()
            torch.save(value, f)
            tensor = isinstance(value, torch.Tensor)
            zero = torch.Size([0] * value.dim()) if tensor else None
            if tensor:
                items[flat] = md.TensorStorageMetadata(
                    properties=md.TensorProperties(dtype=value.dtype), size=value.shape,
                    chunks=[md.ChunkStorageMetadata(offsets=zero, sizes=value.shape)])
            else:
                items[flat] = md.BytesStorageMetadata()
            planner[flat] = path
            storage[md.MetadataIndex(flat, zero)] = _StorageInfo(data.name, start,
                                                                 f.tell() - start)

        for key, load, _, _ in reader.entries(dtype):
            put(("model", key), load().contiguous())
        records = reader.manifest["param_states"]
        for name, record in records.items():
            for key, value in record.get("scalars", {}).items():
                put(("optimizer", "state", name, key), torch.tensor(value, dtype=torch.float32))
            for key in record.get("tensors", []) + list(record.get("whole", {})):
                put(("optimizer", "state", name, key), reader.read_param(name, key))
        for g, (values, names) in enumerate(zip(reader.manifest.get("param_groups") or [],
                                                _group_names(reader))):
            for key, value in values.items():
                put(("optimizer", "param_groups", g, key),
                    tuple(value) if key == "betas" else value)
            put(("optimizer", "param_groups", g, "params"), names)
        for key, value in (reader.client_state() or {}).items():
            put((str(key),), value)  # loops, schedulers, ...: beside the model, as DCP keeps them
    meta = md.Metadata(state_dict_metadata=items, planner_data=planner, storage_data=storage)
    write_atomic(out / ".metadata", pickle.dumps(meta))


# ------------------------------------------------------------------------ ours
def write_zero(reader: ReaderBase, out: Path) -> None:
    """Our format with one unit per parameter and one shard: it loads on any world size and
    stage (loading maps ranges, not ranks). The manifest records no optimizer class (the
    source may not name one): loading checks the hyperparameter names instead."""
    manifest = reader.manifest
    params = manifest["params"]
    groups = reader.param_groups_of()
    records = manifest["param_states"]
    state_keys = sorted({k for r in records.values() for k in r.get("tensors", [])})
    tag = out / CONVERTED_TAG
    tag.mkdir()
    shard: list[TensorOut] = []
    units = []
    for u, name in enumerate(params):
        shape, numel = tuple(params[name]["shape"]), int(torch.Size(params[name]["shape"])
                                                          .numel())
        # A shard holds at least one element (padding, for a parameter of none), as the
        # engine's layouts do and the reader requires.
        size = shard_numel_for(numel, 1, 1)
        units.append({"num_shards": 1, "shard_numel": size, "shard_align": 1,
                      "slots": [[name, list(shape), 0, numel, groups.get(name, 0)]]})
        shard.append(TensorOut(f"u{u}.master", lambda n=name, c=size: _padded(
            reader.read_param(n), c), (size,), torch.float32))
        for key in state_keys:
            shard.append(TensorOut(f"u{u}.{key}", lambda n=name, k=key, c=numel, z=size:
                                   _padded(_state(reader, n, k, c), z), (size,),
                                   torch.float32))
    write_safetensors(tag / shard_file(0), shard)
    aliases = manifest["aliases"]
    module = [TensorOut(k, load, shape, dt) for k, load, shape, dt in reader.entries()
              if k not in aliases]
    write_safetensors(tag / MODULE_FILE, module)
    client = reader.client_state()
    if client:
        torch.save(client, tag / CLIENT_FILE)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(tag.iterdir())}
    document = {
        "format": FORMAT, "version": VERSION, "tag": CONVERTED_TAG, "stage": 0,
        "world_size": 1, "optimizer_shards": 1, "precision": "32-true", "optimizer": "",
        "engine": {**manifest["engine"], "loss_scaler": None},
        "params": {n: {"shape": list(v["shape"]), "dtype": "float32"} for n, v in params.items()},
        "aliases": aliases, "param_groups": manifest.get("param_groups"),
        "state_dict_keys": manifest["state_dict_keys"], "units": units,
        "state_keys": state_keys,
        "param_states": {n: {"scalars": r.get("scalars", {}), "tensors": r.get("tensors", [])}
                         for n, r in records.items()},
        "files": files, "client_state": CLIENT_FILE if client else None,
        "converted_from": f"{manifest.get('written_by', reader.kind)} at {reader.path}",
    }
    write_atomic(tag / MANIFEST, json.dumps(document, indent=1).encode())
    write_atomic(out / LATEST, CONVERTED_TAG.encode())


def _padded(values: torch.Tensor, size: int) -> torch.Tensor:
    flat = values.reshape(-1).float()
    return flat if flat.numel() == size else torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _state(reader: ReaderBase, name: str, key: str, numel: int) -> torch.Tensor:
    """A parameter's optimizer state, zeros where the source has none for it (the record
    then does not list the key, so the zeros are never loaded)."""
    if key in reader.manifest["param_states"].get(name, {}).get("tensors", []):
        return reader.read_param(name, key).reshape(-1).float()
    return torch.zeros(numel)


__all__ = ["CONVERTED_TAG", "TARGETS", "convert", "write_dcp", "write_zero"]
