"""Activation checkpointing and offload (``ZeroConfig(activation_checkpointing=...,
offload_activations=...)``) against the same model checkpointed by hand under DDP.

The reference checkpoints the same modules with ``torch.utils.checkpoint`` itself (GPT-2
through transformers' ``gradient_checkpointing_enable``, non-reentrant), so both sides
recompute the same functions; dropout is on, with each micro-batch's forward started from
the same RNG state on both sides, so the recomputation's masks must equal the forward's for
the gradients to agree. Run by tests/quick/test_activations.py (N=2) and
tests/integration/test_activations_worlds.py (N=1 and N=3).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import MLP, batch, loss_of, make_optimizer
from tests.support.parity import AdamWGain, rel_diff

STAGE3 = {"gpt2": {"unit_numel": 2000, "param_persistence_threshold": 100},
          "mlp": {"unit_numel": 500, "param_persistence_threshold": 40}}


def gpt2(seed: int = 0) -> nn.Module:
    """Three layers, dropout on everywhere (what the recomputation must reproduce)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, tie_word_embeddings=True))


def build(kind: str) -> nn.Module:
    if kind == "gpt2":
        return gpt2()
    torch.manual_seed(0)
    return MLP()


def by_hand(kind: str, model: nn.Module) -> None:
    """The reference's checkpointing: the modules ``activation_checkpointing=True`` picks."""
    if kind == "gpt2":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def zero_config(kind: str, stage: int, **extra: Any) -> zs.ZeroConfig:
    return zs.ZeroConfig(stage=stage, **(STAGE3[kind] if stage == 3 else {}), **extra)


def _train_step(ddp: nn.Module, engine: zs.ZeroEngine, kind: str, gen: torch.Generator,
                seed: int, accum: int) -> tuple[float, float]:
    ref_loss = loss = 0.0
    for micro in range(accum):
        data = batch(kind, gen)
        last = micro == accum - 1
        torch.manual_seed(seed + micro)  # the same dropout masks on both sides
        with contextlib.nullcontext() if last else ddp.no_sync():
            lr = loss_of(kind, ddp, data) / accum
            lr.backward()
        torch.manual_seed(seed + micro)
        with contextlib.nullcontext() if last else engine.no_sync():
            le = loss_of(kind, engine, data) / accum
            engine.backward(le)
        ref_loss, loss = ref_loss + lr.item(), loss + le.item()
    return ref_loss, loss


def parity(kind: str, stage: int, offload: str | bool = False, steps: int = 4, accum: int = 2,
           clip: float = 0.05, choice: Any = True, hand: bool = True) -> dict:
    """Train beside DDP (checkpointed by hand unless ``hand=False``: then the reference keeps
    every activation, and checkpointing must not change the arithmetic either)."""
    rank = dist.get_rank()
    ref, model = build(kind), build(kind)
    if hand:
        by_hand(kind, ref)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ddp = DDP(ref)
    ref_opt = make_optimizer("adamw", ref)
    adam = AdamWGain(ref, ref_opt)
    directory = tempfile.mkdtemp(prefix="zs-act-") if offload == "disk" else None
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(
        kind, stage, activation_checkpointing=choice, offload_activations=offload,
        offload_dir=directory))
    gen = torch.Generator().manual_seed(1000 + rank)
    out: dict[str, list[float]] = {"ref_loss": [], "loss": [], "ref_norm": [], "norm": []}
    for step in range(steps):
        ref_loss, loss = _train_step(ddp, engine, kind, gen, 100 * step + 10 * rank, accum)
        out["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        out["norm"].append(engine.clip_grad_norm_(clip).item())
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
        out["ref_loss"].append(ref_loss)
        out["loss"].append(loss)
    report = engine.memory_report()
    full, ref_sd = engine.full_state_dict(), ref.state_dict()
    # the disk form's files are unlinked when written: none is visible while training,
    # and close() removes the directory it made for them
    files_while_open = [f for d in (os.listdir(directory) if directory else [])
                        for f in os.listdir(os.path.join(directory, d))]
    engine.close()
    return {
        **out,
        "rel": rel_diff(full, ref_sd, adam),
        "rel_eps_bound": rel_diff(full, ref_sd, adam, eps_bound=True),
        "moved": max((ref_sd[k] - initial[k]).abs().max().item() for k in ref_sd),
        "keys": sorted(full) == sorted(ref_sd),
        "shapes": all(full[k].shape == ref_sd[k].shape for k in ref_sd),
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "activation_bytes": report["activation_bytes"],
        "offloaded_bytes": report["offloaded_activation_bytes"],
        "checkpointed": report["checkpointed_modules"],
        "files_while_open": files_while_open,
        "left_after_close": os.listdir(directory) if directory else [],
    }


def _gpt2_engine(checkpointing: bool, offload: str | bool = False) -> zs.ZeroEngine:
    model = gpt2()
    return zs.ZeroEngine(model, make_optimizer("adamw", model), zero_config(
        "gpt2", 3, activation_checkpointing=checkpointing, offload_activations=offload))


def _steps(engine: zs.ZeroEngine, count: int) -> list[float]:
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    losses = []
    for step in range(count):
        torch.manual_seed(step)
        loss = loss_of("gpt2", engine, batch("gpt2", gen))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def gathers_once() -> dict:
    """Stage 3: a checkpointed step gathers each unit once for forward and once for the
    recomputation and backward together, the bytes of a step without checkpointing; in a
    steady step every unit backward needs was already gathering (prefetched in the order the
    recomputation runs) but the first."""
    sent = {}
    for checkpointing in (False, True):
        engine = _gpt2_engine(checkpointing)
        _steps(engine, 1)
        before = engine.comm_bytes()["all_gather"]
        needed: list[tuple[int, str]] = []
        runtime = engine.runtime
        original = runtime.pre_backward

        def record(unit: Any, original: Any = original, runtime: Any = runtime,
                   needed: list = needed) -> None:
            if unit.index not in runtime._traced:  # first need in this backward
                needed.append((unit.index, unit.param_store.state.value))
            original(unit)

        runtime.pre_backward = record  # type: ignore[method-assign]
        _steps(engine, 1)
        sent[checkpointing] = {"bytes": engine.comm_bytes()["all_gather"] - before,
                               "needed": needed, "units": len(engine.units)}
        engine.close()
    return {str(k): v for k, v in sent.items()}


def measured() -> dict:
    """What a forward keeps, as the engine measures it: without checkpointing, checkpointed,
    and checkpointed with the kept inputs on disk."""
    out = {}
    for name, checkpointing, offload in (("plain", False, False), ("checkpointed", True, False),
                                         ("disk", True, "disk"), ("cpu", True, "cpu")):
        engine = _gpt2_engine(checkpointing, offload)
        losses = _steps(engine, 2)
        report = engine.memory_report()
        with engine.measure_activations():
            _steps(engine, 1)
        again = engine.memory_report()["activation_bytes"]
        engine.close()
        out[name] = {"losses": losses, "bytes": report["activation_bytes"], "again": again,
                     "offloaded": report["offloaded_activation_bytes"]}
    return out


def refusals() -> dict:
    """Bad choices are refused by name before anything is built."""
    errors = {}
    cases = {
        "unknown_class": dict(activation_checkpointing=["NoSuchBlock"]),
        "no_blocks": dict(activation_checkpointing=True),
    }
    for name, options in cases.items():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)) \
            if name == "no_blocks" else MLP()
        try:
            zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          zs.ZeroConfig(stage=2, **options))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    model = gpt2()
    model.gradient_checkpointing_enable()
    try:
        zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      zs.ZeroConfig(stage=2, activation_checkpointing=True))
        errors["twice"] = None
    except ValueError as e:
        errors["twice"] = str(e)
    return errors


