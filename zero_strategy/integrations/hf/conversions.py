"""transformers' weight conversions (``WeightConverter``: experts saved one by one and fused in
the model, ``qkv`` split, weights transposed or rotary rows permuted) as streamed reads.

``planner(model)`` takes the conversions transformers itself applies to the class
(``get_model_conversion_mapping``), groups a folder's keys exactly as
``convert_and_load_state_dict_in_model`` does (every renaming, then at most one converter, keys
in natural order), and replays each converter's operations on descriptions instead of tensors
(``checkpoint/conversions.py``): the shapes are checked now, and each rank later reads only
the source slices its shards are made of. An operation not replayed here is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...checkpoint import conversions as cv
from ...checkpoint.errors import CheckpointError

_ADVICE = ("load it whole instead: model = {cls}.from_pretrained(path), then build the engine "
           "on that model (every rank then holds the whole model once while it is sharded)")

STREAMED_FROM = (5, 23)
"""The transformers release whose operations (signatures and semantics) are replayed here, each
tested against its own ``convert``; an older one's converted keys are refused by name."""

ShapeOf = Callable[[str], Any]
"""A target key (as transformers names it) -> the model's shape for it, or None when the model
has no such key (after adding or stripping the base-model prefix)."""


def planner(model: nn.Module) -> Callable[..., cv.ConversionPlan] | None:
    """The planner for ``KeyMap.convert``, or None when transformers converts nothing for this
    class (or is too old to have conversion mappings)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
        )
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model, None, None)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not converters:
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    planner = _Planner(renamings, converters, getattr(model, "config", None),
                       type(model).__name__, dot_natural_key)
    return planner if _release() >= STREAMED_FROM else planner.refuse_all


def _release() -> tuple[int, ...]:
    import transformers

    parts = []
    for part in transformers.__version__.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class _Planner:
    def __init__(self, renamings: list, converters: list, config: Any, cls: str,
                 order: Callable[[str], Any]) -> None:
        self.order = order
        """transformers' key order (``experts.10`` after ``experts.9``): the order tensors
        are stacked and concatenated in."""
        self.renamings = renamings
        self.converters = converters
        self.by_pattern = {p: c for c in converters for p in c.source_patterns}
        self.config = config
        self.cls = cls

    def __call__(self, folder: Any, shape_of: ShapeOf) -> cv.ConversionPlan:
        plan = cv.ConversionPlan()
        for name, (converter, collected) in self._groups(folder, shape_of).items():
            if shape_of(name) is None:  # transformers reports the targets, converts nothing
                first = converter.target_patterns[0]
                plan.unexpected += [name.replace(first, t) for t in converter.target_patterns]
                plan.consumed.update((k, []) for keys in collected.values() for k in keys)
                continue
            targets = _Group(self, folder, shape_of, name, converter, collected).targets()
            plan.targets.update(targets)
            for keys in collected.values():
                for key in keys:
                    plan.consumed[key] = list(targets)
        return plan

    def refuse_all(self, folder: Any, shape_of: ShapeOf) -> cv.ConversionPlan:
        """The planner under a transformers older than ``STREAMED_FROM``."""
        import transformers

        for name, (converter, collected) in self._groups(folder, shape_of).items():
            group = _Group(self, folder, shape_of, name, converter, collected)
            raise group.refuse(converter.operations[0], (
                f"converted tensors stream from transformers "
                f"{'.'.join(map(str, STREAMED_FROM))} on (installed: "
                f"{transformers.__version__}): upgrade it"))
        return cv.ConversionPlan()

    def _groups(self, folder: Any, shape_of: ShapeOf
                ) -> dict[str, tuple[Any, dict[str, list[str]]]]:
        """Folder keys a converter takes, grouped by the target they make, as transformers
        groups them (every renaming, then the first converter that matches)."""
        groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        for key in sorted(folder.keys(), key=self.order):
            renamed = key
            for renaming in self.renamings:
                renamed, _ = renaming.rename_source_key(renamed)
            pattern = None
            for converter in self.converters:
                renamed, pattern = converter.rename_source_key(renamed)
                if pattern is not None:
                    break
            if pattern is None or shape_of(renamed) is None and shape_of(key) is not None:
                continue  # not converted (transformers then takes the key as it is)
            converter, collected = groups.setdefault(
                renamed, (self.by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(key)
        return groups


class _Group:
    """One converter's tensors for one target, its operations replayed on descriptions."""

    def __init__(self, planner: _Planner, folder: Any, shape_of: ShapeOf, name: str,
                 converter: Any, collected: dict[str, list[str]]) -> None:
        self.p, self.folder, self.shape_of = planner, folder, shape_of
        self.name, self.converter, self.collected = name, converter, collected
        self.keys = [k for keys in collected.values() for k in keys]

    def _where(self) -> str:
        first = self.keys[0]
        more = f" (and {len(self.keys) - 1} more)" if len(self.keys) > 1 else ""
        return f"{self.folder.file_of(first)}: tensor {first!r}{more}"

    def refuse(self, op: Any, why: str) -> CheckpointError:
        return CheckpointError(
            f"{self._where()}: transformers' weight conversion {type(op).__name__} of "
            f"{self.converter.source_patterns} -> {self.converter.target_patterns} (for "
            f"{self.name!r}) cannot be streamed into shards: {why}; "
            + _ADVICE.format(cls=self.p.cls))

    def targets(self) -> dict[str, cv.Node]:
        c = self.converter
        if getattr(c, "quantization_operation", None) is not None or \
                getattr(c, "distributed_operation", None) is not None:
            raise self.refuse(c, "it quantizes or distributes")
        values: dict[str, Any] = {}
        for pattern, keys in self.collected.items():
            values[pattern] = [cv.source(k, self.folder.info(k)[1], self.folder.info(k)[0])
                               for k in keys]
        for op in c.operations:
            handler = _HANDLERS.get(type(op).__name__)
            if handler is None or type(op).__module__ != "transformers.core_model_loading":
                raise self.refuse(op, "no streamed form of this operation")
            try:
                values = handler(self, op, values)
            except (cv.ConversionError, ValueError, IndexError) as e:
                raise self.refuse(op, str(e)) from e
        return self._named(values)

    def _named(self, values: dict[str, Any]) -> dict[str, cv.Node]:
        """transformers' naming of the results: the first name (``*.`` as ``0.``) split
        around the first result pattern it contains, each pattern put between."""
        full = self.name.replace("*.", "0.") if "*." in self.name else self.name
        hit = next((k for k in values if k in full), None)
        if hit is None:
            raise self.refuse(self.converter, f"its results {list(values)} are not named in "
                                              f"{self.name!r}")
        head, _, tail = full.partition(hit)
        return {head + k + tail: _one(v) for k, v in values.items()}

    def model_shape(self, key: str, op: Any) -> tuple[int, ...]:
        shape = self.shape_of(key)
        if shape is None:
            raise self.refuse(op, f"it sizes its result by the model's {key!r}, which the "
                                  "model lacks")
        return tuple(shape)

    def config_for(self, op: Any) -> Any:
        config = self.p.config
        if getattr(op, "subconfig_key", None) is not None:
            config = getattr(config, op.subconfig_key, config)
        return config


