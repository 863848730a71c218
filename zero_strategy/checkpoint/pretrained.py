"""Pretrained weights from a Hugging Face ``save_pretrained`` folder, streamed into the shards.

``Model.from_pretrained`` builds the whole model on every rank before the engine shards it: N
copies of the weights in host memory. Here each rank reads only the element ranges of its own
shards (and whole tensors for what the engine keeps whole: buffers, frozen parameters), straight
from the safetensors files with seek + readinto, so no rank ever holds the whole model.

The folder is presented to the loader as one more ``ReaderBase`` source and written by the same
``read.stage_load`` / ``read.commit_load`` as every checkpoint: everything is checked first (the
index, each file a regular member of the folder, every header against the file's size, every
key's shape and dtype against the model), everything this rank writes is read next, and only
then, every rank having agreed, is the engine changed. At engine construction, where the masters
hold nothing yet, each range is read straight into place instead (``PretrainedSource``): a
rank's peak is then its shards plus one piece, not a second copy of them.

Nothing here knows transformers: how a folder's keys find the model's (the base-model prefix,
renamed legacy keys, keys never reported) comes in a ``KeyMap``, which
``integrations/hf/pretrained.py`` builds from the model class. A model that one built on the
meta device is registered here (``register``); the engine loads a registered model's folder when
it is built on it (``pending`` / ``load_pending``).
"""

from __future__ import annotations

import json
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from .conversions import ConversionPlan, Node, read_target
from .errors import CheckpointError
from .read import SafetensorsFile, commit_load, on_all_ranks, stage_load
from .source import ReaderBase, foreign_manifest
from .verify import member, plain_name, read_header

if TYPE_CHECKING:
    from ..engine_view import EngineView

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 1 << 26
"""An index lists one file name per tensor: 64 MiB is millions of tensors."""
_NOT_READ = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
             "flax_model.msgpack")
_COMPARE_BYTES = 1 << 24