class _ChangesItsInput(nn.Module):
    """Changes, in place, a tensor block 0 kept for its recomputation (and keeps it alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        y = self.blocks[0](h)
        h.add_(1.0)
        self.kept = [h]
        return self.blocks[1](y).sum()


def in_place_change_refused() -> dict:
    """Autograd refuses a saved tensor changed in place; so must a measured forward (whose
    counting hook stands between) and the offloaded copy (whose source still lives)."""
    out = {}
    for offload in (False, "disk"):
        model = _ChangesItsInput()
        engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zs.ZeroConfig(
            stage=2, activation_checkpointing=True, offload_activations=offload))
        for step in ("measured", "plain"):
            try:
                engine.backward(engine(torch.randn(3, 4, requires_grad=True)))
                out[f"{offload or 'device'}_{step}"] = None
            except RuntimeError as e:
                out[f"{offload or 'device'}_{step}"] = str(e)
            engine.zero_grad()
        engine.close()
    return out


def closed_model_is_plain() -> dict:
    """close() gives the model back without the engine's checkpointing."""
    model = gpt2()
    engine = zs.ZeroEngine(model, make_optimizer("adamw", model),
                           zero_config("gpt2", 2, activation_checkpointing=True))
    during = [m.gradient_checkpointing for m in model.transformer.h]
    plain = engine.close()
    mlp = MLP()
    engine = zs.ZeroEngine(mlp, make_optimizer("adamw", mlp),
                           zs.ZeroConfig(stage=1, activation_checkpointing=["Sequential"]))
    wrapped = ["forward" in b.__dict__ for b in mlp.blocks]
    engine.close()
    return {"during": during, "after": [m.gradient_checkpointing for m in plain.transformer.h],
            "model_flag_after": plain.transformer.gradient_checkpointing,
            "wrapped": wrapped, "unwrapped": ["forward" in b.__dict__ for b in mlp.blocks]}


def _register(world: str | None) -> None:
    if world == "2":
        for stage in range(4):
            register(f"gpt2_s{stage}", parity, kind="gpt2", stage=stage)
            register(f"gpt2_s{stage}_disk", parity, kind="gpt2", stage=stage, offload="disk")
        register("mlp_s3_cpu", parity, kind="mlp", stage=3, offload="cpu")
        register("mlp_s2_names", parity, kind="mlp", stage=2, choice=["Sequential"])
        register("gpt2_s3_vs_plain_ddp", parity, kind="gpt2", stage=3, hand=False)
        register("gathers_once", gathers_once)
        register("measured", measured)
        register("refusals", refusals)
        register("closed_model_is_plain", closed_model_is_plain)
        register("in_place_change_refused", in_place_change_refused)
    elif world in ("1", "3"):
        for stage in range(4):
            for offload in (False, "cpu", "disk"):
                for kind in ("gpt2", "mlp"):
                    register(f"{kind}_s{stage}_{offload or 'device'}", parity, kind=kind,
                             stage=stage, offload=offload)


_register(os.environ.get("WORLD_SIZE"))
