"""Checking a checkpoint directory nobody vouches for, before a single tensor is read.

Every loader (``engine.load_checkpoint``, consolidation, the command line, the adapters)
reads a checkpoint through ``resolve`` and ``CheckpointReader`` (``read.py``), which call
this module first. What a checkpoint directory someone else produced can and cannot do:

- paths: ``latest``, tag names and the manifest's file names are plain names; every file read
  is a regular file whose real path lies inside the checkpoint directory (a symlink that
  leaves it, ``../x``, an absolute path, a FIFO or ``/dev/zero`` are refused before opening);
- the manifest is checked completely: its schema, each unit's layout (every shape, offset and
  the padding the shard count implies), the files it lists (names, sizes, sha256), and every
  tensor header of every safetensors file against the layout (known dtypes, shapes,
  offsets within the file), so what is read later is bounded by the files' sizes;
- nothing is unpickled except the client state, with ``weights_only=True``.

It can still give you weights you did not want: a consistent checkpoint of the same model is
loaded as it is (the sha256 in the manifest proves integrity against damage, not origin).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

import torch

from ..config import PRECISIONS
from ..core.flat import ALIGN_ELEMENTS, FROZEN_GROUP, shard_numel_for
from . import bounds
from .errors import CheckpointError
from .write import (
    CLIENT_FILE,
    FORMAT,
    LATEST,
    MANIFEST,
    MODULE_FILE,
    READABLE_VERSIONS,
    old_name,
    shard_file,
)

ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
"""The safetensors dtypes this reader knows (all the engine writes)."""
DTYPES_FROM_ST = {v: k for k, v in ST_DTYPES.items()}
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}
"""Dtype names a manifest may give a parameter (its master's dtype)."""

MAX_SHARD_ALIGN = 1 << 12
"""A larger alignment would only be padding (and a hostile manifest's memory bomb)."""
MAX_MANIFEST_BYTES = 1 << 28
MAX_HEADER_BYTES = 100_000_000
_STATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# ---------------------------------------------------------------------------- paths
def plain_name(name: Any, what: str) -> str:
    """``name`` if it names an entry of a directory and nothing else (no separator, no
    ``..``, not hidden); else a CheckpointError naming ``what``."""
    if (not isinstance(name, str) or not name or len(name) > 255 or name.startswith(".")
            or any(c in name for c in "/\\\0") or name != name.strip()):
        raise CheckpointError(f"{what}: {name!r} is not a plain file or directory name "
                              "(paths, '..' and hidden names are refused)")
    return name


def member(root: Path, path: Path, what: str, *, directory: bool = False) -> Path:
    """``path`` after checking that it exists, is a regular file (or a directory) and that its
    real path lies inside ``root``'s: symlinks may point within the checkpoint, not out of it."""
    try:
        real = Path(os.path.realpath(path))
        mode = os.stat(real).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: {what} is missing or unreadable ({e.strerror})") from e
    inside = Path(os.path.realpath(root))
    if real != inside and inside not in real.parents:
        raise CheckpointError(f"{path}: {what} resolves to {real}, outside the checkpoint "
                              f"directory {inside} (a symlink or path that leaves it)")
    if directory and not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: {what} is not a directory")
    if not directory and not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {what} is not a regular file (a device, FIFO or "
                              "directory is never read)")
    return path


def _read_small(root: Path, path: Path, what: str, limit: int) -> bytes:
    member(root, path, what)
    size = path.stat().st_size
    if size > limit:
        raise CheckpointError(f"{path}: {what} is {size} bytes, more than the {limit} allowed")
    return path.read_bytes()


def resolve(directory: str | os.PathLike, tag: str | None = None) -> Path:
    """The tag directory to read: ``directory`` itself if it holds a manifest, else its
    ``latest`` tag (or ``tag``). A tag left half-replaced by a crash between the two renames
    of an overwrite is read from its previous version (``.old-<tag>``)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if tag is None and (root / MANIFEST).exists():
        member(root, root / MANIFEST, MANIFEST)
        return root
    if tag is None:
        latest = root / LATEST
        if not latest.exists() and not latest.is_symlink():
            raise CheckpointError(f"{root}: no {MANIFEST} and no '{LATEST}' file: not a "
                                  "zero_strategy checkpoint (or no save ever completed)")
        text = _read_small(root, latest, f"'{LATEST}'", 4096)
        try:
            tag = plain_name(text.decode("utf-8").strip(), f"{latest}: the tag it names")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{latest}: not a tag name ({e})") from e
    path = root / plain_name(tag, f"{root}: tag")
    if not path.exists() and not path.is_symlink() and (root / old_name(tag)).is_dir():
        path = root / old_name(tag)  # killed between the renames: the previous version
    member(root, path, f"tag directory {tag!r}", directory=True)
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path}: {MANIFEST} is missing: the checkpoint is incomplete")
    member(root, path / MANIFEST, MANIFEST)
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of tag directory ``path``, checked completely (see ``check_manifest``)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(_read_small(path, file, MANIFEST, MAX_MANIFEST_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable manifest ({e})") from e
    check_manifest(file, manifest)
    return manifest


def refusal(error: Exception) -> str:
    """The line of torch's weights_only refusal that names what was refused (its full text
    is a page of advice on loading the file anyway)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "WeightsUnpickler error" in line]
    return (named or lines or [type(error).__name__])[0]


