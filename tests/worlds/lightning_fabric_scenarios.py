"""Fabric scenarios for tests/quick/test_fabric.py, run inside tests/worlds/lightning_run.py's
processes.

Each strategy trains the same MLP on the same per-rank batches as ``Fabric(strategy="ddp")``:
accumulation 2 through ``no_backward_sync``, ``clip_gradients(max_norm=1.0)``, AdamW with a
StepLR schedule; saves with ``fabric.save`` at step K, and a fresh model/optimizer/scheduler
loaded with ``fabric.load`` continues to 2K. Then ``fabric.setup(model, muon, adamw)`` against
single-process training (tests/support/several_optimizers.py).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from tests.support import several_optimizers as so
from tests.support.hostile import forge_framework_state, forge_traversal
from tests.support.models import MLP
from zero_strategy.fabric import ZeroFabricStrategy
from zero_strategy.integrations.shared import CLIENT_KEY

K = 3
ACCUM = 2
CLIP = 1.0
TIMEOUT = timedelta(seconds=120)


def make_strategy(name: str) -> Any:
    if name == "ddp":
        return DDPStrategy(timeout=TIMEOUT)
    if name == "zero3_units":
        return ZeroFabricStrategy(stage=3, unit_numel=500, param_persistence_threshold=40,
                                  timeout=TIMEOUT)
    if name == "zero3_checkpointed":  # the MLP's blocks recomputed, their inputs on disk
        return ZeroFabricStrategy(stage=3, unit_numel=500, param_persistence_threshold=40,
                                  activation_checkpointing=True, offload_activations="disk",
                                  timeout=TIMEOUT)
    return name


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(4, 16, generator=gen), 10 * torch.randn(4, 5, generator=gen))
            for _ in range(2 * K * ACCUM)]


def build(fabric: Fabric) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt = fabric.setup(model, opt)
    return model, opt, sched


def reduce_bytes(model: Any) -> int:
    engine = getattr(model._forward_module, "engine", None)
    if engine is None:
        return 0
    snap = engine.comm_bytes()
    return int(snap.get("all_reduce", 0) + snap.get("reduce_scatter", 0))


def train(fabric: Fabric, model: Any, opt: Any, sched: Any, data: list, first: int, last: int,
          on_step: Any = None) -> dict[str, list]:
    out: dict[str, list] = {"loss": [], "norm": [], "lr": [], "reduce": []}
    for step in range(first, last):
        for micro in range(ACCUM):
            x, y = data[step * ACCUM + micro]
            before = reduce_bytes(model)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = nn.functional.mse_loss(model(x), y) / ACCUM
                fabric.backward(loss)
            out["reduce"].append(reduce_bytes(model) - before)
            out["loss"].append(float(loss))
        out["norm"].append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
        opt.step()
        opt.zero_grad()
        sched.step()
        out["lr"].append(opt.param_groups[0]["lr"])
        if on_step is not None:
            on_step(step + 1)
    return out


def weights(model: Any) -> dict[str, torch.Tensor]:
    engine = getattr(model._forward_module, "engine", None)
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    return {k: v.detach().cpu().float() for k, v in state.items()}


def run(name: str, out_dir: Path, reference: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=make_strategy(name))
    fabric.launch()
    data = batches(fabric.global_rank)
    ckpt = out_dir / f"fabric-{name}.ckpt"
    model, opt, sched = build(fabric)

    def save(step: int) -> None:
        if step == K:
            fabric.save(ckpt, {"model": model, "optimizer": opt, "scheduler": sched, "step": K})

    result: dict[str, Any] = train(fabric, model, opt, sched, data, 0, 2 * K, save)
    final = weights(model)
    result["weights"] = final
    if reference is not None:
        result["rel_vs_ddp"] = rel_diff(final, reference)
    if name != "ddp":
        model2, opt2, sched2 = build(fabric)
        state = {"model": model2, "optimizer": opt2, "scheduler": sched2}
        remainder = fabric.load(ckpt, state)
        result["remainder"] = remainder
        resumed = train(fabric, model2, opt2, sched2, data, K, 2 * K)
        result.update({f"resume_{k}": v for k, v in resumed.items()})
        result["resume_rel"] = rel_diff(weights(model2), final)
        result["is_dir"] = ckpt.is_dir()
        result["precision"] = fabric.strategy.config.precision
    if name == "zero3":
        result["hostile"] = hostile_load(fabric, ckpt, out_dir)
    return result


def hostile_load(fabric: Fabric, ckpt: Path, out_dir: Path) -> dict[str, Any]:
    """``fabric.load`` from forged copies of ``ckpt`` (a framework-state payload, a ``latest``
    leaving the directory): refused, the model unchanged, nothing run."""
    marker = out_dir / "fabric-payload.marker"
    forged = {"framework_payload": out_dir / "fabric-forged-payload.ckpt",
              "traversal": out_dir / "fabric-forged-traversal.ckpt"}
    if fabric.global_rank == 0:
        forge_framework_state(ckpt, forged["framework_payload"], marker, CLIENT_KEY)
        forge_traversal(ckpt, forged["traversal"])
    fabric.barrier()
    model, opt, sched = build(fabric)
    before = weights(model)
    result = {}
    for name, path in forged.items():
        try:
            fabric.load(path, {"model": model, "optimizer": opt, "scheduler": sched})
            error = None
        except Exception as e:  # the test asserts on the type and text
            error = f"{type(e).__name__}: {e}"
        result[name] = {"raised": error, "marker": marker.exists(),
                        "untouched": rel_diff(weights(model), before) == 0.0}
    return result


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp_min(1e-12)).item() for k in b)


def setup_several(fabric: Fabric) -> tuple[Any, Any, Any, Any]:
    model = so.build()
    muon, adamw = so.optimizers(model)
    sched = so.schedule(muon)
    model, muon, adamw = fabric.setup(model, muon, adamw)
    return model, muon, adamw, sched


def several_optimizers(out_dir: Path) -> dict[str, Any]:
    """``fabric.setup(model, muon, adamw)`` at stage 3: so.STEPS steps (both parts stepped, a
    LambdaLR on the Muon part) against single-process training; one more backward with Muon
    stepped twice (refused) and AdamW's turn; ``fabric.save`` of both before it, loaded into
    fresh objects that replay that step (AdamW first) to the same weights; a state with only
    one of the optimizers refused; a turn left over from before a no_sync backward refused."""
    strategy = ZeroFabricStrategy(stage=3, unit_numel=500, param_persistence_threshold=40,
                                  timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    data = so.rank_batches(fabric.global_rank)
    model, muon, adamw, sched = setup_several(fabric)
    lrs = []
    for batch in data:
        fabric.backward(so.loss(model, batch))
        muon.step()
        adamw.step()  # its turn: the engine stepped both at muon.step()
        muon.zero_grad()
        adamw.zero_grad()
        sched.step()
        lrs.append([muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]])
    final = weights(model)
    ref = so.reference(fabric.world_size)
    result: dict[str, Any] = {
        "rel": so.rel_diff(final, ref[-1]["weights"]), "moved": so.moved(final), "lr": lrs,
        "ref_lr": [r["lr"] for r in ref], "engine_steps": model._forward_module.engine.global_step}
    ckpt = out_dir / "fabric-several.ckpt"
    state = {"model": model, "muon": muon, "adamw": adamw, "sched": sched}
    fabric.save(ckpt, state)
    result["partial_save"] = _error(lambda: fabric.save(out_dir / "x.ckpt",
                                                        {"model": model, "muon": muon}))
    fabric.backward(so.loss(model, data[0]))
    result["double_step"] = so.double_step(lambda: (muon.step(), muon.step()))
    adamw.step()
    stepped = weights(model)
    model2, muon2, adamw2, sched2 = setup_several(fabric)
    fabric.load(ckpt, {"model": model2, "muon": muon2, "adamw": adamw2, "sched": sched2})
    result["loaded_lr"] = [muon2.param_groups[0]["lr"], adamw2.param_groups[0]["lr"]]
    result["loaded_rel"] = so.rel_diff(weights(model2), final)
    fabric.backward(so.loss(model2, data[0]))
    adamw2.step()
    muon2.step()
    result["replayed_rel"] = so.rel_diff(weights(model2), stepped)
    # A backward ends the turns of the last step: AdamW's step after a no_sync backward is the
    # engine's step without reduced gradients (refused), not a turn left from Muon's step.
    fabric.backward(so.loss(model2, data[1]))
    muon2.step()
    with fabric.no_backward_sync(model2):
        fabric.backward(so.loss(model2, data[2]))
    result["after_no_sync"] = _error(adamw2.step)
    return result


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # the test asserts on the type and text
        return f"{type(e).__name__}: {e}"
    return "no error"


def fabric_suite(results: Any, out_dir: Path, presets: tuple[str, ...],
                 extras: bool = True) -> None:
    """Registers DDP's reference and one result per strategy of ``presets`` on ``results`` (a
    lightning_run.Results); with ``extras``, several optimizers as well."""
    ref: dict[str, Any] = {}

    def reference() -> dict[str, Any]:
        result = run("ddp", out_dir, None)
        ref["weights"] = result.pop("weights")
        return result

    results.run("fabric_ddp", reference)
    for name in presets:
        def scenario(name: str = name) -> dict[str, Any]:
            result = run(name, out_dir, ref["weights"])
            result.pop("weights")
            return result

        results.run(f"fabric_{name}", scenario)
    if extras:
        results.run("fabric_several_optimizers", lambda: several_optimizers(out_dir))
        results.run("fabric_zero3_checkpointed",
                    lambda: {k: v for k, v in run("zero3_checkpointed", out_dir,
                                                  ref["weights"]).items() if k != "weights"})