class LoadResult(NamedTuple):
    """What ``Module.load_state_dict`` returns: model keys the folder did not give a value, and
    folder keys that went nowhere."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# ---------------------------------------------------------------------------- the folder
class PretrainedFolder:
    """The weights of a ``save_pretrained`` folder: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists. Checked completely when opened (see module doc);
    then ``read(key, start, end)`` reads any element range of a tensor and nothing else."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path}: no such model folder (give the directory save_pretrained wrote; "
                "a Hub model id must be downloaded first, e.g. with "
                "huggingface_hub.snapshot_download)")
        self.files: dict[str, SafetensorsFile] = {}
        self._index: tuple[Path, dict[str, str]] | None = None
        self.where: dict[str, str] = {}
        """Each tensor's file name."""
        names = self._file_names()
        for name in names:
            file = member(self.path, self.path / name, f"weights file {name!r}")
            self.files[name] = SafetensorsFile(file, *read_header(file, file.stat().st_size))
        for name in names:
            for key in self.files[name].keys():
                if key in self.where:
                    raise CheckpointError(f"{self.path / name}: tensor {key!r} is also in "
                                          f"{self.where[key]} (one file per tensor)")
                self.where[key] = name
        if not self.where:
            raise CheckpointError(f"{self.path}: the weights files hold no tensor")
        self._check_index()

    def _file_names(self) -> list[str]:
        if (self.path / INDEX).exists() or (self.path / INDEX).is_symlink():
            return self._indexed()
        if (self.path / WEIGHTS).exists() or (self.path / WEIGHTS).is_symlink():
            return [WEIGHTS]
        other = [n for n in _NOT_READ if (self.path / n).exists()]
        found = f" (found {', '.join(other)}: only safetensors are read, never pickles)" \
            if other else ""
        raise CheckpointError(f"{self.path}: holds neither {WEIGHTS} nor {INDEX}{found}; "
                              "save the model with save_pretrained(safe_serialization=True)")

    def _indexed(self) -> list[str]:
        """The shard files the index names, after checking its schema: every file a plain
        name in the folder. Each listed key must then be in its file (``_check_index``)."""
        file = member(self.path, self.path / INDEX, INDEX)
        size = file.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{file}: {size} bytes, more than the {MAX_INDEX_BYTES} an "
                                  "index may have")
        try:
            index = json.loads(file.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not JSON ({e})") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{file}: field 'weight_map' must be a non-empty object "
                                  "{tensor key: shard file name}")
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise CheckpointError(f"{file}: field 'weight_map.{key}' must be a file name, "
                                      f"got {name!r}")
            plain_name(name, f"{file}: field 'weight_map.{key}'")
        self._index = (file, weight_map)
        return sorted(set(weight_map.values()))

    def _check_index(self) -> None:
        """Every key the index lists is in the file it names (transformers reads each shard
        whole, so a key only the header has still loads, as there)."""
        if self._index is None:
            return
        file, weight_map = self._index
        for key, name in weight_map.items():
            if self.where.get(key) != name:
                got = self.where.get(key)
                raise CheckpointError(
                    f"{file}: tensor {key!r} is listed in {name}, but "
                    + (f"{self.path / got} holds it" if got else f"{self.path / name} lacks it"))

    def keys(self) -> list[str]:
        return list(self.where)

    def file_of(self, key: str) -> Path:
        return self.files[self.where[key]].path

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return self.files[self.where[key]].info(key)

    def read(self, key: str, start: int | None = None, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat elements [start, end) of tensor ``key`` (all of it, in its shape, by default),
        into ``out`` when given (see ``SafetensorsFile.read``)."""
        return self.files[self.where[key]].read(key, start, end, out)

    def float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating tensor of the first file, keys in sorted order: what
        transformers' ``dtype="auto"`` takes when the config names none."""
        first = self.files[sorted(self.files)[0]]
        for key in sorted(first.keys()):
            dtype = first.info(key)[0]
            if dtype.is_floating_point:
                return dtype
        return None

    def same_values(self, a: str, b: str) -> bool:
        """Whether two tensors hold the same bytes, compared a chunk at a time."""
        if self.info(a) != self.info(b):
            return False
        dtype, shape = self.info(a)
        numel = torch.Size(shape).numel()
        step = max(1, _COMPARE_BYTES // dtype.itemsize)
        return all(torch.equal(self.read(a, i, min(i + step, numel)).view(torch.uint8),
                               self.read(b, i, min(i + step, numel)).view(torch.uint8))
                   for i in range(0, numel, step))


def open_folder(path: str | os.PathLike | PretrainedFolder) -> PretrainedFolder:
    return path if isinstance(path, PretrainedFolder) else PretrainedFolder(path)


# ---------------------------------------------------------------------------- key mapping
@dataclass(frozen=True)
class KeyMap:
    """How a folder's keys become the model's state-dict keys (the integration that knows the
    model class fills it in; the default takes keys as they are).

    A folder key is first renamed (``rename``), then, as transformers does: stripped of
    ``prefix + "."`` when the model has the rest (a head model's checkpoint loaded into the
    base model), else given it when the model has that (a base model's checkpoint into a head
    model), else taken as it is.
    """

    prefix: str = ""
    """The base model's attribute name in a head model (transformers' ``base_model_prefix``)."""
    rename: Callable[[str], str] | None = None
    """Legacy names to today's (``LayerNorm.gamma`` -> ``LayerNorm.weight``)."""
    ignore_missing: tuple[str, ...] = ()
    """Regular expressions: model keys never reported missing."""
    ignore_unexpected: tuple[str, ...] = ()
    """Regular expressions: folder keys never reported unexpected."""
    root: str = ""
    """Where the pretrained model sits in the engine's module (``"model."`` for a
    LightningModule holding it as ``self.model``): only keys under it are loaded."""
    convert: Callable[[PretrainedFolder, Callable[[str], Any]], ConversionPlan] | None = None
    """Model tensors the folder stores as others (experts one by one, ``qkv`` fused):
    ``convert(folder, shape_of)`` plans them (``conversions.py``; ``shape_of(key)`` is the
    model's shape for a key, None when it has none). The keys it consumes are not renamed."""


@dataclass
class Resolution:
    """Where each model key's value comes from, and what ``load_state_dict`` would report."""

    sources: dict[str, str | Node]
    """Model key -> folder key, or the description of a converted tensor made of several
    folder tensors, one per tensor (tied keys share their tensor's)."""
    covered: set[str]
    """Model keys whose tensor gets a value from the folder (tied aliases included)."""
    missing: list[str]
    unexpected: list[str]


def resolve(model: dict[str, tuple[int, torch.Size, torch.dtype]], folder: PretrainedFolder,
            key_map: KeyMap) -> Resolution:
    """Which folder tensor (or converted description of several) loads each model key
    (``model``: key -> (tensor identity, shape, dtype), keys relative to ``key_map.root``),
    after checking every pair's shape and dtype."""
    plan = _plan(model, folder, key_map)
    targets: dict[str, str | Node] = {}
    unexpected = list(plan.unexpected)
    named = [(k, k) for k in sorted(folder.keys()) if k not in plan.consumed]
    for key, value in [*named, *plan.targets.items()]:
        target = _model_key(key, model, key_map if isinstance(value, str)
                            else replace(key_map, rename=None))
        if target is None:  # named as transformers names it: after its renamings
            unexpected.append(key_map.rename(key) if key_map.rename is not None
                              and isinstance(value, str) else key)
        elif target in targets:
            raise CheckpointError(f"{_file_of(folder, value)}: tensors {_name(targets[target])}"
                                  f" and {_name(value)} both load model key {target!r}")
        else:
            targets[target] = value
    sources: dict[str, str | Node] = {}
    by_tensor: dict[int, str | Node] = {}
    for target, value in targets.items():
        _check_pair(folder, value, key_map.root + target, model[target])
        first = by_tensor.setdefault(model[target][0], value)
        if first is value:
            sources[target] = value
        elif not (isinstance(first, str) and isinstance(value, str)
                  and folder.same_values(first, value)):  # a tied pair saved untied, changed
            raise CheckpointError(
                f"{_file_of(folder, value)}: tensors {_name(first)} and {_name(value)} differ, "
                "but the model ties them (one parameter); untie them in the config "
                "(tie_word_embeddings=False) to load both")
    covered = {k for k, (tensor, _, _) in model.items() if tensor in by_tensor}
    return Resolution(
        sources, covered,
        [key_map.root + k for k in model if k not in covered
         and not _matches(k, key_map.ignore_missing)],
        sorted(k for k in unexpected if not _matches(k, key_map.ignore_unexpected)))


def _plan(model: dict[str, tuple[int, torch.Size, torch.dtype]], folder: PretrainedFolder,
          key_map: KeyMap) -> ConversionPlan:
    if key_map.convert is None:
        return ConversionPlan()
    bare = replace(key_map, rename=None)

    def shape_of(key: str) -> torch.Size | None:
        target = _model_key(key, model, bare)
        return None if target is None else model[target][1]

    return key_map.convert(folder, shape_of)


def _name(value: str | Node) -> str:
    if isinstance(value, str):
        return repr(value)
    keys = [leaf.key for leaf in value.leaves()]
    return f"{keys[0]!r}" + (f" (with {len(keys) - 1} more, converted)" if len(keys) > 1
                             else " (converted)")


def _file_of(folder: PretrainedFolder, value: str | Node) -> Path:
    return folder.file_of(value if isinstance(value, str) else value.leaves()[0].key)


def _model_key(key: str, model: dict[str, Any], key_map: KeyMap) -> str | None:
    renamed = key_map.rename(key) if key_map.rename is not None else key
    for candidate in dict.fromkeys((renamed, key)):  # the original, if the renamed fits not
        prefix = key_map.prefix + "."
        if key_map.prefix and candidate.startswith(prefix) and candidate[len(prefix):] in model:
            return candidate[len(prefix):]
        if key_map.prefix and prefix + candidate in model:
            return prefix + candidate
        if candidate in model:
            return candidate
    return None


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, key) for p in patterns)


