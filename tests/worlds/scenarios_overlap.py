"""The post-step all-gather in the background (``overlap_param_gather``): every way of reading
the parameters between ``step()`` and the next forward must see the updated values.

Each scenario trains the same model twice on the same data, with the overlap and without it,
and after every step reads the parameters one way. In the overlapped engine every all-gather
is held back until it is waited on (its data lands in the output only at ``wait()``, what a
slow network does), so a read that does not wait sees other ranks' old values and differs
from the plain engine's. Run by tests/quick/test_overlap.py.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP, STAGE3, batch, loss_of

LAYOUTS: dict[str, dict[str, Any]] = {
    "s1": {"stage": 1, "bucket_numel": 300},
    "s2": {"stage": 2, "bucket_numel": 300},
    "s3": {"stage": 3, **STAGE3["mlp"]},  # biases persistent: replicated, gathered after step
}


class _HeldBack:
    """An all-gather whose result reaches the output only when waited on."""

    def __init__(self, handle: Any, staging: torch.Tensor, output: torch.Tensor) -> None:
        self.handle, self.staging, self.output = handle, staging, output

    def wait(self, host: bool = False) -> bool:
        self.handle.wait(host=host)
        self.output.copy_(self.staging)
        return True


def _hold_back_gathers(engine: zs.ZeroEngine) -> None:
    comm, real = engine.comm, engine.comm.all_gather

    def all_gather(flat_output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False,
                   channel: int | None = None):
        if not async_op:
            return real(flat_output, shard, channel=channel)
        staging = flat_output.clone()
        return _HeldBack(real(staging, shard, async_op=True, channel=channel), staging,
                         flat_output)

    comm.all_gather = all_gather  # type: ignore[method-assign]


def _linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [model.inp.weight, model.out.weight, *(b[0].weight for b in model.blocks)]


READS: dict[str, Callable[[zs.ZeroEngine, torch.nn.Module], list[torch.Tensor]]] = {
    "none": lambda engine, model: [],
    "attribute": lambda engine, model: [w.detach().clone() for w in _linear_weights(model)],
    "bias_attribute": lambda engine, model: [model.out.bias.detach().clone()],
    "parameters": lambda engine, model: [p.detach().clone() for p in model.parameters()],
    "full_state_dict": lambda engine, model: list(engine.full_state_dict().values()),
    "eval_forward": lambda engine, model: [_eval(engine)],
    "gathered": lambda engine, model: _gathered(engine, model),
    "checkpoint": lambda engine, model: _checkpoint_roundtrip(engine),
}


def _eval(engine: zs.ZeroEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine(torch.linspace(-1, 1, 32).view(2, 16)).clone()


def _gathered(engine: zs.ZeroEngine, model: torch.nn.Module) -> list[torch.Tensor]:
    with engine.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def _checkpoint_roundtrip(engine: zs.ZeroEngine) -> list[torch.Tensor]:
    """Save, then load into a fresh engine of the same layout and read its weights."""
    path = [tempfile.mkdtemp(prefix="zs-overlap-")]
    dist.broadcast_object_list(path, src=0)
    engine.save_checkpoint(path[0])
    fresh_model = MLP()
    fresh = zs.ZeroEngine(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2),
                          engine.config)
    fresh.load_checkpoint(path[0])
    return list(fresh.full_state_dict().values())


def read_after_step(layout: str, read: str, steps: int = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    base = MLP()
    results = []
    for overlap in (False, True):
        model = copy.deepcopy(base)
        engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               zs.ZeroConfig(**LAYOUTS[layout], overlap_param_gather=overlap))
        if overlap:
            _hold_back_gathers(engine)
        gen = torch.Generator().manual_seed(11 + dist.get_rank())
        reads, losses = [], []
        for _ in range(steps):
            loss = loss_of("mlp", engine, batch("mlp", gen))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            reads.append(READS[read](engine, model))
        results.append((losses, reads, engine.full_state_dict()))
    (plain_losses, plain_reads, plain_w), (losses, reads, weights) = results
    return {
        "losses_equal": losses == plain_losses,
        # Stage 3's sharded matrices read as NaN placeholders outside forward, in both.
        "reads_equal": all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                           for ra, rb in zip(reads, plain_reads) for a, b in zip(ra, rb)),
        "weights_equal": all(torch.equal(weights[k], plain_w[k]) for k in plain_w),
    }


for _layout in LAYOUTS:
    for _read in READS:
        register(f"{_read}_{_layout}", read_after_step, layout=_layout, read=_read)
