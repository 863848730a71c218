"""Scenarios for tests/quick/test_states.py: calls made in a state they do not start from.

- ``inside_backward``: from a tensor hook in the middle of backward (some units reduced, others
  not), ``step``, ``clip_grad_norm_``, ``clip_grad_value_``, ``get_global_grad_norm`` and
  ``zero_grad`` are each refused before they change anything; the backward then ends as if
  nothing was called, and the step after it equals an engine's that never saw the hook.
- ``wrong_phase``: the step's phase refuses through the public API: a step before any
  synchronised backward, a backward after a clip, a step after a forward that raised.
- ``param_stores``: each parameter store (stage 3's sharded, stage 1's replicated over two
  shards) in each state it reaches, asked every move its table does not start from there.
"""

from __future__ import annotations

from typing import Any

import torch

import zero_strategy as zs
from tests.support.harness import register
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config
from zero_strategy.core.params import ParamState
from zero_strategy.core.states import TransitionError

KIND = "mlp"
BUCKETS = {"bucket_numel": 1000}
"""Stages 0-2: several buckets in the MLP, so a hook in the middle of backward finds some
reduced and some not (stage 3 has its units)."""
CALLS = ("step", "clip_grad_norm_", "clip_grad_value_", "get_global_grad_norm", "zero_grad")


def _engine(stage: int) -> zs.ZeroEngine:
    model = make_model(KIND)
    return zs.ZeroEngine(model, make_optimizer("adamw", model),
                         zero_config(KIND, stage, **({} if stage == 3 else BUCKETS)))


def _step(engine: zs.ZeroEngine, data: dict[str, torch.Tensor]) -> None:
    engine.backward(loss_of(KIND, engine, data))
    engine.clip_grad_norm_(1.0)
    engine.step()
    engine.zero_grad()


def _call(engine: zs.ZeroEngine, name: str) -> None:
    args = {"clip_grad_norm_": (1.0,), "clip_grad_value_": (1e-3,)}.get(name, ())
    getattr(engine, name)(*args)


def _refusal(fn: Any) -> str | None:
    """The message of the ``TransitionError`` ``fn()`` raises; None if it raised nothing."""
    try:
        fn()
    except TransitionError as e:
        return str(e)
    return None


def inside_backward(stage: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    data = [batch(KIND, gen) for _ in range(3)]
    engine, clean = _engine(stage), _engine(stage)
    for e in (engine, clean):
        _step(e, data[0])
    refused: dict[str, str | None] = {}
    in_backward: list[bool] = []
    pending: list[bool] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        # the first layer's gradient arrives last: later units are reduced by now
        in_backward.append(engine.runtime.state.value == "backward")
        pending.append(engine.grads_pending)  # "reduced" only once the backward has ended
        for name in CALLS:
            refused[name] = _refusal(lambda name=name: _call(engine, name))
        return grad

    before = engine.full_state_dict()
    handle = engine.module.inp.weight.register_hook(hook)
    loss = loss_of(KIND, engine, data[1])
    engine.backward(loss)
    handle.remove()
    after = engine.full_state_dict()
    out = {"refused": refused, "in_backward": in_backward, "pending_in_backward": pending,
           "unchanged_by_backward": all(torch.equal(before[k], after[k]) for k in before),
           "phase": engine.progress.phase.value, "runtime": engine.runtime.state.value}
    clean.backward(loss_of(KIND, clean, data[1]))
    for e in (engine, clean):
        e.clip_grad_norm_(1.0)
        e.step()
        e.zero_grad()
        _step(e, data[2])
    mine, theirs = engine.full_state_dict(), clean.full_state_dict()
    out["same_as_clean"] = all(torch.equal(mine[k], theirs[k]) for k in mine)
    return out


class _Raised(Exception):
    pass


def wrong_phase(stage: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    engine = _engine(stage)
    out: dict[str, Any] = {"step_first": _refusal(engine.step)}
    with engine.no_sync():
        engine.backward(loss_of(KIND, engine, batch(KIND, gen)))
    out["step_after_no_sync"] = _refusal(engine.step)
    engine.backward(loss_of(KIND, engine, batch(KIND, gen)))
    engine.clip_grad_norm_(1.0)
    out["backward_after_clip"] = _refusal(
        lambda: engine.backward(loss_of(KIND, engine, batch(KIND, gen))))
    engine.zero_grad()

    def fail(*_: Any) -> None:
        raise _Raised("a forward that raises")

    handle = engine.module.blocks[1].register_forward_pre_hook(fail)
    try:
        loss_of(KIND, engine, batch(KIND, gen))
    except _Raised:
        pass
    handle.remove()
    out["after_failed_forward"] = {"runtime": engine.runtime.state.value,
                                   "phase": engine.progress.phase.value}
    out["step_after_failed_forward"] = _refusal(engine.step)
    engine.zero_grad()
    _step(engine, batch(KIND, gen))  # the engine trains on
    out["trained_on"] = engine.global_step == 1
    return out


def _illegal(store: Any) -> list[dict[str, Any]]:
    """Every move ``store``'s table does not start from its current state, each asked of it:
    what each raised and the state it left."""
    out = []
    for op, row in store.MOVES.items():
        if store.state in row:
            continue
        state = store.state.value
        message = _refusal(lambda op=op: store._to(op))
        out.append({"op": op, "state": state, "message": message,
                    "left": store.state.value})
    return out


def param_stores() -> dict[str, Any]:
    out: dict[str, Any] = {}
    stage3 = _engine(3)
    unit = next(u for u in stage3.units if u.param_store.gathers and u.name == "blocks.1.0")
    store, comm, runtime = unit.param_store, stage3.shards, stage3.runtime
    seen = [_illegal(store)]  # sharded
    runtime.unshard(unit)  # the all-gather in flight
    seen.append(_illegal(store))
    # the public calls refuse before any collective: ranks stay in step
    out["start_while_gathering"] = _refusal(lambda: store.start_unshard(comm))
    out["after_step_while_gathering"] = _refusal(lambda: store.after_step(comm))
    store.finish_unshard()
    seen.append(_illegal(store))
    out["start_while_unsharded"] = _refusal(lambda: store.start_unshard(comm))
    store.reshard()
    out["sharded"] = seen
    out["sharded_end"] = store.state is ParamState.SHARDED

    stage1 = _engine(1)
    store = stage1.units[0].param_store
    seen = [_illegal(store)]  # unsharded
    store.after_step(stage1.shards)  # the post-step all-gather in flight
    seen.append(_illegal(store))
    out["noop_while_gathering"] = [store.start_unshard(stage1.shards), store.reshard(),
                                   store.state.value]
    store.finish_unshard()
    out["replicated"] = seen
    return out


for _stage in range(4):
    register(f"inside_backward_s{_stage}", inside_backward, stage=_stage)
for _stage in (1, 3):
    register(f"wrong_phase_s{_stage}", wrong_phase, stage=_stage)
register("param_stores", param_stores)
