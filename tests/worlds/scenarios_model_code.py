"""Model code as users write it, at every stage, against the same model trained on the global
batch in one process (what DDP computes; with unused parameters, what
``DDP(find_unused_parameters=True)`` computes: a gradient averaged with the zeros of ranks
that did not use the parameter, and no update for a parameter no rank used).

Run by tests/quick/test_model_code.py through tests.support.harness (one process group per
world size).
Models avoid parameters whose exact gradient is zero (no bias right before a normalisation),
so every element is compared at fp32 summation-order tolerance.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_strategy as zs
from tests.support.harness import register
from tests.support.user_models import (
    LOSSES,
    D,
    HiddenNet,
    Loss,
    Net,
    batches,
    loss_plain,
    rel_diff,
)

LAYOUTS: dict[str, dict[str, Any]] = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2, "bucket_numel": 200},
    # stage 3, the whole model one unit / every module its own unit
    "s3coarse": {"stage": 3, "unit_numel": 10**9, "param_persistence_threshold": 0},
    "s3fine": {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0},
}


def optimizer_for(model: nn.Module, params: Any = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters() if params is None else params, lr=0.02,
                             weight_decay=0.1)


def train_pair(build: Callable[[], nn.Module], loss: Loss, layout: str, steps: int = 4,
               before_step: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
               select: Callable[[nn.Module], Any] | None = None,
               after_wrap: Callable[[zs.ZeroEngine, nn.Module], None] | None = None,
               wrap: Callable[[nn.Module], nn.Module] | None = None,
               **config: Any) -> dict[str, Any]:
    """Train the engine and the global-batch reference side by side; compare every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = optimizer_for(ref, select(ref) if select else None)
    target = wrap(model) if wrap is not None else model  # e.g. torch.compile(model)
    opt = optimizer_for(target, select(model) if select else None)
    engine = zs.ZeroEngine(target, opt, zs.ZeroConfig(**LAYOUTS[layout], **config))
    if after_wrap is not None:
        after_wrap(engine, model)
        after_wrap(None, ref)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(77)
    out: dict[str, Any] = {"loss": [], "ref_loss": []}
    for step in range(steps):
        data = batches(gen, world)
        if before_step is not None:
            before_step(step, ref, ref_opt)
            before_step(step, model, opt)
        ref_losses = [loss(ref, ref, b) for b in data]
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        value = loss(engine, model, data[rank])
        engine.backward(value)
        engine.step()
        out["loss"].append(value.item())
        out["ref_loss"].append(ref_losses[rank].item())
    full = {k.removeprefix("_orig_mod."): v for k, v in engine.full_state_dict().items()}
    ref_sd = ref.state_dict()
    out["rel"] = rel_diff(full, ref_sd)
    out["moved"] = max((ref_sd[k] - initial[k]).abs().max().item() for k in ref_sd)
    out["engine"] = engine
    return out


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if k != "engine"}


def parity(loss: str, layout: str) -> dict[str, Any]:
    return summary(train_pair(HiddenNet if loss == "tied_head" else Net, LOSSES[loss], layout))


def close_unwraps(layout: str) -> dict[str, Any]:
    """After close() the plain module holds the trained weights and runs."""
    out = train_pair(Net, loss_plain, layout, steps=3)
    engine = out.pop("engine")
    full = engine.full_state_dict()
    module = engine.close()
    plain = {k: v.detach().clone() for k, v in module.state_dict().items()}
    ids = torch.arange(10).view(2, 5)
    with torch.no_grad():
        logits = module(ids)
    out["close_equal"] = all(torch.equal(plain[k], full[k]) for k in full)
    out["close_plain_class"] = type(module.blk).__mro__[1] is nn.Module
    out["close_runs"] = bool(torch.isfinite(logits).all()) and tuple(logits.shape) == (2, 3)
    out["close_no_hooks"] = not any(p._post_accumulate_grad_hooks for p in module.parameters())
    # Nothing sharded is left to write or to load into: both refuse instead of writing a
    # checkpoint with no parameters in it (or loading into units that are gone).
    refusals = []
    with tempfile.TemporaryDirectory() as directory:
        for call in (engine.save_checkpoint, engine.load_checkpoint):
            try:
                call(directory)
                refusals.append("no error")
            except RuntimeError as e:
                refusals.append(str(e))
    out["close_refusals"] = refusals
    return out


