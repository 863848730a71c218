"""States asserted at every transition (issue 57, point 1; core/states.py).

Each state machine is driven into each of its states and asked every move its table does not
start from there: the move is refused with an error naming the object, the state it was in
and the states the move starts from, and the state is left as it was. Beside that sweep,
``REFUSED_*`` state the design independently of the tables (what must be refused, and what
must not), so loosening or tightening a table fails here until the design says so too.

In process: the runtime's pass (``TrainingState``) and the step's phase (``StepPhase``). At
N=2 (tests/worlds/scenarios_states.py): the parameter stores, and the engine's public calls:
from a hook inside backward at every stage, and in the wrong phase of the step.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import check, run_world
from zero_strategy.comm.collectives import Communicator
from zero_strategy.core.progress import StepPhase, StepProgress
from zero_strategy.core.runtime import Runtime, TrainingState
from zero_strategy.core.states import TransitionError

T, P = TrainingState, StepPhase


def _runtime() -> Runtime:
    """A runtime over no units, on a communicator of one rank (no group: nothing here
    communicates)."""
    comm = Communicator.__new__(Communicator)
    comm.rank, comm.world_size, comm.device = 0, 1, torch.device("cpu")
    return Runtime([], comm, torch.nn.Linear(1, 1), prefetch=False, check_gather_order=False)


RUNTIME_ROUTES: dict[TrainingState, list[str]] = {
    T.IDLE: [], T.FORWARD: ["forward"], T.PRE_BACKWARD: ["forward", "end_forward"],
    T.BACKWARD: ["backward"], T.POST_BACKWARD: ["backward", "end_backward"],
    T.FORWARD_FAILED: ["forward_failed"], T.BACKWARD_FAILED: ["backward_failed"],
}
STEP_ROUTES: dict[StepPhase, list[str]] = {
    P.NOT_REDUCED: [], P.REDUCED: ["reduce"], P.UNSCALED: ["reduce", "unscale"],
    P.CLIPPED: ["reduce", "clip_norm"], P.UPDATING: ["reduce", "update"],
    P.UPDATED: ["reduce", "update", "updated"], P.FAILED: ["fail"],
    P.CUT_SHORT: ["reduce", "update", "cut_short"],
}
_LIVE = {T.FORWARD, T.BACKWARD, T.POST_BACKWARD}
REFUSED_RUNTIME: dict[str, set[TrainingState]] = {
    # whatever reads the reduced gradients: only with no pass in progress
    **{call: set(T) - {T.IDLE} for call in ("step", "clip_grad_norm_", "clip_grad_value_",
                                            "get_global_grad_norm")},
    # zero_grad(): never under a pass running now; after one that raised, or between a
    # forward and its backward (Lightning's closure), it ends the pass
    "reset": _LIVE,
    "forward": {T.POST_BACKWARD, T.BACKWARD_FAILED},
    "backward": {T.BACKWARD, T.POST_BACKWARD, T.FORWARD_FAILED, T.BACKWARD_FAILED},
    "end_backward": set(T) - {T.BACKWARD},
    "backward_done": set(T) - {T.POST_BACKWARD},
    "forward_failed": set(), "backward_failed": set(),
}
REFUSED_STEP: dict[str, set[StepPhase]] = {
    # a backward after an unscale or a clip would mix gradients of two scales
    "reduce": set(P) - {P.NOT_REDUCED, P.REDUCED},
    "step": set(P) - {P.REDUCED, P.UNSCALED, P.CLIPPED},
    "update": {P.NOT_REDUCED, P.UPDATED, P.FAILED, P.CUT_SHORT},
    "clip_norm": {P.NOT_REDUCED, P.UPDATING, P.UPDATED, P.FAILED, P.CUT_SHORT},
    "forget": {P.UPDATING, P.UPDATED},  # zero_grad() from inside the optimizer's update
    "fail": {P.UPDATING, P.UPDATED, P.CUT_SHORT},
    "reload": set(P) - {P.NOT_REDUCED, P.CUT_SHORT},
    "done": set(P) - {P.UPDATED},
}


def _at(machine, route: list[str]):  # noqa: ANN001, ANN202 - a runtime or a progress
    for op in route:
        machine._to(op)
    return machine


def _assert_refused(machine, op: str, owner: str) -> str:  # noqa: ANN001
    state = machine.state
    with pytest.raises(TransitionError) as caught:
        machine._to(op)
    message = str(caught.value)
    assert message.startswith(f"{owner}: {op} from state {state.value!r} is refused"), message
    allowed = ", ".join(repr(s.value) for s in machine.MOVES[op])
    assert f"{op} starts only from {allowed}" in message, message
    assert machine.state is state, "a refused move changed the state"
    return message


def test_routes_reach_every_state() -> None:
    assert {_at(_runtime(), r).state: s for s, r in RUNTIME_ROUTES.items()} == {
        s: s for s in T}
    assert {_at(StepProgress(), r).state: s for s, r in STEP_ROUTES.items()} == {
        s: s for s in P}


MACHINES = {
    "runtime": (_runtime, RUNTIME_ROUTES, REFUSED_RUNTIME, "the zero_strategy runtime of rank 0"),
    "step": (StepProgress, STEP_ROUTES, REFUSED_STEP, "the engine's step"),
}


@pytest.mark.parametrize(("machine", "state"),
                         [("runtime", s) for s in T] + [("step", s) for s in P],
                         ids=lambda v: getattr(v, "value", v))
def test_every_illegal_move_is_refused_by_name(machine: str, state: object) -> None:
    make, routes, refused, owner = MACHINES[machine]
    for op, row in make().MOVES.items():
        if state not in row:
            _assert_refused(_at(make(), routes[state]), op, owner)
        if state in refused.get(op, ()):
            assert state not in row, f"{op} must be refused from {state.value}"
        elif op in refused:
            assert state in row, f"{op} must be allowed from {state.value}"


@pytest.mark.parametrize("state", list(T), ids=lambda s: s.value)
def test_reset_goes_through_the_check(state: TrainingState) -> None:
    runtime = _at(_runtime(), RUNTIME_ROUTES[state])
    if state in _LIVE:
        with pytest.raises(TransitionError, match="engine.zero_grad.. was called during"):
            runtime.reset()
        assert runtime.state is state
    else:
        runtime.reset()
        assert runtime.state is T.IDLE


def test_a_step_from_inside_backward_names_the_situation() -> None:
    runtime = _at(_runtime(), RUNTIME_ROUTES[T.BACKWARD])
    with pytest.raises(TransitionError) as caught:
        runtime.expect("step")
    assert str(caught.value) == (
        "the zero_strategy runtime of rank 0: step from state 'backward' is refused; step "
        "starts only from 'idle'. engine.step() was called during backward, from a hook "
        "inside the engine's own pass: it would step with the gradients of some units not "
        "reduced yet; call it after engine.backward(loss) returns")


def test_values_riding_with_a_phase_are_read_only_in_it() -> None:
    progress = _at(StepProgress(), ["reduce"])
    assert progress.norm is None and progress.grads_pending and not progress.reported
    norm = torch.tensor(3.0)
    progress.clipped(norm)
    assert progress.phase is P.CLIPPED and progress.norm is norm
    progress.to("update")
    assert progress.norm is None, "the norm outlived its phase"
    progress.cut_short("an error in the update")
    assert progress.reason == "an error in the update" and progress.reported
    progress.to("forget")  # zero_grad(): the report goes, the refusal stays
    assert progress.phase is P.CUT_SHORT and progress.reason is not None
    progress.to("reload")
    assert progress.phase is P.NOT_REDUCED and progress.reason is None
    assert not progress.grads_pending and not progress.reported


# ------------------------------------------------------------------ at N=2
@pytest.fixture(scope="module")
def two() -> dict:
    return run_world("tests/worlds/scenarios_states.py", 2)


CALLS = ("step", "clip_grad_norm_", "clip_grad_value_", "get_global_grad_norm", "zero_grad")


@pytest.mark.parametrize("stage", range(4))
def test_calls_from_a_hook_inside_backward_are_refused_n2(two: dict, stage: int) -> None:
    """Before: at stages 1 and 2 such a step stepped with some units unreduced, and backward
    then failed at its end; at stage 3 it was refused with a message that did not fit."""
    for rank, r in enumerate(check(two[f"inside_backward_s{stage}"])):
        assert r["in_backward"] == [True], r
        # some units are reduced by then, but the step's gradients are not ready until the
        # backward has ended
        assert r["pending_in_backward"] == [False], r
        for call in CALLS:
            message = r["refused"][call]
            assert message is not None, f"{call} was not refused inside backward"
            op = "reset" if call == "zero_grad" else call
            assert message.startswith(f"the zero_strategy runtime of rank {rank}: {op} from "
                                      "state 'backward' is refused"), message
            assert f"engine.{call}() was called during backward" in message, message
            assert "call it after engine.backward(loss) returns" in message, message
        # nothing the refused calls would have done happened: the weights, and the step
        # after the backward, are those of an engine that never saw the hook
        assert r["unchanged_by_backward"] and r["same_as_clean"], r
        assert (r["phase"], r["runtime"]) == ("reduced", "idle"), r


@pytest.mark.parametrize("stage", [1, 3])
def test_calls_in_the_wrong_phase_are_refused_n2(two: dict, stage: int) -> None:
    needs = ("the engine's step: step from state 'not-reduced' is refused; step starts only "
             "from 'reduced', 'unscaled', 'clipped'. engine.step() needs reduced gradients")
    for rank, r in enumerate(check(two[f"wrong_phase_s{stage}"])):
        assert r["step_first"].startswith(needs), r["step_first"]
        assert r["step_after_no_sync"].startswith(needs), r["step_after_no_sync"]
        assert r["backward_after_clip"].startswith(
            "the engine's step: reduce from state 'clipped' is refused; reduce starts only "
            "from 'not-reduced', 'reduced'. The gradients were already unscaled or clipped"
        ), r["backward_after_clip"]
        assert r["after_failed_forward"] == {"runtime": "forward-failed", "phase": "failed"}
        assert r["step_after_failed_forward"].startswith(
            f"the zero_strategy runtime of rank {rank}: step from state 'forward-failed' is "
            "refused"), r["step_after_failed_forward"]
        assert "engine.zero_grad() forgets it first" in r["step_after_failed_forward"]
        assert r["trained_on"]


def test_every_illegal_move_of_a_parameter_store_is_refused_n2(two: dict) -> None:
    for r in check(two["param_stores"]):
        sharded = "parameter store u2 (ShardedParams) of module 'blocks.1.0'"
        # the sweep: every state each store reaches, every move not listed from it
        asked = {(kind, s["state"], s["op"]): s for kind in ("sharded", "replicated")
                 for seen in r[kind] for s in seen}
        assert set(asked) == {
            ("sharded", "gathering", "start_unshard"), ("sharded", "gathering", "reshard"),
            ("sharded", "gathering", "after_step"), ("sharded", "unsharded", "start_unshard"),
            ("replicated", "gathering", "gather_update")}, sorted(asked)
        for (kind, state, op), s in asked.items():
            assert s["message"] is not None and s["left"] == state, s
            assert f"{op} from state {state!r} is refused" in s["message"], s
            assert f"({kind.capitalize()}Params)" in s["message"], s
        assert asked[("sharded", "gathering", "start_unshard")]["message"].startswith(
            f"{sharded}: start_unshard from state 'gathering' is refused; start_unshard "
            "starts only from 'sharded'")
        # the public calls too, before any collective (the ranks stayed in step)
        assert r["start_while_gathering"] == asked[("sharded", "gathering", "start_unshard")][
            "message"]
        assert r["after_step_while_gathering"].startswith(
            f"{sharded}: after_step from state 'gathering' is refused; after_step starts only "
            "from 'sharded', 'unsharded'"), r["after_step_while_gathering"]
        assert r["start_while_unsharded"].startswith(
            f"{sharded}: start_unshard from state 'unsharded' is refused")
        assert r["sharded_end"]
        # a replicated store's no-ops while its post-step gather runs are listed, not skipped
        assert r["noop_while_gathering"] == [None, None, "gathering"]
