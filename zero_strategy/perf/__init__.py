"""Performance model: what a step sends between nodes and how long it takes, predicted from
a link's rate and a measured or given compute rate (``traffic.py``: the collectives and
their bytes; ``steptime.py``: the step's time)."""

from .steptime import OVERLAP, Rates, StepPrediction, predict, time_step
from .traffic import (
    INT8_BYTES,
    Collective,
    Layout,
    ModelUnits,
    Options,
    by_phase,
    model_units,
    node_bytes,
    rank_bytes,
    step_collectives,
)

__all__ = [
    "INT8_BYTES",
    "OVERLAP",
    "Rates",
    "StepPrediction",
    "predict",
    "time_step",
    "Collective",
    "Layout",
    "ModelUnits",
    "Options",
    "by_phase",
    "model_units",
    "node_bytes",
    "rank_bytes",
    "step_collectives",
]
