"""Partial fine-tunes at stage 3 (tests/quick/test_partial_finetune.py), on 2 gloo processes.

Each freezing pattern users choose trains a tiny GPT-2 for a few steps through the engine,
with the optimizer built over the trainable parameters only (as PEFT recipes and Lightning
modules build it), beside one process training an unsharded copy on the global batch. Besides
the weights and losses, each scenario records what the engine holds while it trains: the
units gathered after forward and at most at once during backward, the bytes reduce-scatter
sent, and the gradient and parameter bytes each rank keeps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.support.harness import register
from tests.support.models import tiny_gpt2
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.core.params import ParamState

LAYERS, STEPS, LR = 4, 3, 0.1
PATTERNS = {
    "full": lambda n: True,
    "head_only": lambda n: n.startswith("transformer.ln_f."),
    "first_block": lambda n: n.startswith("transformer.h.0."),
    "last_block": lambda n: n.startswith(f"transformer.h.{LAYERS - 1}."),
    "one_layer_in_each_block": lambda n: ".mlp.c_proj." in n,
}


def _model(pattern: str) -> torch.nn.Module:
    model = tiny_gpt2(seed=3, n_layer=LAYERS)
    for name, p in model.named_parameters():
        p.requires_grad_(PATTERNS[pattern](name))
    return model


def _batches(rank: int, world: int) -> list[torch.Tensor]:
    """Per step, every rank's rows: the global batch is their concatenation."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, 96, (2 * world, 8), generator=g) for _ in range(STEPS)]
    return [r[2 * rank : 2 * rank + 2] for r in rows] if rank >= 0 else rows


def _gathered(engine: ZeroEngine) -> list[str]:
    return [u.name or "<root>" for u in engine.units
            if u.param_store.state is not ParamState.SHARDED]


