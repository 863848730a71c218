"""The fuzzer's mutations (``tests/support/fuzz.py``): what an attacker, or a broken disk, does
to a checkpoint directory, applied to a fresh copy of a real one.

Four sources, written by the real writers (``tests/worlds/fuzz_sources.py``): DeepSpeed
ZeRO-3 and ZeRO-2 (``ds3``, ``ds2``), FSDP2's DCP (``dcp``) and ours (``ours``). Each has a
catalogue of named, structured mutations (sizes, offsets, dtypes, chunk lists, truncation,
missing and extra files, pickles with payloads, symlinks, ``latest`` tricks), each with the
text its refusal must contain (None: refused or loaded as the original, either is right);
``ours`` takes ``tests/support/hostile.py``'s. ``random_mutation`` draws the rest from a seed:
bytes flipped, overwritten or cut off anywhere in any file, and numbers of the metadata set
to edge values.

The sources are the anchors' own files, so editing their pickles here uses the full
unpickler: nothing from outside this test's own writers is ever loaded that way.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support import hostile

SOURCES = ("ds3", "ds2", "dcp", "ours")
DS_TAG = "global_step2"
WEIGHT = "blocks.0.0.weight"  # [33, 33]: FSDP2 saves rows [0, 17) and [17, 33) as two chunks
DCP_KEYS = (f"model.{WEIGHT}", f"optimizer.state.{WEIGHT}.exp_avg",
            f"optimizer.state.{WEIGHT}.exp_avg_sq")


@dataclass(frozen=True)
class Context:
    """Where a mutation may reach: ``root`` (the copy it edits), ``outside`` (a good copy
    beside it, a target for links out), ``marker`` (what a payload would create)."""

    root: Path
    outside: Path
    marker: Path
    rng: random.Random


Edit = Callable[[Context], Any]


@dataclass(frozen=True)
class Mutation:
    edit: Edit
    expect: str | None
    """Text a refusal must contain; None: refused (naming the file) or loaded as the original."""
    protected: bool = True
    """False where no checksum covers the bytes (our manifest.json): a load that parses and
    passes the checks may then differ in counters and hyperparameters, never in weights."""
    unread_by: tuple[str, ...] = ()
    """Loaders that never read what was changed (the client state, for consolidation): for
    them, a load equal to the original's is right too."""


# ---------------------------------------------------------------------------- file tricks
def payload_pickle(marker: Path) -> bytes:
    """A plain pickle that, unpickled, creates ``marker``."""
    return pickle.dumps(hostile._Payload(marker), protocol=4)


