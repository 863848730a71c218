"""Reading a torch.distributed.checkpoint (DCP) directory by parameter name and element range:
what FSDP2 and torchtitan write with ``dcp.save`` of ``get_state_dict(model, optimizer)``,
and Lightning's ``FSDPStrategy(state_dict_type="sharded")``.

Layout (torch 2.4 - 2.13, ``FileSystemWriter``): ``.metadata`` is a pickle of DCP's
``Metadata``: for every flattened key, a tensor's global size and its saved chunks (offsets
and sizes), or a bytes item; ``planner_data`` maps each flattened key back to its path in
the nested state dict (``("model", "layers.0.weight")``, ``("optimizer", "state",
"layers.0.weight", "exp_avg")``, ``("optimizer", "param_groups", 0, "lr")``), and
``storage_data`` says which ``*.distcp`` file holds each chunk at what byte offset, each a
``torch.save`` stream. The model's tensors sit under a top-level ``model`` key and the
optimizer's under ``optimizer``/``optim`` (Lightning: ``optimizer_0``); every other
top-level key, and Lightning's ``meta.pt``, is the client state. Accelerate's FSDP
``save_state`` puts the model and the optimizer in two DCP directories of one folder; they
are read as one.

``.metadata`` is unpickled with an allow-list of DCP's own classes and every item with
torch's weights_only unpickler (``pickles.py``), unlike DCP's reader, which loads non-tensor
items with ``weights_only=False``. Before any item is read, every number ``.metadata`` gives
is checked against the files (``_check_metadata``, through ``bounds.py``): each item's byte
window lies inside its data file and shares no byte with another's, each chunk's bytes fit
its window, and each tensor's chunks cover its size exactly, so no size in the metadata is
allocated unless the files hold its bytes.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import torch

from .bounds import (
    Window,
    byte_range,
    check_archive,
    disjoint,
    dtype,
    exact_cover,
    fail,
    fits,
    nbytes,
    shape,
)
from .errors import CheckpointError
from .pickles import load_plain_pickle, load_torch_bytes, load_torch_file
from .source import ReaderBase, foreign_manifest
from .verify import member, plain_name

METADATA = ".metadata"
LIGHTNING_META = "meta.pt"
_MODEL_ROOTS = ("model", "state_dict")
_OPTIM_ROOT = re.compile(r"^(optimizer|optim|optimizer_0)$")


ACCELERATE_DIRS = ("pytorch_model_fsdp_0", "optimizer_0")
"""Accelerate's FSDP ``save_state`` with a sharded state dict: the model's DCP directory
(``{"model": ...}``) and the optimizer's (``{"optimizer": ...}``) side by side."""


def dcp_directories(path: Path) -> list[Path]:
    """The DCP directories a checkpoint at ``path`` is made of (none: not DCP)."""
    if _present(path / METADATA):
        return [path]
    model, optimizer = (path / d for d in ACCELERATE_DIRS)
    if _present(model / METADATA):
        return [model] + ([optimizer] if _present(optimizer / METADATA) else [])
    return []


def _present(path: Path) -> bool:
    """Whether something is there, of any kind: what it is (a FIFO? a link out?) is for
    ``member`` to refuse by name, not a reason to try another format."""
    return path.exists() or path.is_symlink()


def _check_metadata(directory: Path, items: Any, paths: dict[Any, Any], storage: dict[Any, Any]
                    ) -> dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]]:
    """Every number of one directory's ``.metadata`` against its files; the byte window of
    each stored item, by (key, chunk offsets)."""
    file = directory / METADATA
    unplaced = [k for k in items if k not in paths]
    if unplaced:
        raise fail(file, repr(unplaced[0]), f"is in state_dict_metadata, but planner_data "
                   f"gives no path for it ({len(unplaced)} such keys)")
    for flat, path in paths.items():
        if not (isinstance(flat, str) and isinstance(path, tuple) and path
                and ".".join(map(str, path)) == flat):
            raise fail(file, f"planner_data[{flat!r}]", f"the path {path!r} does not spell "
                       "the key (DCP joins a path's parts with '.')")
        if flat not in items:
            raise fail(file, repr(flat), "is in planner_data but not in state_dict_metadata")
    windows = _windows(directory, storage)
    for flat in paths:
        _check_item(file, flat, items[flat], windows)
    return windows