def load_and_convert(layout: str) -> dict[str, Any]:
    """model.load_state_dict(pretrained) after wrapping trains like the reference loaded with
    the same weights; .to(bfloat16) / .half() after wrapping are refused, changing nothing."""
    torch.manual_seed(123)
    pretrained = Net().state_dict()
    messages: dict[str, str] = {}

    def after_wrap(engine: zs.ZeroEngine | None, model: nn.Module) -> None:
        model.load_state_dict(pretrained)
        if engine is None:
            return
        for name, convert in (("bf16", lambda m: m.to(torch.bfloat16)),
                              ("half", lambda m: m.blk.half()),
                              ("to_empty", lambda m: m.to_empty(device="cpu"))):
            try:
                convert(model)
                messages[name] = "no error"
            except RuntimeError as e:
                messages[name] = str(e)

    out = summary(train_pair(Net, loss_plain, layout, after_wrap=after_wrap))
    out["messages"] = messages
    return out


def gathered_edit(layout: str) -> dict[str, Any]:
    """Edits inside gathered_parameters(writable=True) and engine.load_state_dict reach the
    masters: training continues exactly like the reference with the same edits."""
    torch.manual_seed(5)
    new_head = nn.Linear(D, 3).state_dict()

    def before_step(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        engine = ENGINES.get(id(model))
        if step == 1:
            ctx = engine.gathered_parameters(model.blk, writable=True) if engine else _null()
            with ctx, torch.no_grad():
                model.blk.lin.weight.mul_(0.5)
        if step == 2:
            full = {**{k: v for k, v in model.state_dict(keep_vars=True).items()}}
            if engine is not None:
                full = engine.full_state_dict()
            full = {**full, "head.weight": new_head["weight"], "head.bias": new_head["bias"]}
            if engine is not None:
                engine.load_state_dict(full)
            else:
                model.load_state_dict(full)

    def after_wrap(engine: zs.ZeroEngine | None, model: nn.Module) -> None:
        if engine is not None:
            ENGINES[id(model)] = engine

    out = summary(train_pair(Net, loss_plain, layout, before_step=before_step,
                             after_wrap=after_wrap))
    ENGINES.clear()
    return out


ENGINES: dict[int, zs.ZeroEngine] = {}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def read_only_edit_refused(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    engine = zs.ZeroEngine(model, optimizer_for(model), zs.ZeroConfig(**LAYOUTS[layout]))
    before = engine.full_state_dict()
    try:
        with engine.gathered_parameters(model.blk), torch.no_grad():
            model.blk.lin.weight.add_(1.0)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    after = engine.full_state_dict()
    with engine.gathered_parameters():
        whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        model.state_dict()
        sd_message = "no error"
    except RuntimeError as e:
        sd_message = str(e)
    return {"message": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "gathered_sd_equal": all(torch.equal(whole[k], after[k]) for k in after),
            "state_dict_message": sd_message}


# ---------------------------------------------------------------- torch.compile
def compiled(when: str, layout: str) -> dict[str, Any]:
    """torch.compile before wrapping (the engine wraps the OptimizedModule) or after
    (``module.compile()`` in place). Inductor at stage 3, where the gathers break the graph
    into eagerly run pieces; aot_eager below (inductor's C++ build would dominate the suite)."""
    backend = "inductor" if layout.startswith("s3") else "aot_eager"

    def after_wrap(engine: zs.ZeroEngine | None, model: nn.Module) -> None:
        if engine is not None and when == "after":
            model.compile(backend=backend)

    def wrap(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend=backend) if when == "before" else model

    return summary(train_pair(Net, loss_plain, layout, steps=3, after_wrap=after_wrap,
                              wrap=wrap))


# ---------------------------------------------------------------- trainability changes
def toggle(kind: str) -> Callable[[int, nn.Module, torch.optim.Optimizer], None]:
    def before_step(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if kind == "freeze_at_2" and step == 2:
            model.blk.requires_grad_(False)
        elif kind == "every_step":
            model.blk2.requires_grad_(step % 2 == 0)
        elif kind == "unfreeze_add_group" and step == 2:
            model.blk.requires_grad_(True)
            opt.add_param_group({"params": list(model.blk.parameters()), "lr": 0.05})
        elif kind == "unfreeze_no_group" and step == 2:
            model.blk.requires_grad_(True)
        elif kind == "unfreeze_part_in_group" and step == 2:  # the bias trains in no group
            model.blk.requires_grad_(True)
            opt.add_param_group({"params": [model.blk.lin.weight], "lr": 0.05})
    return before_step


def trainability(kind: str, layout: str) -> dict[str, Any]:
    frozen_at_start = kind.startswith("unfreeze")

    def build() -> nn.Module:
        model = Net()
        if frozen_at_start:
            model.blk.requires_grad_(False)
        return model

    def select(model: nn.Module) -> Any:  # frozen-at-construction layers stay out
        return [p for p in model.parameters() if p.requires_grad]

    out = train_pair(build, loss_plain, layout, steps=5, before_step=toggle(kind),
                     select=select if frozen_at_start else None)
    engine = out.pop("engine")
    out["blk_grad_none"] = all(p.grad is None for p in engine.module.blk.parameters())
    # close() gives back every parameter, those taken over after wrapping too
    full = engine.full_state_dict()
    closed = engine.close().state_dict()
    out["close_equal"] = sorted(closed) == sorted(full) and all(
        torch.equal(closed[k], v) and closed[k].dtype == v.dtype for k, v in full.items())
    return out


def stray_grad(layout: str) -> dict[str, Any]:
    """A .grad that did not come through engine.backward() is refused, not ignored."""
    torch.manual_seed(0)
    model = Net()
    engine = zs.ZeroEngine(model, optimizer_for(model), zs.ZeroConfig(**LAYOUTS[layout]))
    data = batches(torch.Generator().manual_seed(1), dist.get_world_size())[dist.get_rank()]
    engine.backward(loss_plain(engine, model, data))
    model.head.bias.grad = torch.ones(3)
    try:
        engine.step()
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    engine.zero_grad()
    engine.backward(loss_plain(engine, model, data))
    return {"message": message, "then_steps": engine.step()}


# ---------------------------------------------------------------- dtypes
class OddDtypes(nn.Module):
    def __init__(self, complex_param: bool = False, fp64: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 3)
        self.register_buffer("steps", torch.tensor([3, -7, 2**40], dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.codes = nn.Parameter(torch.tensor([1, 5, 9], dtype=torch.int32),
                                  requires_grad=False)
        if complex_param:
            self.z = nn.Parameter(torch.randn(D, dtype=torch.complex64))
        if fp64:
            self.w64 = nn.Parameter(torch.randn(D, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def dtypes(layout: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kwargs in (("complex", {"complex_param": True}), ("fp64", {"fp64": True})):
        model = OddDtypes(**kwargs)
        try:
            zs.ZeroEngine(model, optimizer_for(model, [p for p in model.parameters()
                                                       if p.requires_grad]),
                          zs.ZeroConfig(**LAYOUTS[layout]))
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    torch.manual_seed(0)
    model = OddDtypes()
    exact = {k: v.clone() for k, v in model.state_dict().items() if not v.is_floating_point()}
    engine = zs.ZeroEngine(model, optimizer_for(model, [model.lin.weight, model.lin.bias]),
                           zs.ZeroConfig(**LAYOUTS[layout]))
    for _ in range(2):
        engine.backward(engine(torch.randn(4, D)).square().mean())
        engine.step()
    full = engine.full_state_dict()
    out["exact"] = all(torch.equal(full[k], v) and full[k].dtype == v.dtype
                       for k, v in exact.items())
    return out


# ---------------------------------------------------------------- mixture of experts
class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing; an expert that receives no token is not called (its parameters get no
    gradient on that rank)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        choice = self.gate(h).argmax(-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return h + out + 0.01 * self.gate(h).sum(-1, keepdim=True)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, D)
        self.moe = MoE()
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.emb(ids).mean(1)))


def moe(layout: str, leaf: bool = False) -> dict[str, Any]:
    extra = {"unit_leaf_classes": ["MoE"]} if leaf else {}
    try:
        out = summary(train_pair(MoENet, loss_plain, layout, steps=6, **extra))
    except RuntimeError as e:
        return {"error_text": str(e)}
    return out


class _Wider(nn.Module):
    """A linear layer whose unit is larger than a plain one (an extra, used, vector)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.extra = nn.Parameter(torch.zeros(5 * D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + self.extra[:D]


class RankOrdered(nn.Module):
    """Two layers that rank 0 runs in one order and the others in the other (while
    ``swapped``): of one size, every gather pairs a different unit across ranks with a shard
    of the same size, so nothing but the gather-order check can tell; ``uneven``, the units
    differ in size (gloo aborts a process that receives a message longer than its buffer)."""

    def __init__(self, uneven: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = _Wider() if uneven else nn.Linear(D, D)
        self.swapped = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        swap = self.swapped and dist.get_rank() != 0
        first, second = (self.b, self.a) if swap else (self.a, self.b)
        return second(torch.tanh(first(h)))


def swapped_gather_order(mode: str) -> dict[str, Any]:
    """Stage 3, every module its own unit: the check must raise before the step, whether
    it reads each gather's header before the gather is waited for (CPU), blocks before each
    gather ("blocking") or is read at the end of backward (as on a GPU, "deferred"). After
    ``zero_grad()`` the ranks' exchanges are matched again: a pass in one order trains as
    one process does."""
    torch.manual_seed(0)
    model = RankOrdered(uneven=mode == "uneven")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = {**LAYOUTS["s3fine"], **({"check_gather_order": "blocking"}
                                       if mode == "blocking" else {})}
    engine = zs.ZeroEngine(model, optimizer_for(model), zs.ZeroConfig(**config))
    engine.runtime.gather_check.deferred = mode == "deferred"
    error = None
    try:
        engine.backward(engine(torch.randn(4, D)).square().mean())
        engine.step()
    except zs.GatherOrderError as e:
        error = str(e)
    engine.zero_grad()
    after = engine.full_state_dict()
    model.swapped = False  # every rank in one order now, on the same batch
    reference = RankOrdered(uneven=mode == "uneven")
    reference.load_state_dict(before)
    reference.swapped = False
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(3))
    for trainee, opt in ((engine, None), (reference, optimizer_for(reference))):
        loss = trainee(x).square().mean()
        if opt is None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
    trained, expected = engine.full_state_dict(), reference.state_dict()
    return {"raised": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "then_trains": max((trained[k] - v).abs().max().item() for k, v in expected.items())}


# ---------------------------------------------------------------- buffers and late parameters
class NormNet(nn.Module):
    """BatchNorm's running statistics, buffers each rank updates from its own batch; and
    ``extra``, frozen at construction, whose loss term is its own, so that adopting it later
    changes no other parameter's gradient (the DDP reference never trains it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, D)
        self.lin = nn.Linear(D, D, bias=False)  # a bias before BatchNorm gets exactly zero
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, 3)
        self.extra = nn.Parameter(torch.zeros(3), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(torch.relu(self.bn(self.lin(self.emb(ids).mean(1))))), self.extra * 1.0


def _norm_loss(call: Any, b: dict) -> torch.Tensor:
    logits, extra = call(b["ids"])
    return torch.nn.functional.cross_entropy(logits, b["y"]) + (extra - 1).square().sum()


def _ddp_run(broadcast: bool, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = NormNet()
    ddp = DDP(model, broadcast_buffers=broadcast)
    opt = optimizer_for(model, [p for p in model.parameters() if p.requires_grad])
    gen = torch.Generator().manual_seed(77)
    for _ in range(steps):
        _norm_loss(ddp, batches(gen, dist.get_world_size())[dist.get_rank()]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def buffers(layout: str, broadcast: bool, steps: int = 3) -> dict[str, Any]:
    """Each rank's buffers and the weights against DDP's with the same ``broadcast_buffers``
    (broadcast from rank 0 before every forward, or each rank's own), with ``extra`` joining
    the optimizer after the first step (``add_param_group``): the buffers are still
    broadcast after the engine took a parameter over."""
    torch.manual_seed(0)
    model = NormNet()
    opt = optimizer_for(model, [p for p in model.parameters() if p.requires_grad])
    engine = zs.ZeroEngine(model, opt, zs.ZeroConfig(**LAYOUTS[layout],
                                                     broadcast_buffers=broadcast))
    gen = torch.Generator().manual_seed(77)
    for step in range(steps):
        if step == 1:
            model.extra.requires_grad_(True)
            opt.add_param_group({"params": [model.extra]})
        engine.backward(_norm_loss(engine, batches(gen, dist.get_world_size())[dist.get_rank()]))
        engine.step()
    full = engine.full_state_dict()
    own, other = _ddp_run(broadcast, steps), _ddp_run(not broadcast, steps)
    names = [n for n, _ in own.named_buffers()]
    ours = {n: b.clone() for n, b in model.named_buffers()}
    return {
        "buffers_rel": rel_diff({n: ours[n].float() for n in names},
                                {n: b.float() for n, b in own.named_buffers()}),
        # on rank 0 the two settings agree (it is the source); elsewhere they must differ,
        # or this scenario could not tell them apart
        "flag_gap": rel_diff({n: b.float() for n, b in own.named_buffers()},
                             {n: b.float() for n, b in other.named_buffers()}),
        "weights_rel": rel_diff({k: v for k, v in full.items() if k != "extra"},
                                {n: p.detach() for n, p in own.named_parameters()
                                 if n != "extra"}),
        "extra": full["extra"].tolist(),
    }


def adoption_refusals(layout: str) -> dict[str, Any]:
    """``add_param_group`` while gradients wait (accumulated under ``no_sync()``, or reduced
    for a step not yet taken), and over parameters that already hold a ``.grad``: the next
    forward refuses by name; ``zero_grad()`` (or clearing the ``.grad``) lets training on."""
    torch.manual_seed(0)
    model = Net()
    model.blk.requires_grad_(False)
    opt = optimizer_for(model, [p for p in model.parameters() if p.requires_grad])
    engine = zs.ZeroEngine(model, opt, zs.ZeroConfig(**LAYOUTS[layout]))
    data = batches(torch.Generator().manual_seed(1), dist.get_world_size())[dist.get_rank()]
    out: dict[str, Any] = {}

    def forward_after_adding(name: str) -> None:
        try:
            engine(data["ids"])
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)

    with engine.no_sync():
        engine.backward(loss_plain(engine, model, data))
    model.blk.requires_grad_(True)
    opt.add_param_group({"params": [model.blk.lin.weight]})
    forward_after_adding("accumulating")
    forward_after_adding("accumulating_again")  # still pending: refused again, not adopted
    engine.zero_grad()
    engine.backward(loss_plain(engine, model, data))
    out["adopted_steps"] = engine.step()
    engine.backward(loss_plain(engine, model, data))
    opt.add_param_group({"params": [model.blk.lin.bias]})
    forward_after_adding("reduced")
    engine.step()
    model.blk.lin.bias.grad = torch.ones_like(model.blk.lin.bias)
    forward_after_adding("stale")
    model.blk.lin.bias.grad = None
    engine.backward(loss_plain(engine, model, data))
    out["then_steps"] = engine.step()
    return out


# torch.compile costs seconds a scenario on 2 cores (inductor), so its scenarios make a world
# of their own (tests/integration/test_model_code_compiled.py), chosen by ZS_COMPILED=1.
_COMPILED_WORLD = __import__("os").environ.get("ZS_COMPILED") == "1"
if not _COMPILED_WORLD:
    for _mode in ("headers", "uneven", "blocking", "deferred"):
        register(f"swapped_order_{_mode}", swapped_gather_order, mode=_mode)
for _layout in LAYOUTS if not _COMPILED_WORLD else ():
    for _loss in LOSSES:
        register(f"parity_{_loss}_{_layout}", parity, loss=_loss, layout=_layout)
    register(f"close_{_layout}", close_unwraps, layout=_layout)
    register(f"load_convert_{_layout}", load_and_convert, layout=_layout)
    register(f"gathered_edit_{_layout}", gathered_edit, layout=_layout)
    register(f"read_only_{_layout}", read_only_edit_refused, layout=_layout)
    for _kind in ("freeze_at_2", "every_step", "unfreeze_add_group", "unfreeze_no_group",
                  "unfreeze_part_in_group"):
        register(f"trainability_{_kind}_{_layout}", trainability, kind=_kind, layout=_layout)
    register(f"dtypes_{_layout}", dtypes, layout=_layout)
    register(f"stray_grad_{_layout}", stray_grad, layout=_layout)
    register(f"moe_{_layout}", moe, layout=_layout)
    for _broadcast in (True, False):
        register(f"buffers_{_broadcast}_{_layout}", buffers, layout=_layout,
                 broadcast=_broadcast)
    register(f"adoption_refusals_{_layout}", adoption_refusals, layout=_layout)
if not _COMPILED_WORLD:
    register("moe_s3fine_leaf", moe, layout="s3fine", leaf=True)
for _layout in ("s0", "s2", "s3coarse", "s3fine") if _COMPILED_WORLD else ():
    for _when in ("before", "after"):
        register(f"compiled_{_when}_{_layout}", compiled, when=_when, layout=_layout)
