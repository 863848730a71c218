"""The optimizer contract: the user's optimizer state_dict in torch's format, resume with LR
schedulers, recovery after exceptions, non-finite gradients, optimizers refused.

Run by tests/quick/test_optimizer_contract.py through tests.support.harness (one process group per
world size). The reference is the same model trained on the global batch in one process (what DDP
computes), as in tests/worlds/scenarios_model_code.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import zero_strategy as zs
from tests.support.harness import register
from tests.support.user_models import Net, batches, loss_plain, rel_diff

LAYOUTS: dict[str, dict[str, Any]] = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2, "bucket_numel": 200},
    "s2off": {"stage": 2, "bucket_numel": 200, "offload_optimizer": True},
    "s3": {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0},
    "s3off": {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0,
              "offload_optimizer": True, "offload_params": True},
    "s3nopf": {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0,
               "prefetch": False},
}
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def engine_for(model: nn.Module, layout: str, opt: torch.optim.Optimizer | None = None,
               **extra: Any) -> zs.ZeroEngine:
    return zs.ZeroEngine(model, opt or adamw(model), zs.ZeroConfig(**LAYOUTS[layout], **extra))


def ref_step(ref: nn.Module, opt: torch.optim.Optimizer, data: list[dict]) -> None:
    (sum(loss_plain(ref, ref, b) for b in data) / len(data)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def engine_step(engine: zs.ZeroEngine, data: list[dict]) -> float:
    loss = loss_plain(engine, engine.module, data[dist.get_rank()])
    engine.backward(loss)
    engine.step()
    return loss.item()


def state_rel(a: dict, b: dict) -> float:
    """Largest relative difference over every tensor of two torch optimizer state dicts."""
    worst = 0.0
    for index, entry in b["state"].items():
        for key, value in entry.items():
            other = a["state"][index][key]
            scale = value.double().abs().max().clamp_min(1e-12)
            worst = max(worst, ((other.double() - value.double()).abs().max() / scale).item())
    return worst


# ---------------------------------------------------------------- 1. state_dict, torch's format
def state_dict_round_trip(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt, engine = adamw(ref), engine_for(model, layout)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        data = batches(gen, WORLD)
        ref_step(ref, ref_opt, data)
        engine_step(engine, data)
    ours, theirs = engine.user_optimizer.state_dict(), ref_opt.state_dict()
    out: dict[str, Any] = {
        "same_indices": sorted(ours["state"]) == sorted(theirs["state"]),
        "same_keys": all(sorted(ours["state"][i]) == sorted(theirs["state"][i])
                         for i in theirs["state"]),
        "same_shapes": all(ours["state"][i][k].shape == v.shape
                           for i, e in theirs["state"].items() for k, v in e.items()),
        "groups": ours["param_groups"] == theirs["param_groups"],
        "rel": state_rel(ours, theirs),
        "user_state_empty": len(engine.user_optimizer.state) == 0,
    }
    # A fresh engine loads the unsharded run's optimizer (and weights): both continue alike.
    fresh_model = Net()
    fresh = engine_for(fresh_model, layout)
    fresh.load_state_dict(ref.state_dict())
    fresh.user_optimizer.load_state_dict(ref_opt.state_dict())
    reloaded = fresh.user_optimizer.state_dict()
    out["reload_rel"] = state_rel(reloaded, theirs)
    for _ in range(2):
        data = batches(gen, WORLD)
        ref_step(ref, ref_opt, data)
        engine_step(fresh, data)
    out["continue_rel"] = rel_diff(fresh.full_state_dict(), ref.state_dict())
    try:
        fresh.user_optimizer.load_state_dict({"state": {}, "param_groups": []})
        out["bad_message"] = "no error"
    except ValueError as e:
        out["bad_message"] = str(e)
    return out


# ---------------------------------------------------------------- 2. resume with schedulers
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.9**k),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
}


def _train(engine: zs.ZeroEngine, sched: Any, data: list[list[dict]]) -> tuple[list, list]:
    losses, lrs = [], []
    for step_data in data:
        lrs.append(engine.user_optimizer.param_groups[0]["lr"])
        losses.append(engine_step(engine, step_data))
        sched.step()
    return losses, lrs


def scheduler_resume(schedule: str, source: str, target: str) -> dict[str, Any]:
    """6 steps straight in ``target`` vs 3 in ``source``, save, a fresh ``target`` engine (and
    scheduler) loads, 3 more."""
    gen = torch.Generator().manual_seed(11)
    data = [batches(gen, WORLD) for _ in range(6)]

    def fresh(layout: str) -> tuple[zs.ZeroEngine, Any]:
        torch.manual_seed(0)
        model = Net()
        engine = engine_for(model, layout)
        return engine, SCHEDULES[schedule](engine.user_optimizer)

    straight, sched = fresh(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, lrs = _train(straight, sched, data)
    # torch's schedulers warn when the optimizer they wrap was never stepped: the engine
    # steps its inner copy, so it records the call on the user's optimizer (step.py)
    order = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    first, sched1 = fresh(source)
    _train(first, sched1, data[:3])
    path = Path(tempfile.gettempdir()) / f"zs-sched-{schedule}-{source}-{target}-{WORLD}"
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    first.save_checkpoint(path, client_state={"scheduler": sched1.state_dict()})
    second, sched2 = fresh(target)
    client = second.load_checkpoint(path)
    sched2.load_state_dict(client["scheduler"])
    resumed_losses, resumed_lrs = _train(second, sched2, data[3:])
    a, b = straight.full_state_dict(), second.full_state_dict()
    return {"lrs": lrs[3:], "resumed_lrs": resumed_lrs, "losses": losses[3:],
            "resumed_losses": resumed_losses,
            "bit_exact": all(torch.equal(a[k], b[k]) for k in a), "rel": rel_diff(b, a),
            "order_warnings": order}


# ---------------------------------------------------------------- 3. exceptions mid-step
class Boom(RuntimeError):
    pass


class Fragile(Net):
    """Net with switches that raise in forward (between two units) or in backward."""

    fail_forward = False
    fail_backward = False

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blk(self.emb(ids).mean(1) + self.pos())
        if self.fail_forward:
            raise Boom("forward")
        if self.fail_backward and h.requires_grad:
            h.register_hook(_raise_in_backward)
        h = self.blk2(h)
        return h + 0.5 * torch.tanh(F.linear(h, self.mix.weight))


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise Boom("backward")


def recovery(layout: str, where: str) -> dict[str, Any]:
    """Step 2's micro-batch raises (forward, backward or step) on every rank; after
    zero_grad() training continues like a reference that never saw that micro-batch."""
    torch.manual_seed(0)
    ref = Net()
    model = Fragile()
    model.load_state_dict(ref.state_dict())
    ref_opt, engine = adamw(ref), engine_for(model, layout)
    gen = torch.Generator().manual_seed(5)
    raised = []
    for step in range(5):
        data = batches(gen, WORLD)
        if step == 2:
            try:
                _fail_once(engine, model, data, where)
            except Boom as e:
                raised.append(str(e))
            engine.zero_grad()
            continue  # the reference skips this micro-batch
        ref_step(ref, ref_opt, data)
        engine_step(engine, data)
    return {"raised": raised, "rel": rel_diff(engine.full_state_dict(), ref.state_dict())}


def _fail_once(engine: zs.ZeroEngine, model: Fragile, data: list[dict], where: str) -> None:
    if where == "step":
        handle = engine.optimizer.parts[0].inner.register_step_pre_hook(
            lambda *a: (_ for _ in ()).throw(Boom("step")))
        try:
            engine_step(engine, data)
        finally:
            handle.remove()
        return
    setattr(model, f"fail_{where}", True)
    try:
        engine_step(engine, data)
    finally:
        setattr(model, f"fail_{where}", False)


# ---------------------------------------------------------------- 4. non-finite gradients
def nonfinite(precision: str, policy: str) -> dict[str, Any]:
    """A NaN gradient on rank 0 only, at step 1."""
    torch.manual_seed(0)
    model = Net()
    engine = zs.ZeroEngine(model, adamw(model), zs.ZeroConfig(
        stage=2, precision=precision, nonfinite_grads=policy))
    gen = torch.Generator().manual_seed(9)
    out: dict[str, Any] = {"stepped": [], "warnings": [], "message": None, "warned_at": []}
    for step in range(3):
        data = batches(gen, WORLD)
        if step == 1:
            before = engine.full_state_dict()
            states = engine.user_optimizer.state_dict()
            if dist.get_rank() == 0:
                handle = model.head.weight.register_hook(lambda g: g * float("nan"))
        loss = loss_plain(engine, model, data[dist.get_rank()])
        engine.backward(loss)
        if step == 1 and dist.get_rank() == 0:
            handle.remove()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out["stepped"].append(engine.step())
            except FloatingPointError as e:
                out["message"] = str(e)
                out["stepped"].append(None)
        out["warnings"] += [str(w.message) for w in caught]
        out["warned_at"] += [Path(w.filename).name for w in caught]  # the line that stepped
        if step == 1:
            after = engine.full_state_dict()
            out["weights_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
            out["weights_finite"] = all(bool(torch.isfinite(v).all()) for v in after.values())
            new_states = engine.user_optimizer.state_dict()
            out["states_unchanged"] = all(
                torch.equal(new_states["state"][i][k], v)
                for i, e in states["state"].items() for k, v in e.items())
    out["skipped"] = engine.skipped_steps
    return out


# ---------------------------------------------------------------- 5. where optimizers run
class ShapeReading(torch.optim.SGD):
    """A user optimizer whose step reads each parameter's norm: not elementwise."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