class _BackwardWatch:
    """The most units whole at once while backward runs, and every unit seen whole: sampled
    as the gradient reaches each block's output (after the engine's own hook there has
    gathered the block) and as each trainable parameter's gradient arrives."""

    def __init__(self, engine: ZeroEngine, model: torch.nn.Module) -> None:
        self.engine, self.most, self.seen = engine, 0, set()
        for block in model.transformer.h:
            block.register_forward_hook(self._hook_output)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sample)

    def _hook_output(self, module: Any, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(self._sample)

    def _sample(self, grad: torch.Tensor) -> None:
        whole = _gathered(self.engine)
        self.most = max(self.most, len(whole))
        self.seen.update(whole)


def _train_reference(pattern: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(pattern)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                          momentum=0.9)
    losses = []
    for x in _batches(-1, world):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(stage: int) -> ZeroConfig:
    """At stage 3 every parameter sharded (none kept whole for being small) and one unit per
    block, as a model of real size gets them (a tiny one would be a single unit); one unit
    prefetched, so that of 4 blocks a unit kept too long shows in what backward holds."""
    three = {"param_persistence_threshold": 0, "unit_numel": 1, "prefetch_units": 1,
             "unit_leaf_classes": ["GPT2Block"]}
    return ZeroConfig(stage=stage, **(three if stage == 3 else {}))


def partial(pattern: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(pattern)
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    engine = ZeroEngine(model, opt, _config(3))
    watch = _BackwardWatch(engine, model)
    after_forward: list[list[str]] = []
    sent: list[int] = []
    losses = []
    for x in _batches(rank, world):
        before = engine.comm_bytes().get("reduce_scatter", 0)
        loss = engine(input_ids=x, labels=x).loss
        after_forward.append(_gathered(engine))
        engine.backward(loss)
        sent.append(engine.comm_bytes().get("reduce_scatter", 0) - before)
        engine.step()
        engine.zero_grad()
        # The loss of the global batch: the mean of the ranks' means (equal row counts).
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    report = engine.memory_report()
    training = [u for u in engine.units if any(p.requires_grad for p in u.params)]
    state = engine.full_state_dict()
    ref_losses, ref_state = _train_reference(pattern, world)
    moved_ref = max((ref_state[k] - v).abs().max().item()
                    for k, v in tiny_gpt2(seed=3, n_layer=LAYERS).state_dict().items())
    result = {
        "losses": losses, "ref_losses": ref_losses, "moved": moved_ref,
        "rel": max((state[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-12)
                   for k, v in ref_state.items()),
        "after_forward": after_forward, "most_in_backward": watch.most,
        "seen_in_backward": sorted(watch.seen),
        "units": len(engine.units), "root": engine.runtime.root_unit is not None,
        "reduce_scatter_bytes": sent,
        # Ring convention, fp32: each rank sends (N-1)/N of every reduced unit's buffer.
        "reduce_scatter_formula": sum(u.layout.padded_numel * 4 * (world - 1) // world
                                      for u in training),
        "grads_bytes": report["grads_bytes"],
        "grads_formula": sum(u.layout.shard_numel * 4 for u in training),
        "params_bytes": report["params_bytes"], "whole_bytes": whole_bytes,
        "module_storage_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
        "param_tensors": len(list(model.parameters())),
    }
    engine.close()
    return result


def frozen_checkpoint_across_stages(directory: str) -> dict[str, Any]:
    """Stage 3 shards the frozen parameters outside the optimizer, stages 0-2 keep them whole:
    a checkpoint of either loads into the other."""
    out: dict[str, Any] = {}
    for save_stage, load_stage in ((3, 2), (2, 3)):
        saved = _model("last_block")
        opt = torch.optim.AdamW([p for p in saved.parameters() if p.requires_grad], lr=LR)
        engine = ZeroEngine(saved, opt, _config(save_stage))
        x = _batches(dist.get_rank(), dist.get_world_size())[0]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        where = f"{directory}/s{save_stage}"
        engine.save_checkpoint(where)
        expected = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.close()
        target = _model("last_block")
        with torch.no_grad():  # other values everywhere, so a missed load shows
            for p in target.parameters():
                p.add_(1.0)
        opt = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad], lr=LR)
        loaded = ZeroEngine(target, opt, _config(load_stage))
        loaded.load_checkpoint(where)
        got = loaded.full_state_dict()
        out[f"{save_stage}->{load_stage}"] = max(
            (got[k].float() - v.float()).abs().max().item() for k, v in expected.items())
        loaded.close()
    return out


for _pattern in PATTERNS:
    register(f"partial_{_pattern}", partial, pattern=_pattern)


def _checkpoint_scenario() -> dict[str, Any]:
    import tempfile

    directory = tempfile.mkdtemp(prefix="zs-partial-") if dist.get_rank() == 0 else ""
    shared = [directory]
    dist.broadcast_object_list(shared, src=0)
    return frozen_checkpoint_across_stages(shared[0])


register("frozen_checkpoint_across_stages", _checkpoint_scenario)


def trainability_disagreement() -> dict[str, Any]:
    """Rank 1 unfreezes one more block than rank 0: the first backward refuses, naming the
    parameters that differ, on every rank (reducing different units would hang instead).
    Before that, on a model every rank freezes alike, unfreezing a block between steps
    adds to a step's collective bytes only that block's reduction and the gathers of the
    blocks backward now crosses: the agreement itself travels through the store."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _batches(rank, world)[0]
    model = _model("last_block")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=LR), _config(3))
    sent = []
    # Four steps: the first has no forward before it, so it keeps no unit whole for its
    # backward (``Runtime._backward_head``) and sends a little more than the next.
    for step in range(4):
        if step == 3:
            for p in model.transformer.h[0].parameters():
                p.requires_grad_(True)
        before = dict(engine.comm_bytes())
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
        sent.append({k: v - before.get(k, 0) for k, v in engine.comm_bytes().items()})
    ring = {u.name: u.layout.padded_numel * 4 * (world - 1) // world for u in engine.units}
    engine.close()
    model = _model("last_block")
    if rank == 1:
        for p in model.transformer.h[0].parameters():
            p.requires_grad_(True)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=LR), _config(3))
    try:
        engine.backward(engine(input_ids=x, labels=x).loss)
        refusal = ""
    except RuntimeError as e:
        refusal = str(e)
    engine.close()
    return {"sent": sent, "refusal": refusal, "world": world,
            "ring_bytes": ring}


register("trainability_disagreement", trainability_disagreement)


def prefetch_depths() -> dict[str, Any]:
    """Full fine-tune at stage 3 with ``prefetch_units`` 1, 2 and 3: as a block starts its
    forward, the other blocks gathered or gathering, ahead of it and behind it (those behind
    are freed, but the ones kept whole for backward); and the losses, which the depth must
    not change."""
    return {str(depth): _with_depth(depth) for depth in (1, 2, 3)}


def _with_depth(depth: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model("full")
    config = ZeroConfig(stage=3, param_persistence_threshold=0, unit_numel=1,
                        unit_leaf_classes=["GPT2Block"], prefetch_units=depth)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    blocks = list(model.transformer.h)
    ahead: list[int] = []
    behind: list[int] = []

    def count(module: Any, args: Any) -> None:
        i = blocks.index(module)
        whole = {blocks.index(u.module) for u in engine.units if u.module in blocks
                 and u.param_store.state is not ParamState.SHARDED}
        ahead.append(sum(1 for j in whole if j > i))
        behind.append(sum(1 for j in whole if j < i))

    for block in blocks:
        block.register_forward_pre_hook(count)
    losses = []
    for x in _batches(rank, world):
        ahead.clear()  # the last step's: the first has no order to prefetch along
        behind.clear()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.close()
    return {"ahead": ahead, "behind": behind, "losses": losses}


register("prefetch_depths", prefetch_depths)
