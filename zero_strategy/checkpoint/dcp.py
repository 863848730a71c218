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
items with ``weights_only=False``.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import torch

from .pickles import load_plain_pickle, load_torch_bytes, load_torch_file
from .source import ReaderBase, foreign_manifest
from .verify import member
from .write import CheckpointError

METADATA = ".metadata"
LIGHTNING_META = "meta.pt"
_MODEL_ROOTS = ("model", "state_dict")
_OPTIM_ROOT = re.compile(r"^(optimizer|optim|optimizer_0)$")


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a file as a seekable stream of their own."""

    def __init__(self, path: Path, offset: int, length: int) -> None:
        self._f = open(path, "rb")
        self._start, self._len, self._pos = offset, length, 0
        size = path.stat().st_size
        if offset < 0 or length < 0 or offset + length > size:
            self._f.close()
            raise CheckpointError(f"{path}: an item at bytes [{offset}, {offset + length}) "
                                  f"is outside the file's {size} (truncated?)")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = min(max(0, base + pos), self._len)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._len - self._pos)
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got or 0
        return got or 0

    def close(self) -> None:
        self._f.close()
        super().close()


ACCELERATE_DIRS = ("pytorch_model_fsdp_0", "optimizer_0")
"""Accelerate's FSDP ``save_state`` with a sharded state dict: the model's DCP directory
(``{"model": ...}``) and the optimizer's (``{"optimizer": ...}``) side by side."""


def dcp_directories(path: Path) -> list[Path]:
    """The DCP directories a checkpoint at ``path`` is made of (none: not DCP)."""
    if (path / METADATA).is_file():
        return [path]
    model, optimizer = (path / d for d in ACCELERATE_DIRS)
    if (model / METADATA).is_file():
        return [model] + ([optimizer] if (optimizer / METADATA).is_file() else [])
    return []


class DcpReader(ReaderBase):
    kind = "dcp"

    def __init__(self, path: Path, *, trust: bool | None = None) -> None:
        self.path = path
        self._trust = trust
        self._items: dict[str, Any] = {}
        self._storage: dict[tuple[str, tuple[int, ...]], tuple[Path, Any]] = {}
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
        self._items.update(meta.state_dict_metadata)
        self._paths.update(paths)
        self._storage.update({(k.fqn, tuple(k.offset or ())): (directory, v)
                              for k, v in meta.storage_data.items()})

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
                self.group_items.setdefault(int(p[2]), {})[str(p[3])] = flat
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
            names.append([str(n) for n in values.pop("params", [])])
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

    def _record(self, name: str, shape: tuple[int, ...]) -> dict[str, Any]:
        scalars, tensors = {}, []
        for key, flat in self.states[name].items():
            item = self._items[flat]
            size = tuple(getattr(item, "size", ()))
            if hasattr(item, "chunks") and size == shape and key != "step":
                tensors.append(key)
            elif hasattr(item, "chunks") and math.prod(size) == 1:
                scalars[key] = float(self._whole(flat).reshape(-1)[0])
            elif not hasattr(item, "chunks"):
                scalars[key] = float(self._bytes(flat))
            else:
                raise CheckpointError(f"{self.path}: optimizer state {key!r} of {name!r} has "
                                      f"shape {list(size)}, the parameter {list(shape)}")
        return {"scalars": scalars, "tensors": tensors}

    def _tensor_meta(self, flat: str) -> Any:
        item = self._items.get(flat)
        if item is None or not hasattr(item, "chunks"):
            raise CheckpointError(f"{self.path}: {flat!r} is not a tensor item")
        return item

    # ------------------------------------------------------------------ items
    def _item(self, flat: str, offset: Any) -> Any:
        found = self._storage.get((flat, tuple(offset)))
        if found is None:
            raise CheckpointError(f"{self.path}: no stored data for {flat!r} at "
                                  f"{list(offset)}")
        directory, info = found
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.path}: {flat!r} is stored through transforms "
                                  f"{info.transform_descriptors} (compression?), not read")
        file = directory / str(info.relative_path)
        member(directory, file, f"data file {info.relative_path!r}")
        with _Window(file, int(info.offset), int(info.length)) as window:
            return load_torch_bytes(io.BufferedReader(window), file, trust=self._trust)

    def _bytes(self, flat: str) -> Any:
        return self._item(flat, ())

    def _whole(self, flat: str) -> torch.Tensor:
        """The whole tensor of a flattened key, from its chunks (one tensor at a time)."""
        if self._cache is not None and self._cache[0] == flat:
            return self._cache[1]
        meta = self._tensor_meta(flat)
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            value = self._item(flat, chunk.offsets)
            if not torch.is_tensor(value) or tuple(value.shape) != tuple(chunk.sizes):
                raise CheckpointError(f"{self.path}: a chunk of {flat!r} is not a tensor of "
                                      f"shape {list(chunk.sizes)}")
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            out[index] = value
            covered += value.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.path}: the chunks of {flat!r} cover {covered} of "
                                  f"its {out.numel()} elements")
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
            node[path[-1]] = value
        meta = self.path / LIGHTNING_META
        if meta.is_file():
            member(self.path, meta, LIGHTNING_META)
            loaded = load_torch_file(meta, trust=self._trust, mmap=False)
            if isinstance(loaded, dict):
                state.update(loaded)
        return state


__all__ = ["ACCELERATE_DIRS", "LIGHTNING_META", "METADATA", "DcpReader", "dcp_directories"]
