"""Broken copies of a ``save_pretrained`` folder, one per way a folder nobody vouches for can
be wrong, for the pretrained-loading tests (tests/quick/test_pretrained.py and the world
tests/worlds/scenarios_pretrained.py). Each case maps to what its error must name."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

WEIGHTS = "model.safetensors"
VICTIM = "transformer.wpe.weight"
"""The tensor each broken file gets wrong (GPT-2's position embedding)."""

CASES = {
    "no_such_folder": ["no such model folder"],
    "no_weights": ["holds neither model.safetensors"],
    "pickle_only": ["pytorch_model.bin", "never pickles"],
    "wrong_shape": [WEIGHTS, VICTIM, "has shape"],
    "truncated": [WEIGHTS, "tensor '", "data_offsets"],
    "forged_offset": [WEIGHTS, VICTIM, "data_offsets"],
    "bad_dtype": [WEIGHTS, VICTIM, "unsupported dtype"],
    "index_escapes": ["model.safetensors.index.json", "weight_map", "not a plain file"],
    "index_names_absent_key": ["model.safetensors.index.json", "ghost.weight", "lacks it"],
    "symlink_outside": [WEIGHTS, "outside the checkpoint directory"],
    "index_not_json": ["model.safetensors.index.json", "not JSON"],
}
"""Case -> fragments its CheckpointError must contain (the file, the key, the problem)."""


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _write(path: Path, header: dict, body: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)


def _copy(good: Path, out: Path, name: str) -> Path:
    target = out / name
    shutil.copytree(good, target)
    return target


def broken_folders(good: Path, out: Path) -> None:
    """Write every case of ``CASES`` (but ``no_such_folder``) under ``out`` from the folder
    ``good`` (a single-file GPT-2 ``save_pretrained``)."""
    (out / "no_weights").mkdir()
    shutil.copy(good / "config.json", out / "no_weights" / "config.json")
    pickle = _copy(good, out, "pickle_only")
    (pickle / WEIGHTS).rename(pickle / "pytorch_model.bin")
    header, body = _header(good / WEIGHTS)

    shape = json.loads(json.dumps(header))
    rows, cols = shape[VICTIM]["shape"]
    shape[VICTIM]["shape"] = [rows * cols]  # same bytes, another shape
    _write(_copy(good, out, "wrong_shape") / WEIGHTS, shape, body)

    truncated = _copy(good, out, "truncated") / WEIGHTS
    truncated.write_bytes(truncated.read_bytes()[:-64])

    forged = json.loads(json.dumps(header))
    start, end = forged[VICTIM]["data_offsets"]
    forged[VICTIM]["data_offsets"] = [start + len(body), end + len(body)]
    _write(_copy(good, out, "forged_offset") / WEIGHTS, forged, body)

    dtype = json.loads(json.dumps(header))
    dtype[VICTIM]["dtype"] = "F8_E4M3"
    _write(_copy(good, out, "bad_dtype") / WEIGHTS, dtype, body)

    keys = [k for k in header if k != "__metadata__"]
    for case, weight_map in (
            ("index_escapes", {k: "../model.safetensors" for k in keys}),
            ("index_names_absent_key", {**dict.fromkeys(keys, WEIGHTS),
                                        "ghost.weight": WEIGHTS})):
        folder = _copy(good, out, case)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    (_copy(good, out, "index_not_json") / "model.safetensors.index.json").write_text("{")

    outside = out / "elsewhere.safetensors"
    shutil.copy(good / WEIGHTS, outside)
    link = _copy(good, out, "symlink_outside") / WEIGHTS
    link.unlink()
    os.symlink(outside, link)
