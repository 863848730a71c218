"""``from_pretrained`` for ZeRO: a Hugging Face model built on the meta device from a
``save_pretrained`` folder, whose weights stream into the shards when a ``ZeroEngine`` is built
on it (directly, by the Lightning or Fabric strategy, by Accelerate or the Trainer adapter).

``Model.from_pretrained`` loads the whole model on every rank before the engine shards it; here
no rank ever holds it whole. The folder is checked completely when the model is built (files,
headers, every key's shape and dtype), missing and unexpected keys are reported then, as
transformers reports them; the engine then materialises each unit without initialising what
the folder will overwrite (the model's own ``_init_weights`` runs with those tensors flagged as
transformers flags loaded ones, so only missing weights and the buffers its constructor
computes, such as rotary ``inv_freq``, get values) and reads each rank's ranges of the folder
into its shards (``checkpoint/pretrained.py``).

What transformers knows about a model (its base-model prefix, legacy key names, keys never
reported) is turned into a ``KeyMap`` here; the checkpoint layer stays transformers-free.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import compat
from ...checkpoint.errors import CheckpointError
from ...checkpoint.pretrained import (
    KeyMap,
    PretrainedFolder,
    PretrainedSpec,
    module_entries,
    register,
    resolve,
    spec_of,
    warn_keys,
)
from ...comm.groups import default_device, group_backend
from ...core.materialize import meta_init, set_module_init
from .. import require
from .conversions import planner

_HUB = "downloading from the Hub: pass a local folder (huggingface_hub.snapshot_download)"
_DISPATCH = ("device_map dispatch: the engine places every shard (build a ZeroEngine, or use "
             "the Lightning / Fabric / Accelerate strategy)")
_REFUSED = {
    "quantization_config": "quantized weights (the engine trains float parameters)",
    "load_in_8bit": "quantized weights (the engine trains float parameters)",
    "load_in_4bit": "quantized weights (the engine trains float parameters)",
    "device_map": _DISPATCH, "max_memory": _DISPATCH, "offload_folder": _DISPATCH,
    "offload_buffers": _DISPATCH,
    "tp_plan": "tensor parallelism", "tp_size": "tensor parallelism",
    "distributed_config": "tensor parallelism", "device_mesh": "tensor parallelism",
    "gguf_file": "GGUF files (only safetensors are streamed)",
    "state_dict": "a state dict in memory (use engine.load_state_dict)",
    "variant": "weight variants (model.<variant>.safetensors)",
    "subfolder": "subfolders: pass the folder holding the weights itself",
    "revision": _HUB, "token": _HUB, "cache_dir": _HUB, "force_download": _HUB,
    "proxies": _HUB,
    "key_mapping": "custom key mappings (engine.load_pretrained(path, key_map=...) takes one)",
    "ignore_mismatched_sizes": "ignoring mismatched sizes",
    "use_kernels": "hub kernels", "kernel_config": "hub kernels",
    "allow_all_kernels": "hub kernels", "fusion_config": "fused modules",
    "adapter_kwargs": "PEFT adapters (load the base model, then add adapters with peft)",
    "adapter_name": "PEFT adapters (load the base model, then add adapters with peft)",
}
_IGNORED = ("low_cpu_mem_usage", "_fast_init", "mirror", "from_tf", "from_flax",
            "offload_state_dict", "local_files_only", "weights_only", "disable_mmap",
            "_from_auto", "_from_pipeline", "_commit_hash", "tqdm_class")
"""What transformers itself ignores, or what cannot apply: the folder is local, and
safetensors are read without pickles or memory maps."""


def from_pretrained(model_class: type[nn.Module], path: str | os.PathLike, *model_args: Any,
                    **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, ...)`` built on the meta device: its weights are
    loaded into the shards when a ``ZeroEngine`` is built on it (docs/pretrained.md).

    ``path`` is a local ``save_pretrained`` folder (``model.safetensors``, or shards and
    ``model.safetensors.index.json``). Takes ``config=`` (an object or a path),
    ``dtype=`` / ``torch_dtype=`` (a torch dtype, its name, or ``"auto"``: the config's, else
    the folder's; the default, as in transformers 5), ``attn_implementation=``,
    ``output_loading_info=``, ``generation_config=``, ``trust_remote_code=`` and config
    overrides, and refuses by name what it cannot honour (quantization, device_map, Hub
    downloads, ...). Everything in the folder is checked now; the model is in eval mode.
    """
    require("transformers", "zero_strategy.integrations.hf.pretrained.from_pretrained")
    _refuse(kwargs)
    with_info = kwargs.pop("output_loading_info", False)
    folder = PretrainedFolder(path)
    requested = kwargs.pop("dtype", None)
    legacy = kwargs.pop("torch_dtype", None)
    requested = requested if requested is not None else legacy
    generation = kwargs.pop("generation_config", None)
    trust = kwargs.pop("trust_remote_code", None)
    config, model_kwargs = _config(model_class, folder.path, kwargs, trust)
    _refuse_quantized(config, folder)
    dtype = _dtype(requested, config, folder)
    config.name_or_path = str(path)
    model, key_map, found = _build(model_class, config, dtype, folder, model_args,
                                   model_kwargs)
    warn_keys(type(model).__name__, folder.path, found.missing, found.unexpected)
    info = {"missing_keys": set(found.missing), "unexpected_keys": set(found.unexpected),
            "mismatched_keys": set(), "error_msgs": []}
    dtypes = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items()}
    spec = PretrainedSpec(folder, key_map, dtypes, found.covered, info)
    spec.record_keys(model)
    register(model, spec)
    model.eval()  # as transformers leaves a loaded model
    _generation_config(model, folder.path, generation, trust)
    return (model, info) if with_info else model


