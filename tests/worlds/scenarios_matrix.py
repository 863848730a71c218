"""Matrix optimizers under every stage: Muon for the hidden matrices beside AdamW for the
rest, Adafactor, and a user's optimizer reading ``p.shape`` and a norm, placed whole on owning
ranks. Run by tests/quick/test_matrix_optimizers.py through tests.support.harness (N=2 and N=3).

The reference is the same model trained in one process on the global batch. Muon
orthogonalises in bf16, so two fp32 roundings of the same gradient can give updates that
differ in bf16's last bit; each parity scenario therefore also trains a twin reference as valid
as the first (DDP's rounding of the gradient: per-rank gradients averaged in float64; AdamW's
fused kernel, which the engine runs on shards) and reports that twin's distance from the
reference as the noise floor.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import register
from tests.support.user_models import Net, batches, loss_plain, rel_diff
from zero_strategy.core.materialize import meta_init
from zero_strategy.optim.owner import OwnerPart

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
UNITS = {"unit_numel": 1, "param_persistence_threshold": 0}
LAYOUTS: dict[str, dict[str, Any]] = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2, "bucket_numel": 200},
    "s2off": {"stage": 2, "bucket_numel": 200, "offload_optimizer": True},
    "s3": {"stage": 3, **UNITS},
    "s3off": {"stage": 3, **UNITS, "offload_optimizer": True, "offload_params": True},
}
OUTPUT = {"emb.weight", "head.weight"}  # 2-D, but not hidden matrices: AdamW trains them


class NormalizedSGD(torch.optim.Optimizer):
    """A user's optimizer that reads each parameter whole: the gradient divided by its norm,
    scaled by sqrt(rows / cols) from ``p.shape``."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                scale = (p.shape[0] / p.shape[-1]) ** 0.5
                self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
                p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"] * scale)


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n not in OUTPUT]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


# ``fused``: AdamW's fused kernel (what the engine runs on shards), for the twin reference.
OPTIMIZERS: dict[str, Callable[..., list[torch.optim.Optimizer]]] = {
    "muon": lambda m, fused=None: [
        torch.optim.Muon(split(m)[0], lr=0.02, weight_decay=0.01),
        torch.optim.AdamW(split(m)[1], lr=0.02, weight_decay=0.1, fused=fused)],
    "adafactor": lambda m, fused=None: [torch.optim.Adafactor(m.parameters(), lr=0.02)],
    "custom": lambda m, fused=None: [NormalizedSGD(split(m)[0], lr=0.05),
                                     torch.optim.AdamW(split(m)[1], lr=0.02, fused=fused)],
}


def ref_step(model: nn.Module, opts: list[torch.optim.Optimizer], data: list[dict],
             exact_sum: bool = False) -> None:
    """The global batch in one process; ``exact_sum``: each rank's gradient on its own,
    divided by the world size, summed in float64 and rounded once (what DDP averages, another
    valid fp32 rounding of the same gradient: the twin giving the noise floor)."""
    if exact_sum:
        total: dict[str, torch.Tensor] = {}
        for b in data:
            model.zero_grad(set_to_none=True)
            loss_plain(model, model, b).backward()
            for n, p in model.named_parameters():
                total[n] = total.get(n, 0) + p.grad.double() / len(data)
        for n, p in model.named_parameters():
            p.grad = total[n].float()
    else:
        (sum(loss_plain(model, model, b) for b in data) / len(data)).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def engine_step(engine: zs.ZeroEngine, data: list[dict]) -> None:
    engine.backward(loss_plain(engine, engine.module, data[RANK]))
    engine.step()


class CountNewtonSchulz:
    """Counts Muon's orthogonalisations on this rank while entered."""

    def __init__(self) -> None:
        import torch.optim._muon as muon
        self.module, self.original, self.calls = muon, muon._zeropower_via_newtonschulz, 0

    def __enter__(self) -> None:
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            return self.original(*args, **kwargs)
        self.module._zeropower_via_newtonschulz = counted

    def __exit__(self, *exc: Any) -> None:
        self.module._zeropower_via_newtonschulz = self.original


