"""Sharded checkpoints: each rank writes its own shards, one JSON manifest describes them all.

Layout of a checkpoint directory::

    CKPT/latest                      name of the newest complete tag (replaced atomically)
    CKPT/<tag>/manifest.json         format, stage, world size, precision, parameter table,
                                     each unit's flat layout, sha256 and size of every file
    CKPT/<tag>/shard-00000.safetensors   shard k of every unit: master values and
                                     parameter-sized optimizer states, plus scalar states
    CKPT/<tag>/module.safetensors    frozen parameters and buffers (rank 0's copy)
    CKPT/<tag>/client_state.pt       optional caller state (loaded with weights_only=True)

A tag is written under a temporary name; the ranks agree that every write succeeded, then it
is renamed into place and ``latest`` replaced. A process killed at any point leaves ``latest``
loadable, a failed save raises on every rank and leaves nothing behind, and the next save
clears what interrupted ones left. Loading (``read.py``, after ``verify.py``) maps
every parameter range of the new layout onto the old shards that hold it, so a checkpoint
loads on any world size and stage with no conversion step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from safetensors.torch import save_file

from ..core.flat import FlatLayout, Slot
from ..optim.owner import OwnerPart
from ..optim.state import hyperparameters, local_records
from .errors import CheckpointError

if TYPE_CHECKING:
    from ..engine_view import EngineView

FORMAT = "zero_strategy.checkpoint"
VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
"""2: per-parameter optimizer records (1: scalar states per param group); 3: shard sizes
aligned (``shard_align`` per unit); 4: whole state tensors of owner-placed optimizers
(``"whole"`` in a parameter's record: shape, dtype and the shard file holding it)."""
MANIFEST = "manifest.json"
LATEST = "latest"
MODULE_FILE = "module.safetensors"
CLIENT_FILE = "client_state.pt"


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


_SHARD_FILE = re.compile(r"shard-(\d{5})\.safetensors")


def shard_of(name: str) -> int | None:
    """The shard index of a file name ``shard_file`` gives, None for every other name. Shard k
    is written by rank k of the world that saved (under hybrid sharding the first shard
    group's ranks are 0 .. k), every other file of a tag by rank 0."""
    match = _SHARD_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def tmp_name(tag: str) -> str:
    """Where a tag is written until it is complete."""
    return f".tmp-{tag}"


def old_name(tag: str) -> str:
    """Where the previous version of a tag waits while an overwrite replaces it."""
    return f".old-{tag}"


# ---------------------------------------------------------------------------- small helpers
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file to write ``path`` through: flushed to disk, then renamed over ``path``, so readers
    see the old file or the new one, never half; a failed write removes its temporary file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    # safetensors refuses two keys over one storage: a frozen tied embedding (a LoRA base at
    # stages 0-2, where frozen parameters stay whole) is written once per key instead.
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, value in tensors.items():
        value = value.detach().contiguous().cpu()
        where = (value.untyped_storage().data_ptr(), value.storage_offset())
        out[key] = value.clone() if where in seen and value.numel() else value
        seen.add(where)
    save_file(out, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def layout_json(layout: FlatLayout) -> dict[str, Any]:
    return {
        "num_shards": layout.num_shards,
        "shard_numel": layout.shard_numel,
        "shard_align": layout.shard_align,
        "slots": [[s.name, list(s.shape), s.offset, s.numel, s.group] for s in layout.slots],
    }


def layout_from_json(data: dict[str, Any]) -> FlatLayout:
    slots = tuple(Slot(n, tuple(shape), off, numel, g) for n, shape, off, numel, g in data["slots"])
    layout = FlatLayout(slots, data["num_shards"], data.get("shard_align", 1))
    if layout.shard_numel != data["shard_numel"]:
        raise CheckpointError(f"manifest unit layout is inconsistent: {data['shard_numel']} "
                              f"elements per shard recorded, {layout.shard_numel} computed")
    return layout


# ---------------------------------------------------------------------------- saving
def save(engine: EngineView, directory: str | os.PathLike, *, tag: str | None = None,
         client_state: dict[str, Any] | None = None) -> Path:
    """Every rank calls this; returns the path of the written tag directory.

    Every rank writes its files under ``.tmp-<tag>``; the ranks then agree that all writes
    succeeded before rank 0 publishes, so a failure anywhere (a full disk on one rank) makes
    every rank raise at once, naming the rank, with the partial files removed and ``latest``
    unchanged.
    """
    comm = engine.comm
    root = Path(directory)
    tag = tag or f"step-{engine.global_step:08d}"
    if "/" in tag or "\\" in tag or tag.startswith(".") or not tag.strip():
        raise ValueError(f"checkpoint tag must be a plain name, got {tag!r}")
    tmp = root / tmp_name(tag)
    _agree(comm, root, tag, "preparing the directory",
           _attempt(lambda: _prepare(root, tmp)) if comm.rank == 0 else None)
    written: tuple[dict[str, Any], dict[str, Any], list[str]] = ({}, {}, [])
    error = None
    owned = _owned_states(engine)  # a collective: before anything a rank may fail in
    try:
        written = _write_rank_files(engine, tmp, client_state, owned)
    except Exception as e:  # reported to every rank below, then re-raised here
        error = e
    gathered = comm.all_gather_object((*written, _describe(error)))
    failed = [(r, part[3]) for r, part in enumerate(gathered) if part[3] is not None]
    if failed:
        _abandon(comm, tmp)
        raise _save_error(root, tag, failed) from error
    error = None
    if comm.rank == 0:
        error = _attempt(lambda: _finish(engine, root, tmp, tag, gathered,
                                         client_state is not None))
    _agree(comm, root, tag, "publishing", error, cleanup=tmp)
    return root / tag


def _write_rank_files(engine: EngineView, tmp: Path, client_state: dict[str, Any] | None,
                      owned: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """This rank's shard file (and on rank 0 the module and client files): their sizes and
    sha256, the optimizer records and the state keys, for the manifest."""
    comm = engine.comm
    files: dict[str, Any] = {}
    tensors, records = _shard_tensors(engine)
    shard_index = engine.shards.rank if engine.plan.optimizer_shards > 1 else 0
    tensors.update(owned)
    for record in records.values():
        for info in record.get("whole", {}).values():
            info["shard"] = shard_index
    # Under hybrid sharding every replica group holds the same shards: the first writes them.
    first_replica = engine.replicas is None or engine.replicas.rank == 0
    if first_replica and (engine.plan.optimizer_shards > 1 or comm.rank == 0):
        name = shard_file(shard_index)
        files[name] = _save_tensors(tensors, tmp / name)
    if comm.rank == 0:
        files[MODULE_FILE] = _save_tensors(engine.unmanaged_state(), tmp / MODULE_FILE)
        if client_state is not None:
            files[CLIENT_FILE] = _save_client_state(client_state, tmp / CLIENT_FILE)
    state_keys = sorted({k.split(".", 1)[1] for k in tensors
                         if k.startswith("u") and not k.endswith(".master")})
    return files, records, state_keys


def _finish(engine: EngineView, root: Path, tmp: Path, tag: str, gathered: list[Any],
            client: bool) -> None:
    """Rank 0, once every rank's files are written: the manifest, then publish."""
    merged: dict[str, Any] = {"files": {}, "param_states": {}, "state_keys": set()}
    for part_files, part_states, part_keys, _ in gathered:
        merged["files"].update(part_files)
        merged["param_states"].update(part_states)
        merged["state_keys"].update(part_keys)
    manifest = _manifest(engine, tag, merged, client)
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _publish(root, tmp, tag)


def _attempt(action: Any) -> str | None:
    """Run ``action``; its exception as text (for the other ranks), or None."""
    try:
        action()
    except Exception as e:  # every rank must hear of it, so it travels as text
        return _describe(e)
    return None


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _agree(comm: Any, root: Path, tag: str, step: str, error: str | None,
           cleanup: Path | None = None) -> None:
    """Every rank learns whether ``step`` failed anywhere; all raise together."""
    failed = comm.failures(error)
    if failed:
        if cleanup is not None:
            _abandon(comm, cleanup)
        raise _save_error(root, tag, failed, step)


def _abandon(comm: Any, tmp: Path) -> None:
    """A failed save leaves nothing behind: rank 0 removes the partial tag once every rank
    has stopped writing into it."""
    if comm.rank == 0:
        _remove(tmp)
    comm.barrier()


def _save_error(root: Path, tag: str, failed: list[tuple[int, str]],
                step: str = "writing") -> CheckpointError:
    causes = "; ".join(f"rank {r}: {e}" for r, e in failed)
    return CheckpointError(
        f"{root}: saving checkpoint {tag!r} failed while {step} on "
        f"{'rank' if len(failed) == 1 else 'ranks'} {', '.join(str(r) for r, _ in failed)} "
        f"({causes}); nothing was published, the partial files were removed and "
        f"'{LATEST}' still names the previous checkpoint")


def _prepare(root: Path, tmp: Path) -> None:
    """Rank 0 before writing: clear what interrupted saves left behind, then the new tag's
    temporary directory."""
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    tmp.mkdir()


def recover(root: Path) -> None:
    """Debris of saves that were killed or failed: partial ``.tmp-*`` tags and temporary
    ``latest`` files are removed; an ``.old-<tag>`` whose tag is missing (killed between
    the two renames of an overwrite) becomes ``<tag>`` again, else it is removed. One writer
    per checkpoint directory is assumed."""
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name.startswith(".tmp-") or name.startswith(f".{LATEST}.tmp-"):
            _remove(entry)
        elif name.startswith(".old-"):
            tag = root / name[len(".old-"):]
            if tag.exists() or tag.is_symlink():
                _remove(entry)
            else:
                os.replace(entry, tag)
    fsync_dir(root)


def _remove(path: Path) -> None:
    """Delete a file or directory; a symlink is removed itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


def _reached(point: str) -> None:
    """Test seam: the crash tests replace this to kill the process at a named point of
    publishing (tests/quick/test_checkpoint_faults.py). Does nothing otherwise."""


def _publish(root: Path, tmp: Path, tag: str) -> None:
    """Move the complete ``tmp`` into place as ``tag``, then point ``latest`` at it. A kill
    at any point leaves ``latest`` loadable: between the two renames of an overwrite the tag
    is missing and readers take ``.old-<tag>`` (the next save restores it)."""
    final = root / tag
    if final.exists() or final.is_symlink():
        old = root / old_name(tag)
        _remove(old)
        _reached("old-cleared")
        os.replace(final, old)
        _reached("old-moved")
        os.replace(tmp, final)
        _reached("new-moved")
        fsync_dir(root)
        _remove(old)
        _reached("old-removed")
    else:
        os.replace(tmp, final)
        _reached("new-moved")
    fsync_dir(root)
    write_atomic(root / LATEST, tag.encode())
    _reached("latest-written")


def _shard_tensors(
    engine: EngineView,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """This rank's master shards and parameter-sized optimizer states, one flat tensor per
    unit and key (laid out like the master), and the per-parameter records of which states
    exist (with the scalar ones, Adam's step)."""
    out: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        out[f"u{unit.index}.master"] = unit.param_store.master
    for seg, key, value in engine.optimizer.state_pieces():
        name = f"u{seg.unit.index}.{key}"
        if name not in out:
            out[name] = torch.zeros(seg.unit.layout.shard_numel, dtype=value.dtype)
        out[name][seg.start : seg.end] = value.detach().cpu()
    return out, local_records(engine.optimizer)


def whole_key(name: str, key: str) -> str:
    """Where an owner-placed parameter's whole state tensor ``key`` is stored."""
    return f"w.{name}.{key}"


def _owned_states(engine: EngineView) -> dict[str, torch.Tensor]:
    """The whole state tensors this rank's shard file stores: its own owned ones, or with an
    unsharded optimizer (one file, rank 0's) every rank's, sent to rank 0."""
    local = {whole_key(name, key): value.detach().cpu()
             for part in engine.optimizer.parts if isinstance(part, OwnerPart)
             for (name, key), value in part.whole_states().items()}
    if engine.plan.optimizer_shards > 1 or engine.comm.world_size == 1 or not any(
            isinstance(part, OwnerPart) for part in engine.optimizer.parts):
        return local
    merged: dict[str, torch.Tensor] = {}
    for part in engine.comm.all_gather_object(local):
        merged.update(part)  # type: ignore[arg-type]
    return merged if engine.comm.rank == 0 else {}


def optimizer_name(engine: EngineView) -> str:
    """The optimizer classes, as the manifest records them ("Muon+AdamW" for several)."""
    return "+".join(type(o).__name__ for o in engine.user_optimizers)


def _save_client_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    torch.save(state, path)  # inside the temporary tag: published with it or not at all
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _manifest(engine: EngineView, tag: str, merged: dict[str, Any], client: bool) -> dict:
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
        "stage": engine.plan.stage, "world_size": engine.shards.world_size,
        "optimizer_shards": engine.plan.optimizer_shards,
        "precision": engine.config.precision, "optimizer": optimizer_name(engine),
        "engine": {"global_step": engine.global_step, "skipped_steps": engine.skipped_steps,
                   "loss_scaler": scaler},
        "params": params, "aliases": aliases,
        "param_groups": hyperparameters(engine.user_optimizer),
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "units": [layout_json(u.layout) for u in engine.units],
        "state_keys": sorted(merged["state_keys"]), "param_states": merged["param_states"],
        "files": merged["files"], "client_state": CLIENT_FILE if client else None,
    }