def _truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def flip_tensor_bytes(path: Path, start: int = 0, length: int | None = None) -> None:
    """Flip a bit in the middle of the largest record (a tensor's bytes) of the torch.save
    archive at bytes [start, start + length) of ``path``: a weight changed on disk."""
    import io
    import zipfile

    data = bytearray(path.read_bytes())
    end = len(data) if length is None else start + length
    with zipfile.ZipFile(io.BytesIO(bytes(data[start:end]))) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size)
    header = start + record.header_offset
    name, extra = (int.from_bytes(data[header + i : header + i + 2], "little") for i in (26, 28))
    data[header + 30 + name + extra + record.file_size // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _flip_item(ctx: Context, key: str, chunk: int) -> None:
    meta = pickle.loads((ctx.root / ".metadata").read_bytes())
    info = _storage(meta, key, chunk)[1]
    flip_tensor_bytes(ctx.root / info.relative_path, info.offset, info.length)


# ---------------------------------------------------------------------------- DCP
def _meta(ctx: Context, change: Callable[[Any], Any]) -> None:
    file = ctx.root / ".metadata"
    meta = pickle.loads(file.read_bytes())  # the anchor's own file (see the module doc)
    change(meta)
    file.write_bytes(pickle.dumps(meta))


def _set(obj: Any, **fields: Any) -> None:
    for name, value in fields.items():
        object.__setattr__(obj, name, value)  # DCP's MetadataIndex is a frozen dataclass


def _sizes(scale: Callable[[torch.Size], list[int]], keys: tuple[str, ...] = DCP_KEYS
           ) -> Callable[[Any], None]:
    def change(meta: Any) -> None:
        for key in keys:
            item = meta.state_dict_metadata[key]
            dims = scale(item.size)
            _set(item, size=torch.Size(dims) if all(type(d) is int for d in dims) else tuple(dims))
    return change


def _storage(meta: Any, key: str, chunk: int) -> tuple[Any, Any]:
    offsets = meta.state_dict_metadata[key].chunks[chunk].offsets
    index = next(i for i in meta.storage_data if i.fqn == key and tuple(i.offset) == offsets)
    return index, meta.storage_data[index]


def _move_chunk(key: str, chunk: int, offsets: list[int], storage_too: bool
                ) -> Callable[[Any], None]:
    def change(meta: Any) -> None:
        index, info = _storage(meta, key, chunk)
        _set(meta.state_dict_metadata[key].chunks[chunk], offsets=torch.Size(offsets))
        if storage_too:
            from torch.distributed.checkpoint.metadata import MetadataIndex

            del meta.storage_data[index]
            meta.storage_data[MetadataIndex(key, torch.Size(offsets))] = info
    return change


def _window(key: str, chunk: int, **fields: Any) -> Callable[[Any], None]:
    def change(meta: Any) -> None:
        _set(_storage(meta, key, chunk)[1], **fields)
    return change


def _same_window(meta: Any) -> None:
    """Chunk 1 of the weight read from chunk 0's bytes (one stored item backing two)."""
    key = DCP_KEYS[0]
    first = _storage(meta, key, 0)[1]
    _set(_storage(meta, key, 1)[1], relative_path=first.relative_path, offset=first.offset,
         length=first.length)


def _item_payload(ctx: Context) -> None:
    """The client state's item pointed at a pickle payload appended to a data file."""
    blob = hostile.payload_bytes(ctx.marker)
    data = ctx.root / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob)
    _meta(ctx, lambda m: _set(m.storage_data[next(i for i in m.storage_data
                                                  if i.fqn == "train_state.data_step")],
                              relative_path="__0_0.distcp", offset=offset, length=len(blob)))


def _item_value(key: str, value: Any) -> Edit:
    """Item ``key`` re-saved as ``value`` (a valid torch.save stream, CRC and all) at the end
    of its data file: a forgery, not damage."""
    def edit(ctx: Context) -> None:
        import io

        blob = io.BytesIO()
        torch.save(value, blob)

        def change(meta: Any) -> None:
            info = next(v for i, v in meta.storage_data.items() if i.fqn == key)
            data = ctx.root / info.relative_path
            _set(info, offset=data.stat().st_size, length=len(blob.getvalue()))
            with open(data, "ab") as f:
                f.write(blob.getvalue())

        _meta(ctx, change)
    return edit


def _dcp_dtype(to: Any) -> Callable[[Any], None]:
    def change(meta: Any) -> None:
        _set(meta.state_dict_metadata[DCP_KEYS[0]].properties, dtype=to)
    return change