def _windows(directory: Path, storage: dict[Any, Any]
             ) -> dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]]:
    """Each storage entry's data file and byte window: a plain name in the directory, the
    window inside the file, no two windows sharing a byte."""
    file = directory / METADATA
    windows: dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]] = {}
    sizes: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        offset = () if offset is None else offset
        key = f"storage_data[{fqn!r} at {list(offset) if isinstance(offset, tuple) else offset}]"
        if not isinstance(fqn, str):
            raise fail(file, key, "names no key")
        at = shape(file, key, offset, "the chunk offset")
        if getattr(info, "transform_descriptors", None):
            raise fail(file, key, f"is stored through transforms {info.transform_descriptors} "
                       "(compression?), which this reader does not apply")
        name = plain_name(getattr(info, "relative_path", None), f"{file}: {key}: relative_path")
        data = directory / name
        if name not in sizes:
            member(directory, data, f"data file {name!r}")
            sizes[name] = data.stat().st_size
        start, end = byte_range(data, key, getattr(info, "offset", None),
                                getattr(info, "length", None), sizes[name])
        spans.setdefault(name, []).append((start, end, f"{fqn} at {list(at)}"))
        windows[(fqn, at)] = (data, start, end)
    for name, ranges in spans.items():
        disjoint(directory / name, ranges)
    return windows


def _check_item(file: Path, flat: str, item: Any,
                windows: dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]]) -> None:
    """A bytes item has a window; a tensor item's chunks each have one holding their bytes,
    and cover its size exactly."""
    key = repr(flat)
    if not hasattr(item, "chunks"):
        if (flat, ()) not in windows:
            raise fail(file, key, "has no stored bytes in storage_data")
        return
    of = dtype(file, key, getattr(getattr(item, "properties", None), "dtype", None))
    size = shape(file, key, getattr(item, "size", None))
    if not isinstance(item.chunks, list):
        raise fail(file, key, f"chunks must be a list, got {type(item.chunks).__name__}")
    chunks = []
    for chunk in item.chunks:
        offsets = shape(file, key, getattr(chunk, "offsets", None), "a chunk's offsets")
        sizes = shape(file, key, getattr(chunk, "sizes", None), "a chunk's sizes")
        window = windows.get((flat, offsets))
        if window is None:
            raise fail(file, key, f"the chunk at {list(offsets)} has no stored bytes in "
                       "storage_data")
        fits(window[0], f"item {flat!r} at {list(offsets)}", nbytes(sizes, of),
             window[2] - window[1], f"a chunk of {list(sizes)} {of}")
        chunks.append((offsets, sizes))
    exact_cover(file, key, size, chunks)


