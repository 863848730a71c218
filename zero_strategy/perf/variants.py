"""Every stage and option predicted for one model on one cluster: what ``zero-strategy link``
prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config import ZeroConfig
from .steptime import Rates, StepPrediction, predict
from .traffic import Layout, ModelUnits, Options, model_units


@dataclass(frozen=True)
class Variant:
    label: str
    fields: dict[str, Any]
    hybrid: bool = False
    """Sharded within each node (``shard_group_size`` = processes per node)."""


VARIANTS = (
    Variant("stage 0", {"stage": 0}),
    Variant("stage 1", {"stage": 1}),
    Variant("stage 2", {"stage": 2}),
    Variant("stage 3", {"stage": 3}),
    Variant("stage 3, int8 weights", {"stage": 3, "quantize_weights": "int8"}),
    Variant("stage 3, int8 gradients", {"stage": 3, "quantize_gradients": "int8"}),
    Variant("stage 3, int8 weights + gradients",
            {"stage": 3, "quantize_weights": "int8", "quantize_gradients": "int8"}),
    Variant("stage 2, shard_group_size = a node", {"stage": 2}, hybrid=True),
    Variant("stage 3, shard_group_size = a node", {"stage": 3}, hybrid=True),
    Variant("stage 3, shard_group_size = a node, int8 weights + gradients",
            {"stage": 3, "quantize_weights": "int8", "quantize_gradients": "int8"},
            hybrid=True),
)


def predict_variants(
    nodes: int, per_node: int, rates: Rates, *, params: int | None = None,
    model: torch.nn.Module | None = None, precision: str = "32-true",
    backend: Literal["gloo", "nccl"] = "nccl",
) -> list[tuple[Variant, StepPrediction]]:
    """Each of ``VARIANTS`` (the hybrid ones where a node has more than one process) for a
    model given by its parameter count (the ZeRO paper's formulas: one unit, none kept
    whole) or as a module (its units as the engine forms them; the meta device will do)."""
    if (params is None) == (model is None):
        raise ValueError("give either params (a count) or model (a module)")
    out = []
    for variant in VARIANTS:
        if variant.hybrid and per_node == 1:
            continue
        layout = Layout(nodes, per_node, per_node if variant.hybrid else None)
        config = ZeroConfig(precision=precision, **variant.fields,
                            shard_group_size=layout.shard_group)
        units = (ModelUnits.plain(int(params)) if params is not None
                 else model_units(model, config, layout))  # type: ignore[arg-type]
        options = Options.from_config(config, backend=backend)
        out.append((variant, predict(units, options, layout, rates)))
    return out