def placements() -> dict[str, str]:
    """Where each kind of optimizer runs: elementwise ones on shard pieces, whole-parameter
    ones (Adafactor, a user's norm-reading step) on owning ranks, LBFGS refused."""
    out = {}
    for name, make in (("adafactor", lambda m: torch.optim.Adafactor(m.parameters())),
                       ("lbfgs", lambda m: torch.optim.LBFGS(m.parameters())),
                       ("custom", lambda m: ShapeReading(m.parameters(), lr=0.1)),
                       ("adamw", adamw)):
        model = Net()
        try:
            engine = zs.ZeroEngine(model, make(model), zs.ZeroConfig(stage=2))
            out[name] = type(engine.optimizer.parts[0]).__name__
        except ValueError as e:
            out[name] = str(e)
    model = Net()
    engine = zs.ZeroEngine(model, ShapeReading(model.parameters(), lr=0.1),
                           zs.ZeroConfig(stage=2, elementwise_optimizer=True))
    out["opt_in"] = type(engine.optimizer.parts[0]).__name__
    return out


for _layout in LAYOUTS:
    register(f"state_dict_{_layout}", state_dict_round_trip, layout=_layout)
    for _where in ("forward", "backward", "step"):
        register(f"recovery_{_where}_{_layout}", recovery, layout=_layout, where=_where)