_W = DCP_KEYS[0]
_DCP_METADATA: dict[str, tuple[Callable[[Any], Any], str | None]] = {
    "size_huge": (_sizes(lambda s: [s[0] * 10**9, s[1]]), "the chunks hold"),
    "size_x1000": (_sizes(lambda s: [s[0] * 1000, s[1]]), "the chunks hold"),
    "size_smaller": (_sizes(lambda s: [s[0] - 1, s[1]]), "lies outside the tensor's size"),
    "size_extra_dim": (_sizes(lambda s: [*s, 1]), "lies outside the tensor's size"),
    "size_negative": (_sizes(lambda s: [-s[0], s[1]]), "must be >= 0"),
    "size_not_ints": (_sizes(lambda s: [float(s[0]), s[1]]), "must be an int"),
    "chunk_moved": (_move_chunk(_W, 1, [16, 0], False), "has no stored bytes"),
    "chunk_overlaps": (_move_chunk(_W, 1, [16, 0], True), "overlap"),
    "chunk_outside": (_move_chunk(_W, 1, [18, 0], True), "lies outside the tensor's size"),
    "chunk_grown": (lambda m: _set(m.state_dict_metadata[_W].chunks[0],
                                   sizes=torch.Size([18, 33])), "the chunks hold"),
    "chunk_dropped": (lambda m: m.state_dict_metadata[_W].chunks.pop(), "the chunks hold"),
    "chunk_twice": (lambda m: m.state_dict_metadata[_W].chunks.append(
        m.state_dict_metadata[_W].chunks[0]), "the chunks hold"),
    "chunks_not_list": (lambda m: _set(m.state_dict_metadata[_W], chunks="x"),
                        "chunks must be a list"),
    "dtype_wider": (_dcp_dtype(torch.float64), "claims"),
    "dtype_narrower": (_dcp_dtype(torch.int8), "torch.float32"),
    "dtype_not_dtype": (_dcp_dtype("float32"), "must be a torch dtype"),
    "window_past_end": (_window(_W, 1, offset=10**9), "outside the file's"),
    "window_huge": (_window(_W, 1, length=10**15), "outside the file's"),
    "window_negative": (_window(_W, 1, offset=-5), "must be >= 0"),
    "window_short": (_window(_W, 0, length=100), "claims"),
    "window_shared": (_same_window, "overlap"),
    "path_traversal": (_window(_W, 0, relative_path="../outside/__0_0.distcp"),
                       "is not a plain file or directory name"),
    "path_absolute": (_window(_W, 0, relative_path="/etc/passwd"), "is not a plain file"),
    "path_missing": (_window(_W, 0, relative_path="__9_0.distcp"), "missing or unreadable"),
    "transformed": (_window(_W, 0, transform_descriptors=["zstd"]), "transforms"),
    "storage_dropped": (lambda m: m.storage_data.pop(_storage(m, _W, 1)[0]),
                        "has no stored bytes"),
    "planner_wrong": (lambda m: m.planner_data.__setitem__(_W, ("model", "other")),
                      "does not spell the key"),
    "planner_dropped": (lambda m: m.planner_data.pop(_W), "planner_data gives no path"),
    "planner_extra": (lambda m: m.planner_data.__setitem__("model.ghost", ("model", "ghost")),
                      "not in state_dict_metadata"),
}
"""Edits of ``.metadata``'s objects."""

_DCP_FILES: dict[str, tuple[Edit, str | None]] = {
    "metadata_payload": (lambda c: (c.root / ".metadata").write_bytes(
        payload_pickle(c.marker)), "trust_pickles=True"),
    "metadata_truncated": (lambda c: _truncate(c.root / ".metadata", 0.5), None),
    "metadata_empty": (lambda c: (c.root / ".metadata").write_bytes(b""), None),
    "item_payload": (_item_payload, "trust_pickles=True"),
    "meta_pt_payload": (lambda c: (c.root / "meta.pt").write_bytes(
        hostile.payload_bytes(c.marker)), "trust_pickles=True"),
    "data_truncated": (lambda c: _truncate(c.root / "__1_0.distcp", 0.5),
                       "outside the file's"),
    "data_flipped": (lambda c: _flip_item(c, DCP_KEYS[0], 1), "is damaged"),
    "data_missing": (lambda c: (c.root / "__1_0.distcp").unlink(), "missing or unreadable"),
    "data_symlink_out": (lambda c: hostile.make_link(c.root / "__0_0.distcp",
                                         c.outside / "__0_0.distcp"),
                         "outside the checkpoint directory"),
    "data_dev_zero": (lambda c: hostile.make_link(c.root / "__0_0.distcp", "/dev/zero"),
                      "outside the checkpoint directory"),
    "data_fifo": (lambda c: hostile.make_fifo(c.root / "__1_0.distcp"), "is not a regular file"),
    "metadata_fifo": (lambda c: hostile.make_fifo(c.root / ".metadata"), "is not a regular file"),
    "extra_file": (lambda c: (c.root / "__2_0.distcp").write_bytes(os.urandom(64)), None),
}


