"""``engine.phase_bounds()`` against what the engine really holds, for
tests/quick/test_phase_bounds.py (2 gloo processes, stage 3, fp32).

A model whose units nest (each block's small layer is left below ``unit_numel`` and joins
the unit of the module around the blocks, which stays whole while they run, inside the
root's), with the first block frozen (its
parameters sharded, in the optimizer at lr 0): a partial fine-tune. Each step samples, at
every module's forward (as it begins) and every trainable gradient's arrival, the bytes of the units
gathered at that moment, and after backward and step the engine's own accounting
(``memory_report``), for the bound's terms to be compared with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from tests.support.harness import scenario

WIDTH = 40


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(WIDTH, WIDTH)  # 1640 elements: a unit of its own
        self.small = nn.Linear(4, WIDTH)  # 200: left to the enclosing unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.big(x) + self.small(x[..., :4]))


class Body(nn.Module):
    """The blocks and a gate: its own unit (3 x 200 + 400 elements left by the blocks), whole
    while they run."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.gate = nn.Parameter(torch.ones(400))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.gate[:WIDTH]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _gathered_bytes(engine: zs.ZeroEngine) -> int:
    return sum(u.layout.padded_numel * 4 for u in engine.units
               if u.param_store.gathers and u.param_store.state.value == "unsharded")


@scenario
def bounds_against_what_the_engine_holds() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    model.body.blocks[0].requires_grad_(False)
    config = zs.ZeroConfig(stage=3, unit_numel=1000, param_persistence_threshold=0)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    bounds = engine.phase_bounds(activation_bytes=0)
    rest = engine.memory_report()
    seen: list[int] = []
    # After the engine's own pre-hooks (prepended): the module's unit is whole by then.
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(_gathered_bytes(engine)))
             for m in model.modules()]
    hooks += [p.register_post_accumulate_grad_hook(lambda _: seen.append(_gathered_bytes(engine)))
              for p in model.parameters() if p.requires_grad]
    # Which units hold a full-size local gradient when an inner block's gradient arrives:
    # the enclosing ones (root, body) got theirs first and reduce only at their module's end.
    held_inner: list[list[str]] = []
    hooks.append(model.body.blocks[1].big.weight.register_post_accumulate_grad_hook(
        lambda _: held_inner.append([u.name for u in engine.units
                                     if getattr(u.grad_store, "local", None) is not None])))
    x = torch.randn(4, 6, WIDTH, generator=torch.Generator().manual_seed(engine.comm.rank))
    engine(x).square().mean().backward()
    after_backward = engine.memory_report()
    engine.step()
    after_step = engine.memory_report()
    for h in hooks:
        h.remove()
    with_report = engine.memory_report(activation_bytes=5 << 20)
    return {
        "terms": bounds.terms, "bounds": bounds.as_dict(),
        "units": {u.name: [u.layout.padded_numel, u.layout.shard_numel,
                           any(p.requires_grad for p in u.params)] for u in engine.units},
        "params_at_rest": rest["params_bytes"], "most_gathered": max(seen),
        "held_at_inner_gradient": held_inner,
        "largest_trainable": max(p.numel() for p in model.parameters() if p.requires_grad),
        "grads_after_backward": after_backward["grads_bytes"],
        "optimizer_growth": after_step["optimizer_bytes"] - after_backward["optimizer_bytes"],
        "report_bounds": {k: v for k, v in with_report.items() if k.startswith("bound_")},
        "bounds_with_activations": engine.phase_bounds(activation_bytes=5 << 20).as_dict(),
    }
