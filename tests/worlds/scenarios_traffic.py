"""The bytes a step sends, counted by the engine's communicators, beside what
``zero_strategy.perf`` predicts for it (tests/quick/test_traffic_counts.py).

Also where stage 3 launches its reductions (``launches_in_backward``): during backward, as
units complete, not held to the end of backward for want of a gather check to agree on.

A tiny language model shaped like GPT-2 (2 blocks of width 64: units of every kind, a tied
root unit kept whole from forward to backward, biases and LayerNorms small enough to stay
whole on every rank) takes one step to settle, then one counted step. At N=2: stages 0-3,
int8 weights and gradients at stage 3, int8 gradients at stage 2. At N=4 (2 "nodes" of 2):
stage 3 over all four and hybrid, in fp32 and with int8, whose all-reduce across the
groups is counted on its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import scenario
from zero_strategy.perf import Layout, Options, model_units, rank_bytes, step_collectives

SMALL = {"unit_numel": 20_000, "param_persistence_threshold": 1_000}
CASES = {
    2: {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2},
        "stage3": {"stage": 3, **SMALL},
        "stage3_int8": {"stage": 3, "quantize_weights": "int8", "quantize_gradients": "int8",
                        **SMALL},
        "stage2_int8": {"stage": 2, "quantize_gradients": "int8"}},
    4: {"stage3": {"stage": 3, **SMALL},
        "stage3_hybrid": {"stage": 3, "shard_group_size": 2, **SMALL},
        "stage3_hybrid_int8": {"stage": 3, "shard_group_size": 2, "quantize_weights": "int8",
                               "quantize_gradients": "int8", **SMALL}},
}


class TiedLM(torch.nn.Module):
    """GPT-2's shape in small: an embedding tied to the output head (registered in both, so
    the root unit owns it), blocks of LayerNorm and two Linear layers."""

    def __init__(self, vocab: int = 256, width: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
            torch.nn.Linear(4 * width, width)) for _ in range(blocks))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _model(device: str = "cpu", blocks: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return TiedLM(blocks=blocks)


def _step(engine: zs.ZeroEngine, generator: torch.Generator) -> None:
    ids = torch.randint(0, 256, (2, 16), generator=generator)
    engine.backward(engine(ids))
    engine.clip_grad_norm_(1.0)
    engine.step()


@scenario
def step_bytes() -> dict[str, Any]:
    world = dist.get_world_size()
    out = {}
    for name, fields in CASES[world].items():
        config = zs.ZeroConfig(**fields)
        model = _model()
        engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        generator = torch.Generator().manual_seed(dist.get_rank())
        _step(engine, generator)
        before = engine.comm_bytes()
        _step(engine, generator)
        after = engine.comm_bytes()
        layout = Layout(2, world // 2, fields.get("shard_group_size"))
        collectives = step_collectives(model_units(_model("meta"), config, layout),
                                       Options.from_config(config), layout)
        replicas = [c for c in collectives if c.group == "replica"]
        out[name] = {
            "counted": after["total"] - before["total"],
            "predicted": rank_bytes(collectives, layout),
            "counted_across": after.get("across_groups", 0) - before.get("across_groups", 0),
            "predicted_across": rank_bytes(replicas, layout),
        }
        engine.close()
    return out


LAUNCH_CASES = {
    2: {"stage3": {"stage": 3, **SMALL}},
    4: {"stage3": {"stage": 3, **SMALL},
        "stage3_hybrid": {"stage": 3, "shard_group_size": 2, **SMALL}},
}


@scenario
def launches_in_backward() -> dict[str, Any]:
    """Per case and prefetch depth, the runtime's state at each reduction launched in the
    counted step: "backward" (while gradients still arrive) or "post-backward" (at its end).
    A depth of 8 keeps every unit whole from forward to backward, so backward gathers
    nothing and no gather check ever agrees on anything before the end."""
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for name, fields in LAUNCH_CASES[world].items():
        for depth in (2, 8):
            config = zs.ZeroConfig(**fields, prefetch_units=depth)
            model = _model(blocks=4)
            engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   config)
            states: list[str] = []
            for unit in engine.units:
                store = unit.grad_store
                launch = store.launch_reduce

                def recorded(comm: Any, launch: Any = launch, states: list[str] = states,
                             runtime: Any = engine.runtime) -> None:
                    states.append(runtime.state.value)
                    launch(comm)

                store.launch_reduce = recorded  # type: ignore[method-assign]
            generator = torch.Generator().manual_seed(dist.get_rank())
            _step(engine, generator)
            states.clear()
            _step(engine, generator)
            out[f"{name}_depth{depth}"] = {
                "states": states,
                "trained_units": sum(any(p.requires_grad for p in u.params) for u in engine.units)}
            engine.close()
    return out
