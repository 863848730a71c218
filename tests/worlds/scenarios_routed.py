"""Routed blocks at stage 3 in a 2-process world, for tests/quick/test_routed_blocks.py.

``parity``: a model whose experts are separate modules (tests/support/routed_models.py),
every module its own unit (``unit_numel=1``) and no ``unit_leaf_classes``, trained beside the
same model in one process on the global batch (what DDP computes, with unused parameters:
``find_unused_parameters=True``). The ranks read different halves of the vocabulary, so they
route to different experts; every rank's per-expert token counts come back with the result.

``early_reduction``: the same model; when backward has passed both blocks, each block's
reduction must have been launched, whether or not an expert of it got no token here.

``unrecognised``: experts chosen by a rule in code, with no router parameter: the engine
cannot know the block is routed, and stage 3 must raise ``GatherOrderError`` naming
``unit_leaf_classes`` (the test runs the world under a timeout, so a hang fails it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import zero_strategy as zs
from tests.support.harness import register
from tests.support.routed_models import RoutedNet, TokenRoutedNet, rank_batch
from tests.support.user_models import rel_diff

FINE = {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0}
STEPS = 4


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def parity(config: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = _optimizer(ref)
    engine = zs.ZeroEngine(model, _optimizer(model), zs.ZeroConfig(**config))
    gen = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {"loss": [], "ref_loss": [], "units": [u.name for u in engine.units]}
    for _ in range(STEPS):
        data = [rank_batch(gen, r) for r in range(world)]
        ref_losses = [F.cross_entropy(ref(b["ids"]), b["y"]) for b in data]
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        value = F.cross_entropy(engine(data[rank]["ids"]), data[rank]["y"])
        engine.backward(value)
        engine.step()
        engine.zero_grad()
        out["loss"].append(value.item())
        out["ref_loss"].append(ref_losses[rank].item())
    full = engine.full_state_dict()
    ref_sd = ref.state_dict()
    out["rel"] = rel_diff(full, ref_sd)
    out["moved"] = max((ref_sd[k] - initial[k]).abs().max().item() for k in ref_sd)
    # What this rank routed: per block, per forward, tokens per expert.
    out["routed"] = {"moe1": model.moe1.routed, "moe2": model.moe2.routed}
    return out


def unrecognised() -> dict[str, Any]:
    torch.manual_seed(0)
    model = TokenRoutedNet()
    engine = zs.ZeroEngine(model, _optimizer(model), zs.ZeroConfig(**FINE))
    gen = torch.Generator().manual_seed(5)
    # Rank 0 reads tokens whose id modulo 4 is 0 or 1, rank 1 tokens whose is 2 or 3.
    ids = torch.tensor([[0, 1, 4, 5]]) + 2 * dist.get_rank()
    try:
        loss = F.cross_entropy(engine(ids), torch.randint(0, 16, (4,), generator=gen))
        engine.backward(loss)
        engine.step()
        error = None
    except zs.GatherOrderError as e:
        error = str(e)
    engine.zero_grad()
    return {"raised": error,
            "units": [u.name for u in engine.units]}


def early_reduction() -> dict[str, Any]:
    """Per step: which experts of each block this rank left idle, and whether each block's
    reduction had been launched when backward reached the embedding below them (its gradient
    is the first computed after both blocks' backward)."""
    torch.manual_seed(0)
    model = RoutedNet()
    engine = zs.ZeroEngine(model, _optimizer(model), zs.ZeroConfig(**FINE))
    blocks = [u for u in engine.units if u.name in ("moe1", "moe2")]
    seen: list[dict[str, bool]] = []
    model.emb.weight.register_post_accumulate_grad_hook(
        lambda _: seen.append({u.name: u.reduced_this_pass for u in blocks}))
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        batch = rank_batch(gen, dist.get_rank())
        engine.backward(F.cross_entropy(engine(batch["ids"]), batch["y"]))
        engine.step()
        engine.zero_grad()
    return {"reduced_by_embedding": seen,
            "routed_held": engine.phase_bounds(activation_bytes=0).terms["routed_held"],
            "largest_block": max(u.layout.padded_numel for u in blocks) * 4,
            "idle": {name: [[e for e, n in enumerate(counts) if n == 0] for counts in
                            getattr(model, name).routed] for name in ("moe1", "moe2")}}


register("parity_fine", parity, config=FINE)
register("early_reduction", early_reduction)
register("parity_fine_offload", parity, config={**FINE, "offload_optimizer": True,
                                                "offload_params": True})
register("unrecognised", unrecognised)