def _dcp_catalogue() -> dict[str, Mutation]:
    out = {name: Mutation(lambda ctx, c=change: _meta(ctx, c), expect)
           for name, (change, expect) in _DCP_METADATA.items()}
    out.update({name: Mutation(edit, expect) for name, (edit, expect) in _DCP_FILES.items()})
    out["params_not_list"] = Mutation(_item_value("optimizer.param_groups.0.params", 5),
                                      "must be a list of names")
    out["step_nan"] = Mutation(_item_value(f"optimizer.state.{WEIGHT}.step",
                                           torch.tensor(float("nan"))), "must be a finite")
    # A hyperparameter forged consistently: the engine refuses what it cannot apply, the
    # converters carry it as the file has it, consolidation never reads it.
    out["lr_string"] = Mutation(_item_value("optimizer.param_groups.0.lr", "fast"), None,
                                protected=False)
    for name in ("item_payload", "meta_pt_payload"):  # the client state
        out[name] = Mutation(*_DCP_FILES[name], unread_by=("consolidate",))
    return out


# ---------------------------------------------------------------------------- DeepSpeed
def _rank(r: int, kind: str) -> str:
    return f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"


DS2_MODEL = "mp_rank_00_model_states.pt"


def _pt(ctx: Context, rank: int, kind: str, change: Callable[[Any], Any]) -> None:
    """Edit rank ``rank``'s ``kind`` file (stage 2 has one model-states file, for all ranks)."""
    name = _rank(rank, kind)
    if kind == "model" and not (ctx.root / DS_TAG / name).exists():
        name = DS2_MODEL
    file = ctx.root / DS_TAG / name
    data = torch.load(file, weights_only=False)  # the anchor's own file (see the module doc)
    change(data)
    torch.save(data, file)


def _optim(change: Callable[[dict[str, Any]], Any], rank: int = 1) -> Edit:
    return lambda ctx: _pt(ctx, rank, "optim", lambda d: change(d["optimizer_state_dict"]))


def _model(change: Callable[[dict[str, Any]], Any], rank: int = 0) -> Edit:
    return lambda ctx: _pt(ctx, rank, "model", change)


