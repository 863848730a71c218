"""Optimizers of any shape through the engine: empty param groups (first, last, all but one),
groups added after wrapping, a trainable parameter in no group, and such optimizers through a
checkpoint resumed at another world size.

Run by tests/quick/test_optimizer_groups.py at N=1 and N=2 (one process group each, see
tests/support/harness.py). The reference is plain torch: the same model and optimizer class in
one process on the global batch, with torch's fused AdamW kernel, the one the engine's inner
optimizer picks for fp32 (``optim/inner.py``), so that at N=1 the arithmetic is the same
and the weights must be bit-equal.
"""

from __future__ import annotations

import copy
import os
import shutil
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

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
STAGES: dict[int, dict[str, Any]] = {
    0: {"stage": 0}, 1: {"stage": 1}, 2: {"stage": 2, "bucket_numel": 200},
    # one unit per parameter, none kept whole: stage 3 really shards every group's parameters
    3: {"stage": 3, "unit_numel": 1, "param_persistence_threshold": 0},
}
KERNEL_KEYS = {"fused", "foreach", "capturable", "differentiable"}  # the kernel, not the math
Groups = Callable[[nn.Module], list[dict[str, Any]]]


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(weights, biases and the position vector): a decay / no-decay split."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if n.endswith("bias") or n.startswith("pos.")]
    return [p for _, p in named if all(p is not q for q in no_decay)], no_decay


SHAPES: dict[str, Groups] = {
    # Trainer's layout when only no-decay parameters train: its decay group is empty
    "first_empty": lambda m: [{"params": [], "weight_decay": 0.3},
                              {"params": _split(m)[0] + _split(m)[1], "weight_decay": 0.0}],
    "last_empty": lambda m: [{"params": _split(m)[0], "weight_decay": 0.1},
                             {"params": _split(m)[1], "weight_decay": 0.0},
                             {"params": [], "lr": 0.5}],
    "all_but_one": lambda m: [{"params": []}, {"params": [], "lr": 0.5},
                              {"params": _split(m)[0] + _split(m)[1], "lr": 0.01},
                              {"params": [], "weight_decay": 0.9}],
}


def adamw(groups: list[dict[str, Any]], reference: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=0.02, fused=True if reference else None)


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """One lambda per group, a different one each: a list that lines up only if every group,
    empty ones included, keeps its position."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda k, g=g: 0.8 ** (k * (g + 1)) for g in range(len(opt.param_groups))])


def ref_step(ref: nn.Module, opt: torch.optim.Optimizer | list[torch.optim.Optimizer],
             data: list[dict]) -> None:
    (sum(loss_plain(ref, ref, b) for b in data) / len(data)).backward()
    for each in opt if isinstance(opt, list) else [opt]:
        each.step()
        each.zero_grad(set_to_none=True)


def engine_step(engine: zs.ZeroEngine, data: list[dict]) -> None:
    engine.backward(loss_plain(engine, engine.module, data[dist.get_rank()]))
    engine.step()


def groups_of(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A state dict's groups without the kernel choice (the reference asks for fused)."""
    return [{k: v for k, v in g.items() if k not in KERNEL_KEYS}
            for g in opt.state_dict()["param_groups"]]


