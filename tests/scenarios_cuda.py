"""CUDA scenarios (nccl, pinned host buffers, device placement); run by test_cuda.py."""

from __future__ import annotations

import torch

import zero_strategy as zs
from tests.harness import register
from tests.models import batch, loss_of, make_model, make_optimizer, zero_config


def gpu_vs_cpu_master(stage: int, **extra) -> dict:
    """Train on the GPU; offloaded masters must be pinned host memory, results finite and
    close to the same engine's fp32 run."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model("gpt2").to(device)
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config("gpt2", stage,
                                                                               **extra))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        data = {k: v.to(device) for k, v in batch("gpt2", gen).items()}
        loss = loss_of("gpt2", engine, data)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(float(loss))
    masters = [u.param_store.master for u in engine.units]
    return {"losses": losses,
            "master_devices": sorted({m.device.type for m in masters}),
            "pinned": all(m.is_pinned() for m in masters if m.device.type == "cpu"),
            "report": engine.memory_report()}


for _stage in (1, 2, 3):
    register(f"gpu_stage{_stage}", gpu_vs_cpu_master, stage=_stage)
register("gpu_stage3_offload_bf16", gpu_vs_cpu_master, stage=3, precision="bf16-mixed",
         offload_optimizer=True, offload_params=True)
register("gpu_stage2_offload", gpu_vs_cpu_master, stage=2, offload_optimizer=True)