def _build(kind: str, layout: str, meta: bool) -> tuple[nn.Module, zs.ZeroEngine]:
    torch.manual_seed(0)
    if not meta:
        model = Net()
        return model, zs.ZeroEngine(model, OPTIMIZERS[kind](model),
                                    zs.ZeroConfig(**LAYOUTS[layout]))
    with meta_init("cpu", _init):
        model = Net()
    return model, zs.ZeroEngine(model, OPTIMIZERS[kind](model), zs.ZeroConfig(**LAYOUTS[layout]),
                                param_init_fn=_init)


def _init(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:  # PosEmb
        nn.init.normal_(module.pos, std=0.1)


def parity(kind: str, layout: str, meta: bool = False, steps: int = 4) -> dict[str, Any]:
    _, engine = _build(kind, layout, meta)
    ref = Net()
    ref.load_state_dict(engine.full_state_dict())  # the same values as eager init (or meta's)
    twin = copy.deepcopy(ref)
    ref_opts, twin_opts = OPTIMIZERS[kind](ref), OPTIMIZERS[kind](twin, fused=True)
    counter = CountNewtonSchulz()
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        data = batches(gen, WORLD)
        ref_step(ref, ref_opts, data)
        ref_step(twin, twin_opts, data, exact_sum=True)
        with counter:
            engine_step(engine, data)
    owners = [p for p in engine.optimizer.parts if isinstance(p, OwnerPart)]
    states = [opt.state_dict() for opt in engine.user_optimizers]  # collectives, all ranks
    return {
        "rel": rel_diff(engine.full_state_dict(), ref.state_dict()),
        "noise": rel_diff(twin.state_dict(), ref.state_dict()),
        "state_rel": max(_state_rel(ours, r.state_dict()) for ours, r in zip(states, ref_opts)),
        "ns_calls": counter.calls / steps,
        "matrices": len(split(ref)[0]) if kind == "muon" else 0,
        "owned": sorted(pl.name for part in owners for pl in part.owned),
        "owned_numel": sum(part.owned_numel() for part in owners),
        "placed": sorted(pl.name for part in owners for pl in part.placed),
        "largest": max((pl.slot.numel for part in owners for pl in part.placed), default=0),
        "placed_held": sum(t.numel() for part in owners for pl in part.owned
                           for t in [pl.handle] if t is not None),
    }


def _state_rel(ours: dict, theirs: dict) -> float:
    worst = 0.0
    assert sorted(ours["state"]) == sorted(theirs["state"]), "different parameters have state"
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                assert float(ours["state"][index][key]) == float(value), key
                continue
            other = ours["state"][index][key]
            scale = value.double().abs().max().clamp_min(1e-12)
            worst = max(worst, ((other.double() - value.double()).abs().max() / scale).item())
    return worst


# ---------------------------------------------------------------- memory of the placement
class Wide(nn.Module):
    """Large enough that alignment padding is far below 2% of the model states."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 128)
        self.hidden = nn.ModuleList(nn.Linear(128, 128) for _ in range(5))
        self.out = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.hidden:
            x = x + torch.tanh(layer(x))
        return self.out(x)


def memory(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Wide()
    mats = [layer.weight for layer in model.hidden]
    ids = {id(p) for p in mats}
    opts = [torch.optim.Muon(mats, lr=0.02),
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=0.01)]
    engine = zs.ZeroEngine(model, opts, zs.ZeroConfig(**LAYOUTS[layout]))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(RANK))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    report = engine.memory_report()
    return {"ratio": report["ratio_to_formula"], "optimizer": report["optimizer_bytes"],
            "predicted_optimizer": report["predicted_optimizer_bytes"]}


# ---------------------------------------------------------------- checkpoints
SHARED = Path(os.environ.get("ZS_MATRIX_DIR") or tempfile.gettempdir())


def _shared_dir(name: str) -> Path:
    """A directory every rank agrees on (rank 0 creates it)."""
    path = [str(Path(tempfile.mkdtemp(prefix=f"zs-{name}-")))] if RANK == 0 else [""]
    dist.broadcast_object_list(path)
    return Path(path[0])


def resume(source: str, target: str) -> dict[str, Any]:
    """3 steps under ``source``, save; a fresh ``target`` engine loads it: the whole optimizer
    state (torch's format, gathered) must be the saved one exactly, and 2 more steps must equal
    a straight run (bit for bit when source == target)."""
    gen = torch.Generator().manual_seed(9)
    data = [batches(gen, WORLD) for _ in range(5)]
    _, straight = _build("muon", source, False)
    for step_data in data:
        engine_step(straight, step_data)
    _, first = _build("muon", source, False)
    for step_data in data[:3]:
        engine_step(first, step_data)
    root = _shared_dir("matrix")
    first.save_checkpoint(root, tag="t")
    saved = [opt.state_dict() for opt in first.user_optimizers]
    _, second = _build("muon", target, False)
    second.load_checkpoint(root, tag="t")
    loaded = [opt.state_dict() for opt in second.user_optimizers]
    loaded_weights = rel_diff(second.full_state_dict(), first.full_state_dict())
    for step_data in data[3:]:
        engine_step(second, step_data)
    out = {"exact_state": all(_state_rel(a, b) == 0.0 for a, b in zip(loaded, saved)),
           "loaded_weights": loaded_weights,
           "rel": rel_diff(second.full_state_dict(), straight.full_state_dict())}
    if source == "s2" and WORLD == 2:  # handed to the N=3 world (tests/test_matrix_...)
        first.save_checkpoint(SHARED / "cross", tag="t")
        weights = first.full_state_dict()  # a collective: on every rank
        if RANK == 0:
            torch.save({"states": saved, "weights": weights}, SHARED / "cross.pt")
    return out


def cross_world() -> dict[str, Any]:
    """The N=2 stage-2 checkpoint loaded at N=3 stage 3: owners change, states must not."""
    blob = torch.load(SHARED / "cross.pt", weights_only=True)
    _, engine = _build("muon", "s3", False)
    engine.load_checkpoint(SHARED / "cross", tag="t")
    loaded = [opt.state_dict() for opt in engine.user_optimizers]
    return {"exact_state": all(_state_rel(a, b) == 0.0 for a, b in zip(loaded, blob["states"])),
            "weights": rel_diff(engine.full_state_dict(), blob["weights"])}


# ---------------------------------------------------------------- a failing owner
class FailsOnRankOne(NormalizedSGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if RANK == 1:
            raise RuntimeError("boom on rank 1")
        super().step()


def failing_owner() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    hidden, rest = split(model)
    engine = zs.ZeroEngine(model, [FailsOnRankOne(hidden, lr=0.1),
                                   torch.optim.AdamW(rest, lr=0.01)], zs.ZeroConfig(stage=2))
    before = engine.full_state_dict()
    gen = torch.Generator().manual_seed(1)
    try:
        engine_step(engine, batches(gen, WORLD))
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    engine.zero_grad()
    return {"message": message,
            "unchanged": rel_diff(engine.full_state_dict(), before) == 0.0}


def adding_groups() -> dict[str, str]:
    """Groups may be added to the last optimizer only, and not to an owner-placed one."""
    out = {}
    for name in ("first", "owner"):  # AdamW first, Muon last
        torch.manual_seed(0)
        model = Net()
        hidden, rest = split(model)
        frozen, hidden = hidden[:1], hidden[1:]
        frozen[0].requires_grad_(False)
        muon = torch.optim.Muon(hidden, lr=0.02)
        adamw = torch.optim.AdamW(rest, lr=0.01)
        engine = zs.ZeroEngine(model, [adamw, muon], zs.ZeroConfig(stage=2))
        frozen[0].requires_grad_(True)
        (adamw if name == "first" else muon).add_param_group({"params": frozen})
        try:
            engine(batches(torch.Generator().manual_seed(0), 1)[0]["ids"])
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


for _layout in LAYOUTS:
    register(f"muon_{_layout}", parity, kind="muon", layout=_layout)
register("muon_s3_meta", parity, kind="muon", layout="s3", meta=True)
for _kind, _layout in (("adafactor", "s2"), ("adafactor", "s3off"), ("custom", "s0"),
                       ("custom", "s3")):
    register(f"{_kind}_{_layout}", parity, kind=_kind, layout=_layout)
for _layout in ("s1", "s2", "s3"):
    register(f"memory_{_layout}", memory, layout=_layout)
for _src, _dst in (("s2", "s2"), ("s2", "s0"), ("s3off", "s1")):
    register(f"resume_{_src}_{_dst}", resume, source=_src, target=_dst)
if WORLD == 3:
    register("cross_world", cross_world)
register("failing_owner", failing_owner)
register("adding_groups", adding_groups)
