"""Accelerate's ``find_executable_batch_size`` over a model that runs out of memory above a
batch size (issue 51 part 3), under ``accelerate launch`` of 2 processes, for
tests/integration/test_batch_size_finders.py; ``--out DIR`` gets each rank's ``rank<N>.json``.

The training function is Accelerate's documented pattern: ``accelerator.free_memory()``, then
a new model, optimizer and loader prepared at the batch size it is given. The model raises what
Accelerate takes for an out-of-memory error on the CPU (``should_reduce_batch_size``) in its
forward or its backward when a rank's batch holds more than ``LIMIT`` rows (``--where``), on
both ranks alike. From 16 (x0.9 after each failure): 16, 14, 12, 10 and 9 fail, 8 trains.
``--mode ddp`` runs the same loop with a plain ``Accelerator``: the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.faults import HungryMLP
from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin
from zero_strategy.comm.groups import destroy_default_group

STEPS = 6


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(512, 16, generator=gen),
                         10 * torch.randn(512, 5, generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "zero3", "zero2"], required=True)
    parser.add_argument("--where", choices=["forward", "backward"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    small = ({"unit_numel": 1000, "param_persistence_threshold": 0} if args.mode == "zero3"
             else {"bucket_numel": 1000})  # several units / buckets in the tiny MLP
    accelerator = (Accelerator(cpu=True) if args.mode == "ddp" else ZeroAccelerator(
        zero_plugin=ZeroPlugin(stage=int(args.mode[-1]), **small)))
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> dict[str, Any]:
        tried.append(batch_size)
        accelerator.free_memory()  # the previous try's engine goes (its pass failed)
        torch.manual_seed(0)
        model = HungryMLP(args.where)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        loader = DataLoader(data(), batch_size=batch_size, shuffle=False)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for _, (x, y) in zip(range(STEPS), loader):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        state = accelerator.get_state_dict(model)
        return {"batch_size": batch_size, "loss": losses,
                "weights": {k: v.float().flatten().tolist() for k, v in state.items()}}

    record = {"rank": accelerator.process_index, "tried": tried, **train()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    destroy_default_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
