"""The "-autocast" precisions against one process running torch.autocast over fp32 weights,
and the dtypes each precision's forward computes in (N=2).

Run by tests/quick/test_trainer_precision.py through tests.support.harness.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import STAGE3, batch, loss_of, make_model, make_optimizer

STEPS = 4


def _config(stage: int, precision: str, **kw) -> zs.ZeroConfig:
    return zs.ZeroConfig(stage=stage, precision=precision,
                         **{**(STAGE3["mlp"] if stage == 3 else {}), **kw})


def _reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, fp32 weights, the forward under autocast(bf16) as Accelerate puts it;
    each rank's micro-batch is a backward of its loss / N accumulated into .grad: the
    average DDP and the engine form, term by term (see the test for why that is exact)."""
    model = make_model("mlp")
    optimizer = make_optimizer("adamw", model)
    world = dist.get_world_size()
    gens = [torch.Generator().manual_seed(11 + r) for r in range(world)]
    losses = []
    for _ in range(steps):
        per_rank = []
        for gen in gens:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of("mlp", model, batch("mlp", gen))
            (loss.float() / world).backward()
            per_rank.append(loss.float().item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(per_rank[dist.get_rank()])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of any element, relative to its tensor's largest |b|."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def against_reference(stage: int, precision: str = "bf16-autocast", **kw) -> dict:
    model = make_model("mlp")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), _config(stage, precision, **kw))
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = loss_of("mlp", engine, batch("mlp", gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    full = engine.full_state_dict()
    ref, ref_losses = _reference(STEPS)
    return {
        "precision": engine.plan.policy.name,
        "rel": _rel(full, ref),
        "moved": max(((ref[k] - initial[k]).abs().max() / ref[k].abs().max()).item()
                     for k in ref),
        "losses": losses,
        "ref_losses": ref_losses,
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "master_dtypes": sorted({str(u.param_store.master.dtype) for u in engine.units}),
    }


def observed_dtypes(stage: int, precision: str) -> dict:
    """What a Linear inside the engine's forward sees: its weight's dtype, the autocast state
    and the dtype it computes in; and the gradient dtype its weight receives."""
    model = make_model("mlp")
    seen: dict[str, object] = {}

    def before(module: nn.Module, args: tuple) -> None:
        seen["weight"] = str(module.weight.dtype)
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["autocast_dtype"] = str(torch.get_autocast_dtype("cpu"))
        seen["input"] = str(args[0].dtype)

    def after(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["output"] = str(output.dtype)

    def grad(p: torch.Tensor) -> None:
        seen["grad"] = str(p.grad.dtype)

    layer = model.blocks[1][0]
    layer.register_forward_pre_hook(before)
    layer.register_forward_hook(after)
    layer.weight.register_post_accumulate_grad_hook(grad)
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), _config(stage, precision))
    gen = torch.Generator().manual_seed(3)
    engine.backward(loss_of("mlp", engine, batch("mlp", gen)).float())
    engine.step()
    seen["autocast_after"] = torch.is_autocast_enabled("cpu")
    return seen


def generate_under_autocast(stage: int) -> dict:
    """``generate()`` on the engine's model runs in the forward's autocast, as it does under
    Accelerate (which autocasts the model's ``forward`` itself): the same greedy tokens as
    the plain model generating under torch.autocast, and the autocast seen inside."""
    ref = make_model("gpt2")
    model = make_model("gpt2")
    states: set[bool] = set()
    model.transformer.h[0].register_forward_pre_hook(
        lambda module, args: states.add(torch.is_autocast_enabled("cpu")))
    config = zs.ZeroConfig(stage=stage, precision="bf16-autocast",
                           **(STAGE3["gpt2"] if stage == 3 else {}))
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), config)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(5))
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref.generate(ids, **kwargs)
    got = engine.module.generate(ids, **kwargs)
    return {"equal": torch.equal(got, expected), "autocast_seen": sorted(states)}


def frozen_keeps_its_dtype(stage: int) -> dict:
    """A frozen bf16 layer outside the optimizer (stages 0-2 leave it whole): autocast keeps
    it bf16 as Accelerate does; the compute-copy mode brings it to its compute dtype."""
    out = {}
    for precision in ("bf16-autocast", "32-true"):
        model = make_model("mlp")
        model.inp.requires_grad_(False)
        model.inp.to(torch.bfloat16)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine = zs.ZeroEngine(model, torch.optim.AdamW(trainable, lr=1e-2),
                               _config(stage, precision))
        gen = torch.Generator().manual_seed(3)
        engine.backward(loss_of("mlp", engine, batch("mlp", gen)).float())
        engine.step()
        out[precision] = str(model.inp.weight.dtype)
    return out


register("frozen_stage0", frozen_keeps_its_dtype, stage=0)
for _stage in (0, 3):
    register(f"generate_stage{_stage}", generate_under_autocast, stage=_stage)
for _stage in (0, 3):
    register(f"mixed_stage{_stage}", against_reference, stage=_stage, precision="bf16-mixed")
for _stage in range(4):
    register(f"autocast_stage{_stage}", against_reference, stage=_stage)
    for _precision in ("bf16-autocast", "bf16-mixed"):
        register(f"dtypes_{_precision}_stage{_stage}", observed_dtypes, stage=_stage,
                 precision=_precision)
register("autocast_stage2_offload", against_reference, stage=2, offload_optimizer=True)
register("autocast_stage3_offload", against_reference, stage=3, offload_optimizer=True,
         offload_params=True)
register("autocast_stage3_ckpt", against_reference, stage=3, activation_checkpointing=True)
