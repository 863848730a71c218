"""Reading sharded checkpoints: into an engine of any world size and stage, or consolidated.

Everything is addressed by parameter name and element range, never by rank: a parameter range
of the new layout is read from whichever old shards hold it, lazily (safetensors slices), so
loading and consolidation stay bounded by the largest tensor rather than the model size.

Nothing is trusted: ``CheckpointReader`` checks the whole directory (``verify.py``)
before the first tensor is read, and ``load`` reads everything it will write before it
changes anything, so a rejected checkpoint leaves the engine as it was.
"""

from __future__ import annotations

import copy
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..optim.state import load_records, requests, restore_hyperparameters
from .errors import CheckpointError
from .source import ReaderBase
from .stream import TensorOut, write_safetensors
from .verify import (
    DTYPES_FROM_ST,
    check_tensors,
    member,
    param_records,
    read_header,
    read_manifest,
    refusal,
    resolve,
)
from .write import (
    CLIENT_FILE,
    MANIFEST,
    MODULE_FILE,
    file_sha256,
    layout_from_json,
    optimizer_name,
    shard_file,
    whole_key,
)

if TYPE_CHECKING:
    from ..comm.collectives import Communicator
    from ..engine_view import EngineView


class SafetensorsFile:
    """Element ranges of tensors in a safetensors file, read with seek + readinto, from a
    header ``verify.read_header`` checked against the file's size.

    Not memory-mapped on purpose: pages of a mapping stay resident while it is open, so
    reading a whole checkpoint through one would grow RSS to the checkpoint's size.
    """

    def __init__(self, path: Path, header: dict[str, dict[str, Any]], data_start: int) -> None:
        self.path = path
        self.header = header
        self.data_start = data_start

    def keys(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.header:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        entry = self.header[name]
        return DTYPES_FROM_ST[entry["dtype"]], tuple(entry["shape"])

    def read(self, name: str, start: int | None = None, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat elements [start, end) of tensor ``name`` (all of it by default); into ``out``
        (contiguous, on the CPU, of the tensor's dtype) when given, else a new tensor."""
        dtype, shape = self.info(name)
        numel = torch.Size(shape).numel()
        start, end = start or 0, numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of tensor {name!r} "
                                  f"are outside its {numel}")
        item = dtype.itemsize
        if out is None:
            out = torch.empty(end - start, dtype=dtype)
        elif (out.dtype, out.numel(), out.device.type) != (dtype, end - start, "cpu") \
                or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {end - start} "
                             f"elements, got {out.dtype} {tuple(out.shape)} on {out.device}")
        begin = self.data_start + self.header[name]["data_offsets"][0] + start * item
        with open(self.path, "rb") as f:
            f.seek(begin)
            got = f.readinto(out.view(torch.uint8).numpy())
        if got != out.numel() * item:
            raise CheckpointError(f"{self.path}: tensor {name!r} is cut short (truncated file)")
        return out if start or end != numel else out.view(shape)


class CheckpointReader(ReaderBase):
    """A tag directory, checked completely when opened: the manifest's schema and layouts,
    each listed file (a regular file inside the directory, of the listed size) and every
    tensor header against the layout. Hashes are checked by ``verify`` (or, shared between
    ranks, by ``load``) before data is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        self.layouts = [layout_from_json(u) for u in self.manifest["units"]]
        self.where = {slot.name: (i, slot) for i, lay in enumerate(self.layouts)
                      for slot in lay.slots}
        self._handles: dict[str, SafetensorsFile] = {}
        for name, entry in sorted(self.manifest["files"].items()):
            file = self._listed(name, entry["bytes"])
            if name != CLIENT_FILE:
                self._handles[name] = SafetensorsFile(file, *read_header(file, entry["bytes"]))
        check_tensors(path, self.manifest, {n: h.header for n, h in self._handles.items()})

    def _listed(self, name: str, size: int) -> Path:
        file = self.path / name
        if not file.exists() and not file.is_symlink():
            raise CheckpointError(f"{file}: missing (the manifest lists it)")
        member(self.path, file, f"listed file {name!r}")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, the manifest says "
                                  f"{size} (truncated or replaced)")
        return file

    # -------------------------------------------------------------- integrity
    def verify(self, names: list[str]) -> list[str]:
        """Files among ``names`` whose sha256 differs from the manifest's, as messages."""
        problems = []
        for name in names:
            file = self.path / name
            if file_sha256(file) != self.manifest["files"][name]["sha256"]:
                problems.append(f"{file}: sha256 differs from the manifest (corrupted or altered)")
        return problems

    def verify_all(self) -> None:
        problems = self.verify(sorted(self.manifest["files"]))
        if problems:
            raise CheckpointError("; ".join(problems))

    def _open(self, name: str) -> SafetensorsFile:
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
        if hi == lo:  # a parameter of no elements (its slot may sit past the last shard)
            entry = self._open(shard_file(0)).header.get(f"u{unit}.{key}")
            return torch.empty(0, dtype=DTYPES_FROM_ST[entry["dtype"]] if entry else
                               torch.float32)
        parts = []
        for k in range(lo // n, (hi - 1) // n + 1):
            handle = self._open(shard_file(k if layout.num_shards > 1 else 0))
            parts.append(handle.read(f"u{unit}.{key}", max(lo, k * n) - k * n,
                                     min(hi, (k + 1) * n) - k * n))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_state(self, name: str, key: str, start: int | None, end: int | None
                   ) -> torch.Tensor:
        """Optimizer state ``key`` of parameter ``name``: elements [start, end) flattened, or
        with ``start`` None the whole tensor in its own shape, whether the checkpoint holds it
        laid out like the master or whole (an owner-placed optimizer's)."""
        whole = param_records(self.manifest).get(name, {}).get("whole", {})
        if key in whole:
            value = self._open(shard_file(whole[key]["shard"])).read(whole_key(name, key))
            return value if start is None else value.reshape(-1)[start:end]
        return super().read_state(name, key, start, end)

    def module_keys(self) -> list[str]:
        return list(self._open(MODULE_FILE).keys())

    def module_tensor(self, key: str) -> torch.Tensor:
        return self._open(MODULE_FILE).read(key)

    def module_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return self._open(MODULE_FILE).info(key)

    def param_groups_of(self) -> dict[str, int]:
        return {slot.name: slot.group for lay in self.layouts for slot in lay.slots}

    def client_state(self) -> dict[str, Any] | None:
        """Unpickled with weights_only=True; its hash is checked by the caller first."""
        return _load_client_state(self.path, self.manifest)


# ------------------------------------------------------------------------ loading an engine
def load(engine: EngineView, directory: str | os.PathLike, *, tag: str | None = None,
         load_optimizer: bool = True,
         before_commit: Callable[[dict[str, Any] | None, str], None] | None = None,
         trust_pickles: bool | None = None) -> dict[str, Any] | None:
    """Every rank calls this; returns the client state saved with the checkpoint (or None).

    Validate, then mutate: the checkpoint is checked completely, its files hashed (each rank
    a share) and everything this rank will write is read into new tensors, the ranks agreeing
    after each phase; only then are weights, optimizer state, loss scaler and counters
    replaced. A failure anywhere, on any rank, raises on every rank and changes nothing.
    ``before_commit(client_state, kind)`` runs on every rank just before the engine changes
    (an adapter restoring its own state there is covered by the same agreement); ``kind`` is
    who wrote the checkpoint: "zero_strategy", "deepspeed" or "dcp".
    """
    comm = engine.comm
    reader = on_all_ranks(comm, lambda: _open_checked(engine, directory, tag, load_optimizer,
                                                       trust_pickles))
    on_all_ranks(comm, lambda: _verify_share(engine, reader))
    staged = on_all_ranks(comm, lambda: stage_load(engine, reader, load_optimizer,
                                                   before_commit))
    commit_load(engine, staged, load_optimizer)
    return staged.client_state


def on_all_ranks(comm: Communicator, action: Callable[[], Any]) -> Any:
    """Run ``action`` on every rank and agree on the outcome: a rank that failed raises its own
    exception, the others a CheckpointError naming it, so no rank changes anything (or waits
    in a collective for a rank that gave up)."""
    result, error = None, None
    try:
        result = action()
    except Exception as e:  # every rank must hear of it before anyone raises
        error = e
    failed = comm.failures(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed:
        raise CheckpointError("loading the checkpoint failed on " + "; ".join(
            f"rank {r} ({e})" for r, e in failed) + "; nothing was changed")
    return result


def open_reader(directory: str | os.PathLike, tag: str | None = None, *,
                trust: bool | None = None) -> ReaderBase:
    """A reader for the checkpoint at ``directory``, whoever wrote it, told by its layout:
    ours (a manifest, or ``latest`` naming a tag that has one), DeepSpeed's (``latest`` naming
    a tag with ``*model_states.pt``) or DCP's (a ``.metadata`` file, or Accelerate's FSDP
    folder of two DCP directories)."""
    from . import dcp, deepspeed

    root = Path(directory)
    ds_tag = deepspeed.deepspeed_tag(root, tag) if root.is_dir() else None
    if ds_tag is not None:
        return deepspeed.DeepSpeedReader(ds_tag, trust=trust)
    if root.is_dir() and tag is None and dcp.dcp_directories(root):
        return dcp.DcpReader(root, trust=trust)
    return CheckpointReader(resolve(directory, tag))


def _open_checked(engine: EngineView, directory: str | os.PathLike, tag: str | None,
                  load_optimizer: bool, trust_pickles: bool | None = None) -> ReaderBase:
    reader = open_reader(directory, tag, trust=trust_pickles)
    _check_same_model(engine, reader)
    _check_loadable(engine, reader, load_optimizer)
    return reader


def _saved_module(reader: ReaderBase) -> set[str]:
    """Module keys the checkpoint holds whole (buffers, frozen parameters it did not shard)."""
    return set(reader.manifest["state_dict_keys"]) - set(reader.manifest["aliases"])


def _check_same_model(engine: EngineView, reader: ReaderBase) -> None:
    """A frozen parameter may be sharded on one side and whole on the other (stage 3 shards
    the frozen ones outside the optimizer, stages 0-2 keep them whole): it is looked for in
    both places (``_master_range``, ``_module_value``)."""
    saved = {n: tuple(v["shape"]) for n, v in reader.manifest["params"].items()}
    saved_module = _saved_module(reader)
    current = {slot.name: slot.shape for u in engine.units for slot in u.layout.slots}
    unmanaged = engine.unmanaged_state()
    sharded_whole = [n for n in current if n not in saved and n in saved_module]
    shapes = {**{n: reader.module_info(n)[1] for n in sharded_whole}, **saved}
    kinds = {
        "sharded parameters of this model missing from the checkpoint":
            [n for n in current if n not in shapes],
        "checkpoint parameters this model does not have":
            [n for n in saved if n not in current and n not in unmanaged],
        "shapes that differ (checkpoint vs model)":
            [f"{n} {list(shapes[n])} vs {list(current[n])}" for n in current
             if n in shapes and tuple(shapes[n]) != tuple(current[n])],
        "buffers or frozen parameters missing from the checkpoint":
            [k for k in unmanaged if k not in saved_module and _sharded_name(reader, k) is None],
        "buffers or frozen parameters of another shape or dtype (checkpoint vs model)":
            [f"{k} {_module_info(reader, k)} vs {t.dtype, tuple(t.shape)}"
             for k, t in unmanaged.items()
             if (k in saved_module or _sharded_name(reader, k) is not None)
             and not _fits(_module_info(reader, k), t)],
    }
    problems = [f"{len(v)} {kind} (e.g. {', '.join(v[:3])})" for kind, v in kinds.items() if v]
    if problems:
        raise CheckpointError(f"{reader.path}: checkpoint of a different model: "
                              + "; ".join(problems))


def _sharded_name(reader: ReaderBase, key: str) -> str | None:
    """The parameter the checkpoint sharded under module key ``key`` (itself, or the one a
    tied key names), None where it holds none."""
    name = reader.manifest["aliases"].get(key, key)
    return name if name in reader.manifest["params"] else None


def _module_info(reader: ReaderBase, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
    if key in _saved_module(reader):
        return reader.module_info(key)
    name = _sharded_name(reader, key)
    assert name is not None  # the callers checked
    return torch.float32, tuple(reader.manifest["params"][name]["shape"])  # an fp32 master


def _module_value(reader: ReaderBase, key: str) -> torch.Tensor:
    """A buffer or frozen parameter this engine keeps whole: from the module file, or
    assembled from the shards where the checkpoint sharded it (one parameter at a time)."""
    name = _sharded_name(reader, key)
    if key in _saved_module(reader) or name is None:
        return reader.module_tensor(key)
    return reader.read_param(name)


def _master_range(reader: ReaderBase, name: str, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a parameter this engine shards: from the shards, or from the
    module file where the checkpoint kept it whole (frozen, saved below stage 3)."""
    if name in reader.manifest["params"]:
        return reader.read_range(name, "master", start, end)
    return reader.module_tensor(name).reshape(-1)[start:end]


def _fits(info: tuple[torch.dtype, tuple[int, ...]], tensor: torch.Tensor) -> bool:
    """A stored buffer can be copied into ``tensor``: same shape, and floating point into
    floating point (cast) or exactly the same dtype (integers and bools stay exact)."""
    dtype, shape = info
    same_kind = dtype.is_floating_point and tensor.is_floating_point() or dtype == tensor.dtype
    return shape == tuple(tensor.shape) and same_kind


def _check_loadable(engine: EngineView, reader: ReaderBase, load_optimizer: bool) -> None:
    """What the commit will apply besides tensors, tried on copies: the optimizer, its
    hyperparameters and the loss scaler's state."""
    manifest = reader.manifest
    file = reader.path / MANIFEST if reader.kind == "zero_strategy" else reader.path
    if load_optimizer and not manifest["optimizer"]:  # another system's, or converted
        _check_foreign_optimizer(engine, reader)
    elif load_optimizer and manifest["optimizer"] != optimizer_name(engine):
        raise CheckpointError(
            f"{file}: saved with optimizer {manifest['optimizer']}, loading into "
            f"{optimizer_name(engine)}; pass load_optimizer=False to load weights only")
    groups = manifest.get("param_groups")  # v1 checkpoints did not record them
    if load_optimizer and groups is not None:
        if len(groups) != len(engine.user_optimizer.param_groups):
            raise CheckpointError(
                f"{file}: saved with {len(groups)} optimizer param groups, loading into "
                f"{len(engine.user_optimizer.param_groups)}; build the optimizer as when "
                "saving, or pass load_optimizer=False to load weights only")
        for g, (current, saved) in enumerate(zip(engine.user_optimizer.param_groups, groups)):
            for key, value in saved.items():
                if key in current and not _same_kind(current[key], value):
                    raise CheckpointError(
                        f"{file}: field 'param_groups[{g}].{key}' is {value!r}, the optimizer "
                        f"holds {current[key]!r}; a damaged or forged manifest")
        trial = types.SimpleNamespace(param_groups=[
            {k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)
             for k, v in g.items() if k != "params"} for g in engine.user_optimizer.param_groups])
        _try(file, "param_groups",
             lambda: restore_hyperparameters(trial, groups))  # type: ignore[arg-type]
    scaler, state = engine.scaler, manifest["engine"]["loss_scaler"]
    if scaler is not None and state is not None:
        _try(file, "engine.loss_scaler", lambda: copy.deepcopy(scaler).load_state_dict(state))


def _check_foreign_optimizer(engine: EngineView, reader: ReaderBase) -> None:
    """Another system's checkpoint does not name its optimizer class: the saved
    hyperparameter names and state names must be this optimizer's (Adam's moments do not
    load into SGD), and there must be as many param groups."""
    groups = reader.manifest.get("param_groups") or []
    current = engine.user_optimizer.param_groups
    where = f"{reader.path} ({reader.manifest.get('written_by', reader.kind)})"
    if groups and len(groups) != len(current):
        raise CheckpointError(
            f"{where}: saved with {len(groups)} optimizer param groups, loading into "
            f"{len(current)}; build the optimizer as when saving, or pass "
            "load_optimizer=False to load weights only")
    for g, (now, saved) in enumerate(zip(current, groups)):
        differ = sorted(set(saved) ^ (set(now) - {"params"}))
        if differ:
            raise CheckpointError(
                f"{where}: param group {g} has hyperparameters {sorted(saved)}, the optimizer "
                f"{optimizer_name(engine)} has {sorted(set(now) - {'params'})} (differing: "
                f"{differ}): saved with another optimizer; pass load_optimizer=False to load "
                "weights only")


def _same_kind(current: Any, saved: Any) -> bool:
    """A saved hyperparameter can replace the current one: a number for a number (or a
    one-element tensor), a flag for a flag, a string for a string, a list of as many numbers
    for a tuple or list (betas), None for None."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if isinstance(current, torch.Tensor):
        return current.numel() == 1 and number(saved)
    if isinstance(current, bool) or current is None:  # flags such as foreach may be unset
        return saved is None or isinstance(saved, bool)
    if isinstance(current, str):
        return isinstance(saved, str)
    if number(current):
        return number(saved)
    if isinstance(current, (tuple, list)):
        return (isinstance(saved, list) and len(saved) == len(current)
                and all(number(x) == number(c) for x, c in zip(saved, current)))
    return True  # a kind the manifest does not record (hyperparameters() skips it)


def _try(file: Path, field: str, action: Callable[[], None]) -> None:
    try:
        action()
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: field {field!r} cannot be applied ({e!r}); a damaged "
                              "or forged manifest") from e


def _verify_share(engine: EngineView, reader: ReaderBase) -> None:
    """This rank's share of the hashing: file i is hashed by rank i mod world size."""
    comm = engine.comm
    files = sorted(reader.manifest["files"])
    problems = reader.verify([f for i, f in enumerate(files) if i % comm.world_size == comm.rank])
    if problems:
        raise CheckpointError("; ".join(problems))


@dataclass
class Staged:
    """Everything a load writes into the engine, read before the engine is touched."""

    reader: ReaderBase
    masters: list[tuple[torch.Tensor, int, torch.Tensor]]
    """(a unit's master shard, offset in it, values)"""
    module: dict[str, torch.Tensor]
    records: dict[str, dict[str, Any]]
    ranges: dict[tuple[str, str, int | None, int | None], torch.Tensor]
    """Optimizer state ranges, by (parameter, key, start, end)."""
    client_state: dict[str, Any] | None

    def read(self, name: str, key: str, start: int | None, end: int | None) -> torch.Tensor:
        return self.ranges[(name, key, start, end)]  # staged from the same requests


def stage_load(engine: EngineView, reader: ReaderBase, load_optimizer: bool,
                before_commit: Callable[[dict[str, Any] | None, str], None] | None) -> Staged:
    """Read what this rank will write: its master pieces, the module's buffers, its optimizer
    state ranges, the client state. Costs one more copy of the rank's shard until commit."""
    rank = engine.shards.rank if engine.plan.optimizer_shards > 1 else 0
    masters = []
    for unit in engine.units:
        for piece in unit.layout.pieces(rank):
            if not reader.holds(piece.slot.name):  # a partial source: the rest stays
                continue
            values = _master_range(reader, piece.slot.name, piece.slot_start,
                                   piece.slot_start + piece.numel)
            masters.append((unit.param_store.master, piece.shard_start, values))
    module = {key: _module_value(reader, key) for key in engine.unmanaged_state()
              if reader.holds(key)}
    records = param_records(reader.manifest) if load_optimizer else {}
    ranges = {request: reader.read_state(*request)
              for request in requests(engine.optimizer, records)}
    client = reader.client_state()
    if before_commit is not None:
        before_commit(client, reader.kind)
    return Staged(reader, masters, module, records, ranges, client)


def commit_load(engine: EngineView, staged: Staged, load_optimizer: bool) -> None:
    """Write what ``stage_load`` read. Nothing here reads a file or can find a problem."""
    manifest = staged.reader.manifest
    engine.runtime.settle()
    engine.settle_tier()
    engine.runtime.reshard_all()
    engine.zero_grad()
    for unit in engine.units:
        unit.param_store.wait_host_copies()
    with torch.no_grad():
        for master, start, values in staged.masters:
            master[start : start + values.numel()].copy_(values)
        engine.refresh_compute_copies()
        module = engine.unmanaged_state()
        for key, value in staged.module.items():
            module[key].copy_(value)
    groups = manifest.get("param_groups")  # v1 checkpoints did not record them
    if load_optimizer:
        # Saved before the first step (no records): every state goes, as in a new engine;
        # keeping the trained moments resumed a step no run ever took (a batch-size
        # finder's trials restored to the checkpoint saved before them).
        load_records(engine.optimizer, staged.records, staged.read)
        if groups is not None:  # lr, initial_lr, ...: where the schedule had got to
            restore_hyperparameters(engine.user_optimizer, groups)
    state = manifest["engine"]
    engine.global_step, engine.skipped_steps = state["global_step"], state["skipped_steps"]
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])
    engine.comm.barrier()


def read_client_state(directory: str | os.PathLike, tag: str | None = None
                      ) -> dict[str, Any] | None:
    """The client state saved with a checkpoint (None if none was), without an engine: the
    checkpoint is checked as for loading and the file's sha256 verified first."""
    reader = CheckpointReader(resolve(directory, tag))
    return _load_client_state(reader.path, reader.manifest, verify=reader)


def _load_client_state(path: Path, manifest: dict[str, Any],
                       verify: CheckpointReader | None = None) -> dict[str, Any] | None:
    """The client state, unpickled only with ``weights_only=True`` (tensors and plain
    containers; no code runs), from a file listed in the manifest with its sha256 (verified
    here when ``verify`` is given, else by the caller)."""
    if not manifest.get("client_state"):
        return None
    file = path / CLIENT_FILE
    problems = verify.verify([CLIENT_FILE]) if verify is not None else []
    if problems:
        raise CheckpointError("; ".join(problems))
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling refused or a damaged file
        raise CheckpointError(f"{file}: cannot be loaded with weights_only=True "
                              f"({refusal(e)})") from e


# ------------------------------------------------------------------------ consolidation
def consolidate(directory: str | os.PathLike, *, tag: str | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint as a plain ``model.state_dict()`` (loads with ``strict=True``);
    ours, DeepSpeed's or DCP's (see ``open_reader``)."""
    reader = open_reader(directory, tag)
    reader.verify_all()
    return {key: load_fn() for key, load_fn, _, _ in reader.entries(dtype)}


def write_consolidated(directory: str | os.PathLike, out: str | os.PathLike, *,
                       tag: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Stream the consolidated state dict into a safetensors file, one tensor at a time: peak
    memory is the largest tensor, not the model. A failed write leaves no partial file."""
    reader = open_reader(directory, tag)
    reader.verify_all()
    target = Path(out)
    write_safetensors(target, [TensorOut(*entry) for entry in reader.entries(dtype)],
                      metadata={"source": str(reader.path)})
    return target


__all__ = ["CLIENT_FILE", "CheckpointReader", "consolidate", "load", "read_client_state",
           "resolve", "write_consolidated"]