def _scalar(path: Path, flat: str, value: Any) -> float:
    """An optimizer scalar (Adam's step) as a finite float."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise fail(path, repr(flat), f"an optimizer scalar must be a finite number, got "
                   f"{value!r:.60}")
    return float(value)


class DcpReader(ReaderBase):
    kind = "dcp"

    def __init__(self, path: Path, *, trust: bool | None = None) -> None:
        self.path = path
        self._trust = trust
        self._items: dict[str, Any] = {}
        self._storage: dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}
        for directory in dcp_directories(path):
            self._add(directory)
        self._cache: tuple[str, torch.Tensor] | None = None
        self._sort()
        self.manifest = self._describe()

    def _add(self, directory: Path) -> None:
        """One DCP directory's items (Accelerate writes the model and optimizer to two)."""
        member(self.path, directory / METADATA, METADATA)
        meta = load_plain_pickle(directory / METADATA, trust=self._trust)
        for field in ("state_dict_metadata", "storage_data"):
            if not isinstance(getattr(meta, field, None), dict):
                raise CheckpointError(f"{directory / METADATA}: field {field!r} is missing: "
                                      "not a DCP checkpoint written by FileSystemWriter")
        paths = dict(getattr(meta, "planner_data", None) or {})
        if not paths:
            raise CheckpointError(f"{directory / METADATA}: no planner_data (saved without "
                                  "flattening): the state dict's structure is unknown")
        self._storage.update(_check_metadata(directory, meta.state_dict_metadata, paths,
                                             meta.storage_data))
        self._items.update(meta.state_dict_metadata)
        self._paths.update(paths)

    # ------------------------------------------------------------------ structure
    def _sort(self) -> None:
        """Split the flattened keys into model, optimizer state, param groups and the rest."""
        self.model: dict[str, str] = {}
        self.states: dict[str, dict[str, str]] = {}
        self.group_items: dict[int, dict[str, str]] = {}
        self.param_group_items: dict[str, dict[str, str]] = {}
        """torchtitan's flattened form: each parameter's own copy of its group's values."""
        self.rest: dict[tuple[Any, ...], str] = {}
        flattened: list[tuple[str, str]] = []
        roots = {p[0] for p in self._paths.values()}
        model_root = next((r for r in _MODEL_ROOTS if r in roots), None)
        optim_root = next((r for r in sorted(roots, key=str) if _OPTIM_ROOT.match(str(r))), None)
        if model_root is None:
            raise CheckpointError(f"{self.path}: no top-level 'model' entry (top-level keys: "
                                  f"{sorted(map(str, roots))}): not a model checkpoint")
        for flat, p in self._paths.items():
            if p[0] == model_root and len(p) == 2:
                self.model[str(p[1])] = flat
            elif p[0] == optim_root and len(p) == 4 and p[1] == "state":
                self.states.setdefault(str(p[2]), {})[str(p[3])] = flat
            elif p[0] == optim_root and len(p) == 4 and p[1] == "param_groups":
                if isinstance(p[2], bool) or not isinstance(p[2], int):
                    raise fail(self.path, repr(flat), f"the param group index {p[2]!r} in its "
                               "planner_data path must be an int")
                self.group_items.setdefault(p[2], {})[str(p[3])] = flat
            elif p[0] == optim_root and len(p) == 2 and str(p[1]).startswith(
                    ("state.", "param_groups.")):
                flattened.append((str(p[1]), flat))
            else:
                self.rest[tuple(p)] = flat
        self._unflatten(flattened)

    def _unflatten(self, items: list[tuple[str, str]]) -> None:
        """``flatten_optimizer_state_dict=True`` (torchtitan) keys: ``state.<name>.<key>``
        and ``param_groups.<name>.<hyperparameter>``, split at the longest parameter name."""
        names = sorted(self.model, key=len, reverse=True)
        for inner, flat in items:
            kind, _, rest = inner.partition(".")
            name = next((n for n in names if rest.startswith(n + ".")), None)
            if name is None:
                raise CheckpointError(f"{self.path}: optimizer entry {inner!r} names no "
                                      "parameter of the model")
            target = self.states if kind == "state" else self.param_group_items
            target.setdefault(name, {})[rest[len(name) + 1:]] = flat

    def _groups(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """(each param group's hyperparameters, each group's parameter names)."""
        groups: list[dict[str, Any]] = []
        names: list[list[str]] = []
        for g in sorted(self.group_items):
            values = {k: self._bytes(f) for k, f in self.group_items[g].items()}
            params = values.pop("params", [])
            if not isinstance(params, (list, tuple)):
                raise fail(self.path, repr(self.group_items[g]["params"]), "a param group's "
                           f"params must be a list of names, got {type(params).__name__}")
            names.append([str(n) for n in params])
            groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})
        # Flattened: parameters with the same values were one group (their saved order).
        for name in (n for n in self.model if n in self.param_group_items):
            values = {k: self._bytes(f) for k, f in self.param_group_items[name].items()}
            values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
            if values not in groups:
                groups.append(values)
                names.append([])
            names[groups.index(values)].append(name)
        return groups, names

    def _describe(self) -> dict[str, Any]:
        tensors = {k: self._tensor_meta(f) for k, f in self.model.items()}
        groups, names = self._groups()
        trained = [n for g in names for n in g] if names else list(self.states)
        missing = [n for n in trained if n not in tensors]
        if missing:
            raise CheckpointError(f"{self.path}: optimizer parameters {missing[:3]} have no "
                                  "model tensor")
        params = {n: tuple(tensors[n].size) for n in trained}
        records = {n: self._record(n, params[n]) for n in trained if n in self.states}
        steps = [r["scalars"].get("step", 0) for r in records.values()]
        return foreign_manifest(
            params=params, state_dict_keys=list(self.model), aliases={n: n for n in params},
            param_groups=groups or None, param_states=records,
            global_step=int(max(steps, default=0)), written_by="torch.distributed.checkpoint",
            group_names=names or None)

    def _record(self, name: str, dims: tuple[int, ...]) -> dict[str, Any]:
        scalars, tensors = {}, []
        for key, flat in self.states[name].items():
            item = self._items[flat]
            size = tuple(getattr(item, "size", ()))
            if hasattr(item, "chunks") and size == dims and key != "step":
                tensors.append(key)
            elif hasattr(item, "chunks") and math.prod(size) == 1:
                scalars[key] = _scalar(self.path, flat, self._whole(flat).reshape(-1)[0])
            elif not hasattr(item, "chunks"):
                scalars[key] = _scalar(self.path, flat, self._bytes(flat))
            else:
                raise CheckpointError(f"{self.path}: optimizer state {key!r} of {name!r} has "
                                      f"shape {list(size)}, the parameter {list(dims)}")
        return {"scalars": scalars, "tensors": tensors}

    def _tensor_meta(self, flat: str) -> Any:
        item = self._items.get(flat)
        if item is None or not hasattr(item, "chunks"):
            raise CheckpointError(f"{self.path}: {flat!r} is not a tensor item")
        return item

    # ------------------------------------------------------------------ items
    def _item(self, flat: str, offset: Any) -> Any:
        """One stored item, from the window ``_check_metadata`` bounded, its archive checked."""
        file, start, end = self._storage[(flat, tuple(offset))]
        check_archive(file, f"item {flat!r} at {list(offset)}", start, end - start)
        with open(file, "rb") as f:
            window = io.BufferedReader(Window(f, start, end - start))
            return load_torch_bytes(window, file, trust=self._trust)

    def _bytes(self, flat: str) -> Any:
        return self._item(flat, ())

    def _whole(self, flat: str) -> torch.Tensor:
        """The whole tensor of a flattened key, from its chunks (one tensor at a time). Its
        size is no longer a claim: the chunks cover it exactly and their bytes are stored."""
        if self._cache is not None and self._cache[0] == flat:
            return self._cache[1]
        meta = self._tensor_meta(flat)
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            value = self._item(flat, chunk.offsets)
            if not torch.is_tensor(value) or tuple(value.shape) != tuple(chunk.sizes) or (
                    value.dtype != out.dtype):
                got = (f"{value.dtype} {list(value.shape)}" if torch.is_tensor(value)
                       else type(value).__name__)
                raise CheckpointError(
                    f"{self._storage[(flat, tuple(chunk.offsets))][0]}: item {flat!r} at "
                    f"{list(chunk.offsets)} is {got}, .metadata says {out.dtype} "
                    f"{list(chunk.sizes)}")
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            out[index] = value
        self._cache = (flat, out)
        return out

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        flat = self.model[name] if key == "master" else self.states[name][key]
        return self._whole(flat).reshape(-1)[start:end].clone()

    def module_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if key not in self.model:
            raise CheckpointError(f"{self.path}: tensor {key!r} is missing")
        meta = self._tensor_meta(self.model[key])
        return meta.properties.dtype, tuple(meta.size)

    def module_tensor(self, key: str) -> torch.Tensor:
        self.module_info(key)
        return self._whole(self.model[key]).clone()

    def client_state(self) -> dict[str, Any]:
        """Every entry outside the model and optimizer, nested again; with Lightning's
        ``meta.pt`` (loops, callbacks, schedulers) merged in."""
        state: dict[str, Any] = {}
        for path, flat in self.rest.items():
            item = self._items[flat]
            value = self._whole(flat).clone() if hasattr(item, "chunks") else self._bytes(flat)
            node = state
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            if not isinstance(node, dict) or path[-1] in node:
                raise fail(self.path, repr(flat), f"its path {path!r} runs into another "
                           "entry's (two planner_data paths that nest into each other)")
            node[path[-1]] = value
        meta = self.path / LIGHTNING_META
        if meta.is_file():
            member(self.path, meta, LIGHTNING_META)
            loaded = load_torch_file(meta, trust=self._trust, mmap=False)
            if isinstance(loaded, dict):
                state.update(loaded)
        return state


__all__ = ["ACCELERATE_DIRS", "LIGHTNING_META", "METADATA", "DcpReader", "dcp_directories"]
