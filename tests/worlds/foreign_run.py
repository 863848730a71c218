"""The anchors' side of the foreign-checkpoint tests, run under torchrun: DeepSpeed (ZeRO
stage 1-3) or FSDP2 trains ``tests.support.models.MLP`` for ``K`` steps, saves its own checkpoint
(``<out>/at{K}``), goes on uninterrupted to step ``K + M`` and saves again (``<out>/at{K+M}``);
rank 0 writes the losses of the continued steps to ``<out>/losses.json``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/worlds/foreign_run.py deepspeed OUT STAGE
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/worlds/foreign_run.py fsdp2 OUT
    ... tests/worlds/foreign_run.py fsdp2-resume OUT DCP_DIR  (FSDP2 continues a converted one)
    ... tests/worlds/foreign_run.py deepspeed-zoo OUT         (stages 1-3 x fp32/bf16, see its doc)

The data and loss are shared with our side (``tests/worlds/scenarios_foreign.py``): a global batch
of ``ROWS`` rows per step, rank r of N taking rows [r ROWS/N, (r+1) ROWS/N), each rank's loss
the mean over its rows, so the averaged gradient is the global batch's on any N dividing ROWS.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

K, M, ROWS = 3, 3, 6
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def make_model() -> torch.nn.Module:
    from tests.support.models import MLP

    torch.manual_seed(0)
    return MLP()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 5, generator=g)


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def global_loss(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean of the ranks' equal-sized means."""
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train(engine: Any, first: int, last: int,
          save: Callable[[int], None] | None = None) -> list[float]:
    """Steps [first, last) of the shared work on an engine with ZeroEngine's and DeepSpeed's
    interface (call, ``backward``, ``step``); the global losses of steps K and after;
    ``save(step)`` after steps K and K + M."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last):
        x, y = global_batch(step)
        loss = loss_fn(engine(local(x, rank, world)), local(y, rank, world))
        engine.backward(loss)
        engine.step()
        if step >= K:
            losses.append(global_loss(loss))
        if save is not None and step + 1 in (K, K + M):
            save(step + 1)
    return losses


class _Plain:
    """A model and its optimizer (FSDP2's way) behind the engines' interface for ``train``."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _deepspeed(out: Path, stage: int) -> list[float]:
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, 0, K + M, lambda step: engine.save_checkpoint(
        str(out / f"at{step}"), client_state={"data_step": step}))


def _deepspeed_zoo(out: Path) -> None:
    """Stages 1-3 in fp32 and bf16, 2 steps each, saved to ``<out>/s{stage}_{precision}``
    with DeepSpeed's own view of every parameter's full fp32 master and Adam moments
    (``safe_get_full_*``, gathered from the live optimizer) in ``reference.pt`` beside it."""
    import logging

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            model = make_model()
            config = {
                "train_micro_batch_size_per_gpu": ROWS // world, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                "zero_optimization": {"stage": stage},
                "bf16": {"enabled": precision == "bf16"},
            }
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            for step in range(2):
                x, y = global_batch(step)
                loss = loss_fn(engine(local(x, rank, world).to(dtype)), local(y, rank, world))
                engine.backward(loss)
                engine.step()
            path = out / f"s{stage}_{precision}"
            engine.save_checkpoint(str(path))
            reference = {}
            for name, p in engine.module.named_parameters():
                reference[name] = {
                    "master": safe_get_full_fp32_param(p),
                    "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                    "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
            if rank == 0:
                torch.save(reference, path / "reference.pt")
            dist.barrier()
            engine.destroy()


def _fsdp2(out: Path) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def save(step: int) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd, "train_state": {"data_step": step}},
                 checkpoint_id=str(out / f"at{step}"))
        # torchtitan's form: the optimizer flattened to "state.<name>.<key>" keys
        flat = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"model": msd, "optimizer": flat}, checkpoint_id=str(out / f"flat{step}"))
        # Accelerate's FSDP save_state: model and optimizer in two DCP directories
        dcp.save({"model": msd}, checkpoint_id=str(out / f"accel{step}" / "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": osd}, checkpoint_id=str(out / f"accel{step}" / "optimizer_0"))

    return train(_Plain(model, opt), 0, K + M, save)


def _fsdp2_resume(source: Path, out: Path) -> list[float]:
    """FSDP2 loads a DCP checkpoint of step K (ours, converted) the way its users load one,
    and continues to K + M; rank 0 also writes the final full state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(99)  # another initialisation: every weight must come from the file
    from tests.support.models import MLP

    model = MLP()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "lr": 0.5})
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(source))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = train(_Plain(model, opt), K, K + M)
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save({"state": {k: v.clone() for k, v in final.items()},
                    "lr": opt.param_groups[0]["lr"]}, out / "final.pt")
    return losses


def main() -> None:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    losses = None
    if mode == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        losses = _deepspeed(out, int(sys.argv[3]))
    elif mode == "deepspeed-zoo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _deepspeed_zoo(out)
    elif mode == "fsdp2-resume":
        losses = _fsdp2_resume(Path(sys.argv[3]), out)
    else:
        losses = _fsdp2(out)
    if dist.get_rank() == 0 and losses is not None:
        (out / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
