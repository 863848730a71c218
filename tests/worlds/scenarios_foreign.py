"""Our side of the foreign-checkpoint tests (test_foreign_checkpoints.py): load the step-K
checkpoint an anchor wrote (``tests/worlds/foreign_run.py``) and continue to K + M on this world
size and stage; the results are compared with the anchor's uninterrupted run."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP
from tests.worlds.foreign_run import ADAMW, K, M, train

ROOT = Path(os.environ.get("ZS_FOREIGN_ROOT", "/tmp/zs-foreign"))


def resume(source: str, stage: int) -> dict:
    torch.manual_seed(123)  # another initialisation: every weight must come from the file
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "lr": 0.5, "weight_decay": 0.0})
    engine = zs.ZeroEngine(model, opt, zs.ZeroConfig(stage=stage))
    client = engine.load_checkpoint(ROOT / source / f"at{K}")
    restored = {"lr": opt.param_groups[0]["lr"],
                "weight_decay": opt.param_groups[0]["weight_decay"],
                "global_step": engine.global_step}
    losses = train(engine, K, K + M)
    final = {k: v.tolist() for k, v in engine.full_state_dict().items()}
    return {"losses": losses, "final": final, "restored": restored,
            "client": {k: v for k, v in (client or {}).items() if k in ("data_step",
                                                                        "train_state")}}


def uninterrupted(stage: int) -> dict:
    """Ours from step 0: the checkpoint at step K (``<root>/ours/at{K}``) and the run that
    goes on to K + M without stopping."""
    from tests.worlds.foreign_run import make_model

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine = zs.ZeroEngine(model, opt, zs.ZeroConfig(stage=stage))
    def save(step: int) -> None:
        if step == K:
            engine.save_checkpoint(ROOT / "ours" / f"at{K}")

    losses = train(engine, 0, K + M, save)
    final = {k: v.tolist() for k, v in engine.full_state_dict().items()}
    return {"losses": losses, "final": final}


if os.environ.get("ZS_FOREIGN_OURS"):
    register("uninterrupted", uninterrupted, stage=int(os.environ["ZS_FOREIGN_OURS"]))

for _source in os.environ.get("ZS_FOREIGN_SOURCES", "").split(","):
    if _source:
        name, stage = _source.split(":")
        register(f"resume_{name}", resume, source=name, stage=int(stage))
