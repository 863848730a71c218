"""Differential testing over the space of models and configs: generated cases, each trained by
the engine on N ranks and by single-process training on the global batch (what DDP computes),
compared weight by weight and optimizer state by optimizer state.

A case is plain data (``generate(seed, world)``), so any case the long mode finds failing can
be kept as a regression test by pasting its dict (tests/quick/test_space.py). Run the long mode with

    python -m tests.support.space --cases 3000     # N = 1, 2, 3; prints failures as case dicts

The oracle and its noise floor. The engine computes each rank's gradient on its local batch
and averages them across ranks (in fp32, or the compute dtype), runs torch's fused kernels on
its shards, clips with a norm summed in another order: each a different but equally valid
rounding of what the one-process reference computes. How far such last-bit differences can
move the weights depends on the optimizer (Adam and its kin divide each element by its own
gradient scale, so an element whose gradient nearly cancels turns a last-bit difference into a
visible one), on the precision and on the steps, so no single tolerance fits the whole space.
Every case therefore also trains ``TWINS`` twin references that compute the same mathematics
with the engine's rounding structure (each rank's gradient apart, accumulated and averaged in
the dtype the engine reduces in) and one unit in the last place of difference wherever a
kernel may round otherwise (the reduced gradient, each step's weights and states; random
signs, a seed per twin). The engine must land within ``K_NOISE`` times the farthest twin's
distance from the reference, or within ``FLOOR`` of the master dtype. With int8 collectives
the twins also perturb every weight the forward reads, and every rank's gradient, by int8's
largest error (half a quantization step of the largest magnitude).

A parameter whose true gradient is exactly zero (the attention key bias: ``exact_zero_grads``
in tests/support/space_models.py) is left out of the comparison, by name, rather than widening the
tolerance for everything.

Refusals: a case the engine refuses passes only if the error matches a limitation listed in
``REFUSALS`` (with the reason the engine gives).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import math
import os
import random
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import zero_strategy as zs
from tests.support import space_models as sm

TWINS = 6
"""Twins per case, each rounding differently (its own random signs): the noise floor is the
farthest of them. An optimizer that follows signs (Adam, RMSprop, Adagrad) moves an element
whose effective gradient nearly cancels (weight decay against the gradient) by a full lr one
way or the other depending on the last bits; each twin lands on the engine's side of such an
element with a chance of about one half, so T twins all miss it with a chance of 2^-T (1.6%
at 6, for the few cases that hold such an element)."""
TWINS_INT8 = 10
"""Twins of a case that sends int8: each draws its own quantization errors of up to 0.4% per
element at every gather or reduction, far coarser than a last-bit rounding, and more draws
are needed to see how far such errors can carry a tensor."""
K_NOISE = 4.0
"""The engine may be this many times further from the reference than the twin is: the twin is
one valid rounding, the engine another of the same size, and the worst element of a tensor
varies with the realisation (measured ratios are reported by the long mode)."""
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}
"""Below this, relative to a tensor's largest element, any two runs agree. fp32: the tests'
usual 1e-5 (reordered fp32 sums differ by ~1e-7 of a tensor's largest element; 100x margin).
bf16/fp16 masters (``-true``): two units in the last place of the largest element (2^-8 and
2^-11 relative per ulp), since one rounding step of the master itself is that large."""
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor", "muon")
OPS = ("checkpoint", "checkpoint_other", "optim_before_wrap", "optim_after_wrap",
       "state_roundtrip", "freeze", "raise_forward", "raise_backward", "raise_step")
LOCAL_BATCH, TOKENS = 2, 5

REFUSALS: list[tuple[str, str]] = [
    # (regex the error must match, why the engine refuses)
]


# ----------------------------------------------------------------------------- generation
def generate(seed: int, world: int) -> dict[str, Any]:
    """One case of the space, drawn from ``seed`` (the same on every rank)."""
    rng = random.Random(seed * 7919 + world)
    parts = [rng.choice(sm.PARTS) for _ in range(rng.randint(1, 4))]
    model = {"seed": rng.randrange(1000), "width": rng.choice([4, 5, 6, 7, 8, 12]),
             "vocab": rng.choice([7, 11, 13, 19]), "parts": parts, "tied": rng.random() < 0.3}
    config = _config(rng, world, "experts" in parts)
    precision = config.get("precision", "32-true")
    steps = rng.randint(2, 4)
    case = {
        "seed": seed, "world": world, "model": model, "config": config,
        "optimizer": {"name": rng.choice(OPTIMIZERS), "groups": rng.choice([1, 2]),
                      "scheduler": rng.choice([None, "step", "lambda"]),
                      "only_trainable": rng.random() < 0.5},
        "steps": steps, "accum": rng.choice([1, 1, 2, 3]),
        "clip": rng.choice([None, None, 0.3, 5.0]),
        "op": None,
    }
    _activations(case, seed)
    if rng.random() < 0.5:
        op = rng.choice(OPS)
        case["op"] = {"name": op, "at": rng.randint(1, steps - 1), "pick": rng.random()}
        if op == "checkpoint_other":
            case["op"]["config"] = _config(rng, world, "experts" in parts,
                                           precision=precision)
    return case


def _activations(case: dict[str, Any], seed: int) -> None:
    """Activation checkpointing of some of the model's part classes, their inputs on the
    device, in host memory or on disk. Drawn from a generator of its own, so the draws of
    the rest of a case (and the regression cases written as dicts before it) stay as
    they were."""
    rng = random.Random(seed * 104729 + case["world"])
    if rng.random() >= 0.3:
        return
    classes = sorted({sm.PART_CLASSES[p] for p in case["model"]["parts"]})
    chosen = rng.sample(classes, rng.randint(1, len(classes)))
    case["config"]["activation_checkpointing"] = chosen
    case["config"]["offload_activations"] = rng.choice([False, False, "cpu", "disk"])


def _config(rng: random.Random, world: int, experts: bool,
            precision: str | None = None) -> dict[str, Any]:
    stage = rng.choice([0, 1, 2, 3, 3])
    c: dict[str, Any] = {"stage": stage, "timeout": 120.0}
    c["precision"] = precision or rng.choice(["32-true"] * 3 + ["bf16-mixed", "16-mixed",
                                                                  "bf16-true"])
    if c["precision"] != "32-true" and rng.random() < 0.5:
        c["reduce_dtype"] = "compute"
    if c["precision"] == "16-mixed":
        # A scale no tiny model's gradient overflows, fixed for the few steps (the oracle
        # applies the same one): dynamic scaling itself is tested in
        # tests/quick/test_precision_dist.py.
        c["loss_scale"] = {"initial_scale": 1024.0}
    c["bucket_numel"] = rng.choice([7, 64, 5_000_000])
    if stage >= 1:
        c["overlap_param_gather"] = rng.random() < 0.7
        c["offload_optimizer"] = rng.random() < 0.25
        if rng.random() < 0.25:
            c["quantize_gradients"] = "int8"
        if world > 1 and rng.random() < 0.3:
            c["shard_group_size"] = rng.choice([d for d in range(1, world + 1) if world % d == 0])
    if stage == 3:
        c["param_persistence_threshold"] = rng.choice([0, None, 10**9])
        c["unit_numel"] = rng.choice([1, None])
        c["prefetch"] = rng.random() < 0.7
        c["offload_params"] = rng.random() < 0.25
        if rng.random() < 0.25:
            c["quantize_weights"] = "int8"
        if experts:
            c["unit_leaf_classes"] = ["Experts"]
    return {k: v for k, v in c.items() if v is not None}


# ----------------------------------------------------------------------------- optimizers
def make_optimizers(case: dict[str, Any], model: nn.Module,
                    fused: bool = False) -> list[torch.optim.Optimizer]:
    """The case's optimizers over ``model``; ``fused``: torch's fused kernels where the class
    has one for these tensors (what the engine runs on its shards,
    ``zero_strategy/optim/inner.py``), for the twin reference."""
    spec = case["optimizer"]
    named = [(n, p) for n, p in model.named_parameters()
             if p.requires_grad or not spec["only_trainable"]]
    name = spec["name"]
    if name == "muon":
        hidden = [(n, p) for n, p in named if p.ndim == 2 and n not in ("emb.weight",
                                                                          "head.weight")]
        ids = {id(p) for _, p in hidden}
        rest = [(n, p) for n, p in named if id(p) not in ids]
        opts = [torch.optim.Muon([p for _, p in hidden], lr=0.02)] if hidden else []
        return opts + [_build(torch.optim.AdamW, _groups(rest, spec["groups"], 1e-2, 0.1),
                              fused, lr=1e-2)]
    factory: dict[str, tuple[Callable[..., torch.optim.Optimizer], float, dict[str, Any]]] = {
        "sgd": (torch.optim.SGD, 0.05, {"momentum": 0.9}),
        "adam": (torch.optim.Adam, 1e-2, {}),
        "adamw": (torch.optim.AdamW, 1e-2, {}),
        "adagrad": (torch.optim.Adagrad, 0.05, {}),
        "rmsprop": (torch.optim.RMSprop, 1e-2, {}),
        "adafactor": (torch.optim.Adafactor, 1e-2, {}),
    }
    cls, lr, extra = factory[name]
    decay = 0.0 if name == "adafactor" else 1e-2
    return [_build(cls, _groups(named, spec["groups"], lr, decay), fused, lr=lr, **extra)]


def _build(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], fused: bool,
           **kwargs: Any) -> torch.optim.Optimizer:
    if fused and "fused" in inspect.signature(cls.__init__).parameters:
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # no fused kernel for this dtype
            pass
    return cls(groups, **kwargs)


def _groups(named: list[tuple[str, nn.Parameter]], groups: int, lr: float,
            decay: float) -> list[dict[str, Any]]:
    if groups == 1:
        return [{"params": [p for _, p in named], "weight_decay": decay}]
    matrices = [p for _, p in named if p.ndim >= 2]
    vectors = [p for _, p in named if p.ndim < 2]
    return [g for g in ({"params": matrices, "weight_decay": decay},
                        {"params": vectors, "weight_decay": 0.0, "lr": lr / 2}) if g["params"]]


def make_schedulers(case: dict[str, Any], opts: list[torch.optim.Optimizer]) -> list[Any]:
    kind = case["optimizer"]["scheduler"]
    if kind == "step":
        return [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    if kind == "lambda":
        return [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 2))
                for o in opts]
    return []


# ----------------------------------------------------------------------------- data
def micro_batches(case: dict[str, Any], step: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """[micro-batch][rank] -> (ids, targets): every rank's local slice of the global batch."""
    n = case["world"]
    out = []
    for m in range(case["accum"]):
        ids, tg = sm.data(case["model"], 1000 * case["seed"] + 10 * step + m,
                          n * LOCAL_BATCH, TOKENS)
        out.append([(ids[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH],
                     tg[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH]) for r in range(n)])
    return out


def _global(slices: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat(t) for t in zip(*slices))


# ----------------------------------------------------------------------------- the oracle
_COMPUTE = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16,
            "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


class Reference:
    """Single-process training on the global batch under the engine's precision semantics:
    the forward reads a copy of the masters in the compute dtype (floating buffers and frozen
    parameters in it too), the fp16 loss is scaled and its gradients unscaled, gradients are
    carried to the masters (fp32, or the ``-true`` dtype), clipping, the optimizers and their
    schedulers run there. A parameter no micro-batch gave a gradient keeps ``grad=None``, so
    torch's optimizers skip it, as after DDP.

    ``twin=i`` (the i-th twin): the engine's rounding structure: each rank's gradient on its
    own local batch, accumulated over micro-batches and averaged over ranks in the dtype the engine
    reduces in (fp32, or the compute dtype with ``reduce_dtype="compute"``), the gradient the
    optimizer reads and each step's weights and states moved by an ulp (a last-bit difference
    in the clipping norm, or another kernel's rounding, is all it takes where an optimizer
    divides by a gradient scale that nearly cancels, e.g. weight decay against the gradient).
    Where the case
    sends int8, the twin's forward also reads every trainable weight moved by +-max|w|/254
    and every rank's gradient is moved by +-max|g_rank|/254 (random signs): int8's largest
    error (half a quantization step of a block's largest magnitude, at most the largest of
    all) on all it sends."""

    def __init__(self, case: dict[str, Any], twin: int | None = None) -> None:
        cfg = case["config"]
        precision = cfg.get("precision", "32-true")
        self.case, self.twin = case, twin
        self.is_twin = twin is not None
        self.master = sm.build(case["model"])
        dtype = _COMPUTE[precision]
        if precision.endswith("-true"):
            self.master.to(dtype)
        self.compute = (self.master if next(self.master.parameters()).dtype == dtype
                        else copy.deepcopy(self.master).to(dtype))
        self.opts = make_optimizers(case, self.master)
        self.scheds = make_schedulers(case, self.opts)
        self.scale = (cfg.get("loss_scale", {}).get("initial_scale", 2.0**16)
                      if precision == "16-mixed" else 1.0)
        self.managed = {id(p) for o in self.opts for g in o.param_groups for p in g["params"]}
        # Every rank decodes its own piece of a weight gather too; a gradient's own part is
        # never quantized, so nothing is at N=1. A config the case switches to counts too.
        configs = [cfg] + ([case["op"]["config"]] if "config" in (case["op"] or {}) else [])
        self.noisy_weights = self.is_twin and any(
            c.get("quantize_weights") == "int8" for c in configs)
        self.noisy_grads = self.is_twin and case["world"] > 1 and any(
            c.get("quantize_gradients") == "int8" for c in configs)
        self.compute_dtype = dtype
        self.adopt(cfg)
        self.signs = torch.Generator().manual_seed(case["seed"] * 10 + (twin or 0))
        self.skipped = 0

    def adopt(self, config: dict[str, Any]) -> None:
        """Reduce as the engine now does (a checkpoint resumed under another config)."""
        compute = config.get("reduce_dtype") == "compute"
        self.reduce_dtype = self.compute_dtype if compute else torch.float32

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return [(m, c) for m, c in zip(self.master.parameters(), self.compute.parameters())
                if id(m) in self.managed]

    def set_trainable(self, name: str, flag: bool) -> None:
        self.master.get_parameter(name).requires_grad_(flag)
        self.compute.get_parameter(name).requires_grad_(flag)

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        pairs = self._pairs()
        if self.compute is not self.master:
            for m, c in pairs:
                c.copy_(m)
        if self.noisy_weights:
            peak = max(float(m.abs().max()) for m, _ in pairs)
            for _, c in pairs:
                c.add_(self._signs(c) * (peak / 254))

    def _signs(self, like: torch.Tensor) -> torch.Tensor:
        bits = torch.randint(0, 2, like.shape, generator=self.signs)
        return (bits * 2 - 1).to(like.dtype)

    def step(self, micro: list[list[tuple[torch.Tensor, ...]]], clip: float | None) -> None:
        self._refresh_compute()
        pairs = [(m, c) for m, c in self._pairs() if m.requires_grad]
        n = self.case["world"]
        # The twin accumulates each rank's micro-batches in the dtype the engine reduces in.
        acc_dtype = self.reduce_dtype if self.is_twin else torch.float64
        ranks: list[dict[int, torch.Tensor]] = [{} for _ in range(n if self.is_twin else 1)]
        for slices in micro:
            pieces = slices if self.is_twin else [_global(slices)]
            for acc, (ids, tg) in zip(ranks, pieces):
                for _, c in pairs:
                    c.grad = None
                out = sm.loss(self.compute, self.compute, ids, tg) / len(micro)
                (out * self.scale).backward()
                for m, c in pairs:
                    if c.grad is not None:
                        g = c.grad.to(acc_dtype)
                        acc[id(m)] = acc[id(m)] + g if id(m) in acc else g
        total: dict[int, torch.Tensor] = {}
        addends: dict[int, torch.Tensor] = {}
        for acc in ranks:
            if self.noisy_grads and acc:
                peak = max(float(g.abs().max()) for g in acc.values())
                acc = {k: g.double() + self._signs(g) * (peak / 254) for k, g in acc.items()}
            for k, g in acc.items():  # divided before the sum, in the sum's dtype, as DDP does
                g = g / len(ranks)
                total[k] = total[k] + g if k in total else g
                addends[k] = addends[k] + g.double().abs() if k in addends else g.double().abs()
        total = {k: g.double() / self.scale for k, g in total.items()}
        if len(ranks) > 1:
            # The engine sums the ranks' gradients in another order (per chunk, along a ring
            # or an exchange), rounding each partial sum in the reduce dtype: its error is up
            # to an ulp of the *addends*, not of the result, and where they nearly cancel
            # (found at N=3 in bf16: an Adam step of a full lr one way or the other) that is
            # far more than an ulp of the sum. Each twin rounds by that much, random signs.
            eps = torch.finfo(self.reduce_dtype).eps
            for k, g in total.items():
                g.add_(self._signs(g) * eps * addends[k] / self.scale)
        for m, c in pairs:
            c.grad = None
            m.grad = total[id(m)].to(m.dtype) if id(m) in total else None
        self._apply(clip)

    @torch.no_grad()
    def _round_differently(self) -> None:
        """Move every weight and optimizer state element by one unit in its last place, random
        signs: what a kernel that rounds differently leaves after a step (the engine runs
        torch's fused kernels on fp32 shards; the reference runs the per-tensor loop)."""
        tensors = [p for p, _ in self._pairs()]
        tensors += [v for o in self.opts for st in o.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()]
        for t in tensors:
            t.add_(t * self._signs(t) * torch.finfo(t.dtype).eps)

    def _apply(self, clip: float | None) -> None:
        grads = [p for p, _ in self._pairs() if p.grad is not None]
        if clip is not None and grads:
            # torch.nn.utils.clip_grad_norm_'s formula, with the norm taken in fp32 as the
            # engine does (the docstring of ZeroEngine.clip_grad_norm_): for bf16 gradients
            # torch's own would round it to bf16, a 2^-9 change of every clipped gradient.
            norm = torch.stack([p.grad.float().norm() for p in grads]).norm()
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for p in grads:
                p.grad.mul_(coef.to(p.grad.dtype))
        if self.is_twin:  # another rounding of the reduced, clipped gradient,
            eps = torch.finfo(self.reduce_dtype).eps  # summed in another order in its dtype
            for p in grads:
                p.grad.add_(p.grad * self._signs(p.grad) * eps)
        if not all(bool(torch.isfinite(p.grad).all()) for p in grads):
            self.skipped += 1  # every rank skips the step (ZeroConfig.nonfinite_grads="skip")
        else:
            for o in self.opts:
                o.step()
            if self.is_twin:
                self._round_differently()
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        for s in self.scheds:
            s.step()


# ----------------------------------------------------------------------------- the engine
class Boom(RuntimeError):
    """The exception a case raises on purpose in forward, backward or step."""


class EngineRun:
    """The case trained by the engine on this rank, with its operation mid-run."""

    def __init__(self, case: dict[str, Any], directory: str, rank: int) -> None:
        self.case, self.directory, self.rank = case, directory, rank
        self.model = sm.build(case["model"])
        self._wrap(self.model, case["config"])

    def _wrap(self, model: nn.Module, config: dict[str, Any],
              resume: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None) -> None:
        """A new engine over ``model``; ``resume``: optimizer and scheduler states, loaded into
        the user's objects before wrapping (the engine must take them over), as a plain
        PyTorch run resumes: optimizer, scheduler, then their states."""
        opts = make_optimizers(self.case, model)
        self.model, self.opts = model, opts
        self.scheds = make_schedulers(self.case, opts)
        if resume is not None:
            self._load(*resume)
        self.engine = zs.ZeroEngine(model, opts if len(opts) > 1 else opts[0],
                                    zs.ZeroConfig(**config))

    def _load(self, states: list[dict[str, Any]], scheds: list[dict[str, Any]]) -> None:
        for o, state in zip(self.opts, states):
            o.load_state_dict(state)
        for s, state in zip(self.scheds, scheds):
            s.load_state_dict(state)

    def step(self, micro: list[list[tuple[torch.Tensor, ...]]], clip: float | None) -> None:
        for m, slices in enumerate(micro):
            ids, tg = slices[self.rank]
            last = m == len(micro) - 1
            with contextlib.nullcontext() if last else self.engine.no_sync():
                self.engine.backward(sm.loss(self.model, self.engine, ids, tg) / len(micro))
        if clip is not None:
            self.engine.clip_grad_norm_(clip)
        self.engine.step()
        for s in self.scheds:
            s.step()

    # ------------------------------------------------------------------ operations
    def operate(self, op: dict[str, Any], micro: list[list[tuple[torch.Tensor, ...]]],
                ref: list[Reference]) -> None:
        name = op["name"]
        if name.startswith("raise_"):
            self._fail(name.removeprefix("raise_"), micro)
        elif name == "freeze":
            target = self.trainable_pick(op)
            flag = not self.model.get_parameter(target).requires_grad
            self.model.get_parameter(target).requires_grad_(flag)
            for r in ref:
                r.set_trainable(target, flag)
        elif name == "state_roundtrip":
            saved = self.engine.full_state_dict()
            noise = {k: torch.randn_like(v) if v.is_floating_point() else v
                     for k, v in saved.items()}
            self.engine.load_state_dict(noise)
            self.engine.load_state_dict(saved)
        elif name.startswith("checkpoint"):
            self._checkpoint(op.get("config", self.case["config"]))
            for r in ref:
                r.adopt(op.get("config", self.case["config"]))
        else:
            self._rewrap(before=name == "optim_before_wrap")

    def trainable_pick(self, op: dict[str, Any]) -> str:
        names = sorted(n for n, p in self.model.named_parameters()
                       if any(p is q for o in self.opts for g in o.param_groups
                              for q in g["params"]))
        return names[int(op.get("pick", 0.5) * len(names)) % len(names)]

    def _fresh_model(self) -> nn.Module:
        # Other initial values and buffers: everything must come from what is loaded.
        return sm.build({**self.case["model"], "seed": self.case["model"]["seed"] + 1})

    def _checkpoint(self, config: dict[str, Any]) -> None:
        path = os.path.join(self.directory, f"case{self.case['seed']}-w{self.case['world']}")
        self.engine.save_checkpoint(path, client_state={
            "schedulers": [s.state_dict() for s in self.scheds]})
        self._wrap(self._fresh_model(), config)
        client = self.engine.load_checkpoint(path)
        for s, state in zip(self.scheds, client["schedulers"]):
            s.load_state_dict(state)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def _rewrap(self, before: bool) -> None:
        weights = self.engine.full_state_dict()
        resume = ([o.state_dict() for o in self.opts], [s.state_dict() for s in self.scheds])
        self.engine.close()
        model = self._fresh_model()
        if before:
            model.load_state_dict(weights)
            self._wrap(model, self.case["config"], resume)
        else:
            self._wrap(model, self.case["config"])
            self.engine.load_state_dict(weights)
            self._load(*resume)

    def _fail(self, where: str, micro: list[list[tuple[torch.Tensor, ...]]]) -> None:
        """A micro-batch that raises in ``where``; then ``zero_grad()`` forgets it."""
        handles = []
        block = self.model.blocks[len(self.model.blocks) // 2]
        if where == "forward":
            handles.append(block.register_forward_pre_hook(_raiser("forward")))
        elif where == "backward":
            def arm(module: nn.Module, args: Any, out: torch.Tensor) -> None:
                out.register_hook(_raiser("backward"))
            handles.append(block.register_forward_hook(arm))
        else:
            handles.append(register_optimizer_step_pre_hook(
                _raiser("step")))
        try:
            ids, tg = micro[0][self.rank]
            self.engine.backward(sm.loss(self.model, self.engine, ids, tg))
            self.engine.step()
        except Boom:
            pass
        else:
            raise AssertionError(f"the failure injected in {where} did not raise")
        finally:
            for h in handles:
                h.remove()
        self.engine.zero_grad()


def _raiser(where: str) -> Callable[..., Any]:
    def hook(*args: Any) -> None:
        raise Boom(f"injected failure in {where}")
    return hook


# ----------------------------------------------------------------------------- comparison
def _rel(a: torch.Tensor, b: torch.Tensor, skip: torch.Tensor | None,
         trim: bool = False) -> float:
    """Largest |a - b| relative to b's largest magnitude (elements in ``skip`` left out);
    ``trim``: the (1 + n/50)-th largest instead (see ``compare``)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = (a - b).abs()
    if skip is not None:
        diff = diff[~skip.reshape(-1)]
    if not diff.numel():
        return 0.0
    k = min(diff.numel(), 1 + diff.numel() // 50) if trim else 1
    worst = float(diff.topk(k).values[-1])
    return worst / max(scale, 1e-12) if worst > 0 else 0.0


def _states(opts: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, named by optimizer, parameter index and key."""
    out = {}
    for k, o in enumerate(opts):
        for index, state in o.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{k}.{index}.{key}"] = value.detach().cpu()
    return out


def _param_of_state(opts: list[torch.optim.Optimizer], names: dict[int, str]) -> dict[str, str]:
    """State key prefix "opt{k}.{index}" -> the parameter's name."""
    out = {}
    for k, o in enumerate(opts):
        index = 0
        for g in o.param_groups:
            for p in g["params"]:
                out[f"opt{k}.{index}"] = names[id(p)]
                index += 1
    return out


def compare(engine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
            twins: list[dict[str, torch.Tensor]], floor: float,
            skips: dict[str, torch.Tensor], trim: bool = False) -> dict[str, Any]:
    """The worst tensor's distance over its bound (<= 1 passes), and the worst few named.

    ``trim`` (cases sending int8): each tensor's (1 + n/50)-th largest deviation instead of
    its largest. int8 moves every gradient element by up to half a quantization step, and an
    element whose update direction (under Adam and its kin: the sign of its gradient plus
    weight decay) is closer to zero than that flips, by a full lr, with a chance that twins
    with random errors can only sample; a wiring error (a misplaced block, a wrong scale, a
    lost rank's piece) moves most elements of a tensor, which the trimmed measure still sees.
    """
    rows = []
    missing = sorted(set(ref) ^ set(engine))
    for key, b in ref.items():
        if key not in engine:
            continue
        a = engine[key]
        if not b.is_floating_point():
            rows.append((0.0 if torch.equal(a, b) else math.inf, key, 0.0, 0.0))
            continue
        if tuple(a.shape) != tuple(b.shape) or not bool(torch.isfinite(a).all()):
            rows.append((math.inf, key, math.inf, 0.0))
            continue
        skip = skips.get(key) if skips.get(key) is not None and skips[key].numel() == b.numel() \
            else None
        rel = _rel(a, b, skip, trim)
        noise = max(_rel(t[key], b, skip, trim) for t in twins)
        bound = max(floor, K_NOISE * noise)
        rows.append((rel / bound, key, rel, noise))
    rows.sort(reverse=True)
    worst = math.inf if missing else (rows[0][0] if rows else 0.0)
    return {"ratio": worst, "missing": missing,
            "worst": [(k, rel, noise) for _, k, rel, noise in rows[:3]]}


# ----------------------------------------------------------------------------- one case
def run_case(case: dict[str, Any], directory: str) -> dict[str, Any]:
    """Train ``case`` on this rank (a collective: every rank of the world runs it). Rank 0
    also trains the reference and the twins and gives the verdict (what it compares, the
    consolidated weights and optimizer states, is the same on every rank); the others
    report only an error of their own."""
    rank = int(os.environ.get("RANK", "0"))
    refs = _references(case) if rank == 0 else []
    try:
        run = EngineRun(case, directory, rank)
        for step in range(case["steps"]):
            micro = micro_batches(case, step)
            op = case["op"]
            if op and op["at"] == step:
                run.operate(op, micro, refs)
            for r in refs:
                r.step(micro, case["clip"])
            run.step(micro, case["clip"])
        weights = run.engine.full_state_dict()
        states = _states(run.opts)
        skipped = run.engine.skipped_steps
    except Exception as e:  # a refusal passes only if it names a known limitation
        message = f"{type(e).__name__}: {e}"
        for pattern, reason in REFUSALS:
            if re.search(pattern, message):
                return {"ok": True, "refused": reason}
        return {"ok": False, "error": traceback.format_exc()[-3000:]}
    if not refs:
        return {"ok": True, "rank": rank}
    return _verdict(case, refs[0], refs[1:], weights, states, skipped)


def _references(case: dict[str, Any]) -> list[Reference]:
    """The reference, then its twins (more where the case sends int8)."""
    twins = [Reference(case, twin=i) for i in range(TWINS)]
    if twins[0].noisy_weights or twins[0].noisy_grads:
        twins += [Reference(case, twin=i) for i in range(TWINS, TWINS_INT8)]
    return [Reference(case), *twins]


def _reference_state(ref: Reference) -> dict[str, torch.Tensor]:
    """Managed parameters as masters; buffers and parameters outside the optimizer as the
    forward holds them (the compute copy), but at stage 3, which shards frozen parameters
    outside the optimizer too and keeps their masters exact: masters there."""
    op = ref.case["op"] or {}
    stage3 = (op.get("config") or ref.case["config"]).get("stage", 0) == 3
    managed = {n for n, p in ref.master.named_parameters()
               if id(p) in ref.managed or (stage3 and not p.requires_grad
                                           and p.dtype in _SHARDABLE)}
    master, compute = ref.master.state_dict(), ref.compute.state_dict()
    return {k: (master[k] if k in managed else compute[k]).detach().cpu() for k in master}


_SHARDABLE = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes of the frozen parameters stage 3 shards (the engine's trainable dtypes)."""


def _verdict(case: dict[str, Any], ref: Reference, twins: list[Reference],
             weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor],
             skipped: int) -> dict[str, Any]:
    master_dtype = next(ref.master.parameters()).dtype
    floor = FLOOR[master_dtype]
    zero = sm.exact_zero_grads(ref.master)
    names = {id(p): n for n, p in ref.master.named_parameters()}
    owners = _param_of_state(ref.opts, names)
    state_skips = {k: zero.get(owners.get(k.rsplit(".", 1)[0], ""))
                   for k in _states(ref.opts)}
    trim = twins[0].noisy_weights or twins[0].noisy_grads
    w = compare(weights, _reference_state(ref), [_reference_state(t) for t in twins], floor,
                zero, trim)
    s = compare(states, _states(ref.opts), [_states(t.opts) for t in twins], floor,
                state_skips, trim)
    initial = sm.build(case["model"]).state_dict()
    moved = max((_rel(v, initial[k].to(v.dtype), None) for k, v in ref.master.state_dict().items()
                 if v.is_floating_point()), default=0.0)
    ok = w["ratio"] <= 1 and s["ratio"] <= 1 and skipped == ref.skipped and moved > 0
    return {"ok": ok, "weights": w, "states": s, "skipped": [skipped, ref.skipped],
            "moved": moved}


# ----------------------------------------------------------------------------- worlds
def cases(first: int, count: int, world: int) -> list[dict[str, Any]]:
    return [generate(seed, world) for seed in range(first, first + count)]


def cases_from_env() -> list[dict[str, Any]]:
    """The cases a world of tests/worlds/scenarios_space.py runs: ``ZS_SPACE_SEEDS=first:count`` and
    ``ZS_SPACE_CASES`` (a JSON file of case dicts, the regression cases)."""
    import json

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = []
    seeds = os.environ.get("ZS_SPACE_SEEDS")
    if seeds:
        first, count = (int(x) for x in seeds.split(":"))
        out += cases(first, count, world)
    path = os.environ.get("ZS_SPACE_CASES")
    if path:
        with open(path) as f:
            out += [c for c in json.load(f) if c["world"] == world]
    return out


def case_name(case: dict[str, Any]) -> str:
    return f"{case.get('name', 'case' + str(case['seed']))}_w{case['world']}"


def run_cases(world: int, seeds: tuple[int, int] | None = None,
              regression: list[dict[str, Any]] | None = None,
              timeout: float = 600.0) -> dict[str, dict[str, Any]]:
    """Run cases in one world of ``world`` processes; {case name: rank 0's result, with
    every rank's verdict folded in}."""
    import json

    from tests.support.harness import run_world

    directory = tempfile.mkdtemp(prefix="zs-space-")
    env = {"ZS_SPACE_DIR": directory}
    if seeds is not None:
        env["ZS_SPACE_SEEDS"] = f"{seeds[0]}:{seeds[1]}"
    if regression:
        path = os.path.join(directory, "cases.json")
        with open(path, "w") as f:
            json.dump(regression, f)
        env["ZS_SPACE_CASES"] = path
    try:
        results = run_world("tests/worlds/scenarios_space.py", world, timeout=timeout, env=env)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = {}
    for name, per_rank in results.items():
        first = per_rank[0]
        failing = [r for r in per_rank if not r.get("ok")]
        out[name] = failing[0] if failing else first
    return out


# The fixed seed's cases per world size in the test tiers (N=3 runs three processes on two
# cores, so fewer): the quick tier runs the first QUICK_CASES, the integration tier the rest
# up to CI_CASES (150 in all, as one tier ran before the split).
CI_SEED = 0
CI_CASES = {1: 60, 2: 60, 3: 30}
QUICK_CASES = {1: 20, 2: 20, 3: 10}


def verdict(result: dict[str, Any] | None) -> str:
    """Why a case failed, for a test's message."""
    if result is None:
        return "no result (the world died before this case)"
    if "error" in result:
        return result["error"]
    return (f"weights {result['weights']['worst']}, optimizer states "
            f"{result['states']['worst']} (name, distance, farthest twin); skipped steps "
            f"engine/reference {result['skipped']}; reference moved {result['moved']:.3g}")


def assert_generated_cases_pass(results: dict[str, dict[str, Any]], first: int, count: int,
                                world: int) -> None:
    """Every generated case of seeds ``first .. first + count`` matched single-process
    training (failures listed as case dicts to paste), and most of them trained."""
    generated = cases(first, count, world)
    failed = {}
    for case in generated:
        r = results.get(case_name(case))
        if r is None or not r.get("ok"):
            failed[case_name(case)] = (case, verdict(r))
    assert not failed, "\n\n".join(f"{n}: {c}\n{v}" for n, (c, v) in failed.items())
    refused = [case for case in generated if "refused" in results[case_name(case)]]
    assert len(refused) < max(1, count // 4), "most of the space must train, not refuse"


def main(argv: list[str] | None = None) -> int:
    """The long mode: many cases per world size, failures printed as case dicts."""
    import json
    import time

    parser = argparse.ArgumentParser(prog="python -m tests.support.space", description=main.__doc__)
    parser.add_argument("--cases", type=int, default=3000, help="cases in all (split over N)")
    parser.add_argument("--first", type=int, default=10_000, help="first seed")
    parser.add_argument("--worlds", default="1,2,3", help="world sizes, comma-separated")
    parser.add_argument("--chunk", type=int, default=100, help="cases per set of processes")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    per_world = -(-args.cases // len(worlds))
    start, failures, refused, ratios, ran = time.monotonic(), [], {}, [], 0
    for world in worlds:
        for first in range(args.first, args.first + per_world, args.chunk):
            count = min(args.chunk, args.first + per_world - first)
            try:
                results = run_cases(world, (first, count), timeout=60.0 * count)
            except RuntimeError as e:  # the whole world died: record and go on
                failures.append({"world": world, "seeds": [first, count], "error": str(e)[-2000:]})
                continue
            for seed in range(first, first + count):
                r = results.get(f"case{seed}_w{world}")
                ran += 1
                if r is None or not r.get("ok"):
                    failures.append({"case": generate(seed, world), "result": r})
                elif "refused" in r:
                    refused[r["refused"]] = refused.get(r["refused"], 0) + 1
                else:
                    ratios.append(max(r["weights"]["ratio"], r["states"]["ratio"]))
            print(f"N={world} seeds {first}..{first + count - 1}: {len(failures)} failures so far "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    ratios.sort()
    print(json.dumps({"cases": ran, "seconds": round(time.monotonic() - start),
                      "failures": len(failures), "refused": refused,
                      "ratio_median": ratios[len(ratios) // 2] if ratios else None,
                      "ratio_max": ratios[-1] if ratios else None}, indent=1))
    for f in failures:
        print(json.dumps(f, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