def _shape(name: str, dims: list[Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["param_shapes"][0].__setitem__(name, dims)


def _states(optim: dict[str, Any]) -> dict[str, Any]:
    """Group 0's Adam state (stage 3 and stages 1-2 keep it under different names)."""
    inner = optim.get("optimizer_state_dict") or optim["base_optimizer_state"]
    return inner["state"][0]


def _masters(optim: dict[str, Any]) -> list[torch.Tensor]:
    return optim.get("fp32_flat_groups") or optim["single_partition_of_fp32_groups"]


def _state(key: str, change: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: _states(d).__setitem__(key, change(_states(d)[key]))


def _master(change: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: _masters(d).__setitem__(0, change(_masters(d)[0]))


def _extra_rank(ctx: Context) -> None:
    for kind in ("model", "optim"):
        shutil.copy(ctx.root / DS_TAG / _rank(1, kind), ctx.root / DS_TAG / _rank(2, kind))


_DS3_FILES: dict[str, tuple[Edit, str | None]] = {
    "model_rank1_missing": (lambda c: (c.root / DS_TAG / _rank(1, "model")).unlink(),
                            "are missing: ZeRO stage 3 writes one model-states file"),
    "model_rank0_missing": (lambda c: (c.root / DS_TAG / _rank(0, "model")).unlink(),
                            "some rank's file is missing"),
    "optim_rank1_missing": (lambda c: (c.root / DS_TAG / _rank(1, "optim")).unlink(),
                            "'partition_count' is [2] but 1 optimizer"),
    "optim_rank0_missing": (lambda c: (c.root / DS_TAG / _rank(0, "optim")).unlink(),
                            "some rank's file is missing"),
    "extra_rank": (_extra_rank, "'partition_count' is [2] but 3 optimizer"),
    "model_parallel": (lambda c: (c.root / DS_TAG / _rank(1, "model")).rename(
        c.root / DS_TAG / _rank(1, "model").replace("mp_rank_00", "mp_rank_01")),
        "tensor- or pipeline-parallel"),
    "optim_payload": (lambda c: (c.root / DS_TAG / _rank(1, "optim")).write_bytes(
        hostile.payload_bytes(c.marker)), "trust_pickles=True"),
    "model_payload": (lambda c: (c.root / DS_TAG / _rank(0, "model")).write_bytes(
        hostile.payload_bytes(c.marker)), "trust_pickles=True"),
    "optim_plain_pickle": (lambda c: (c.root / DS_TAG / _rank(1, "optim")).write_bytes(
        payload_pickle(c.marker)), "not a torch.save zip archive"),
    "optim_truncated": (lambda c: _truncate(c.root / DS_TAG / _rank(1, "optim"), 0.5),
                        "not an intact torch.save archive"),
    "optim_flipped": (lambda c: flip_tensor_bytes(c.root / DS_TAG / _rank(1, "optim")),
                      "is damaged"),
    "latest_traversal": (lambda c: (c.root / "latest").write_text(f"../outside/{DS_TAG}"),
                         "is not a plain file or directory name"),
    "latest_absolute": (lambda c: (c.root / "latest").write_text(str(c.outside / DS_TAG)),
                        "is not a plain file or directory name"),
    "latest_fifo": (lambda c: hostile.make_fifo(c.root / "latest"), "is not a regular file"),
    "latest_symlink_out": (lambda c: hostile.make_link(c.root / "latest", c.outside / "latest"),
                           "outside the checkpoint directory"),
    "latest_unknown_tag": (lambda c: (c.root / "latest").write_text("global_step9"),
                           "global_step9"),
    "latest_empty": (lambda c: (c.root / "latest").write_text(""), None),
    "tag_symlink_out": (lambda c: hostile.make_link(c.root / DS_TAG, c.outside / DS_TAG),
                        "outside the checkpoint directory"),
    "rank_file_symlink_out": (lambda c: hostile.make_link(c.root / DS_TAG / _rank(1, "optim"),
                                              c.outside / DS_TAG / _rank(1, "optim")),
                              "outside the checkpoint directory"),
    "rank_file_fifo": (lambda c: hostile.make_fifo(c.root / DS_TAG / _rank(1, "optim")),
                       "is not a regular file"),
    "extra_file": (lambda c: (c.root / DS_TAG / "notes.txt").write_text("hello"), None),
}
"""Files missing, extra, moved, linked, replaced or damaged; ``latest`` tricks."""

_DS3_FIELDS: dict[str, tuple[Edit, str | None]] = {
    "shape_huge": (_model(_shape(WEIGHT, [33 * 10**9, 33])), "master elements"),
    "shape_x1000": (_model(_shape(WEIGHT, [33000, 33])), "master elements"),
    "shape_negative": (_model(_shape(WEIGHT, [-33, 33])), "must be >= 0"),
    "shape_not_ints": (_model(_shape(WEIGHT, ["33", 33])), "must be an int"),
    "shapes_not_dict": (_model(lambda d: d.__setitem__("param_shapes", [[1, 2]])),
                        "must map names to shapes"),
    "master_short": (_optim(_master(lambda t: t[:-7].clone())), "master elements"),
    "master_not_tensor": (_optim(_master(lambda t: "x")), "must be a flat float tensor"),
    "master_int": (_optim(_master(lambda t: t.long())), "must be a flat float tensor"),
    "exp_avg_short": (_optim(_state("exp_avg", lambda t: t[:-3].clone())),
                      "the layout reads"),
    "exp_avg_2d": (_optim(_state("exp_avg", lambda t: t[:-1].reshape(2, -1).clone())),
                   "must be a flat float tensor"),
    "exp_avg_missing": (_optim(lambda o: _states(o).pop("exp_avg")),
                        "optimizer state 'exp_avg' is missing"),
    "stage_bad": (_optim(lambda o: o.__setitem__("zero_stage", 7), rank=0), "in [1, 3]"),
    "partition_count_bad": (_optim(lambda o: o.__setitem__("partition_count", 3), rank=0),
                            "'partition_count' is [3]"),
    "dp_world_bad": (_model(lambda d: d.__setitem__("dp_world_size", 3)),
                     "'dp_world_size' is 3"),
    "steps_not_int": (_model(lambda d: d.__setitem__("global_steps", "many")),
                      "must be an int"),
    "shared_not_dict": (_model(lambda d: d.__setitem__("shared_params", [1])),
                        "must map names to names"),
}
"""Fields of the pickled model and optimizer states."""


def _ds_catalogue() -> dict[str, Mutation]:
    return {name: Mutation(edit, expect)
            for name, (edit, expect) in {**_DS3_FILES, **_DS3_FIELDS}.items()}


def _ds2_catalogue() -> dict[str, Mutation]:
    """Stage 2: one model-states file; each group one flat vector cut into equal partitions,
    the last saved without its end padding."""
    tag, model = DS_TAG, DS2_MODEL
    pad = "param_alignment_paddings"
    m: dict[str, tuple[Edit, str | None]] = {
        "model_states_missing": (lambda c: (c.root / tag / model).unlink(),
                                 "the model-states file is missing"),
        "model_states_symlink_out": (lambda c: hostile.make_link(c.root / tag / model,
                                                     c.outside / tag / model),
                                     "outside the checkpoint directory"),
        "model_states_fifo": (lambda c: hostile.make_fifo(c.root / tag / model),
                              "is not a regular file"),
        "optim_rank1_missing": (lambda c: (c.root / tag / _rank(1, "optim")).unlink(),
                                "'partition_count' is [2] but 1 optimizer"),
        "padding_negative": (_optim(lambda o: o[pad][0].__setitem__(0, -3), rank=0),
                             "must be >= 0"),
        "padding_huge": (_optim(lambda o: o[pad][0].__setitem__(0, 10**6), rank=0),
                         "group 0 needs"),
        "paddings_short": (_optim(lambda o: o[pad][0].pop(), rank=0),
                           "one padding per parameter"),
        "master_rank0_short": (_optim(_master(lambda t: t[:-5].clone()), rank=0), None),
        "master_last_long": (_optim(_master(lambda t: torch.cat([t, t[:5]])), rank=1),
                             "the layout reads"),
        "master_last_short": (_optim(_master(lambda t: t[:-9].clone()), rank=1),
                              "the layout reads"),
        "exp_avg_rank0_short": (_optim(_state("exp_avg", lambda t: t[:-3].clone()), rank=0),
                                "the layout reads"),
        "base_state_missing": (_optim(lambda o: o.pop("base_optimizer_state")),
                               "field 'base_optimizer_state' is missing"),
        "shape_x1000": (_model(_shape(WEIGHT, [33000, 33])), "group 0 needs"),
        "shape_smaller": (_model(_shape("inp.bias", [2])), "not the layout of these shapes"),
        "optim_flipped": (lambda c: flip_tensor_bytes(c.root / tag / _rank(0, "optim")),
                          "is damaged"),
    }
    return {name: Mutation(edit, expect) for name, (edit, expect) in m.items()}


# ---------------------------------------------------------------------------- ours
def _ours_catalogue() -> dict[str, Mutation]:
    def adapt(edit: hostile.Edit) -> Edit:
        return lambda ctx: edit(ctx.root, ctx.outside, ctx.marker)

    out = {name: Mutation(adapt(edit), expect,
                          unread_by=("consolidate",) if name == "client_payload" else ())
           for name, (edit, expect) in hostile.VARIANTS.items()}
    # Refused by the engine (what it would apply), harmless to the readers.
    out["param_group_type"] = Mutation(adapt(hostile.ENGINE_VARIANTS["param_group_type"][0]),
                                       None, protected=False)
    return out


CATALOGUES: dict[str, Callable[[], dict[str, Mutation]]] = {
    "ds3": _ds_catalogue, "ds2": _ds2_catalogue, "dcp": _dcp_catalogue,
    "ours": _ours_catalogue}


def catalogue(source: str) -> dict[str, Mutation]:
    return CATALOGUES[source]()


# ---------------------------------------------------------------------------- random
EDGE_VALUES = (0, 1, 2, 7, 17, 33, 10**3, 2**31, 2**40, 10**12, -1)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                  and not p.name.startswith("zero_to_"))


def _bytes(ctx: Context, file: Path) -> None:
    """Flip, overwrite or cut bytes of ``file`` (what a broken disk or a careless edit does)."""
    rng, data = ctx.rng, bytearray(file.read_bytes())
    if not data:
        return
    action = rng.choice(["flip", "flip", "flip", "overwrite", "truncate"])
    if action == "truncate":
        file.write_bytes(bytes(data[: rng.randrange(len(data))]))
        return
    for _ in range(rng.randint(1, 8) if action == "flip" else 1):
        at = rng.randrange(len(data))
        if action == "flip":
            data[at] ^= 1 << rng.randrange(8)
        else:
            n = min(rng.randint(1, 64), len(data) - at)
            data[at : at + n] = bytes(rng.randrange(256) for _ in range(n))
    file.write_bytes(bytes(data))


def _dcp_number(ctx: Context) -> None:
    """One number of DCP's metadata (a size, a chunk's offset or size, a byte window) set to
    an edge value."""
    rng = ctx.rng

    def change(meta: Any) -> None:
        key = rng.choice(sorted(k for k, v in meta.state_dict_metadata.items()
                                if hasattr(v, "chunks") and v.size))
        item = meta.state_dict_metadata[key]
        chunk = rng.randrange(len(item.chunks))
        value, where = rng.choice(EDGE_VALUES), rng.choice(["size", "offsets", "sizes", "window"])
        if where == "window":
            info = _storage(meta, key, chunk)[1]
            _set(info, **{rng.choice(["offset", "length"]): value})
            return
        target = item if where == "size" else item.chunks[chunk]
        dims = list(getattr(target, where))
        dims[rng.randrange(len(dims))] = value
        _set(target, **{where: torch.Size(dims)})

    _meta(ctx, change)


def _ds_number(ctx: Context) -> None:
    """One dimension of DeepSpeed's param_shapes, one padding (stages 1-2), or one rank's
    flat master or moment partition cut or lengthened."""
    rng = ctx.rng
    what = rng.random()
    if what < 0.4:
        def shapes(d: dict[str, Any]) -> None:
            group = d["param_shapes"][0]
            name = rng.choice(sorted(group))
            dims = list(group[name])
            dims[rng.randrange(len(dims))] = rng.choice(EDGE_VALUES)
            group[name] = torch.Size(dims)
        _pt(ctx, rng.randrange(2), "model", shapes)
        return
    key = rng.choice(["master", "exp_avg", "exp_avg_sq", "padding"])
    keep = rng.choice([0, 1, 100, 2080, 2081, 2082, 2083, 2086, 2088])

    def flat(d: dict[str, Any]) -> None:
        if key == "padding":
            paddings = d.get("param_alignment_paddings") or [[0]]
            paddings[0][rng.randrange(len(paddings[0]))] = rng.choice(EDGE_VALUES)
            d["param_alignment_paddings"] = paddings
            return
        pick = _master if key == "master" else lambda f: _state(key, f)
        pick(lambda t: torch.cat([t, t])[:keep].clone())(d)
    _optim(flat, rank=rng.randrange(2))(ctx)


def _ours_number(ctx: Context) -> None:
    """One integer of our manifest set to an edge value (the manifest has no checksum; its
    layout is checked against the files' headers)."""
    rng, file = ctx.rng, ctx.root / hostile.TAG / hostile.MANIFEST
    manifest = json.loads(file.read_text())
    spots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
            node, list) else []
        for k, v in items:
            if isinstance(v, int) and not isinstance(v, bool):
                spots.append((node, k))
            walk(v)

    walk(manifest)
    node, key = rng.choice(spots)
    node[key] = rng.choice(EDGE_VALUES)
    file.write_text(json.dumps(manifest))


NUMBERS: dict[str, Edit] = {"dcp": _dcp_number, "ds3": _ds_number, "ds2": _ds_number,
                            "ours": _ours_number}


def random_mutation(source: str, good: Path, rng: random.Random) -> tuple[str, Mutation]:
    """A random mutation of ``source`` (its good copy at ``good``): bytes of a random file
    (70%), or one number of the metadata at an edge value; and a name saying which."""
    if rng.random() < 0.3:
        return "number", Mutation(NUMBERS[source], None, protected=source != "ours")
    file = rng.choice(_files(good)).relative_to(good)

    def edit(ctx: Context) -> None:
        _bytes(ctx, ctx.root / file)

    return f"bytes of {file}", Mutation(edit, None, protected=file.name != hostile.MANIFEST)


__all__ = ["CATALOGUES", "SOURCES", "Context", "Mutation", "catalogue", "random_mutation"]