def _check_pair(folder: PretrainedFolder, value: str | Node, target: str,
                expected: tuple[int, torch.Size, torch.dtype]) -> None:
    """A folder tensor (or every source of a converted one) can load a model tensor: same
    shape, and floating point into floating point (cast as transformers casts) or exactly the
    same dtype (integers and bools)."""
    _, want_shape, want_dtype = expected
    if isinstance(value, str):
        dtype, shape = folder.info(value)
        where = f"{folder.file_of(value)}: tensor {value!r}"
        pairs = [(where, dtype)]
    else:
        shape = value.shape
        where = f"{_file_of(folder, value)}: tensors {_name(value)}"
        pairs = [(f"{folder.file_of(leaf.key)}: tensor {leaf.key!r}", leaf.dtype)
                 for leaf in value.leaves()]
    if tuple(shape) != tuple(want_shape):
        raise CheckpointError(f"{where} {'make' if isinstance(value, Node) else 'has'} shape "
                              f"{list(shape)}, model key {target!r} needs {list(want_shape)}")
    for where, dtype in pairs:
        if not (dtype.is_floating_point and want_dtype.is_floating_point or
                dtype == want_dtype):
            raise CheckpointError(f"{where} is {dtype}, model key {target!r} is {want_dtype} "
                                  "(floats load into floats; integers and bools need their "
                                  "dtype)")


