"""Exporting a checkpoint as a Hugging Face ``save_pretrained`` directory, streamed.

The weights are written as ``transformers`` writes them (``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``) but one
tensor at a time: every shape and dtype is known from ``reader.entries()`` before any data is
read, so each file's header is written first and the data streamed after it. Peak memory is
the largest tensor, never the model. Anything with ``entries(dtype)`` (our
``CheckpointReader``, or another format's reader) can be exported; ``transformers`` is needed
only to write a config object or to find tied weights, and is imported only then.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .stream import (
    TensorOut,
    check_target,
    raw_bytes,
    staged_directory,
    tensor_value,
    write_safetensors,
)
from .verify import ST_DTYPES
from .write import write_atomic

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
WRAPPER_PREFIX = "model."
"""Where a LightningModule (the recipes' ``RecipeModule``) holds its HF model."""


def write_hf(reader: Any, out_dir: str | os.PathLike, *, config: Any = None,
             prefix: str | None = None, dtype: torch.dtype | None = None,
             max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write the weights of ``reader`` (anything with ``entries(dtype)``, such as
    ``CheckpointReader(resolve(directory, tag))``) into ``out_dir`` as ``save_pretrained``
    does, so that ``<ModelClass>.from_pretrained(out_dir)`` loads them; returns ``out_dir``.

    Verifying the checkpoint's hashes (``reader.verify_all()``) is the caller's job.

    - ``config``: a ``transformers`` config object, or the path of a ``config.json`` or of a
      directory holding one, written as ``out_dir/config.json``. With None no config.json is
      written (``from_pretrained`` then needs ``config=`` from elsewhere) and no tied weight
      is dropped.
    - ``prefix``: stripped from every key (a key without it is refused); ``""`` keeps the
      keys. None strips ``"model."`` when every key starts with it (a LightningModule holding
      the HF model as ``self.model``), else keeps the keys.
    - ``dtype``: floating tensors are cast to it (and the config records it); integer and
      bool buffers are written as they are.
    - ``max_shard_bytes``: a shard file holds at most this many bytes of tensor data; a tensor
      larger than that is a shard of its own.

    Tied weights (``lm_head.weight`` of GPT-2, the decoder of BERT) are dropped as
    ``save_pretrained`` drops them, where the config ties them and the two tensors are equal
    bit for bit (see ``_tied_pairs``). Everything is written into a temporary sibling
    directory renamed into place at the end: a failed export leaves nothing. ``out_dir`` must
    not exist or be an empty directory.
    """
    out = Path(out_dir)
    source = getattr(reader, "path", type(reader).__name__)
    _check_options(dtype, max_shard_bytes)
    check_target(out)  # before reading anything
    tensors = _renamed(reader.entries(dtype), prefix, source)
    with staged_directory(out) as tmp:
        hf_config = _write_config(config, tmp, dtype) if config is not None else None
        tensors = _without_tied(tensors, hf_config)
        _write_weights(tensors, tmp, max_shard_bytes)
    return out


# ---------------------------------------------------------------------------- checks
def _check_options(dtype: Any, max_shard_bytes: Any) -> None:
    floats = sorted(str(d).removeprefix("torch.") for d in ST_DTYPES if d.is_floating_point)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
                              or dtype not in ST_DTYPES):
        raise CheckpointError(f"dtype must be None or one of torch.{', torch.'.join(floats)}; "
                              f"got {dtype!r}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be a positive int (bytes), got "
                              f"{max_shard_bytes!r}")


def _renamed(entries: Iterable[Any], prefix: str | None, source: Any) -> list[TensorOut]:
    """The reader's entries under their export names, each checked to be writable."""
    items = list(entries)
    if not items:
        raise CheckpointError(f"{source}: the checkpoint holds no tensors to export")
    keys = [key for key, *_ in items]
    if prefix is None:
        prefix = WRAPPER_PREFIX if all(k.startswith(WRAPPER_PREFIX) for k in keys) else ""
    elif not isinstance(prefix, str):
        raise CheckpointError(f"prefix must be a string or None, got {prefix!r}")
    lacking = [k for k in keys if not k.startswith(prefix) or k == prefix]
    if lacking:
        raise CheckpointError(
            f"{source}: prefix {prefix!r}: key {lacking[0]!r} does not start with it "
            f"({len(lacking)} of {len(keys)} keys lack it); pass a prefix every key has, "
            "prefix='' to keep the keys, or None to strip 'model.' only where all have it")
    out = []
    for key, load, shape, dt in items:
        if dt not in ST_DTYPES:
            raise CheckpointError(f"{source}: tensor {key!r} is {dt}; safetensors export "
                                  f"supports {sorted(str(d) for d in ST_DTYPES)}")
        name = key[len(prefix):]
        if name == "__metadata__":
            raise CheckpointError(f"{source}: key {key!r} is reserved in safetensors")
        out.append(TensorOut(name, load, tuple(shape), dt))
    return out


# ---------------------------------------------------------------------------- config
def _write_config(config: Any, tmp: Path, dtype: torch.dtype | None) -> Any:
    """Write ``config.json``; the config object that ties are read from (None where it
    cannot be built, and then no weight is dropped)."""
    if isinstance(config, (str, os.PathLike)):
        write_atomic(tmp / CONFIG, _config_file(Path(config), dtype))
        return _load_config(tmp)
    if not callable(getattr(config, "to_json_string", None)):
        raise CheckpointError(
            f"config must be a transformers PretrainedConfig, the path of a {CONFIG} or of a "
            f"directory holding one, or None; got {type(config).__name__}")
    if dtype is not None:  # so that from_pretrained(dtype="auto") loads what was written
        config = copy.deepcopy(config)
        setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", dtype)
    write_atomic(tmp / CONFIG, config.to_json_string().encode())
    return config


def _config_file(path: Path, dtype: torch.dtype | None) -> bytes:
    file = path / CONFIG if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"config: {file} is not a file; give a {CONFIG}, a directory "
                              "holding one, or a config object")
    data = file.read_bytes()
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"config: {file} is not JSON ({e})") from e
    if not isinstance(parsed, dict):
        raise CheckpointError(f"config: {file} must hold a JSON object, got "
                              f"{type(parsed).__name__}")
    if dtype is None:
        return data  # copied as it is
    for name in [k for k in ("dtype", "torch_dtype") if k in parsed] or ["dtype"]:
        parsed[name] = str(dtype).removeprefix("torch.")
    return (json.dumps(parsed, indent=2, sort_keys=True) + "\n").encode()


