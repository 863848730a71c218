"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3; fp32, fp16 or bf16 training) by
parameter name and element range, so it loads into any of our stages and world sizes.

Layout, as DeepSpeed 0.19 writes it (``engine.save_checkpoint``; Lightning's
``DeepSpeedStrategy`` uses the same with tag ``checkpoint``):

- ``<dir>/latest`` names the tag directory; in it ``mp_rank_00_model_states.pt`` (stages
  1-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (stage 3, one per rank) hold the
  module's state_dict (compute dtype; empty placeholders for stage-3 parameters),
  ``param_shapes`` (per param group, name -> shape, in flattening order), frozen and shared
  parameters, step counters and the client state; ``[bf16_]zero_pp_rank_<r>_mp_rank_00_
  optim_states.pt`` hold rank r's fp32 master partition and optimizer state.
- Stages 1-2: each param group is one flat vector (its parameters in ``param_shapes`` order,
  each followed by its ``param_alignment_paddings``, the end padded), cut into equal
  partitions, partition r on rank r; the optimizer state is laid out like it.
- Stage 3: every parameter is cut into ``ceil(numel / N)`` elements per rank (the last
  padded); rank r's flat vector is its piece of each parameter in ``param_shapes`` order,
  stored as one or more sub-groups; the optimizer state follows the sub-groups.

Nothing is imported from DeepSpeed and no file is unpickled beyond tensors and allow-listed
records (``pickles.py``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from .bounds import count, fail, shape
from .errors import CheckpointError
from .pickles import load_torch_file
from .source import MappedFile, ReaderBase, copy_flat, foreign_manifest
from .verify import member, plain_name

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
_MODEL_FILE = "mp_rank_00_model_states.pt"
_DS_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}
"""Model-states keys DeepSpeed writes itself; every other key is the client state."""


def deepspeed_tag(directory: Path, tag: str | None = None) -> Path | None:
    """The tag directory of a DeepSpeed checkpoint at ``directory`` (the directory given to
    ``save_checkpoint`` or a tag directory), or None if it is not laid out as one."""
    if not directory.is_dir():
        return None
    if tag is None and _states_files(directory):
        return directory
    if tag is None:
        latest = directory / "latest"
        if not latest.is_file():  # a FIFO or device is no tag name
            return None
        member(directory, latest, "'latest'")
        with open(latest, "rb") as f:
            tag = f.read(4096).decode("utf-8", errors="replace").strip()
    try:
        path = directory / plain_name(tag, f"{directory}: tag")
    except CheckpointError:
        return None
    if not path.is_dir() or not _states_files(path):
        return None
    member(directory, path, f"tag directory {tag!r}", directory=True)
    return path


def _states_files(path: Path) -> list[Path]:
    """What tells a DeepSpeed tag directory: its model- or optimizer-states files (either
    alone is an incomplete save, refused by name rather than read as another format)."""
    return sorted(p for p in path.iterdir() if p.name.endswith(("model_states.pt",
                                                                 "optim_states.pt")))


def _rank_files(path: Path, kind: str) -> list[Path]:
    """Rank-numbered files of ``kind`` ("model"/"optim"), in rank order, checked complete."""
    found: dict[int, Path] = {}
    for p in path.iterdir():
        m = _RANK_FILE.match(p.name)
        if not m or m.group(4) != kind:
            continue
        if m.group(3) != "00":
            raise CheckpointError(f"{p}: a tensor- or pipeline-parallel DeepSpeed checkpoint "
                                  "(mp_rank other than 00); only data parallelism is read")
        member(path, p, p.name)
        if int(m.group(2)) in found:
            raise CheckpointError(f"{path}: two {kind} files for rank {m.group(2)}")
        found[int(m.group(2))] = p
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{path}: {kind}-state files for ranks {sorted(found)}: some "
                              "rank's file is missing (a save that did not complete?)")
    return [found[r] for r in range(len(found))]