def loading_info(model: nn.Module) -> dict[str, Any]:
    """What ``from_pretrained(..., output_loading_info=True)`` returns for ``model``."""
    spec = spec_of(model)
    if spec is None:
        raise ValueError(f"this {type(model).__name__} was not built by "
                         "zero_strategy.integrations.hf.pretrained.from_pretrained")
    return spec.info


def _refuse(kwargs: dict[str, Any]) -> None:
    for name, what in _REFUSED.items():
        if kwargs.get(name) not in (None, False, "", {}):
            raise ValueError(f"from_pretrained: {name}={kwargs[name]!r} asks for {what}, which "
                             "streaming pretrained weights into ZeRO shards does not do")
    if kwargs.get("use_safetensors") is False:
        raise ValueError("from_pretrained: use_safetensors=False asks for pytorch_model.bin "
                         "(pickles), which are never read; convert the folder to safetensors")
    for name in (*_IGNORED, "use_safetensors"):
        kwargs.pop(name, None)
    for name in _REFUSED:
        kwargs.pop(name, None)


def _refuse_quantized(config: Any, folder: PretrainedFolder) -> None:
    """A folder saved quantized stores integer or fp8 tensors and their scales, which
    transformers turns into modules the engine does not train."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", None)
        raise CheckpointError(
            f"{folder.path / 'config.json'}: field 'quantization_config' (quant_method="
            f"{method!r}): a quantized checkpoint cannot be streamed into shards (the engine "
            "trains float parameters); load it with transformers, dequantized (e.g. "
            "Model.from_pretrained(path, quantization_config=..., with dequantize=True where "
            "the method has it), then build the engine on that model")


def _config(model_class: type[nn.Module], path: Path, kwargs: dict[str, Any],
            trust: bool | None) -> tuple[Any, dict[str, Any]]:
    """The config as transformers builds it: ``config=`` (a copy), else loaded from the
    folder (or ``config=``'s path) with ``kwargs`` overriding its fields; the kwargs it does
    not take go to the model's constructor."""
    from transformers import AutoConfig, PretrainedConfig

    config = kwargs.pop("config", None)
    if isinstance(config, PretrainedConfig):
        config, model_kwargs = copy.deepcopy(config), kwargs
    else:
        source = config if config is not None else path
        config_class = getattr(model_class, "config_class", None)
        if config_class is None:
            config, model_kwargs = AutoConfig.from_pretrained(
                source, return_unused_kwargs=True, local_files_only=True,
                trust_remote_code=trust, **kwargs)
        else:
            config, model_kwargs = config_class.from_pretrained(
                source, return_unused_kwargs=True, local_files_only=True, **kwargs)
    for name in ("attn_implementation", "experts_implementation"):
        if name in kwargs:
            setattr(config, f"_{name}", kwargs[name])
            model_kwargs.pop(name, None)
    return config, model_kwargs


def _dtype(requested: Any, config: Any, folder: PretrainedFolder) -> torch.dtype:
    """transformers' rule: a dtype given, else ("auto", the default) the config's, else the
    first floating tensor's in the folder, else torch's default; recorded in the config."""
    dtype = requested
    if requested is None or requested == "auto":
        dtype = getattr(config, "dtype", None) or folder.float_dtype() or \
            torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"from_pretrained: dtype={requested!r}: give a floating torch dtype, "
                         "its name, or 'auto' (one dtype for the whole model; a dict per "
                         "sub-model is not supported)")
    config.dtype = dtype
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            sub.dtype = dtype
    return dtype


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(model_class: type[nn.Module], config: Any, dtype: torch.dtype,
           folder: PretrainedFolder, model_args: tuple, model_kwargs: dict[str, Any]
           ) -> tuple[nn.Module, KeyMap, Any]:
    """The model on meta, its keys checked against the folder; each module's init set to
    initialise only what the folder lacks, before ``meta_init`` replays the inits (or, nested
    in a strategy's ``configure_model``, before the strategy's does)."""
    with _default_dtype(dtype), meta_init(_materialising_device()):
        model = model_class(config, *model_args, **model_kwargs)
        dtype_plan = getattr(model, compat.DTYPE_PLAN.name, None)
        plan = dtype_plan(dtype) if dtype_plan is not None else {}
        if plan:
            raise ValueError(f"from_pretrained: {type(model).__name__} keeps {sorted(plan)} in "
                             f"float32 under {dtype} (_keep_in_fp32_modules), which is not "
                             "supported; load it in float32 or bfloat16")
        key_map = key_map_for(model, folder.path)
        found = resolve(module_entries(model), folder, key_map)
        set_module_init(model.modules(), _InitMissing(model, found.covered))
    return model, key_map, found


