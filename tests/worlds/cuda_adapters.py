"""Lightning and Fabric on one GPU over nccl, run by test_cuda.py as
``python -m tests.worlds.cuda_adapters OUT.json``: ``Trainer(strategy="zero3")`` and
``Fabric(strategy="zero3")`` against ``strategy="ddp"``, the same model, data and AdamW
steps (the CPU suite makes the same comparisons on two CPU processes: test_lightning.py,
test_fabric.py). This exercises what only a GPU run has: Lightning's ``device_id`` bound to
the default group, nccl, the module and batches moved to ``cuda:0``.

One rank: no cross-rank sums, so zero3 and ddp differ only where a flat buffer changes a
reduction's order (the clipping norm) or cuBLAS picks another kernel for other addresses,
~1e-6 of a weight per step; four steps are held to 1e-4 of each tensor's largest weight.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from lightning.fabric import Fabric

from tests.worlds.lightning_fabric_scenarios import batches, build
from tests.worlds.lightning_fabric_scenarios import weights as fabric_weights
from tests.worlds.lightning_run import MLPModule, loader, rel_diff, trainer, weights_of

STEPS = 4


def with_trainer(strategy: str) -> tuple[dict[str, torch.Tensor], str]:
    model = MLPModule()
    t = trainer(strategy, STEPS, accelerator="gpu", devices=1, limit_val_batches=0,
                num_sanity_val_steps=0)
    t.fit(model, loader(0))
    return weights_of(t, model), str(t.strategy.root_device)


def with_fabric(strategy: str) -> tuple[dict[str, torch.Tensor], str]:
    fabric = Fabric(accelerator="cuda", devices=1, strategy=strategy)
    fabric.launch()
    model, opt, _ = build(fabric)
    for x, y in batches(0)[:STEPS]:
        loss = torch.nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return fabric_weights(model), str(fabric.device)


def main(out: str) -> None:
    result: dict[str, Any] = {}
    for name, run in (("trainer", with_trainer), ("fabric", with_fabric)):
        ddp, _ = run("ddp")
        zero3, device = run("zero3")
        result[name] = {"rel": rel_diff(zero3, ddp), "device": device}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