def _load_config(directory: Path) -> Any:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(directory))
    except Exception:  # no transformers, an unknown model type: ties are then kept
        return None


# ---------------------------------------------------------------------------- tied weights
def _tied_pairs(config: Any, keys: set[str]) -> dict[str, str]:
    """{dropped key: the key it is tied to}.

    ``from_pretrained`` re-ties a missing target to its source exactly when the config has
    ``tie_word_embeddings`` and the model class lists the pair in ``_tied_weights_keys``
    (transformers >= 5: {target: source}); that is the rule here. The classes are the
    config's ``architectures``, else every class transformers registers for its
    ``model_type`` (instantiating none): a pair counts when both keys are in the checkpoint
    and no class names another source for the target. Where the rule is unsure (regex
    patterns, transformers 4's list without sources, a composite config tying in a
    sub-config, a source itself tied) both keys are kept, which always loads exactly: the
    file then holds two equal tensors that from_pretrained ties again.
    """
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return {}
    sources: dict[str, set[str]] = {}
    for cls in _model_classes(config):
        mapping = getattr(cls, "_tied_weights_keys", None)
        if isinstance(mapping, dict):
            for target, source in mapping.items():
                if target in keys and source in keys and target != source:
                    sources.setdefault(target, set()).add(source)
    pairs = {t: next(iter(s)) for t, s in sources.items() if len(s) == 1}
    return {t: s for t, s in pairs.items() if s not in pairs}


def _model_classes(config: Any) -> list[Any]:
    import transformers
    from transformers.models.auto import modeling_auto

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        for attr in dir(modeling_auto):
            table = getattr(modeling_auto, attr)
            if attr.endswith("_MAPPING_NAMES") and isinstance(table, dict):
                found = table.get(getattr(config, "model_type", None))
                names += [found] if isinstance(found, str) else list(found or ())
    classes = []
    for name in dict.fromkeys(names):
        try:
            classes.append(getattr(transformers, name))
        except Exception:  # a class whose backend is missing ties nothing we could load
            continue
    return classes


def _without_tied(tensors: list[TensorOut], config: Any) -> list[TensorOut]:
    """Drop the targets of tied pairs whose two tensors are equal bit for bit (compared by
    sha256, one tensor in memory at a time). An unequal pair is kept: the weights were
    trained untied, and from_pretrained keeps two present, different tensors apart."""
    by_key = {t.key: t for t in tensors}
    pairs = _tied_pairs(config, set(by_key))
    digests: dict[str, str] = {}

    def digest(key: str) -> str:
        if key not in digests:
            value = tensor_value(by_key[key])
            digests[key] = hashlib.sha256(raw_bytes(value)).hexdigest()
            del value
        return digests[key]

    drop = set()
    for target, source in pairs.items():
        a, b = by_key[target], by_key[source]
        if (a.shape, a.dtype) == (b.shape, b.dtype) and digest(target) == digest(source):
            drop.add(target)
        else:
            warnings.warn(f"{target!r} and {source!r} differ although the config ties them "
                          "(tie_word_embeddings); both are written", stacklevel=3)
    return [t for t in tensors if t.key not in drop]


# ---------------------------------------------------------------------------- weights
def _write_weights(tensors: list[TensorOut], tmp: Path, max_shard_bytes: int) -> None:
    shards = _plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    for name, shard in zip(names, shards):
        write_safetensors(tmp / name, shard)
    if len(shards) > 1:
        write_atomic(tmp / INDEX, index_json(dict(zip(names, shards)), {}))


def index_json(files: dict[str, list[Any]], metadata: dict[str, Any]) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    weight_map = {t.key: name for name, shard in files.items() for t in shard}
    total = sum(t.nbytes for shard in files.values() for t in shard)
    index = {"metadata": {**metadata, "total_size": total}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _plan_shards(tensors: list[Any], max_bytes: int) -> list[list[Any]]:
    """huggingface_hub's rule (``split_torch_state_dict_into_shards``, which
    ``save_pretrained`` uses): tensors in order fill the current shard, a new one begun
    wherever the next would overflow it; a tensor over the limit is a shard of its own,
    listed where it occurs, while the current shard stays open for the tensors after it."""
    shards: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_bytes:
            shards.append([t])
            continue
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, weights: str = WEIGHTS) -> list[str]:
    if count == 1:
        return [weights]
    stem = weights.removesuffix(".safetensors")
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


__all__ = ["write_hf"]