for _schedule in SCHEDULES:
    register(f"sched_{_schedule}_s2_s2", scheduler_resume, schedule=_schedule, source="s2",
             target="s2")
for _src, _dst in (("s1", "s3"), ("s3", "s2"), ("s0", "s1"), ("s3", "s3off")):
    register(f"sched_lambda_{_src}_{_dst}", scheduler_resume, schedule="lambda", source=_src,
             target=_dst)
for _precision in ("32-true", "bf16-mixed"):
    for _policy in ("skip", "error", "off"):
        register(f"nonfinite_{_precision}_{_policy}", nonfinite, precision=_precision,
                 policy=_policy)
register("placements", placements)


def clip_refusals() -> dict[str, Any]:
    """A clipping bound that clips nothing sensible (0, below, NaN) is refused by name, and
    the pass can still be clipped and stepped after the refusal."""
    torch.manual_seed(0)
    model = Net()
    engine = engine_for(model, "s2")
    data = batches(torch.Generator().manual_seed(4), WORLD)
    engine.backward(loss_plain(engine, model, data[dist.get_rank()]))
    out: dict[str, Any] = {}
    for name, call in {"norm_0": lambda: engine.clip_grad_norm_(0.0),
                       "norm_-1": lambda: engine.clip_grad_norm_(-1.0),
                       "norm_nan": lambda: engine.clip_grad_norm_(float("nan")),
                       "value_0": lambda: engine.clip_grad_value_(0.0),
                       "value_-1": lambda: engine.clip_grad_value_(-1.0)}.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    out["norm"] = float(engine.clip_grad_norm_(1.0))
    out["stepped"] = engine.step()
    return out


register("clip_refusals", clip_refusals)