def _materialising_device() -> torch.device:
    """Where the engine will materialise the model: meta_init records the generator states
    of that device (on another, the engine replays the inits itself when built)."""
    backend = group_backend()
    return default_device(backend) if backend is not None else torch.device("cpu")


def key_map_for(model: nn.Module, path: Path | None = None) -> KeyMap:
    """How transformers maps a folder's keys onto ``model``: its ``base_model_prefix``, its
    legacy renamings, its keys never reported (and, as transformers adds, stale rotary
    ``inv_freq`` and ``position_ids`` buffers). For ``engine.load_pretrained(key_map=...)``."""
    buffers = [n for n, _ in model.named_buffers()]
    ignored = set(getattr(model, compat.IGNORE_UNEXPECTED.name, None) or ())
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        ignored.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        ignored.add(r"(^|\.)position_ids$")
    return KeyMap(
        prefix=getattr(model, "base_model_prefix", "") or "",
        rename=_renamer(model),
        ignore_missing=tuple(sorted(getattr(model, compat.IGNORE_MISSING.name, None)
                                    or ())),
        ignore_unexpected=tuple(sorted(ignored)),
        convert=planner(model))


def _renamer(model: nn.Module) -> Callable[[str], str] | None:
    """transformers' renamings of legacy keys (``LayerNorm.gamma``). The keys its converters
    take (tensors merged or split on load, as Mixtral's experts) never come here: the
    ``KeyMap.convert`` planner (``conversions.py``) consumes them first."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings renames nothing
        return None
    transforms = get_model_conversion_mapping(model, None, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [])[0]

    return rename


class _InitMissing:
    """A module's init as ``from_pretrained`` runs it: the model's own ``_init_weights`` (of
    the nearest transformers model above the module), with every tensor the folder holds
    flagged ``_is_hf_initialized`` so the guarded initialisers skip it. Only missing weights
    and the buffers constructors compute get values. Holds no module: the registries that
    keep it are weak."""

    def __init__(self, model: nn.Module, covered: set[str]) -> None:
        from transformers import PreTrainedModel

        self.model = weakref.ref(model)
        self.covered = covered
        self.custom = bool(getattr(model, "is_custom_code", lambda: False)())
        self.names: dict[int, str] = {}
        self.owners: dict[int, str] = {}
        owner_of: dict[str, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            if id(module) in self.names:
                continue
            owner = name if isinstance(module, PreTrainedModel) else \
                owner_of.get(name.rpartition(".")[0], "")
            owner_of[name] = self.owners[id(module)] = owner
            self.names[id(module)] = name

    def __call__(self, module: nn.Module) -> None:
        from transformers.initialization import guard_torch_init_functions

        model = self.model()
        if model is None:
            return
        prefix = self.names[id(module)]
        tensors = list(chain(module.named_parameters(prefix, remove_duplicate=False),
                             module.named_buffers(prefix, remove_duplicate=False)))
        own = {f"{prefix}.{n}" if prefix else n for n in (*module._parameters,
                                                         *module._buffers)}
        if self.custom and all(k in self.covered for k, _ in tensors if k in own):
            return  # transformers skips such modules of remote code (its writes are unguarded)
        flag = compat.HF_INITIALIZED.name
        flagged = [t for k, t in tensors if k in self.covered and not getattr(t, flag, False)]
        for t in flagged:
            setattr(t, flag, True)
        try:
            with guard_torch_init_functions():
                model.get_submodule(self.owners[id(module)])._init_weights(module)
        finally:
            for t in flagged:
                delattr(t, flag)


def _generation_config(model: nn.Module, path: Path, given: Any, trust: bool | None) -> None:
    """The folder's generation_config.json (or ``generation_config=``), as transformers sets
    it on models that generate."""
    adjust = getattr(model, "adjust_generation_fn", None)
    if adjust is None or not model.can_generate():
        return
    adjust(given, False, None, str(path), cache_dir=None, force_download=False, proxies=None,
           local_files_only=True, token=None, revision=None, subfolder="",
           trust_remote_code=trust)


__all__ = ["from_pretrained", "key_map_for", "loading_info"]