def compare(engine: zs.ZeroEngine, ref: nn.Module, ref_opt: torch.optim.Optimizer,
            initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The engine against the reference; ``moved``: how far the reference's weights went from
    ``initial`` (a parity of untrained weights would be vacuous)."""
    ours, theirs = engine.full_state_dict(), ref.state_dict()
    mine, plain = engine.user_optimizer.state_dict(), ref_opt.state_dict()
    return {"bit_equal": all(torch.equal(ours[k], v) for k, v in theirs.items()),
            "rel": rel_diff(ours, theirs),
            "moved": max((theirs[k] - v).abs().max().item() for k, v in initial.items()),
            "groups_equal": groups_of(engine.user_optimizer) == groups_of(ref_opt),
            "state_indices_equal": sorted(mine["state"]) == sorted(plain["state"]),
            "user_groups": [len(g["params"]) for g in engine.user_optimizer.param_groups]}


# ---------------------------------------------------------------- empty groups anywhere
def empty_groups(stage: int, shape: str) -> dict[str, Any]:
    """3 steps with a per-group LambdaLR, against plain torch."""
    torch.manual_seed(0)
    ref = Net()
    initial = copy.deepcopy(ref.state_dict())
    model = copy.deepcopy(ref)
    ref_opt = adamw(SHAPES[shape](ref), reference=True)
    engine = zs.ZeroEngine(model, adamw(SHAPES[shape](model), reference=False),
                           zs.ZeroConfig(**STAGES[stage]))
    scheds = [schedule(ref_opt), schedule(engine.user_optimizer)]
    gen = torch.Generator().manual_seed(3)
    lrs: list[list[list[float]]] = [[], []]
    for _ in range(3):
        data = batches(gen, WORLD)
        ref_step(ref, ref_opt, data)
        engine_step(engine, data)
        for k, (sched, opt) in enumerate(zip(scheds, (ref_opt, engine.user_optimizer))):
            sched.step()
            lrs[k].append([g["lr"] for g in opt.param_groups])
    return {**compare(engine, ref, ref_opt, initial), "lrs_equal": lrs[0] == lrs[1]}


# ---------------------------------------------------------------- groups added after wrapping
def late_groups(stage: int) -> dict[str, Any]:
    """``head`` and ``mix`` frozen at first, the optimizer's first group empty. After 2 steps
    an empty group is added; after 2 more, ``head`` is unfrozen and added as a group of its
    own while ``mix`` is unfrozen but left out of every group, which torch's step never
    touches; 2 more steps."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    initial = copy.deepcopy(ref.state_dict())

    def build(m: nn.Module, reference: bool) -> torch.optim.Optimizer:
        m.head.requires_grad_(False)
        m.mix.requires_grad_(False)
        return adamw([{"params": []},
                      {"params": [p for p in m.parameters() if p.requires_grad]}], reference)

    ref_opt = build(ref, True)
    engine = zs.ZeroEngine(model, build(model, False), zs.ZeroConfig(**STAGES[stage]))
    pairs = [(ref, ref_opt), (model, engine.user_optimizer)]
    gen = torch.Generator().manual_seed(4)

    def train(steps: int) -> None:
        for _ in range(steps):
            data = batches(gen, WORLD)
            ref_step(ref, ref_opt, data)
            engine_step(engine, data)

    train(2)
    for _, opt in pairs:
        opt.add_param_group({"params": [], "lr": 0.5, "weight_decay": 0.7})
    train(2)
    for m, opt in pairs:
        m.head.requires_grad_(True)
        m.mix.requires_grad_(True)
        opt.add_param_group({"params": list(m.head.parameters()), "lr": 0.05})
    train(2)
    out = compare(engine, ref, ref_opt, initial)
    final = engine.full_state_dict()
    out["mix_untouched"] = torch.equal(final["mix.weight"], initial["mix.weight"])
    out["head_moved"] = (final["head.weight"] - initial["head.weight"]).abs().max().item()
    return out


def last_of_two_grows(stage: int) -> dict[str, Any]:
    """Two optimizers, SGD over ``blk`` and AdamW over the rest but ``head`` (frozen). After 2
    steps ``head`` is unfrozen and added to the AdamW, the last, as a group of its own: its
    pieces must join the AdamW's inner groups, not the SGD's; 2 more steps, against torch
    stepping both optimizers."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    initial = copy.deepcopy(ref.state_dict())

    def build(m: nn.Module, reference: bool) -> list[torch.optim.Optimizer]:
        m.head.requires_grad_(False)
        rest = [p for n, p in m.named_parameters() if p.requires_grad and not n.startswith("blk.")]
        return [torch.optim.SGD(m.blk.parameters(), lr=0.1), adamw([{"params": rest}], reference)]

    ref_opts = build(ref, True)
    opts = build(model, False)
    engine = zs.ZeroEngine(model, opts, zs.ZeroConfig(**STAGES[stage]))
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        if step == 2:
            for m, last in ((ref, ref_opts[1]), (model, opts[1])):
                m.head.requires_grad_(True)
                last.add_param_group({"params": list(m.head.parameters()), "lr": 0.05})
        data = batches(gen, WORLD)
        ref_step(ref, ref_opts, data)
        engine_step(engine, data)
    ours, theirs = engine.full_state_dict(), ref.state_dict()
    return {"bit_equal": all(torch.equal(ours[k], v) for k, v in theirs.items()),
            "rel": rel_diff(ours, theirs),
            "moved": max((theirs[k] - v).abs().max().item() for k, v in initial.items()),
            "head_moved": (ref.head.weight - initial["head.weight"]).abs().max().item()}


def grown_in_place(stage: int) -> dict[str, Any]:
    """``head`` frozen at first; after 2 steps it is unfrozen and appended to the optimizer's
    empty first group in place (``param_groups[0]["params"].extend``), which torch's step
    reads as it is: it trains with that group's hyperparameters from then on; 2 more steps."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    initial = copy.deepcopy(ref.state_dict())

    def build(m: nn.Module, reference: bool) -> torch.optim.Optimizer:
        m.head.requires_grad_(False)
        return adamw([{"params": [], "weight_decay": 0.5, "lr": 0.05},
                      {"params": [p for p in m.parameters() if p.requires_grad]}], reference)

    ref_opt = build(ref, True)
    engine = zs.ZeroEngine(model, build(model, False), zs.ZeroConfig(**STAGES[stage]))
    gen = torch.Generator().manual_seed(8)
    for step in range(4):
        if step == 2:
            for m, opt in ((ref, ref_opt), (model, engine.user_optimizer)):
                m.head.requires_grad_(True)
                opt.param_groups[0]["params"].extend(m.head.parameters())
        data = batches(gen, WORLD)
        ref_step(ref, ref_opt, data)
        engine_step(engine, data)
    out = compare(engine, ref, ref_opt, initial)
    out["head_moved"] = (ref.head.weight - initial["head.weight"]).abs().max().item()
    return out


LATE_TO_OWNERS = ("emb.weight", "blk2.lin.weight", "blk2.lin.bias", "mix.weight", "head.weight",
                  "head.bias")
"""Six parameters unfrozen after the engine is built, in model order (a refusal lists five)."""


def owner_placed(stage: int) -> dict[str, Any]:
    """Adafactor (each parameter updated whole on an owning rank) with an empty first group,
    and an empty group added after 2 steps, against torch; then a group with parameters
    added, which owners placed at construction cannot take: refused at the next forward."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    initial = copy.deepcopy(ref.state_dict())

    def build(m: nn.Module) -> torch.optim.Optimizer:
        for frozen in LATE_TO_OWNERS:  # six: the refusal lists five of them
            m.get_parameter(frozen).requires_grad_(False)
        return torch.optim.Adafactor(
            [{"params": []}, {"params": [p for p in m.parameters() if p.requires_grad]}],
            lr=0.02)

    ref_opt = build(ref)
    engine = zs.ZeroEngine(model, build(model), zs.ZeroConfig(**STAGES[stage]))
    gen = torch.Generator().manual_seed(9)
    for step in range(4):
        if step == 2:
            for opt in (ref_opt, engine.user_optimizer):
                opt.add_param_group({"params": [], "lr": 0.5})
        data = batches(gen, WORLD)
        ref_step(ref, ref_opt, data)
        engine_step(engine, data)
    out = compare(engine, ref, ref_opt, initial)
    late = [model.get_parameter(n) for n in LATE_TO_OWNERS]
    for q in late:
        q.requires_grad_(True)
    engine.user_optimizer.add_param_group({"params": late})
    try:
        engine_step(engine, batches(gen, WORLD))
        out["refused"] = "no error"
    except ValueError as e:
        out["refused"] = str(e)
    return out


# ---------------------------------------------------------------- refused, clearly
def refusals(stage: int) -> dict[str, str]:
    """What torch would train differently, or what the engine cannot train, is refused with
    a message naming it; the message is returned (or "no error")."""
    config = zs.ZeroConfig(**STAGES[stage])
    out: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:  # the test checks the type and the message
            out[name] = f"{type(e).__name__}: {e}"

    torch.manual_seed(0)
    model = Net()
    attempt("all_empty", lambda: zs.ZeroEngine(
        model, adamw([{"params": []}, {"params": []}], False), config))
    attempt("left_out", lambda: zs.ZeroEngine(
        model, adamw([{"params": []}, {"params": list(model.blk.parameters())}], False), config))
    engine = zs.ZeroEngine(model, adamw([{"params": []}, {"params": list(model.parameters())}],
                                        False), config)
    engine.user_optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    gen = torch.Generator().manual_seed(1)
    attempt("foreign_added", lambda: engine_step(engine, batches(gen, WORLD)))
    # several optimizers: their groups are numbered in order, only the last may grow
    torch.manual_seed(0)
    model = Net()
    model.head.requires_grad_(False)
    sgd = torch.optim.SGD([{"params": []}, {"params": list(model.blk.parameters())}], lr=0.1)
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("blk.")]
    engine = zs.ZeroEngine(model, [sgd, adamw([{"params": rest}], False)], config)
    model.head.requires_grad_(True)
    sgd.param_groups[0]["params"].append(model.head.weight)
    attempt("first_of_two_grown", lambda: engine_step(engine, batches(gen, WORLD)))
    sgd.param_groups[0]["params"].pop()
    sgd.add_param_group({"params": [model.head.weight]})
    attempt("first_of_two_added", lambda: engine_step(engine, batches(gen, WORLD)))
    # three optimizers, six parameters unfrozen into the first two: the message lists five
    # and names the optimizer of the first it lists (emb.weight to SGD 0, the rest to SGD 1)
    torch.manual_seed(0)
    model = Net()
    late = [model.get_parameter(n) for n in LATE_TO_OWNERS]
    for q in late:
        q.requires_grad_(False)
    sgds = [torch.optim.SGD([{"params": [model.blk.lin.weight]}], lr=0.1),
            torch.optim.SGD([{"params": [model.blk.lin.bias]}], lr=0.1)]
    engine = zs.ZeroEngine(model, [*sgds, adamw([{"params": [model.pos.pos]}], False)], config)
    for q in late:
        q.requires_grad_(True)
    sgds[0].param_groups[0]["params"].append(late[0])
    sgds[1].param_groups[0]["params"].extend(late[1:])
    attempt("two_of_three_grown", lambda: engine_step(engine, batches(gen, WORLD)))
    return out


# ---------------------------------------------------------------- checkpoints
def _shared_dir(tag: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"zs-optgroups-{tag}-{WORLD}-{os.getppid()}"
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def resume_alone(stage: int, shape: str) -> dict[str, Any]:
    """Train 2 steps at N=WORLD and ``stage``, save; each rank resumes the checkpoint in an
    engine of its own (a process group of one, stage 3): the same weights, optimizer state
    and groups, bit for bit (loading copies values; no arithmetic)."""
    torch.manual_seed(0)
    model = Net()
    engine = zs.ZeroEngine(model, adamw(SHAPES[shape](model), False),
                           zs.ZeroConfig(**STAGES[stage]))
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        engine_step(engine, batches(gen, WORLD))
    for group in engine.user_optimizer.param_groups:
        group["lr"] *= 0.5  # as a scheduler would: the saved groups carry it
    path = _shared_dir(f"{stage}-{shape}")
    engine.save_checkpoint(path)
    saved, saved_opt = engine.full_state_dict(), engine.user_optimizer.state_dict()
    alone = [dist.new_group([r]) for r in range(WORLD)][dist.get_rank()]  # every rank makes each
    torch.manual_seed(1)
    fresh_model = Net()
    fresh = zs.ZeroEngine(fresh_model, adamw(SHAPES[shape](fresh_model), False),
                          zs.ZeroConfig(**STAGES[3]), process_group=alone)
    fresh.load_checkpoint(path)
    loaded, loaded_opt = fresh.full_state_dict(), fresh.user_optimizer.state_dict()
    return {"weights_equal": all(torch.equal(loaded[k], v) for k, v in saved.items()),
            "groups_equal": loaded_opt["param_groups"] == saved_opt["param_groups"],
            "state_equal": saved_opt["state"].keys() == loaded_opt["state"].keys() and all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(loaded_opt["state"][i][k]))
                for i, entry in saved_opt["state"].items() for k, v in entry.items()),
            "world": fresh.comm.world_size}


for _stage in STAGES:
    for _shape in SHAPES:
        register(f"empty_{_shape}_stage{_stage}", empty_groups, stage=_stage, shape=_shape)
    register(f"late_stage{_stage}", late_groups, stage=_stage)
    register(f"refusals_stage{_stage}", refusals, stage=_stage)
    register(f"grown_in_place_stage{_stage}", grown_in_place, stage=_stage)
    register(f"last_of_two_grows_stage{_stage}", last_of_two_grows, stage=_stage)
register("owner_placed_stage3", owner_placed, stage=3)
register("resume_alone_first_empty", resume_alone, stage=2, shape="first_empty")
register("resume_alone_all_but_one", resume_alone, stage=0, shape="all_but_one")
