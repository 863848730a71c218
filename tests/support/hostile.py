"""Hostile and damaged checkpoint directories, made from a good one by editing files on disk
as an attacker (or a broken disk) would. No torch.distributed here: the scenarios load these
into engines, the tests consolidate them in the pytest process.

Every forgery that changes a file also fixes the manifest's size and sha256 for it, so the
checks under test are the structural ones, not the checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zero_strategy.core.flat import shard_numel_for

TAG = "t"
MANIFEST = "manifest.json"
SHARD0, SHARD1 = "shard-00000.safetensors", "shard-00001.safetensors"
CLIENT = "client_state.pt"


class _Payload:
    """Unpickled with weights_only=False, this creates the file ``marker`` (here: harmless
    proof that code ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def payload_bytes(marker: Path) -> bytes:
    """A torch.save file whose unpickling (without weights_only) writes ``marker``."""
    path = marker.with_name(marker.name + ".payload")
    torch.save({"state": _Payload(marker)}, path)
    data = path.read_bytes()
    path.unlink()
    return data


def edit_manifest(tag_dir: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    change(manifest)
    (tag_dir / MANIFEST).write_text(json.dumps(manifest))


def refresh(tag_dir: Path, name: str) -> None:
    """Make the manifest's size and sha256 of ``name`` match the (forged) file."""
    data = (tag_dir / name).read_bytes()
    edit_manifest(tag_dir, lambda m: m["files"].__setitem__(
        name, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def rewrite_header(file: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Edit a safetensors header in place (same data), then fix the manifest."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])
    refresh(file.parent, file.name)


def _first_master(header: dict[str, Any]) -> dict[str, Any]:
    return header[sorted(k for k in header if k.endswith(".master"))[0]]


def _last_slot(m: dict[str, Any], numel: int) -> None:
    """Unit 0's last parameter declared with ``numel`` elements, everything else consistent."""
    unit = m["units"][0]
    slot = unit["slots"][-1]
    slot[1], slot[3] = [numel], numel
    m["params"][slot[0]]["shape"] = [numel]
    unit["shard_numel"] = shard_numel_for(slot[2] + numel, unit["num_shards"],
                                          unit["shard_align"])


def _one_shard(m: dict[str, Any]) -> None:
    """The whole checkpoint forged as if written by one rank."""
    m["optimizer_shards"] = 1
    for unit in m["units"]:
        end = unit["slots"][-1][2] + unit["slots"][-1][3] if unit["slots"] else 0
        unit["num_shards"] = 1
        unit["shard_numel"] = shard_numel_for(end, 1, unit["shard_align"])
    del m["files"][SHARD1]


def _into_padding(m: dict[str, Any]) -> None:
    """The first slot with padding after it moved one element into it."""
    for unit in m["units"]:
        ends = [s[2] for s in unit["slots"][1:]] + [unit["shard_numel"] * unit["num_shards"]]
        for slot, limit in zip(unit["slots"], ends):
            if slot[2] + slot[3] < limit:
                slot[2] += 1
                return
    raise ValueError("no slot of this checkpoint has padding after it")


def _first_param(m: dict[str, Any]) -> str:
    return m["units"][0]["slots"][0][0]


def make_fifo(path: Path) -> None:
    """``path`` replaced by a FIFO (reading one never ends)."""
    path.unlink()
    os.mkfifo(path)


def make_link(path: Path, target: Path | str) -> None:
    """``path`` (a file or a folder) replaced by a symlink to ``target``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(target)


# name -> (edit(root, outside, marker), text the error must contain). ``root`` is a copy of
# the good checkpoint directory, ``outside`` a good copy next to it (a target for links).
Edit = Callable[[Path, Path, Path], Any]
VARIANTS: dict[str, tuple[Edit, str]] = {
    "latest_traversal": (lambda r, o, _: (r / "latest").write_text(f"../{o.name}/{TAG}"),
                         "is not a plain file or directory name"),
    "latest_absolute": (lambda r, o, _: (r / "latest").write_text(str(o / TAG)),
                        "is not a plain file or directory name"),
    "latest_fifo": (lambda r, o, _: make_fifo(r / "latest"), "is not a regular file"),
    "tag_symlink": (lambda r, o, _: make_link(r / TAG, o / TAG),
                    "outside the checkpoint directory"),
    "shard_symlink": (lambda r, o, _: make_link(r / TAG / SHARD0, o / TAG / SHARD0),
                      "outside the checkpoint directory"),
    "manifest_symlink": (lambda r, o, _: make_link(r / TAG / MANIFEST, o / TAG / MANIFEST),
                         "outside the checkpoint directory"),
    "shard_dev_zero": (lambda r, o, _: make_link(r / TAG / SHARD1, "/dev/zero"),
                       "outside the checkpoint directory"),
    "shard_fifo": (lambda r, o, _: make_fifo(r / TAG / SHARD1), "is not a regular file"),
    "entry_dev_zero": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["files"].__setitem__(
        "/dev/zero", {"bytes": 0, "sha256": "0" * 64})), "is not a plain file or directory name"),
    "entry_traversal": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["files"].__setitem__(
        f"../../{o.name}/{TAG}/{SHARD0}", {"bytes": 0, "sha256": "0" * 64})),
        "is not a plain file or directory name"),
    "manifest_not_object": (lambda r, o, _: (r / TAG / MANIFEST).write_text("[1, 2]"),
                            "not a JSON object"),
    "missing_units": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m.pop("units")),
                      "field 'units' is missing"),
    "missing_step": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["engine"].pop(
        "global_step")), "field 'engine.global_step' is missing"),
    "counter_string": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["engine"].__setitem__(
        "global_step", "7")), "field 'engine.global_step' must be int"),
    "unit_shard_count": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["units"][0].__setitem__(
        "num_shards", 1)), "field 'units[0].num_shards' is 1"),
    "all_shard_counts": (lambda r, o, _: edit_manifest(r / TAG, _one_shard),
                         "the manifest's unit layout"),
    "shape_vs_layout": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["params"][
        _first_param(m)].__setitem__("shape", [7, 7])), "is not in 'params' with this shape"),
    "numel_vs_shape": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["units"][0]["slots"][0]
                                                     .__setitem__(3, 3)), ".numel' is 3"),
    "huge_numel": (lambda r, o, _: edit_manifest(r / TAG, lambda m: _last_slot(m, 2**40)),
                   "the manifest's unit layout"),
    # Found by the fuzzer: moved within the padding after it, a slot overlapped nothing and
    # kept the shard size, and every loader read its weights one element off.
    "slot_in_padding": (lambda r, o, _: edit_manifest(r / TAG, _into_padding),
                        "slots start at"),
    "unknown_dtype": (lambda r, o, _: rewrite_header(r / TAG / SHARD0, lambda h: _first_master(
        h).__setitem__("dtype", "F8_E4M3")), "unsupported dtype 'F8_E4M3'"),
    "offsets_past_end": (lambda r, o, _: rewrite_header(r / TAG / SHARD0, lambda h: _first_master(
        h)["data_offsets"].__setitem__(1, 10**9)), "field 'data_offsets'"),
    "state_key_unknown": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["param_states"][
        _first_param(m)]["tensors"].append("bogus")), "are not all in state_keys"),
    "state_tensor_missing": (lambda r, o, _: edit_manifest(r / TAG, lambda m: (
        m["state_keys"].append("momentum_buffer"),
        m["param_states"][_first_param(m)]["tensors"].append("momentum_buffer"))),
        "is missing (the manifest's layout needs it)"),
    "module_key_missing": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m[
        "state_dict_keys"].append("extra.buffer")), "['extra.buffer'] listed in the manifest"),
    "client_altered": (lambda r, o, _: _flip_last_byte(r / TAG / CLIENT),
                       "client_state.pt: sha256 differs"),
    "client_unlisted": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["files"].pop(CLIENT)),
                        "field 'client_state'"),
    "client_payload": (lambda r, o, marker: _client_payload(r / TAG, marker),
                       "cannot be loaded with weights_only=True"),
}


# Refused when loading into an engine (what the engine would apply), harmless to readers.
ENGINE_VARIANTS: dict[str, tuple[Edit, str]] = {
    "param_group_type": (lambda r, o, _: edit_manifest(r / TAG, lambda m: m["param_groups"][0]
                                                       .__setitem__("lr", "fast")),
                         "field 'param_groups[0].lr' is 'fast'"),
}


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))


def _client_payload(tag_dir: Path, marker: Path) -> None:
    (tag_dir / CLIENT).write_bytes(payload_bytes(marker))
    refresh(tag_dir, CLIENT)


def make_variants(good: Path, out: Path) -> dict[str, dict[str, str]]:
    """Every variant as a checkpoint directory under ``out``: {name: {"root", "marker",
    "expect"}}. ``good`` is a checkpoint directory whose ``latest`` is ``TAG``."""
    out.mkdir(parents=True, exist_ok=True)
    outside = out / "outside"
    shutil.copytree(good, outside)
    made = {}
    for name, (edit, expect) in {**VARIANTS, **ENGINE_VARIANTS}.items():
        root = out / name
        shutil.copytree(good, root)
        marker = out / f"{name}.marker"
        edit(root, outside, marker)
        made[name] = {"root": str(root), "marker": str(marker), "expect": expect}
    return made


def forge_framework_state(good: Path, out: Path, marker: Path, key: str) -> None:
    """A copy of a Lightning / Fabric checkpoint directory whose framework state (the bytes
    under ``key`` in the client state) is the marker payload, checksums fixed."""
    shutil.copytree(good, out)
    tag_dir = next(p.parent for p in out.glob(f"*/{MANIFEST}"))
    blob = torch.frombuffer(bytearray(payload_bytes(marker)), dtype=torch.uint8)
    torch.save({key: blob}, tag_dir / CLIENT)
    refresh(tag_dir, CLIENT)


def forge_traversal(good: Path, out: Path) -> None:
    """A copy whose ``latest`` names a directory outside it."""
    shutil.copytree(good, out)
    (out / "latest").write_text(f"../{good.name}/{(good / 'latest').read_text()}")