def _field(file: Path, data: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise CheckpointError(f"{file}: field {key!r} is missing: not a DeepSpeed ZeRO file")
    if not isinstance(data[key], kind):
        raise CheckpointError(f"{file}: field {key!r} is a {type(data[key]).__name__}")
    return data[key]


class DeepSpeedReader(ReaderBase):
    kind = "deepspeed"

    def __init__(self, path: Path, *, trust: bool | None = None) -> None:
        self.path = path
        self._trust = trust
        optim_files = _rank_files(path, "optim")
        if not optim_files:
            raise CheckpointError(f"{path}: no *_optim_states.pt files: a DeepSpeed checkpoint "
                                  "without ZeRO (stage 0) or an incomplete save")
        self._optim_files = optim_files
        self._optim: list[dict[str, Any] | None] = [None] * len(optim_files)
        self._mapped = [MappedFile(f) for f in optim_files]
        first = self._optimizer_state(0)
        self.stage = count(optim_files[0], "field 'zero_stage'",
                           _field(optim_files[0], first, "zero_stage", int), "the stage",
                           low=1, high=3)
        self.world = len(optim_files)
        counts = first.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != self.world for c in counts):
            raise CheckpointError(
                f"{optim_files[0]}: field 'partition_count' is {counts} but {self.world} "
                "optimizer files exist (an overwritten or partial checkpoint, or expert "
                "parallelism, which is not read)")
        self._model_files = self._model_files_of(path)
        self.states = load_torch_file(self._model_files[0], trust=trust)
        if not isinstance(self.states, dict):
            raise CheckpointError(f"{self._model_files[0]}: not a DeepSpeed model-states file")
        world = self.states.get("dp_world_size", self.world)
        if world != self.world:
            raise CheckpointError(f"{self._model_files[0]}: field 'dp_world_size' is {world!r}, "
                                  f"but {self.world} optimizer files exist")
        self._frozen: dict[str, torch.Tensor] = {}
        self._fragments: dict[Path, Any] = {}
        self._layout()
        self.manifest = self._describe()
        self._check_partitions()

    def _model_files_of(self, path: Path) -> list[Path]:
        """The model-states files: one at stages 1-2; one per rank at stage 3, every one of
        them, as DeepSpeed's own loader requires (each holds its rank's share of the frozen
        parameters, and the set is what tells a complete save)."""
        if self.stage < 3:
            file = path / _MODEL_FILE
            if not file.exists() and not file.is_symlink():
                raise CheckpointError(f"{file}: the model-states file is missing")
            return [member(path, file, _MODEL_FILE)]
        files = _rank_files(path, "model")
        if len(files) != self.world:
            names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                     for r in range(min(len(files), self.world), max(len(files), self.world))]
            problem = "are missing" if len(files) < self.world else "have no optimizer file"
            raise CheckpointError(
                f"{path}: {names} {problem}: ZeRO stage 3 writes one model-states file per "
                f"rank, and {self.world} ranks wrote optimizer files (an incomplete save; "
                "DeepSpeed refuses it too)")
        return files

    # ------------------------------------------------------------------ files
    def _optimizer_state(self, rank: int) -> dict[str, Any]:
        data = self._optim[rank]
        if data is None:
            file = self._optim_files[rank]
            loaded = load_torch_file(file, trust=self._trust)
            data = _field(file, loaded, "optimizer_state_dict", dict)
            self._optim[rank] = data
        return data

    def _flat(self, rank: int, key: str) -> list[torch.Tensor]:
        """Rank ``rank``'s flat vectors (one per group or sub-group) of ``key``."""
        state = self._optimizer_state(rank)
        file = self._optim_files[rank]
        if key == "master":
            field = "single_partition_of_fp32_groups" if self.stage < 3 else "fp32_flat_groups"
            flats = list(_field(file, state, field, list))
        else:
            if self.stage < 3:
                base = _field(file, state, "base_optimizer_state", (dict, list))
                entries = base["state"] if isinstance(base, dict) else dict(enumerate(base))
            else:
                entries = _field(file, state, "optimizer_state_dict", dict)["state"]
            try:
                flats = [entries[i][key] for i in sorted(entries)]
            except (KeyError, TypeError) as e:
                raise CheckpointError(f"{file}: optimizer state {key!r} is missing for a "
                                      "group") from e
        for i, flat in enumerate(flats):
            if not (torch.is_tensor(flat) and flat.is_floating_point() and flat.dim() == 1):
                got = f"{flat.dtype} {list(flat.shape)}" if torch.is_tensor(flat) else type(
                    flat).__name__
                raise fail(file, f"{key} of group {i}", f"must be a flat float tensor, got {got}")
        return flats

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        """Where each trainable parameter's elements are: ``self.where[name]``."""
        file = self._model_files[0]
        self.groups = []
        for g, group in enumerate(_field(file, self.states, "param_shapes", list)):
            if not isinstance(group, dict):
                raise fail(file, f"param_shapes[{g}]", "must map names to shapes")
            self.groups.append([(str(n), shape(file, f"param_shapes[{g}][{n!r}]", s, "shape"))
                                for n, s in group.items()])
        names = [n for g in self.groups for n, _ in g]
        if len(set(names)) != len(names):
            raise fail(file, "param_shapes", "names a parameter twice")
        self.where: dict[str, tuple[int, int, int]] = {}
        self._need: list[int] = []
        """Stages 1-2: the elements each group's layout reads."""
        if self.stage < 3:
            self._layout_flat_groups()
        else:
            self._layout_per_parameter()

    def _paddings(self) -> list[list[int]]:
        """Stages 1-2: the elements of padding after each parameter of each group."""
        file = self._optim_files[0]
        paddings = self._optimizer_state(0).get("param_alignment_paddings")
        if paddings is None:
            return [[0] * len(g) for g in self.groups]
        if not isinstance(paddings, list) or [len(p) if isinstance(p, list) else None
                                              for p in paddings] != [len(g) for g in self.groups]:
            raise fail(file, "param_alignment_paddings", "must list one padding per parameter "
                       "of each group in param_shapes")
        return [[count(file, f"param_alignment_paddings[{g}]", p, "a padding")
                 for p in group] for g, group in enumerate(paddings)]

    def _layout_flat_groups(self) -> None:
        file = self._optim_files[0]
        paddings = self._paddings()
        self.partition = [p.numel() for p in self._flat(0, "master")]
        if len(self.partition) != len(self.groups):
            raise CheckpointError(f"{file}: {len(self.partition)} fp32 partitions for "
                                  f"{len(self.groups)} param groups")
        for g, params in enumerate(self.groups):
            offset = 0
            for i, (name, dims) in enumerate(params):
                numel = math.prod(dims)
                self.where[name] = (g, offset, numel)
                offset += numel + paddings[g][i]
            self._need.append(offset)
            if offset > self.partition[g] * self.world:
                raise CheckpointError(
                    f"{file}: group {g} needs {offset} elements, the {self.world} partitions "
                    f"hold {self.partition[g] * self.world}: not the layout of these shapes")
        self._check_end_padding()

    def _check_end_padding(self) -> None:
        """DeepSpeed records each group's end padding (``group_paddings``, in the last rank's
        file; 0 in the others'): with it, the shapes and paddings must fill the partitions
        exactly, so a shape changed in the model states cannot shift where the later
        parameters are read from."""
        ends = [0] * len(self.groups)
        for rank in range(self.world):
            file = self._optim_files[rank]
            found = self._optimizer_state(rank).get("group_paddings")
            if found is None:  # older DeepSpeed: only the bound above
                return
            if not isinstance(found, list) or len(found) != len(self.groups):
                raise fail(file, "group_paddings", f"must list one padding per group, got "
                           f"{found!r}")
            for g, end in enumerate(found):
                ends[g] += count(file, f"group_paddings[{g}]", end, "a padding")
        for g, (need, end) in enumerate(zip(self._need, ends)):
            if need + end != self.partition[g] * self.world:
                raise fail(self._model_files[0], f"param_shapes[{g}]", f"the shapes and "
                           f"paddings need {need} elements and the group's end padding is "
                           f"{end}, but the {self.world} partitions hold "
                           f"{self.partition[g] * self.world}: not the layout of these shapes")

    def _layout_per_parameter(self) -> None:
        offset = 0
        for params in self.groups:
            for name, dims in params:
                numel = math.prod(dims)
                self.where[name] = (0, offset, numel)
                offset += -(-numel // self.world)
        for rank in range(self.world):
            held = sum(t.numel() for t in self._flat(rank, "master"))
            if held != offset:
                raise CheckpointError(
                    f"{self._optim_files[rank]}: {held} master elements, the parameter "
                    f"shapes need {offset} per rank: not the layout of these shapes")

    def _check_partitions(self) -> None:
        """Every rank's flat vectors hold what the layout reads from them, so no range read
        from any rank reaches past what that rank stores. Stage 3: each state as the rank's
        masters, sub-group by sub-group. Stages 1-2: each group's partition at most rank 0's
        size and at least what the layout reads there (DeepSpeed saves the last rank's
        masters without the group's end padding, its moments with it)."""
        keys = sorted({k for r in self.manifest["param_states"].values() for k in r["tensors"]})
        for rank in range(self.world):
            file = self._optim_files[rank]
            masters = [t.numel() for t in self._flat(rank, "master")]
            if self.stage == 3:
                needed, allowed = masters, masters
            else:
                needed = [min(max(need - rank * size, 0), size)
                          for need, size in zip(self._need, self.partition)]
                allowed = self.partition
            for key in ["master", *keys]:
                held = [t.numel() for t in self._flat(rank, key)]
                if len(held) != len(needed) or any(
                        not n <= h <= a for h, n, a in zip(held, needed, allowed)):
                    raise fail(file, f"optimizer state {key!r}", f"holds {held} elements per "
                               f"group; the layout reads {needed} from this rank, of partitions "
                               f"of {allowed} (damaged, or the ranks are from different saves)")
        self._check_frozen_shapes()

    def _check_frozen_shapes(self) -> None:
        frozen = self.states.get("frozen_param_shapes") or {}
        if not isinstance(frozen, dict):
            raise fail(self._model_files[0], "frozen_param_shapes", "must map names to shapes")
        for key, dims in frozen.items():
            shape(self._model_files[0], f"frozen_param_shapes[{key!r}]", dims, "shape")

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        group, offset, numel = self.where[name]
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of {name!r} are "
                                  f"outside its {numel}")
        dtype = torch.float32 if key == "master" else self._flat(0, key)[0].dtype
        out = torch.empty(end - start, dtype=dtype)
        if self.stage < 3:
            size = self.partition[group]
            lo, hi = offset + start, offset + end
            for rank in range(lo // size, (hi - 1) // size + 1) if hi > lo else []:
                a, b = max(lo, rank * size), min(hi, (rank + 1) * size)
                copy_flat([self._flat(rank, key)[group]], a - rank * size, b - rank * size,
                          out[a - lo : b - lo], self._mapped[rank].release)
        else:
            size = -(-numel // self.world)
            for rank in range(start // size, (end - 1) // size + 1) if end > start else []:
                a, b = max(start, rank * size), min(end, (rank + 1) * size)
                copy_flat(self._flat(rank, key), offset + a - rank * size,
                          offset + b - rank * size, out[a - start : b - start],
                          self._mapped[rank].release)
        return out

    # ------------------------------------------------------------------ description
    def _describe(self) -> dict[str, Any]:
        states, file = self.states, self._model_files[0]
        module = _field(file, states, "module", dict)
        params = {n: s for g in self.groups for n, s in g}
        aliases = {n: n for n in params}
        shared = states.get("shared_params") or {}
        if not isinstance(shared, dict):
            raise fail(file, "shared_params", "must map names to names")
        for alias, source in shared.items():
            if source in params:
                aliases[str(alias)] = source
        keys = list(module)
        keys += [k for k in aliases if k not in keys]
        groups, records = self._optimizer_description()
        self._module = {k: v for k, v in module.items() if k not in aliases}
        return foreign_manifest(
            params=params, state_dict_keys=keys, aliases=aliases, param_groups=groups,
            param_states=records,
            global_step=count(file, "global_steps", states.get("global_steps") or 0, "a count"),
            skipped_steps=count(file, "skipped_steps", states.get("skipped_steps") or 0,
                                "a count"),
            written_by=f"DeepSpeed {states.get('ds_version', '?')} ZeRO stage {self.stage}",
            group_names=[[n for n, _ in g] for g in self.groups])

    def _optimizer_description(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        state, file = self._optimizer_state(0), self._optim_files[0]
        if self.stage < 3:
            base = _field(file, state, "base_optimizer_state", (dict, list))
        else:
            base = _field(file, state, "optimizer_state_dict", dict)
        saved_groups = base.get("param_groups", []) if isinstance(base, dict) else []
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
                   if k != "params"} for g in saved_groups]
        if groups and len(groups) != len(self.groups):
            raise CheckpointError(f"{file}: {len(groups)} optimizer param groups for "
                                  f"{len(self.groups)} groups of parameters")
        entries = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        first = entries[min(entries)] if entries else {}
        scalars = {k: float(v) for k, v in first.items()
                   if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.dim() == 0)}
        tensors = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
        records = {n: {"scalars": dict(scalars), "tensors": list(tensors)}
                   for g in self.groups for n, _ in g} if entries else {}
        return groups, records

    def module_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        tensor = self._module_entry(key)
        return tensor.dtype, tuple(tensor.shape)

    def module_tensor(self, key: str) -> torch.Tensor:
        return self._module_entry(key).clone()

    def _module_entry(self, key: str) -> torch.Tensor:
        if key not in self._module:
            raise CheckpointError(f"{self.path}: tensor {key!r} is missing")
        frozen = self.states.get("frozen_param_shapes") or {}
        if self.stage == 3 and key in frozen:  # frozen: a fragment per rank, like the masters
            if key not in self._frozen:
                self._frozen[key] = self._frozen_param(key, tuple(frozen[key]))
            return self._frozen[key]
        value = self._module[key]
        if not torch.is_tensor(value):
            raise fail(self._model_files[0], f"module[{key!r}]",
                       f"must be a tensor, got {type(value).__name__}")
        return value

    def _frozen_param(self, key: str, dims: tuple[int, ...]) -> torch.Tensor:
        """A stage-3 frozen parameter from every rank's fragment, each checked to be there."""
        frags = []
        for file in self._model_files:
            if file not in self._fragments:  # each file read (and its archive checked) once
                loaded = load_torch_file(file, trust=self._trust)
                self._fragments[file] = (loaded.get("frozen_param_fragments") or {}) if (
                    isinstance(loaded, dict)) else {}
            found = self._fragments[file]
            frag = found.get(key) if isinstance(found, dict) else None
            if not torch.is_tensor(frag):
                raise fail(file, f"frozen_param_fragments[{key!r}]", "is missing (every rank "
                           "holds a fragment of each frozen parameter)")
            frags.append(frag.reshape(-1))
        held = sum(f.numel() for f in frags)
        if held < math.prod(dims):
            raise fail(self._model_files[0], f"frozen_param_shapes[{key!r}]",
                       f"is {list(dims)}, but the ranks' fragments hold {held} elements")
        return torch.cat(frags)[: math.prod(dims)].view(dims)

    def client_state(self) -> dict[str, Any]:
        state = {k: v for k, v in self.states.items() if k not in _DS_KEYS}
        if self.states.get("lr_scheduler") is not None:
            state["deepspeed_lr_scheduler"] = self.states["lr_scheduler"]
        return state


__all__ = ["DeepSpeedReader", "deepspeed_tag"]
