"""A built engine's attributes, for tests/quick/test_engine_parts.py (one rank)."""

from __future__ import annotations

import torch

import zero_strategy as zs
from tests.support.harness import scenario


@scenario
def built() -> list[str]:
    """Every attribute ``setup.build`` left on an engine (fp16 with the disk tier: every
    optional part is set to something)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters()), zs.ZeroConfig(
        stage=3, precision="16-mixed", offload_optimizer="disk", offload_params="disk"))
    names = sorted(vars(engine))
    engine.close()
    return names