# ---------------------------------------------------------------------------- the manifest
def _fail(file: Path, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{file}: field {field!r} {problem} (a damaged or forged manifest)")


def _get(file: Path, data: Any, field: str, kind: type | tuple[type, ...], where: str = ""
         ) -> Any:
    name = f"{where}.{field}" if where else field
    if not isinstance(data, dict) or field not in data:
        raise _fail(file, name, "is missing")
    value = data[field]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _fail(file, name, f"must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise _fail(file, name, f"must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _count(file: Path, data: Any, field: str, where: str = "", low: int = 0) -> int:
    value = _get(file, data, field, int, where)
    if value < low:
        raise _fail(file, f"{where}.{field}" if where else field, f"must be >= {low}, got {value}")
    return value


def _shape(file: Path, value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise _fail(file, field, f"must be a list of sizes >= 0, got {value!r}")
    return tuple(value)


def check_manifest(file: Path, manifest: Any) -> None:
    """Schema and consistency of a manifest, down to every unit's layout and the files it
    lists; a CheckpointError names the file and the field."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this zero_strategy reads {FORMAT!r} versions {list(READABLE_VERSIONS)}")
    _get(file, manifest, "tag", str)
    if _count(file, manifest, "stage") > 3:
        raise _fail(file, "stage", f"must be 0-3, got {manifest['stage']}")
    world = _count(file, manifest, "world_size", low=1)
    shards = _count(file, manifest, "optimizer_shards", low=1)
    if shards not in (1, world):
        raise _fail(file, "optimizer_shards", f"must be 1 or world_size ({world}), got {shards}")
    if _get(file, manifest, "precision", str) not in PRECISIONS:
        raise _fail(file, "precision", f"must be one of {PRECISIONS}")
    _get(file, manifest, "optimizer", str)
    _check_engine_state(file, manifest)
    _check_params(file, manifest)
    _check_units(file, manifest, shards)
    _check_states(file, manifest)
    _check_files(file, manifest, shards)
    groups = manifest.get("param_groups")
    if groups is not None and not (isinstance(groups, list)
                                   and all(isinstance(g, dict) for g in groups)):
        raise _fail(file, "param_groups", "must be a list of objects")


def _check_engine_state(file: Path, manifest: dict[str, Any]) -> None:
    engine = _get(file, manifest, "engine", dict)
    _count(file, engine, "global_step", "engine")
    _count(file, engine, "skipped_steps", "engine")
    scaler = _get(file, engine, "loss_scaler", (dict, type(None)), "engine")
    for key, value in (scaler or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise _fail(file, f"engine.loss_scaler.{key}", f"must be a finite number, got "
                        f"{value!r}")


def _check_params(file: Path, manifest: dict[str, Any]) -> None:
    params = _get(file, manifest, "params", dict)
    for name, entry in params.items():
        where = f"params.{name}"
        _shape(file, _get(file, entry, "shape", list, where), f"{where}.shape")
        if _get(file, entry, "dtype", str, where) not in PARAM_DTYPES:
            raise _fail(file, f"{where}.dtype", f"must be one of {sorted(PARAM_DTYPES)}, got "
                        f"{entry['dtype']!r}")
    keys = _get(file, manifest, "state_dict_keys", list)
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise _fail(file, "state_dict_keys", "must be a list of distinct strings")
    aliases = _get(file, manifest, "aliases", dict)
    for key, name in aliases.items():
        if not isinstance(name, str) or name not in params or key not in keys:
            raise _fail(file, f"aliases.{key}", f"names {name!r}, which is not a parameter "
                        "of the manifest (or the key is not in state_dict_keys)")


def _check_units(file: Path, manifest: dict[str, Any], shards: int) -> None:
    """Every unit's layout: slots of the declared shapes, in order and without overlap, the
    shard size the element count and shard count imply, each parameter in exactly one slot."""
    params = manifest["params"]
    seen: set[str] = set()
    for u, unit in enumerate(_get(file, manifest, "units", list)):
        where = f"units[{u}]"
        if _count(file, unit, "num_shards", where, low=1) != shards:
            raise _fail(file, f"{where}.num_shards", f"is {unit['num_shards']}, but the "
                        f"checkpoint has {shards} optimizer shard file(s)")
        end = 0
        for s, slot in enumerate(_get(file, unit, "slots", list, where)):
            name = _slot(file, slot, f"{where}.slots[{s}]", end)
            offset, numel = slot[2], slot[3]
            if name in seen or name not in params or _shape(
                    file, params[name]["shape"], f"params.{name}.shape") != tuple(slot[1]):
                raise _fail(file, f"{where}.slots[{s}]", f"parameter {name!r} is not in "
                            "'params' with this shape, or appears twice")
            seen.add(name)
            end = offset + numel
        align = _shard_align(file, manifest, unit, where)
        expected = shard_numel_for(end, shards, align)
        if _count(file, unit, "shard_numel", where) != expected:
            raise _fail(file, f"{where}.shard_numel", f"is {unit['shard_numel']}; "
                        f"{end} elements over {shards} shard(s) aligned to {align} make "
                        f"{expected}")
    missing = sorted(set(params) - seen)
    if missing:
        raise _fail(file, "units", f"place no slot for parameters {missing[:3]}")


def _shard_align(file: Path, manifest: dict[str, Any], unit: Any, where: str) -> int:
    """Format 3 records each unit's shard alignment (elements); older formats had none."""
    if manifest["version"] < 3:
        if "shard_align" in unit:
            raise _fail(file, f"{where}.shard_align", "is not part of format "
                        f"v{manifest['version']} (it was added in v3)")
        return 1
    align = _count(file, unit, "shard_align", where, low=1)
    if align > MAX_SHARD_ALIGN:
        raise _fail(file, f"{where}.shard_align", f"must be at most {MAX_SHARD_ALIGN}, "
                    f"got {align}")
    return align


def _slot(file: Path, slot: Any, where: str, previous_end: int) -> str:
    """One ``[name, shape, offset, numel, group]`` slot, after the previous slot's end."""
    if not isinstance(slot, list) or len(slot) != 5 or not isinstance(slot[0], str):
        raise _fail(file, where, "must be [name, shape, offset, numel, group]")
    shape = _shape(file, slot[1], f"{where}.shape")
    for index, field in ((2, "offset"), (3, "numel"), (4, "group")):
        value = slot[index]
        # group -1 (FROZEN_GROUP): a frozen parameter sharded in no optimizer group
        low = FROZEN_GROUP if field == "group" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _fail(file, f"{where}.{field}", f"must be an int >= {low}, got {value!r}")
    if slot[3] != math.prod(shape):
        raise _fail(file, f"{where}.numel", f"is {slot[3]}, the shape {list(shape)} holds "
                    f"{math.prod(shape)}")
    if slot[2] < previous_end:
        raise _fail(file, f"{where}.offset", f"{slot[2]} overlaps the previous slot (ends at "
                    f"{previous_end})")
    # Where the writer puts it, exactly: a slot moved within the padding before the next
    # boundary overlaps nothing, keeps the shard size, and would read shifted weights.
    expected = -(-previous_end // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    if slot[2] != expected:
        raise _fail(file, f"{where}.offset", f"is {slot[2]}; slots start at the first multiple "
                    f"of {ALIGN_ELEMENTS} elements after the previous slot's end ({expected})")
    return slot[0]


def _check_states(file: Path, manifest: dict[str, Any]) -> None:
    keys = _get(file, manifest, "state_keys", list)
    if not all(isinstance(k, str) and _STATE_KEY.match(k) and k != "master" for k in keys):
        raise _fail(file, "state_keys", "must be a list of identifiers (not 'master')")
    if manifest["version"] >= 2:
        records, field = _get(file, manifest, "param_states", dict), "param_states"
    else:
        records, field = _get(file, manifest, "scalar_states", dict), "scalar_states"
    for name, record in records.items():
        where = f"{field}.{name}"
        if manifest["version"] < 2:
            _numbers(file, record, where)
            continue
        if name not in manifest["params"]:
            raise _fail(file, where, "names no parameter of the manifest")
        _numbers(file, _get(file, record, "scalars", dict, where), f"{where}.scalars")
        tensors = _get(file, record, "tensors", list, where)
        if not all(isinstance(t, str) for t in tensors) or not set(tensors) <= set(keys):
            raise _fail(file, f"{where}.tensors", f"{tensors} are not all in state_keys {keys}")
        _check_whole(file, record.get("whole", {}), f"{where}.whole", manifest)


def _check_whole(file: Path, whole: Any, where: str, manifest: dict[str, Any]) -> None:
    """Whole state tensors of an owner-placed optimizer (format 4): key -> shape, float
    dtype and the shard file that holds it."""
    if not isinstance(whole, dict):
        raise _fail(file, where, "must be an object")
    for key, info in whole.items():
        at = f"{where}.{key}"
        if not (isinstance(key, str) and _STATE_KEY.match(key)):
            raise _fail(file, at, "must be named by an identifier")
        if not isinstance(info, dict):
            raise _fail(file, at, "must be an object")
        _shape(file, _get(file, info, "shape", list, at), f"{at}.shape")
        dtype = _get(file, info, "dtype", str, at)
        if dtype not in PARAM_DTYPES:
            raise _fail(file, f"{at}.dtype", f"must be a float dtype, got {dtype!r}")
        if _count(file, info, "shard", at) >= manifest["optimizer_shards"]:
            raise _fail(file, f"{at}.shard", f"must be below optimizer_shards "
                        f"({manifest['optimizer_shards']}), got {info['shard']}")


def _numbers(file: Path, values: Any, where: str) -> None:
    if not isinstance(values, dict):
        raise _fail(file, where, "must be an object")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value)):
            raise _fail(file, f"{where}.{key}", f"must be a finite number, got {value!r}")


def param_records(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per parameter name: {"scalars": {...}, "tensors": [...]} (v1 checkpoints recorded
    scalars per param group, every parameter of a group with the same state)."""
    if manifest["version"] >= 2:
        return manifest["param_states"]
    groups, keys = manifest["scalar_states"], manifest["state_keys"]
    out = {}
    for layout in manifest["units"]:
        for name, _, _, _, group in layout["slots"]:
            scalars = groups.get(str(group), {})
            if scalars or keys:
                out[name] = {"scalars": scalars, "tensors": keys}
    return out


def _check_files(file: Path, manifest: dict[str, Any], shards: int) -> None:
    files = _get(file, manifest, "files", dict)
    allowed = {shard_file(k) for k in range(shards)} | {MODULE_FILE, CLIENT_FILE}
    for name, entry in files.items():
        if plain_name(name, f"{file}: files entry") not in allowed:
            raise _fail(file, f"files.{name}", "is not a file this checkpoint format has")
        _count(file, entry, "bytes", f"files.{name}")
        digest = _get(file, entry, "sha256", str, f"files.{name}")
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise _fail(file, f"files.{name}.sha256", "must be 64 hex digits")
    missing = sorted(allowed - {CLIENT_FILE} - set(files))
    if missing:
        raise _fail(file, "files", f"does not list {missing}")
    client = _get(file, manifest, "client_state", (str, type(None)))
    if client is not None and (client != CLIENT_FILE or CLIENT_FILE not in files):
        raise _fail(file, "client_state", f"is {client!r}, but only {CLIENT_FILE!r} listed "
                    "with its size and sha256 in 'files' is read (older checkpoints did not "
                    "checksum it; an unverified file is never loaded)")


# ---------------------------------------------------------------------------- tensor files
def read_header(path: Path, size: int) -> tuple[dict[str, dict[str, Any]], int]:
    """A safetensors file's tensor table, every entry checked against the file's ``size``
    (known dtype, a shape whose bytes equal its span, offsets within the data); and where the
    data starts."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, entry in header.items():
        _check_entry(path, name, entry, data)
    return header, 8 + length


def _check_entry(path: Path, name: str, entry: Any, data_bytes: int) -> None:
    """One header entry through the readers' shared checks (``bounds.py``): a known dtype, a
    shape, ``data_offsets`` inside the data, and a span of exactly the shape's bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES_FROM_ST:
        got = entry.get("dtype") if isinstance(entry, dict) else entry
        raise CheckpointError(f"{where}: unsupported dtype {got!r} (this reader knows "
                              f"{', '.join(DTYPES_FROM_ST)})")
    key = f"tensor {name!r}"
    dims = bounds.shape(path, key, entry.get("shape"), "field 'shape'")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2):
        raise bounds.fail(path, key, f"field 'data_offsets' must be [begin, end], got "
                          f"{offsets!r}")
    begin = bounds.count(path, key, offsets[0], "field 'data_offsets' begin")
    end = bounds.count(path, key, offsets[1], "field 'data_offsets' end", low=begin)
    bounds.byte_range(path, f"{key} field 'data_offsets'", begin, end - begin, data_bytes,
                      within="data section")
    need = bounds.nbytes(dims, DTYPES_FROM_ST[entry["dtype"]])
    if need != end - begin:
        raise CheckpointError(f"{where}: field 'shape' {list(dims)} needs {need} bytes, "
                              f"'data_offsets' span {end - begin}")


def check_tensors(path: Path, manifest: dict[str, Any],
                  headers: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Every tensor the manifest implies is in its file, with the layout's shape: each unit's
    master and optimizer states in every shard file, the rest of the state dict in the module
    file. Reads are then bounded by the layout, and the layout by the files' sizes."""
    params, states = manifest["params"], param_records(manifest)
    for u, unit in enumerate(manifest["units"]):
        if not unit["slots"]:
            continue
        dtype = params[unit["slots"][0][0]]["dtype"]
        keys = sorted({k for s in unit["slots"] for k in states.get(s[0], {}).get("tensors", [])})
        n = unit["shard_numel"]
        for k in range(unit["num_shards"]):
            header = headers[shard_file(k)]
            # A shard holding no piece of a parameter with state ``key`` (only padding, or
            # only parameters of another optimizer) has none to write, and no read of that
            # key ever reaches it.
            needed = {key for name, _, offset, numel, _ in unit["slots"]
                      if offset < (k + 1) * n and offset + numel > k * n
                      for key in states.get(name, {}).get("tensors", [])}
            for key in ["master", *keys]:
                name = f"u{u}.{key}"
                entry = header.get(name)
                where = f"{path / shard_file(k)}: tensor {name!r}"
                if entry is None and key != "master" and key not in needed:
                    continue
                if entry is None:
                    raise CheckpointError(f"{where} is missing (the manifest's layout needs it)")
                if entry["shape"] != [unit["shard_numel"]]:
                    raise CheckpointError(f"{where} has shape {entry['shape']}, the manifest's "
                                          f"unit layout [{unit['shard_numel']}]")
                if key == "master" and entry["dtype"] != ST_DTYPES[PARAM_DTYPES[dtype]]:
                    raise CheckpointError(f"{where} is {entry['dtype']}, the manifest says "
                                          f"{dtype}")
                if not DTYPES_FROM_ST[entry["dtype"]].is_floating_point:
                    raise CheckpointError(f"{where} is {entry['dtype']}, not a float dtype")
    for name, record in states.items():
        for key, info in record.get("whole", {}).items():
            file = shard_file(info["shard"])
            tensor = f"w.{name}.{key}"
            entry = headers[file].get(tensor)
            where = f"{path / file}: tensor {tensor!r}"
            if entry is None:
                raise CheckpointError(f"{where} is missing (the manifest's param_states name it)")
            if entry["shape"] != info["shape"] or entry["dtype"] != ST_DTYPES[
                    PARAM_DTYPES[info["dtype"]]]:
                raise CheckpointError(f"{where} is {entry['dtype']} {entry['shape']}, the "
                                      f"manifest says {info['dtype']} {info['shape']}")
    module = headers[MODULE_FILE]
    missing = [k for k in manifest["state_dict_keys"]
               if k not in manifest["aliases"] and k not in module]
    if missing:
        raise CheckpointError(f"{path / MODULE_FILE}: tensors {missing[:3]} listed in the "
                              "manifest's state_dict_keys are missing")