def module_entries(module: nn.Module, root: str = "",
                   dtypes: dict[str, torch.dtype] | None = None
                   ) -> dict[str, tuple[int, torch.Size, torch.dtype]]:
    """``resolve``'s view of a plain module (on meta or real): its state-dict keys under
    ``root``, relative to it, with tensor identity, shape and dtype."""
    return {k[len(root):]: (id(t), t.shape, (dtypes or {}).get(k, t.dtype))
            for k, t in module.state_dict(keep_vars=True).items() if k.startswith(root)}


# ---------------------------------------------------------------------------- the source
class PretrainedSource(ReaderBase):
    """The folder in the shape ``read.stage_load`` reads: the engine's parameters by name, by
    element range, each cast to the dtype the model gave it (then to the master's, as a
    model loaded whole and then wrapped would be), and whole module tensors by key.

    ``into`` (the load at engine construction): this rank's master shard and the offset of
    each parameter's first element in it. A freshly built engine's masters hold nothing yet,
    only memory the load overwrites (missing keys are not read), so a range is read straight
    into its place instead of into a staging copy of the shard: a rank's peak is its shards
    plus one piece. Every range was checked against the headers before the first read; what
    can still fail is the file system, and the engine is then closed (``load_pending``)."""

    kind = "huggingface"

    def __init__(self, folder: PretrainedFolder, manifest: dict[str, Any],
                 sources: dict[str, str | Node], dtypes: dict[str, torch.dtype],
                 into: dict[str, tuple[torch.Tensor, int]] | None = None) -> None:
        self.folder = folder
        self.path = folder.path
        self.manifest = manifest
        self.sources = sources
        """Engine parameter name or module key -> folder key, or a converted description."""
        self.dtypes = dtypes
        self.into = into

    def holds(self, name: str) -> bool:
        return name in self.sources

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        if key != "master":
            raise CheckpointError(f"{self.path}: pretrained weights hold no optimizer state")
        source, dtype = self.sources[name], self.dtypes[name]
        if self.into is None:
            if isinstance(source, Node):
                return read_target(source, start, end, self.folder.read,
                                   torch.empty(end - start, dtype=dtype))
            return self.folder.read(source, start, end).reshape(-1).to(dtype)
        master, offset = self.into[name]
        target = master[offset + start : offset + end]
        if isinstance(source, Node):
            return read_target(source, start, end, self.folder.read, target)
        stored = self.folder.info(source)[0]
        if target.device.type == "cpu" and target.dtype == stored == dtype:
            return self.folder.read(source, start, end, out=target).reshape(-1)
        target.copy_(self.folder.read(source, start, end).reshape(-1).to(dtype))
        return target  # commit_load copies it onto itself

    def module_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        source = self.sources[key]
        if isinstance(source, Node):
            return self.dtypes[key], source.shape
        return self.dtypes[key], self.folder.info(source)[1]

    def module_tensor(self, key: str) -> torch.Tensor:
        source = self.sources[key]
        if isinstance(source, Node):
            out = torch.empty(source.numel, dtype=self.dtypes[key])
            return read_target(source, 0, source.numel, self.folder.read, out).view(
                source.shape)
        return self.folder.read(source).to(self.dtypes[key])