def _one(value: Any) -> cv.Node:
    if isinstance(value, list):
        if len(value) != 1:
            raise cv.ConversionError(f"{len(value)} tensors where one is expected")
        return value[0]
    return value


def _first(values: dict[str, Any]) -> cv.Node:
    """The one input's (first) tensor, as the single-input ops take it."""
    if len(values) != 1:
        raise cv.ConversionError(f"one input expected, got {list(values)}")
    value = next(iter(values.values()))
    return value[0] if isinstance(value, list) else value


# ---------------------------------------------------------------------------- the operations
# Each mirrors the ``convert`` of the transformers op of its name: which inputs it takes, in
# which order, and under which names its results go on.
def _merge(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    size, out = len(values), {}
    for pattern, tensors in values.items():
        target = op.get_target_pattern(size, pattern, g.converter.target_patterns)
        out[target] = tensors if isinstance(tensors, cv.Node) else cv.stack(tensors, op.dim)
    return out


def _split_modules(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for pattern, tensors in values.items():
        node = _one(tensors)
        n = node.shape[op.dim]
        names = op.get_target_patterns(values, pattern, g.converter.target_patterns, n)
        shape = node.shape[:op.dim] + node.shape[op.dim + 1:]
        pieces = [cv.reshape(p, shape) for p in cv.chunk(node, n, op.dim)]
        out.update(zip(names, pieces))
    return out


def _concatenate(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    target = op.get_target_pattern(g.converter.target_patterns)
    parts: list[cv.Node] = []
    for pattern in g.converter.source_patterns:
        if pattern in values:
            got = values[pattern]
            parts.extend(got if isinstance(got, list) else [got])
    return {target: cv.cat(parts, op.dim)}


def _chunk(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    node = _first(values)
    targets = op.get_target_patterns(g.converter.target_patterns, config=g.p.config)
    return dict(zip(targets, cv.chunk(node, len(targets), op.dim)))


def _split(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    node = _first(values)
    patterns = g.converter.target_patterns
    sizes = [g.model_shape(g.name.replace(patterns[0], t), op)[op.dim] for t in patterns]
    return dict(zip(patterns, cv.split(node, sizes, op.dim)))


def _interleave(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    return {g.converter.target_patterns[0]: cv.interleave(_first(values), op.dim, op.inverse)}


def _transpose(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    target = op.get_target_pattern(values, g.converter.source_patterns,
                                   g.converter.target_patterns)
    node = _first(values)
    if op.check_dims and node.shape == g.model_shape(g.name, op):
        return {target: node}
    return {target: cv.transpose(node, op.dim0, op.dim1)}


def _permute_for_rope(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    config = g.config_for(op)
    heads = getattr(config, "num_attention_heads", 1)
    out = {}
    for pattern, tensors in values.items():
        target = op.get_target_pattern(pattern, g.converter.source_patterns,
                                       g.converter.target_patterns)
        if op.permute_layer_names is None or any(n in pattern for n in op.permute_layer_names):
            out[target] = cv.permute_rows_for_rope(_one(tensors), heads, op.inverse)
        else:
            out[target] = tensors
    return out


def _conv3d_to_linear(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    target = op._get_target_pattern(values, g.converter.source_patterns,
                                    g.converter.target_patterns)
    node = _first(values)
    if len(node.shape) == 5:
        node = cv.reshape(node, (node.shape[0], node.numel // max(node.shape[0], 1)))
    elif len(node.shape) != 2:
        raise cv.ConversionError(f"expects a 5-d or 2-d tensor, got {list(node.shape)}")
    return {target: node}


def _linear_to_conv3d(g: _Group, op: Any, values: dict[str, Any]) -> dict[str, Any]:
    from transformers.core_model_loading import Conv3dToLinear

    target = Conv3dToLinear._get_target_pattern(values, g.converter.source_patterns,
                                                g.converter.target_patterns)
    node = _first(values)
    return {target: cv.reshape(node, (node.shape[0], op.in_channels, *op.kernel_size))}


_HANDLERS: dict[str, Callable[[_Group, Any, dict[str, Any]], dict[str, Any]]] = {
    "MergeModulelist": _merge, "SplitModulelist": _split_modules,
    "Concatenate": _concatenate, "Chunk": _chunk, "Split": _split,
    "Interleave": _interleave, "Transpose": _transpose, "PermuteForRope": _permute_for_rope,
    "Conv3dToLinear": _conv3d_to_linear, "LinearToConv3d": _linear_to_conv3d,
}
"""The operations transformers' mappings use for its causal-LM and seq2seq families (and a
few more); a mapping using another one is refused by name (``_Group.refuse``)."""


__all__ = ["planner"]
