"""Sharded checkpoints: each rank writes its own shards, one JSON manifest describes them all.

Layout of a checkpoint directory::

    CKPT/latest                      name of the newest complete tag (replaced atomically)
    CKPT/<tag>/manifest.json         format, stage, world size, precision, parameter table,
                                     each unit's flat layout, sha256 and size of every file
    CKPT/<tag>/shard-00000.safetensors   shard k of every unit: master values and
                                     parameter-sized optimizer states, plus scalar states
    CKPT/<tag>/module.safetensors    frozen parameters and buffers (rank 0's copy)
    CKPT/<tag>/client_state.pt       optional caller state (loaded with weights_only=True)

A tag is written under a temporary name and renamed once every file is complete, so a
process killed mid-write leaves the previous checkpoint and ``latest`` untouched. Loading
maps every parameter range of the new layout onto the old shards that hold it, so a
checkpoint loads on any world size and stage with no conversion step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from .flat import FlatLayout, Slot

if TYPE_CHECKING:
    from .engine import ZeroEngine

FORMAT = "zero_strategy.checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""v2 records optimizer state per parameter (v1: scalar states per param group)."""
MANIFEST = "manifest.json"
MODULE_FILE = "module.safetensors"
CLIENT_FILE = "client_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the cause."""


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


# ---------------------------------------------------------------------------- small helpers
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write, flush to disk, then rename over ``path``: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _layout_json(layout: FlatLayout) -> dict[str, Any]:
    return {
        "num_shards": layout.num_shards,
        "shard_numel": layout.shard_numel,
        "slots": [[s.name, list(s.shape), s.offset, s.numel, s.group] for s in layout.slots],
    }


def _layout_from_json(data: dict[str, Any]) -> FlatLayout:
    slots = tuple(Slot(n, tuple(shape), off, numel, g) for n, shape, off, numel, g in data["slots"])
    layout = FlatLayout(slots, data["num_shards"])
    if layout.shard_numel != data["shard_numel"]:
        raise CheckpointError(f"manifest unit layout is inconsistent: {data['shard_numel']} "
                              f"elements per shard recorded, {layout.shard_numel} computed")
    return layout


# ---------------------------------------------------------------------------- saving
def save(engine: ZeroEngine, directory: str | os.PathLike, *, tag: str | None = None,
         client_state: dict[str, Any] | None = None) -> Path:
    """Every rank calls this; returns the path of the written tag directory."""
    comm = engine.comm
    root = Path(directory)
    tag = tag or f"step-{engine.global_step:08d}"
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag must be a plain name, got {tag!r}")
    tmp = root / f".tmp-{tag}"
    if comm.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        tmp.mkdir()
    comm.barrier()
    files: dict[str, Any] = {}
    tensors, scalars = _shard_tensors(engine)
    shard_index = comm.rank if engine.plan.optimizer_shards > 1 else 0
    if engine.plan.optimizer_shards > 1 or comm.rank == 0:
        name = shard_file(shard_index)
        files[name] = _save_tensors(tensors, tmp / name)
    if comm.rank == 0:
        files[MODULE_FILE] = _save_tensors(engine.unmanaged_state(), tmp / MODULE_FILE)
        if client_state is not None:
            _save_client_state(client_state, tmp / CLIENT_FILE)
    state_keys = sorted({k.split(".", 1)[1] for k in tensors if not k.endswith(".master")})
    gathered = comm.all_gather_object((files, scalars, state_keys))
    if comm.rank == 0:
        merged: dict[str, Any] = {"files": {}, "param_states": {}, "state_keys": set()}
        for part_files, part_states, part_keys in gathered:  # type: ignore[misc]
            merged["files"].update(part_files)
            merged["param_states"].update(part_states)
            merged["state_keys"].update(part_keys)
        manifest = _manifest(engine, tag, merged, client_state is not None)
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _publish(root, tmp, tag)
    comm.barrier()
    return root / tag


def _publish(root: Path, tmp: Path, tag: str) -> None:
    final = root / tag
    if final.exists():  # overwriting a tag: keep the old one until the new one is in place
        old = root / f".old-{tag}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    write_atomic(root / "latest", tag.encode())


def _shard_tensors(
    engine: ZeroEngine,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's master shards and parameter-sized optimizer states, one flat tensor per
    unit and key (laid out like the master), and per parameter that has optimizer state: its
    scalar states (Adam's step) and the names of its tensor states."""
    out: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for unit in engine.units:
        out[f"u{unit.index}.master"] = unit.param_store.master
    for seg in engine.optimizer.segments:
        state = engine.optimizer.inner.state.get(seg.view, {})
        if not state:
            continue  # never stepped (frozen since construction): no state to restore
        record = states.setdefault(seg.unit.layout.slots[seg.index].name,
                                   {"scalars": {}, "tensors": []})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:
                record["scalars"][key] = float(value)
                continue
            record["tensors"].append(key)
            name = f"u{seg.unit.index}.{key}"
            if name not in out:
                out[name] = torch.zeros(seg.unit.layout.shard_numel, dtype=value.dtype)
            out[name][seg.start : seg.end] = value.detach().cpu()
    return out, states


def _save_client_state(state: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest(engine: ZeroEngine, tag: str, merged: dict[str, Any], client: bool) -> dict:
    params = {}
    for unit in engine.units:
        for slot in unit.layout.slots:
            params[slot.name] = {"shape": list(slot.shape),
                                 "dtype": str(unit.param_store.master.dtype).replace("torch.", "")}
    aliases = {key: engine.param_names[id(t)] for key, t
               in engine.module.state_dict(keep_vars=True).items() if id(t) in engine.param_names}
    scaler = engine.scaler.state_dict() if engine.scaler is not None else None
    return {
        "format": FORMAT, "version": VERSION, "tag": tag,
        "stage": engine.plan.stage, "world_size": engine.comm.world_size,
        "optimizer_shards": engine.plan.optimizer_shards,
        "precision": engine.config.precision, "optimizer": type(engine.user_optimizer).__name__,
        "engine": {"global_step": engine.global_step, "skipped_steps": engine.skipped_steps,
                   "loss_scaler": scaler},
        "params": params, "aliases": aliases,
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "units": [_layout_json(u.layout) for u in engine.units],
        "state_keys": sorted(merged["state_keys"]), "param_states": merged["param_states"],
        "files": merged["files"], "client_state": CLIENT_FILE if client else None,
    }


# ---------------------------------------------------------------------------- reading
def resolve(directory: str | os.PathLike, tag: str | None = None) -> Path:
    """The tag directory to read: ``directory`` itself if it holds a manifest, else its
    ``latest`` (or the given tag)."""
    root = Path(directory)
    if tag is None and (root / MANIFEST).exists():
        return root
    if tag is None:
        latest = root / "latest"
        if not latest.exists():
            raise CheckpointError(f"{root}: no {MANIFEST} and no 'latest' file: not a "
                                  "zero_strategy checkpoint (or no save ever completed)")
        tag = latest.read_text().strip()
    path = root / tag
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path}: {MANIFEST} is missing: the checkpoint is incomplete")
    return path