def _in_place(engine: EngineView) -> dict[str, tuple[torch.Tensor, int]]:
    """Where each parameter's element 0 would sit in this rank's master shard (negative when
    it starts in an earlier shard), after every copy still reading the masters finished."""
    engine.runtime.settle()
    engine.settle_tier()
    rank = engine.shards.rank if engine.plan.optimizer_shards > 1 else 0
    out = {}
    for unit in engine.units:
        unit.param_store.wait_host_copies()
        lo = unit.layout.shard_bounds(rank)[0]
        for slot in unit.layout.slots:
            out[slot.name] = (unit.param_store.master, slot.offset - lo)
    return out


def _engine_entries(engine: EngineView, root: str, dtypes: dict[str, torch.dtype],
                    built: PretrainedSpec | None = None
                    ) -> tuple[dict[str, tuple[int, torch.Size, torch.dtype]], dict[int, str],
                               dict[str, str]]:
    """The engine module's keys under ``root`` with the shapes and dtypes the model had before
    wrapping (a stage-3 parameter's own tensor is empty now), each managed parameter's engine
    name by identity, and the module's own key of each (relative to ``root``). A parameter
    ``built`` knows is keyed as it was built, so the folder's key finds it wherever a wrapper
    has moved it since."""
    shapes = {id(p): torch.Size(s.shape) for u in engine.units
              for s, p in zip(u.layout.slots, u.params)}
    names = {id(p): s.name for u in engine.units for s, p in zip(u.layout.slots, u.params)}
    out, current = {}, {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if key.startswith(root):
            own = key[len(root):]
            rel = built.built_key(t, own, out) if built is not None else own
            if rel in out:  # an untouched key and a moved one now both claim it
                raise CheckpointError(f"model keys {root + current[rel]!r} and {key!r} both "
                                      f"stand for {rel!r} of the pretrained model")
            dtype = engine.original_dtypes.get(id(t), dtypes.get(root + rel, t.dtype))
            out[rel] = (id(t), shapes.get(id(t), t.shape), dtype)
            current[rel] = own
    return out, names, current


def _source(engine: EngineView, folder: PretrainedFolder, key_map: KeyMap,
            dtypes: dict[str, torch.dtype], strict: bool, in_place: bool,
            built: PretrainedSpec | None = None) -> tuple[PretrainedSource, Resolution]:
    entries, names, current = _engine_entries(engine, key_map.root, dtypes, built)
    found = resolve(entries, folder, key_map)
    if strict and (found.missing or found.unexpected):
        raise CheckpointError(
            f"{folder.path}: nothing was loaded (strict=True): "
            f"{len(found.missing)} model keys missing from the folder "
            f"{found.missing[:5]}, {len(found.unexpected)} folder keys unexpected "
            f"{found.unexpected[:5]}; pass strict=False to load the rest")
    sources: dict[str, str | Node] = {}
    manifest_dtypes: dict[str, torch.dtype] = {}
    params: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    for rel, key in found.sources.items():
        tensor, shape, dtype = entries[rel]
        name = names.get(tensor, key_map.root + rel)
        if tensor in names:
            params[name] = tuple(shape)
            aliases[key_map.root + current[rel]] = name
        sources[name] = key
        manifest_dtypes[name] = dtype
    manifest = foreign_manifest(
        params=params, state_dict_keys=list(engine.module.state_dict(keep_vars=True)),
        aliases=aliases, param_groups=None, param_states={}, global_step=engine.global_step,
        skipped_steps=engine.skipped_steps, written_by="huggingface save_pretrained")
    into = _in_place(engine) if in_place else None
    return PretrainedSource(folder, manifest, sources, manifest_dtypes, into), found


def load(engine: EngineView, path: str | os.PathLike | PretrainedFolder, *,
         key_map: KeyMap | None = None, strict: bool = True,
         dtypes: dict[str, torch.dtype] | None = None) -> LoadResult:
    """Load the folder's weights into ``engine`` (every rank calls this): validate on every
    rank, read this rank's ranges on every rank, agree, then write (``read.commit_load``). The
    engine's step counters and optimizer state stay as they are. ``dtypes``: the dtype each
    key had in the model before the engine cast it (buffers); managed parameters' are known."""
    spec = None
    if key_map is None:
        key_map, dtypes, spec = _registered(engine.module, dtypes)
    found = _load(engine, path, key_map, strict, dtypes or {}, in_place=False, built=spec)
    return LoadResult(found.missing, found.unexpected)


def _load(engine: EngineView, path: str | os.PathLike | PretrainedFolder, key_map: KeyMap,
          strict: bool, dtypes: dict[str, torch.dtype], *, in_place: bool,
          built: PretrainedSpec | None = None) -> Resolution:
    comm = engine.comm
    source, found = on_all_ranks(comm, lambda: _source(
        engine, open_folder(path), key_map, dtypes, strict, in_place, built))
    staged = on_all_ranks(comm, lambda: stage_load(engine, source, False, None))
    commit_load(engine, staged, False)
    return found


# ---------------------------------------------------------------------------- registry
@dataclass
class PretrainedSpec:
    """A model built on meta whose weights are in ``folder``: what the engine needs to load
    them when it is built on the model."""

    folder: PretrainedFolder
    key_map: KeyMap
    dtypes: dict[str, torch.dtype]
    """Each state-dict key's dtype in the model as built (the engine casts buffers later)."""
    expected: set[str]
    """Model keys the folder covered when the model was built (checked again at load)."""
    info: dict[str, Any] = field(default_factory=dict)
    loaded: bool = False
    built: dict[int, tuple[torch.Tensor, list[str]]] = field(default_factory=dict)
    """Each parameter's keys when the model was built (more than one: tied), by identity: a
    wrapper that moves parameters after that (PEFT puts a LoRA target's weight under
    ``base_layer.``) renames their keys, never the parameter objects, which the engine keeps
    too. The parameter is held (the model holds it anyway) so that its id is never another
    object's: a weak reference would stop the engine swapping its meta tensor for a real one."""

    def record_keys(self, model: nn.Module) -> None:
        for key, p in model.named_parameters(remove_duplicate=False):
            self.built.setdefault(id(p), (p, []))[1].append(key)

    def built_key(self, tensor: torch.Tensor, key: str, taken: Iterable[str] = ()) -> str:
        """The key as built of the parameter ``tensor`` that now sits at ``key``: ``key`` if it
        was one of its keys then, else the first of them not ``taken`` by another key of a
        tied parameter (a key as it is, for a tensor the model did not have as a parameter)."""
        entry = self.built.get(id(tensor))
        if entry is None or entry[0] is not tensor or key in entry[1]:
            return key
        return next((k for k in entry[1] if k not in taken), key)


_REGISTERED: weakref.WeakKeyDictionary[nn.Module, PretrainedSpec] = weakref.WeakKeyDictionary()


def register(model: nn.Module, spec: PretrainedSpec) -> None:
    _REGISTERED[model] = spec


def spec_of(model: nn.Module) -> PretrainedSpec | None:
    return _REGISTERED.get(model)


def pending(model: nn.Module) -> list[tuple[str, PretrainedSpec]]:
    """Registered models in ``model`` (itself or submodules) whose weights no engine has
    loaded yet, with where each sits (its key prefix)."""
    return [(f"{name}." if name else "", spec) for name, sub in model.named_modules()
            if (spec := _REGISTERED.get(sub)) is not None and not spec.loaded]


def load_pending(engine: EngineView, found: list[tuple[str, PretrainedSpec]]) -> None:
    """The load at the end of ``ZeroEngine.__init__``: each pending model's folder, with the
    key map it was built with; keys missing from the folder keep the values the engine's
    materialisation gave them (the model's own init; reported when the model was built).
    Every rank fails together (each phase is agreed on), and then gives the module back
    unhooked (``engine.close()``) rather than half set up."""
    try:
        for root, spec in found:
            dtypes = {root + k: d for k, d in spec.dtypes.items()}
            result = _load(engine, spec.folder, replace(spec.key_map, root=root), False,
                           dtypes, in_place=True, built=spec)
            lost = sorted(spec.expected - result.covered)
            if lost:  # neither initialised nor loaded: training them would read garbage
                raise CheckpointError(f"{spec.folder.path}: the folder changed since the "
                                      f"model was built: {lost[:5]} are no longer in it")
            spec.loaded = True
    except BaseException:
        engine.close()
        raise


def _registered(model: nn.Module, dtypes: dict[str, torch.dtype] | None
                ) -> tuple[KeyMap, dict[str, torch.dtype] | None, PretrainedSpec | None]:
    """For ``engine.load_pretrained`` without a key map: that of the one model in ``model``
    that ``from_pretrained`` built (placed at its prefix, with the dtypes it was built with,
    and its spec, which knows its parameters' keys as built), else keys as they are."""
    found = [(f"{n}." if n else "", s) for n, sub in model.named_modules()
             if (s := _REGISTERED.get(sub)) is not None]
    if len(found) > 1:
        raise ValueError(f"the module holds {len(found)} models built by from_pretrained (at "
                         f"{[r or '<root>' for r, _ in found]}): pass key_map= (KeyMap(root=...)) "
                         "to say which one to load")
    if not found:
        return KeyMap(), dtypes, None
    root, spec = found[0]
    built = {root + k: d for k, d in spec.dtypes.items()}
    return replace(spec.key_map, root=root), {**built, **(dtypes or {})}, spec


def warn_keys(what: str, path: Path, missing: list[str], unexpected: list[str]) -> None:
    """transformers' report of a load, as a warning."""
    if unexpected:
        warnings.warn(f"Some weights of the model checkpoint at {path} were not used when "
                      f"initializing {what}: {unexpected}", stacklevel=3)
    if missing:
        warnings.warn(f"Some weights of {what} were not initialized from the model checkpoint "
                      f"at {path} and are newly initialized: {missing}\nYou should probably "
                      "TRAIN this model on a down-stream task to be able to use it for "
                      "predictions and inference.", stacklevel=3)


__all__ = ["INDEX", "WEIGHTS", "KeyMap", "LoadResult", "PretrainedFolder", "PretrainedSource",
           "PretrainedSpec", "load", "load_pending", "module_entries", "open_folder", "pending",
           "register", "resolve", "spec_of"]
