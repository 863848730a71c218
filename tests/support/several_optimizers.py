"""Muon for the hidden matrices beside AdamW for the rest, through each adapter: the model, the
per-rank data and the single-process reference the adapter scenarios compare with
(tests/worlds/lightning_fabric_scenarios.py, tests/worlds/lightning_run.py,
tests/worlds/accelerate_optimizers.py).
Importing it registers no scenario.

The reference trains the same model in one process on the global batch, forwarded as the ranks'
halves and averaged: its gradient is the same two fp32 terms the engine's reduction adds (an
fp32 sum of two terms does not depend on their order), so only the elementwise ops' grouping
can make the two differ. Muon orthogonalises in fp32 here (``Fp32Muon``): these tests check an
adapter's wiring, and torch's bf16 orthogonalisation turns a last-bit difference of a gradient
into a bf16-sized one (2^-8 relative) depending on the CPU's rounding; Muon's own numerics under
every stage, bf16 included, are tested against a noise floor in
tests/quick/test_matrix_optimizers.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.muon_fp32 import Fp32Muon
from tests.support.models import MLP

MUON_LR, ADAMW_LR = 0.02, 0.01
STEPS = 3
# Tolerance against the reference: measured 1.7e-7 after 3 steps (Accelerate at stages 2 and 3;
# per tensor, Muon's matrices 1.3e-7 to 1.7e-7): AdamW's multi-tensor update over flat shards
# groups the fp32 ops differently (~6e-8 after the first step), and the next gradients carry
# that into Muon's fp32 orthogonalisation. 1e-5 leaves a margin of ~50, while a wrong step
# moves the weights by 5e-2 or more (Muon's lr not following its scheduler: 6.1e-2; Muon
# stepped twice once: 5.2e-2; AdamW skipped once: 3.2e-1). (With torch's bf16
# orthogonalisation the same runs differed by 6e-4 to 1.6e-3 on one CPU and by 2e-7 on
# another: the bf16 rounding of the Newton-Schulz input decides.)
TOL = 1e-5


def build() -> MLP:
    torch.manual_seed(0)
    return MLP()


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The residual blocks' weights (33 x 33): Muon trains them, AdamW everything else."""
    return [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden = hidden_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [Fp32Muon(hidden, lr=MUON_LR),
            torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1)]


def muon_factor(calls: int) -> float:
    """The Muon part's LambdaLR factor after ``calls`` scheduler steps (AdamW has none)."""
    return 1.0 / (1.0 + calls)


def schedule(muon: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(muon, muon_factor)


def rank_batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(700 + rank)
    return [(torch.randn(4, 16, generator=gen), 3 * torch.randn(4, 5, generator=gen))
            for _ in range(steps)]


def loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def reference(world: int, steps: int = STEPS, sched_calls: int = 1,
              cycle: int | None = None) -> list[dict[str, Any]]:
    """After each of ``steps`` single-process steps: the weights and both parts' lr. The
    scheduler steps ``sched_calls`` times per step (Accelerate steps it once per process);
    ``cycle`` reuses the first ``cycle`` batches (an epoch of that many steps)."""
    model = build()
    opts = optimizers(model)
    sched = schedule(opts[0])
    data = [rank_batches(r, cycle or steps) for r in range(world)]
    after = []
    for step in range(steps):
        i = step % len(data[0])
        (sum(loss(model, data[r][i]) for r in range(world)) / world).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(sched_calls):
            sched.step()
        after.append({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                      "lr": [opt.param_groups[0]["lr"] for opt in opts]})
    return after


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of a tensor relative to the largest |b| of that tensor."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp_min(1e-12)).item() for k in b)


def moved(weights: dict[str, torch.Tensor]) -> float:
    """The largest change of a weight from its initial value (so parity is not vacuous)."""
    initial = build().state_dict()
    return max((weights[k].double() - initial[k].double()).abs().max().item() for k in initial)


def double_step(step_twice: Any) -> str:
    """The error text of stepping one part twice after one backward (``step_twice()``)."""
    try:
        step_twice()
    except RuntimeError as err:
        return str(err)
    return "no error"
