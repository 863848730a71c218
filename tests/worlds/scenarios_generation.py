"""Stage-3 generation (issue 49): ``model.generate()`` on a tiny GPT-2 under the engine, each
rank asking its own number of tokens (``synced_gpus`` keeps them in step).

For each budget the tokens are compared with the unsharded model's (the consolidated weights
in a plain copy, generating alone), the all-gather bytes of the call with the formula
(N-1)/N x (held bytes + forwards x streamed bytes), and the training step that follows with
the same step of an engine that never generated (bit for bit). Run by
tests/quick/test_generation.py through tests.support.harness.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import batch, loss_of, make_model, make_optimizer
from zero_strategy.core.generation import gathered_bytes
from zero_strategy.core.params import ParamState

NEW_TOKENS = (3, 9)  # by rank: the shorter rank keeps stepping (synced_gpus)
BUDGETS = {"auto": None, "streamed": 0, "partial": "some"}


def _engine() -> zs.ZeroEngine:
    model = make_model("gpt2")
    # Every parameter sharded (threshold 0) in several units; no gather-order tags, so the
    # all-gather bytes are the parameters' alone.
    config = zs.ZeroConfig(stage=3, unit_numel=5000, param_persistence_threshold=0,
                           check_gather_order=False)
    return zs.ZeroEngine(model, make_optimizer("adamw", model), config)


def _step(engine: zs.ZeroEngine, gen: torch.Generator) -> None:
    engine.backward(loss_of("gpt2", engine, batch("gpt2", gen)))
    engine.step()
    engine.zero_grad()


def _generate(model: torch.nn.Module, prompt: torch.Tensor, new: int, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, **kw)


def _all_sharded(engine: zs.ZeroEngine) -> bool:
    return (all(u.param_store.state is ParamState.SHARDED for u in engine.units
                if u.param_store.gathers)
            and engine.runtime.idle() and not engine.runtime._held)


def generate_budgets() -> dict:
    """Each budget in turn on one engine, a training step before each generation and after
    the last; beside it an engine taking the same steps without generating."""
    rank = dist.get_rank()
    engine, untouched = _engine(), _engine()
    gen_a, gen_b = (torch.Generator().manual_seed(100 + rank) for _ in range(2))
    units = [u for u in engine.units if u.param_store.gathers]
    out: dict[str, Any] = {"world": dist.get_world_size(),
                           "model_bytes": sum(gathered_bytes(u) for u in units)}
    for budget, chosen in BUDGETS.items():
        _step(engine, gen_a)
        _step(untouched, gen_b)
        if chosen == "some":  # room for the first unit and two streamed ones: the rest streamed
            sizes = [gathered_bytes(u) for u in units]
            chosen = sizes[0] + 2 * max(sizes)
        out[budget] = _generate_once(engine, chosen)
    _step(engine, gen_a)
    _step(untouched, gen_b)
    a, b = engine.full_state_dict(), untouched.full_state_dict()
    out["step_after_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    # parameters() names a tied weight once; placeholders have the whole shape
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    out.update(_nested_and_raising(engine))
    report = engine.memory_report()
    out["report"] = {k: report[k] for k in ("free_bytes", "generation_budget_bytes",
                                            "generation_held_bytes")}
    return out


def _generate_once(engine: zs.ZeroEngine, budget: int | None) -> dict:
    rank = dist.get_rank()
    reference = make_model("gpt2").eval()
    reference.load_state_dict(engine.full_state_dict())
    prompt = batch("gpt2", torch.Generator().manual_seed(7 + rank), size=1)["input_ids"][:, :5]
    new = NEW_TOKENS[rank]
    model = engine.module.eval()
    forwards: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    before = engine.comm_bytes().get("all_gather", 0)
    # None: no block of ours, only the one the engine wraps generate() in (its default
    # budget, this machine's free memory, holds this tiny model whole).
    outer = engine.generation(budget=budget) if budget is not None else contextlib.nullcontext()
    with outer:  # synced_gpus left to the engine: in step only while something streams
        tokens = _generate(model, prompt, new)
    sent = engine.comm_bytes().get("all_gather", 0) - before
    handle.remove()
    held = engine.generation_mode.last_held
    sharded_after = _all_sharded(engine)
    model.train()
    return {"tokens_equal": torch.equal(tokens, _generate(reference, prompt, new)),
            "forwards": len(forwards), "new": new, "sent": sent,
            "sharded_after": sharded_after,
            "held_bytes": sum(gathered_bytes(u) for u in engine.units if u.name in held)}


def _nested_and_raising(engine: zs.ZeroEngine) -> dict:
    """An ``engine.generation()`` block around two generate() calls gathers once for both;
    a generate() that raises inside the mode leaves every unit sharded."""
    model = engine.module.eval()
    prompt = batch("gpt2", torch.Generator().manual_seed(7), size=1)["input_ids"][:, :5]
    before = engine.comm_bytes().get("all_gather", 0)
    with engine.generation():
        _generate(model, prompt, 2, synced_gpus=True)
        _generate(model, prompt, 3, synced_gpus=True)
    twice = engine.comm_bytes().get("all_gather", 0) - before
    raised = ""
    try:
        _generate(model, prompt, 2, synced_gpus=True, stopping_criteria=[_boom()])
    except RuntimeError as err:
        raised = str(err)
    return {"twice": twice, "raised": raised, "sharded_after_raise": _all_sharded(engine)}


def _boom() -> Any:
    """A stopping criterion that fails inside the generation loop (after a forward)."""
    from transformers import StoppingCriteria

    class Boom(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> Any:
            raise RuntimeError("boom inside generate")

    return Boom()


if __import__("os").environ.get("WORLD_SIZE") == "2":
    register("generate_budgets", generate_budgets)
