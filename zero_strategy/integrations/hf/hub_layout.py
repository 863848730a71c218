"""transformers' hub layout for the engine's streamed export (``checkpoint/export.py``): the
reverse of its weight conversions, its tied-weight rule, and ``config.json`` /
``generation_config.json`` beside the weights, all read off the model, with no per-model code.

transformers 5 loads some checkpoints into a layout of its own (Mixtral's or Qwen3-MoE's
per-expert ``experts.{i}.gate_proj.weight`` fused into one 3-D ``experts.gate_up_proj``) and
reverts that in ``save_pretrained`` with ``core_model_loading.revert_weight_conversion``,
which needs the whole state dict at once. Here it runs twice over: once on meta tensors that
record which state-dict tensors each result was computed from (``_Traced``), which gives the
conversion groups (the in-memory tensors that must be whole together) and every hub tensor's
name, shape and order before anything is gathered; then on each group's gathered tensors
alone. The layout is registered for every user (``peft_layout.register``, from
``zero_strategy/__init__``) and imports nothing of transformers: a model of its classes means
it is loaded already.
"""

from __future__ import annotations

import copy
import re
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ... import compat
from ...checkpoint.export import Group, Output


class _Traced(torch.Tensor):
    """A (meta) tensor carrying the state-dict keys its value was computed from: every torch
    op on it returns such tensors, their sources the union of the inputs'."""

    sources: frozenset[str]

    @staticmethod
    def __new__(cls, base: torch.Tensor, sources: frozenset[str]) -> _Traced:
        out = torch.Tensor._make_subclass(cls, base)
        out.sources = sources
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found: set[str] = set()
        for item in tree_flatten((args, kwargs))[0]:
            if isinstance(item, _Traced):
                found |= item.sources
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        sources = frozenset(found)

        def traced(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return _Traced(value, sources)
            return value

        return tree_map(traced, result)


def _revert() -> Any:
    try:  # transformers >= 5.0's weight conversions; before them the layout is the module's
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion


class TransformersLayout:
    """The ``HubLayout`` of a transformers ``PreTrainedModel`` (at ``prefix`` in the module
    the engine trains: "" for the model itself, "model." under a LightningModule)."""

    def __init__(self, model: nn.Module, prefix: str) -> None:
        self.model = model
        self.prefix = prefix
        self._identity: set[str] = set()
        """Keys whose group is the key itself, unchanged: converted without transformers."""

    # ------------------------------------------------------------------ planning
    def plan(self, tensors: dict[str, torch.Tensor]) -> list[Group]:
        ignored = set(getattr(self.model, compat.IGNORED_ON_SAVE.name, None) or ())
        tensors = {k: t for k, t in tensors.items() if k not in ignored}
        traced = {k: _Traced(t, frozenset([k])) for k, t in tensors.items()}
        revert = _revert()
        try:
            reverted = revert(self.model, traced) if revert is not None else traced
        except Exception as e:
            raise RuntimeError(f"{type(self.model).__name__}: transformers' reverse weight "
                               f"conversion could not be planned on shapes alone ({e})") from e
        # Outputs sharing an input are one group (a union: conversions may overlap); a
        # group's place is its first output's in transformers' order.
        groups: dict[frozenset[str], list[tuple[int, Output]]] = {}
        owner: dict[str, frozenset[str]] = {}
        for index, (name, value) in enumerate(reverted.items()):
            sources = getattr(value, "sources", frozenset([name]))
            outs = [(index, Output(name, tuple(value.shape), value.dtype))]
            for old in {owner[k] for k in sources if k in owner}:
                outs += groups.pop(old)
                sources = sources | old
            groups[sources] = sorted(outs, key=lambda item: item[0])
            for key in sources:
                owner[key] = sources
        out = []
        for sources, outs in sorted(groups.items(), key=lambda item: item[1][0][0]):
            inputs = tuple(k for k in tensors if k in sources)
            names = [o.name for _, o in outs]
            if len(inputs) == 1 and names == list(inputs):
                self._identity.add(inputs[0])
            out.append(Group(inputs, tuple(o for _, o in outs)))
        return out

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if all(k in self._identity for k in tensors):
            return dict(tensors)
        revert = _revert()
        return revert(self.model, dict(tensors)) if revert is not None else dict(tensors)

    def aliases_to_drop(self, aliases: list[list[str]]) -> set[str]:
        """``save_pretrained``'s rule: of keys naming one tensor, those matching a tied-weight
        pattern (``_tied_weights_keys`` of any submodule) are left out, one key always kept;
        ``from_pretrained`` ties them again."""
        patterns = []
        for name, module in self.model.named_modules():
            tied = getattr(module, compat.TIED_WEIGHTS.name, None) or {}
            patterns += [f"{name}.{k}" if name else k for k in tied]
        drop: set[str] = set()
        for keys in aliases:
            matching = [k for k in sorted(keys) if any(re.search(p, k) for p in patterns)]
            drop.update(matching[: len(keys) - 1] if len(matching) == len(keys) else matching)
        return drop

    # ------------------------------------------------------------------ beside the weights
    def extra_files(self, dtype: torch.dtype | None) -> dict[str, bytes]:
        """``config.json`` (recording the dtype written and the class, as save_pretrained
        does) and, for a model that generates, ``generation_config.json``."""
        config = copy.deepcopy(self.model.config)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        config.architectures = [type(self.model).__name__]
        files = {"config.json": config.to_json_string(use_diff=True).encode()}
        can_generate = getattr(self.model, "can_generate", None)
        generation = getattr(self.model, "generation_config", None)
        if callable(can_generate) and can_generate() and generation is not None:
            files["generation_config.json"] = generation.to_json_string(use_diff=True).encode()
        return files


def find_model(module: nn.Module) -> tuple[nn.Module, str] | None:
    """The transformers model in ``module`` (itself, else the outermost one inside it) and
    its key prefix; None where transformers is not loaded or no model is found."""
    loaded = sys.modules.get("transformers")
    if loaded is None:
        return None
    base = loaded.PreTrainedModel
    for name, sub in module.named_modules():
        if isinstance(sub, base):
            return sub, f"{name}." if name else ""
    return None


__all__ = ["TransformersLayout", "find_model"]
