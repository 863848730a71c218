"""Run by test_checkpoint_files.py with 2 processes: save tag 'good', then rank 1 dies half-way
through writing tag 'bad' (as a node failure would), leaving rank 0 waiting to be killed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zero_strategy as zs
import zero_strategy.checkpoint.write as ckpt
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config


def main(root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = make_model("mlp")
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config("mlp", 3))
    gen = torch.Generator().manual_seed(dist.get_rank())
    engine.backward(loss_of("mlp", engine, batch("mlp", gen)))
    engine.step()
    engine.save_checkpoint(root, tag="good")
    if dist.get_rank() == 1:
        real = ckpt._save_tensors

        def dying(tensors: dict, path: Path) -> dict:
            real(tensors, path)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            os._exit(17)

        ckpt._save_tensors = dying
    engine.backward(loss_of("mlp", engine, batch("mlp", gen)))
    engine.step()
    engine.save_checkpoint(root, tag="bad")
    print("unreachable: the save should never complete", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
