"""One process: ZeroAccelerator.load_state on a folder holding a DeepSpeed checkpoint (what
Accelerate's DeepSpeed integration saves: ``latest`` and DeepSpeed's tag beside Accelerate's
own files), or Fabric's ``fabric.load`` with ZeroFabricStrategy; prints the restored
weights' agreement with the file, the restored lr and what came back as JSON.

    python tests/worlds/accelerate_foreign.py accelerate|fabric FOLDER
"""

from __future__ import annotations

import json
import sys

import torch


def main(kind: str, folder: str) -> None:
    from tests.support.models import MLP
    from tests.worlds.foreign_run import ADAMW
    from zero_strategy.checkpoint.read import consolidate

    torch.manual_seed(5)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "lr": 0.5})
    if kind == "accelerate":
        from zero_strategy.accelerate import ZeroAccelerator

        accelerator = ZeroAccelerator()
        model, opt = accelerator.prepare(model, opt)
        accelerator.load_state(folder)
        engine, rest = accelerator.engine, None
    else:
        from lightning.fabric import Fabric

        from zero_strategy.fabric import ZeroFabricStrategy

        fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=2))
        fabric.launch()
        model, opt = fabric.setup(model, opt)
        rest = fabric.load(folder, {"model": model, "optimizer": opt})
        engine = model._forward_module.engine  # the EngineModule Fabric wraps
    expected = consolidate(folder)
    got = engine.full_state_dict()
    print(json.dumps({
        "equal": sorted(k for k in expected if torch.equal(got[k], expected[k])),
        "keys": sorted(expected), "lr": opt.param_groups[0]["lr"],
        "global_step": engine.global_step, "rest": rest}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
