"""What happens during forward and backward: gathers, prefetches, frees and reductions.

The runtime is driven by the hooks in ``hooks.py``. It never asks for the stage: a replicated
param store makes gather/free no-ops, and the grad store the plan chose decides what a
reduction is.

Every collective must be issued in the same order on every rank, including when ranks run
different code (mixture-of-experts routing leaves an expert unused on one rank only):

- reductions are launched in one order fixed before backward starts (the reverse of the
  forward's unit order, then the remaining units by index), a unit whose gradients are ready
  early waits for its predecessors, and a unit some of whose gradients never arrive on this
  rank is launched at the end of backward, still in that order;
- where backward also gathers (stage 3) and the gather order is checked on the host, a
  reduction is launched as soon as its unit and those before it are complete, but a rank
  *waits* for one (to keep the in-flight window) only once every rank has launched it: each
  check also exchanges how many reductions each rank has launched, and the smallest count is
  what may be waited for. A reduction in flight beyond it is finished only when found in;
  otherwise launches stop until a later hook. So a rank never waits for a reduction a peer
  has not launched while that peer waits for a gather this rank has not issued. Which comes
  first on a rank when ranks run different modules (experts), a unit's completion or the
  next unit's gather, depends on its data, and blocking on unagreed reductions let two ranks
  hang each other (found by tests/support/space.py). Launching without waiting for a gather
  check matters at the end of backward: the units that complete after the last gather
  reduce while the rest of backward computes, not after it;
- a module's forward inside backward is a checkpointed module recomputing: its units are
  gathered then and stay whole through the backward that follows at once (freed when their
  gradients arrive), so a step gathers each unit once for forward and once for backward as
  without checkpointing; and since backward then needs units block by block, each block's in
  forward order, it prefetches along the order the previous backward needed them;
- the forward's last ``prefetch`` units (the root aside, which stays whole anyway) are not
  freed after their forward: backward needs them first, and freed they would be gathered
  again at once. Which ones is decided from the last forward, which every rank ran alike;
- stage-3 gathers follow the modules that run, so with ``check_gather_order`` ranks check
  that they gather the same unit at each point (``gather_order.py``): on CPU a header sent
  beside each gather, read before its rows are waited for, the rows on a channel of the
  unit's own; on a GPU tags read at the end of backward. After a pass cut short, ``reset``
  has every rank issue the gathers and headers its peers issued and it did not, so nothing
  stays unmatched.
"""

from __future__ import annotations

import enum
import zlib
from typing import Any

import torch
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from ..comm.collectives import Communicator
from ..comm.handles import Handle
from .autograd import (
    Inputs,
    queue_end_of_backward,
    register_post_backward,
    register_pre_backward,
)
from .devices import from_host
from .gather_order import GatherOrder
from .params import ParamState
from .progress import StepProgress
from .routed import routed_blocks
from .states import StateMachine, every
from .units import Unit

# Reductions in flight at once. Each holds a unit's full-size local gradient buffer until it
# completes, so the window bounds stage 2/3's transient gradient memory to a few units while
# still overlapping communication with the rest of backward.
MAX_INFLIGHT_REDUCTIONS = 2

READ_AHEAD_UNITS = 2
"""Units beyond the one being prefetched whose disk-tier shards are read ahead: enough to
keep the disk busy while a unit computes, few enough to bound what is resident."""


class TrainingState(enum.Enum):
    """Where the runtime is in a pass; every change goes through ``Runtime._to``."""

    IDLE = "idle"
    """No pass in progress: nothing gathered for a pass, no reduction pending."""
    FORWARD = "forward"
    """The engine's forward is running."""
    PRE_BACKWARD = "pre-backward"
    """A forward that autograd recorded has ended; its backward has not begun."""
    BACKWARD = "backward"
    """Gradients are arriving; reductions are launched in the order fixed at its start."""
    POST_BACKWARD = "post-backward"
    """The end-of-backward callback: waiting for reductions, agreeing on used parameters."""
    FORWARD_FAILED = "forward-failed"
    """The engine's forward raised: what it gathered waits for ``reset`` (``zero_grad()``)."""
    BACKWARD_FAILED = "backward-failed"
    """``engine.backward`` raised: ranks may have launched different reductions, which
    ``reset`` matches with the peers'."""


_S = TrainingState
_LIVE = (_S.FORWARD, _S.BACKWARD, _S.POST_BACKWARD)
"""A pass running now: an engine call in one of them comes from a hook inside it."""
_GRADS_READ = ("step", "clip_grad_norm_", "clip_grad_value_", "get_global_grad_norm")
"""Engine calls that read the reduced gradients: only with no pass in progress."""
_MOVES: dict[str, dict[TrainingState, TrainingState]] = {
    # FORWARD again: a forward nested in another, or one after a forward that raised (a
    # batch-size finder retries before its zero_grad()). BACKWARD stays: a checkpointed
    # module (or the whole forward) recomputing inside backward.
    "forward": {_S.IDLE: _S.FORWARD, _S.PRE_BACKWARD: _S.FORWARD, _S.FORWARD: _S.FORWARD,
                _S.FORWARD_FAILED: _S.FORWARD, _S.BACKWARD: _S.BACKWARD},
    # From PRE_BACKWARD or IDLE: a nested forward, or a backward run inside the forward (a
    # gradient penalty), ended first; the outer forward's output still waits for backward.
    "end_forward": {_S.FORWARD: _S.PRE_BACKWARD, _S.PRE_BACKWARD: _S.PRE_BACKWARD,
                    _S.IDLE: _S.PRE_BACKWARD, _S.BACKWARD: _S.BACKWARD},
    "end_forward_no_grad": {_S.FORWARD: _S.IDLE, _S.IDLE: _S.IDLE,
                            _S.PRE_BACKWARD: _S.PRE_BACKWARD, _S.BACKWARD: _S.BACKWARD},
    # From IDLE: a backward through parameters read outside forward; from FORWARD: autograd
    # run inside the model's own forward (a gradient penalty).
    "backward": {_S.IDLE: _S.BACKWARD, _S.FORWARD: _S.BACKWARD, _S.PRE_BACKWARD: _S.BACKWARD},
    "end_backward": {_S.BACKWARD: _S.POST_BACKWARD},
    "backward_done": {_S.POST_BACKWARD: _S.IDLE},
    # An exception may leave a pass anywhere. A forward that raised inside a backward (or
    # with a backward of its own in progress) leaves that backward's reductions to match.
    "forward_failed": {**every(TrainingState, _S.FORWARD_FAILED),
                       _S.BACKWARD: _S.BACKWARD_FAILED, _S.POST_BACKWARD: _S.BACKWARD_FAILED,
                       _S.BACKWARD_FAILED: _S.BACKWARD_FAILED},
    "backward_failed": every(TrainingState, _S.BACKWARD_FAILED),
    # Not from a pass running now: forgetting it under its feet would free what it uses
    # (its backward then ends in a state no pass has).
    "reset": {s: _S.IDLE for s in TrainingState if s not in _LIVE},
    **{call: {_S.IDLE: _S.IDLE} for call in _GRADS_READ},
}


class Runtime(StateMachine):
    MOVES = _MOVES

    def __init__(self, units: list[Unit], comm: Communicator, root: torch.nn.Module,
                 prefetch: int, check_gather_order: bool,
                 world: Communicator | None = None, blocking_order_check: bool = False,
                 progress: StepProgress | None = None) -> None:
        self.units = units
        self.progress = StepProgress() if progress is None else progress
        """The step's phase: a synchronised backward that ended leaves its gradients
        reduced (``reduce``)."""
        self.comm = comm
        self.world = world or comm
        """Every rank (``comm`` is the shard group under hybrid sharding): they all check the
        gather order (replicas reduce in the order their groups gathered) and agree on which
        parameters were used anywhere."""
        self.prefetch = int(prefetch)
        """Units gathered ahead of the one computing (0: none)."""
        self.gather_check = GatherOrder(units, comm, self.world, check_gather_order,
                                        blocking_order_check, ready=lambda: self._cursor,
                                        agreed=self._agree_launches)
        self._hooked: set[int] = set()
        """Units whose output the last forward hooked for backward: those backward gathers."""
        self._trainable: tuple[bool, ...] | None = None
        """Every parameter's ``requires_grad`` as last agreed by the ranks."""
        self.root_unit = next((u for u in units if u.module is root), None)
        self.sync = True
        self._order: list[Unit] = []
        self._previous_order: list[Unit] = []
        self._backward_trace: list[Unit] = []
        """Units in the order this backward first needed them (by a pre-backward hook, or by
        a recomputation's forward)."""
        self._recomputed = False
        """A checkpointed module was recomputed in this backward."""
        self._backward_plan: list[Unit] = []
        """The last backward's trace when it recomputed (its gathers then run region by
        region, each in forward order, not in reverse forward order): backward prefetches
        along it. Empty: along the reverse of the forward."""
        self._in_order: set[int] = set()
        self._kept: set[int] = set()
        """Units this forward keeps whole for the backward (``_backward_head``)."""
        self._callback_queued = False
        self._launched: list[Unit] = []
        self._resting: list[Unit] = []
        """Units whose reduced gradient is still on its way to the disk tier (copied from a
        GPU): rested one unit later, so the copy overlaps the next unit's work."""
        self._pinned: set[int] = set()
        """Units kept whole until the end of backward: read outside their module's forward,
        or returned (a view of) their parameters from it."""
        routed = routed_blocks(root)
        self._routed = {u.index for u in units if u.module is not None and id(u.module) in routed}
        """Routed blocks (mixture of experts): reduced once their module's backward ended,
        whatever experts idle on this rank did not send (``_post_backward``)."""
        self._held: dict[int, int] = {}
        """Units ``engine.gathered_parameters()`` keeps whole (how many blocks hold each): no
        forward, backward or inference pass frees them until the block ends."""
        self._traced: set[int] = set()
        self._plan_index: dict[int, int] = {}
        self._plan_reached = -1
        """The furthest position of this backward in ``_backward_plan``."""
        self._start_launches([], agree=False)
        self._state = TrainingState.IDLE

    def _owner(self) -> str:
        return f"the zero_strategy runtime of rank {self.comm.rank}"

    def _hint(self, op: str) -> str:
        state = self._state
        if state in (_S.FORWARD_FAILED, _S.BACKWARD_FAILED):
            return "A pass raised: engine.zero_grad() forgets it first"
        if state not in _LIVE:
            return ""
        call = {"reset": "zero_grad"}.get(op, op)
        why = {"step": "it would step with the gradients of some units not reduced yet",
               "zero_grad": "it would forget gradients and free parameters the pass is still "
                            "using"}.get(call, "the gradients of some units are not reduced yet"
                                       if call in _GRADS_READ else "")
        after = "the forward" if state is _S.FORWARD else "engine.backward(loss)"
        return (f"engine.{call}() was called during {state.value}, from a hook inside the "
                f"engine's own pass{': ' + why if why else ''}; call it after {after} returns")

    def idle(self) -> bool:
        return self._state is TrainingState.IDLE

    def failed_in(self, where: str) -> None:
        """The engine's ``where`` ("forward" or "backward") raised: the pass is over here."""
        self._to(f"{where}_failed")

    # ---------------------------------------------------------------- gathering
    def unshard(self, unit: Unit) -> None:
        store = unit.param_store
        if store.gathers and store.state is ParamState.SHARDED:
            # A channel of the unit's own where headers check the order: a rank gathering
            # another unit at this point never receives its rows, and the header says so
            # before they are waited for.
            store.start_unshard(self.comm, channel=self.gather_check.before_gather(unit))

    def finish(self, unit: Unit) -> None:
        """Wait until ``unit`` is whole, the order of every gather up to it checked first."""
        self.gather_check.read(upto=unit)
        unit.param_store.finish_unshard()

    def _start_launches(self, order: list[Unit], agree: bool) -> None:
        """A pass's reductions, launched along ``order``; ``agree``: this rank waits only for
        those every rank had launched at the last gather check (``_window_open``)."""
        self._launch_order = order
        self._position = {u.index: i for i, u in enumerate(order)}
        self._cursor = 0
        """Reductions launched this pass (a prefix of the launch order)."""
        self._ready = 0
        """Units complete this pass, counted from the start of the launch order."""
        self._agreed: int | None = 0 if agree else None
        """The smallest ``_cursor`` over the ranks at the last gather check: the reductions
        every rank has launched, the only ones this rank may block on (None: any)."""
        self._complete: set[int] = set()
        self._reduced_early: set[int] = set()
        """Routed blocks reduced early in this backward: a gradient of theirs arriving after
        that would be lost, and is refused."""

    def _agree_launches(self, least: int) -> None:
        """The least count of launched reductions over the ranks, read from a gather's
        check: in backward, this rank may wait for those (``_window_open``)."""
        if self._agreed is not None:
            self._agreed = least
            self._launch_ready()

    def gather_for_access(self, unit: Unit) -> None:
        """A parameter of ``unit`` is read outside its module's forward: gather it now and
        keep it whole until the end of backward (or of the step, without backward)."""
        with record_function("zero::gather_external"):
            self.unshard(unit)
            self.finish(unit)
        self._pinned.add(unit.index)

    def release(self, unit: Unit) -> None:
        if unit.index not in self._pinned and unit.index not in self._held:
            unit.param_store.reshard()

    def hold(self, unit: Unit) -> None:
        """Keep ``unit`` whole (it is gathered already) until as many ``unhold`` calls."""
        self._held[unit.index] = self._held.get(unit.index, 0) + 1

    def unhold(self, unit: Unit) -> None:
        left = self._held.pop(unit.index) - 1
        if left:
            self._held[unit.index] = left

    def settle(self) -> None:
        """Wait for every gather in flight (the post-step all-gathers of stages 1-2 among
        them): run before anything reads or writes whole compute copies outside forward."""
        for unit in self.units:
            self.finish(unit)
        self.gather_check.verify()

    def reshard_all(self) -> None:
        """Free every gathered unit but those a ``gathered_parameters()`` block holds."""
        self._pinned.clear()
        for unit in self.units:
            if unit.index not in self._held:
                unit.param_store.reshard()

    # ---------------------------------------------------------------- forward
    def follow_trainability(self, agree: bool) -> None:
        """Which parameters require grad now. ``agree`` (a backward, which every rank runs):
        checked against every rank whenever it changed (one small uncounted all-gather then,
        none otherwise), since ``Unit.trains`` decides which units are reduced
        and ranks that reduced different units would wait for each other forever. A forward
        does not agree: a forward may run on one rank alone (a sample logged by rank 0 at
        stages 0-2)."""
        flags = tuple(p.requires_grad for unit in self.units for p in unit.params)
        if agree and flags != self._trainable:
            self._agree_trainability(flags)
            self._trainable = flags
        for unit in self.units:
            trainable = [p.requires_grad for p in unit.params]
            unit.trains = unit.trains or any(trainable)
            unit.has_frozen = not all(trainable)

    def _agree_trainability(self, flags: tuple[bool, ...]) -> None:
        if self.world.world_size == 1:
            return
        # Not counted: metadata, so a step's collective bytes stay the same in the step where
        # trainability changed (ZeRO's traffic formula per step). Not through the store
        # either: its keys are numbered per process, and a process that lives on (a Hydra
        # sweep's rank 0) numbers them unlike its job's new peers.
        mine = zlib.crc32(bytes(flags)) | len(flags) << 32
        if len({t[0] for t in self.world.all_gather_ints([mine], counted=False)}) == 1:
            return
        names = [slot.name for unit in self.units for slot in unit.layout.slots]
        every = self.world.all_gather_object(flags)
        differ = [n for i, n in enumerate(names) if len({f[i] for f in every}) > 1]
        raise RuntimeError(
            f"zero_strategy: ranks disagree on which parameters require grad ({differ[:5]}"
            f"{' ...' if len(differ) > 5 else ''} differ; rank by rank trainable counts "
            f"{[sum(f) for f in every]}): freeze and unfreeze the same parameters on every "
            "rank, between the same steps")

    def begin_forward(self) -> None:
        self.follow_trainability(agree=False)
        self._to("forward")
        if self._order:
            self._previous_order = self._order
        self._order, self._in_order, self._hooked = [], set(), set()
        self._kept = self._backward_head()

    def _backward_head(self) -> set[int]:
        """The units a forward keeps whole for the backward that follows: the last
        ``prefetch`` units the last forward gathered (the root aside, which stays whole), the
        first that backward needs. Freed and gathered again at once, their bytes would cross
        the link twice more per step while the head's compute leaves it idle; kept, they are
        the units backward would have prefetched, within the same budget. Decided from the
        last forward, which every rank ran alike (its gathers' order is checked). Under
        activation checkpointing they are the last region's, which backward recomputes
        first: kept, they are not gathered for the recomputation either."""
        if not self.prefetch:
            return set()
        gathered = [u for u in self._previous_order
                    if u is not self.root_unit and u.param_store.gathers]
        return {u.index for u in gathered[-self.prefetch:]}

    def end_forward(self) -> None:
        self._to("end_forward" if torch.is_grad_enabled() else "end_forward_no_grad")

    def pre_forward(self, unit: Unit, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Inputs | None:
        """Gather ``unit`` for its module's call; the call's inputs, where they change (see
        ``_follow_backward``)."""
        if self.recomputing():
            self._recomputed = True
            self.pre_backward(unit)  # the unit's backward follows its recomputation at once
            return None
        with record_function("zero::gather"):
            if unit.index not in self._in_order:
                self._in_order.add(unit.index)
                self._order.append(unit)
            self.unshard(unit)
            if self.prefetch:
                self._prefetch_after(unit, self._previous_order)
            self.finish(unit)
        return self._follow_backward(unit, args, kwargs)

    def _follow_backward(self, unit: Unit, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Inputs | None:
        """A unit with a frozen parameter is still read by its module's backward after its
        trainable parameters got their gradients (the frozen weight computes the gradient of
        the module's input, as under a LoRA adapter). Where the inputs require grad, the end
        of that backward is observable: the unit is freed then, not at the end of the whole
        backward (which would hold every frozen unit of a partial fine-tune at once). A
        routed block is watched so too: an expert that got no token here sends no gradient,
        so only the end of the block's backward says that every gradient it gets arrived."""
        watched = unit.has_frozen or unit.index in self._routed
        if not (watched and torch.is_grad_enabled()):
            return None
        inputs = register_post_backward(args, kwargs, lambda: self._post_backward(unit))
        if inputs is not None:
            unit.pending_calls += 1
        return inputs

    def _post_backward(self, unit: Unit) -> None:
        """One call of ``unit``'s module has finished its backward. After the last, a routed
        block still waiting for an idle expert's gradients is reduced (those count as zeros,
        as under DDP) instead of at the end of backward, where it held its full-size
        gradient and every reduction after it in the launch order."""
        unit.pending_calls = max(unit.pending_calls - 1, 0)
        if unit.pending_calls:
            return
        if unit.reduced_this_pass:
            self.release(unit)
        elif unit.index in self._routed and unit.index not in self._pinned:
            if unit.expected:
                self._reduced_early.add(unit.index)
            self._finish_unit(unit)

    def recomputing(self) -> bool:
        """A module's forward inside backward: a checkpointed module recomputing."""
        return self._state is TrainingState.BACKWARD and torch.is_grad_enabled()

    def post_forward(self, unit: Unit, output: Any) -> None:
        if self.recomputing():
            # Kept whole until its gradients arrive (``_finish_unit``), which its backward,
            # next, delivers: freeing it here would gather it a second time for that.
            register_pre_backward(output, lambda: self.pre_backward(unit))
            return
        leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if any(unit.param_store.shares_storage(t) for t in leaves):
            self._pinned.add(unit.index)  # the caller holds a view of the parameters
        hooked = torch.is_grad_enabled() and register_pre_backward(
            leaves, lambda: self.pre_backward(unit)
        )
        if hooked:
            self._hooked.add(unit.index)
        if not torch.is_grad_enabled() and unit is self.root_unit:
            self.gather_check.verify()
            # Inference: nothing will need the parameters again (but what a
            # gathered_parameters() block holds: generate() inside one gathers once).
            self.reshard_all()
        elif hooked and unit.index in self._kept:
            return  # backward needs it first (``_backward_head``): freed when reduced
        elif unit is not self.root_unit and (hooked or not torch.is_grad_enabled()
                                             or self._out_of_backward(unit, leaves)):
            # Only free what a pre-backward hook can bring back, or what no backward will
            # read; an output we cannot hook keeps its unit gathered until the end of
            # backward.
            with record_function("zero::free"):
                self.release(unit)

    @staticmethod
    def _out_of_backward(unit: Unit, leaves: list[torch.Tensor]) -> bool:
        """Whether no backward can read ``unit``: its outputs are tensors none of which
        requires grad, and none of its parameters does (a frozen block before every
        trainable one, as in head or norm tuning)."""
        return (bool(leaves) and not any(t.requires_grad for t in leaves)
                and not any(p.requires_grad for p in unit.params))

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        for i, u in enumerate(order[:-1]):
            if u is unit:
                ahead = i + 1 + self.prefetch
                for later in order[i + 1 : ahead]:
                    self.unshard(later)  # those gathering already are left as they are
                # Shards at rest on disk are read further ahead than the gather: the gather
                # of the next unit then finds its bytes in memory.
                for later in order[ahead : ahead + READ_AHEAD_UNITS]:
                    later.param_store.read_ahead()
                return

    # ---------------------------------------------------------------- backward
    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            if self.sync:  # its end will leave the gradients reduced: refuse before any arrives
                self.progress.expect("reduce")
            self._to("backward")
            self._callback_queued = True
            queue_end_of_backward(self.end_backward)
            self._begin_backward()

    def _begin_backward(self) -> None:
        """Fix, before any gradient arrives, how many each unit expects and the order in
        which reductions are launched: the same on every rank whatever arrives."""
        for unit in self.units:
            unit.expected = sum(1 for p in unit.params if p.requires_grad)
            unit.trains = unit.trains or unit.expected > 0  # a backward with no forward
            if unit.expected < len(unit.params) and not unit.pending_calls:
                # A frozen parameter's value is still read after the unit's trainable ones
                # have their gradients, and no input of its module showed when that backward
                # ends (``_follow_backward``): the unit stays whole until the end of backward.
                self._pinned.add(unit.index)
        gathers = any(u.param_store.gathers for u in self.units)
        agree = gathers and self.gather_check.agrees_launches
        ran = list(reversed(self._order))
        seen = {u.index for u in ran}
        self._start_launches(ran + [u for u in self.units if u.index not in seen], agree)
        self._backward_trace, self._traced, self._recomputed = [], set(), False
        self._plan_reached = -1
        for unit in self.units:
            if unit.expected == 0:  # complete already: no gradient can arrive for it
                unit.reduced_this_pass = True
                if self.sync:
                    self._complete.add(unit.index)

    def pre_backward(self, unit: Unit) -> None:
        self._ensure_callback()
        self.gather_check.poll()
        self._launch_ready()  # what a full window held back may have room now
        if unit.index not in self._traced:
            self._traced.add(unit.index)
            self._backward_trace.append(unit)
        with record_function("zero::gather_for_backward"):
            self.unshard(unit)
            if self.prefetch:
                self._prefetch_in_backward(unit)
            self.finish(unit)

    def _prefetch_in_backward(self, unit: Unit) -> None:
        """Gather the next unit backward will need: along the reverse of the forward, or
        along the last backward's order when that one recomputed. Along the latter, from
        the furthest unit reached: a late pre-backward hook of a unit whose region is done
        (its output's hook fires after its recomputation) must not bring back the units
        after it in that region, whose gradients are already reduced."""
        plan = self._backward_plan
        if not plan:
            # Along the units backward can reach (their outputs were hooked): a frozen block
            # before everything that trains is never needed, and gathered it would stay
            # whole to the end of backward.
            self._prefetch_after(unit, [u for u in reversed(self._order)
                                        if u.index in self._hooked])
            return
        position = self._plan_index.get(unit.index)
        if position is not None and position > self._plan_reached:
            self._plan_reached = position
        ahead: list[Unit] = []
        for i in range(self._plan_reached + 1, len(plan)):
            later = plan[i]
            if later.index not in self._traced:
                ahead.append(later)
                if len(ahead) >= self.prefetch + READ_AHEAD_UNITS:
                    break
        for later in ahead[: self.prefetch]:
            self.unshard(later)
        for later in ahead[self.prefetch :]:
            later.param_store.read_ahead()

    def on_grad(self, unit: Unit, index: int, param: torch.Tensor) -> None:
        self._ensure_callback()
        if unit.index in self._reduced_early:
            raise RuntimeError(
                f"a gradient of {unit.layout.slots[index].name!r} arrived after its routed "
                f"block {unit.name!r} was reduced (a routed block is reduced once its "
                "module's backward ends, whatever experts idle on this rank did not send): "
                "the parameter is read outside the block's forward too, on a path backward "
                "reaches later, and its gradient would be lost; keep the expert's use inside "
                "its block's forward")
        grad = param.grad
        assert grad is not None
        unit.grad_store.accumulate(index, grad)
        param.grad = None  # the store holds it now; a full-size .grad would defeat sharding
        unit.used[index] = True
        unit.ready += 1
        if unit.ready >= unit.expected:
            self._finish_unit(unit)

    def _finish_unit(self, unit: Unit) -> None:
        unit.ready = 0
        unit.reduced_this_pass = True
        if self.sync:
            self._complete.add(unit.index)
            self.gather_check.poll()
            self._launch_ready()
        # Every use of the unit's parameters is behind us once all their gradients arrived
        # and every call's backward ended (a unit with frozen parameters whose end cannot be
        # seen is pinned instead: ``_begin_backward``).
        if unit.pending_calls == 0:
            self.release(unit)

    def _advance_crossings(self) -> None:
        """Hybrid sharding: start the reductions across replicas of the launched units whose
        group reduction is in, in launch order (the same order on every rank)."""
        for unit in self._launched:
            if not unit.grad_store.advance():
                return

    def _launch_ready(self) -> None:
        self._advance_crossings()
        order = self._launch_order
        while self._ready < len(order) and order[self._ready].index in self._complete:
            self._ready += 1
        while self._cursor < self._ready and self._window_open():
            unit = order[self._cursor]
            self._cursor += 1
            if not unit.trains:  # nothing to reduce, on every rank alike
                continue
            with record_function("zero::reduce"):
                unit.grad_store.launch_reduce(self.comm)
            self._launched.append(unit)
        self._window_open()

    def _window_open(self) -> bool:
        """Finish the oldest reductions while more than ``MAX_INFLIGHT_REDUCTIONS`` are in
        flight; False when one must stay: it is not in yet, and a peer may not have launched
        it (not agreed), so waiting for it could wait for a peer that waits for a gather this
        rank has not issued. Launches then stop until a later hook finds it in."""
        while len(self._launched) > MAX_INFLIGHT_REDUCTIONS:
            oldest = self._launched[0]
            agreed = self._agreed is None or self._position[oldest.index] < self._agreed
            if not (agreed or oldest.grad_store.reduced()):
                return False
            self._finish(self._launched.pop(0))
        return True

    def end_backward(self) -> None:
        """Reduce what unused parameters left pending, wait for every reduction, agree on
        which parameters were used anywhere, free."""
        self._to("end_backward")
        with record_function("zero::end_backward"):
            self._agreed = None  # every rank reaches this point: it launches everything
            self._launch_ready()
            for unit in self.units:
                if not unit.reduced_this_pass:
                    self._finish_unit(unit)
                unit.reduced_this_pass = False
                unit.pending_calls = 0
            for unit in self._launched:
                self._finish(unit)
            self._launched = []
            self._rest_grads(keep=0)
            for unit in self.units:
                unit.fence_grad_copy()
            self.gather_check.verify()  # before anything gathered can reach the step
            if self.sync:
                self._agree_on_used()
            self.reshard_all()
            self._backward_plan = self._backward_trace if self._recomputed else []
            self._plan_index = {u.index: i for i, u in enumerate(self._backward_plan)}
            self._callback_queued = False
            if self.sync:  # only now: every unit's reduction has ended
                self.progress.to("reduce")
        self._to("backward_done")

    def reset(self) -> None:
        """Back to "no pass in progress": wait for collectives already issued, then forget
        counts, order and pins. Run by ``zero_grad()``, so an exception in the middle of a
        pass leaves nothing behind (never from a pass running now: see ``_MOVES``)."""
        self.expect("reset")
        if self._state in (TrainingState.FORWARD_FAILED, TrainingState.BACKWARD_FAILED):
            self._match_peers_gathers()
            # The failed pass's order (possibly another on each rank) must not steer the
            # next pass's prefetches: ranks would gather in different orders.
            self._order, self._previous_order, self._backward_plan = [], [], []
            self._plan_index = {}
        if self._state is TrainingState.BACKWARD_FAILED:
            self._match_peers_launches()
        for unit in self._launched:
            unit.grad_store.wait()
        self._launched = []
        self._resting = []  # the pass's gradients are dropped with it
        self.gather_check.verify()
        for unit in self.units:
            unit.ready = 0
            unit.reduced_this_pass = False
            unit.pending_calls = 0
        self._start_launches(self._launch_order, agree=False)
        self._callback_queued = False
        self.reshard_all()
        self._to("reset")  # only now: an error above leaves the pass to reset again

    def _match_peers_gathers(self) -> None:
        """After a pass cut short (a ``GatherOrderError`` among the causes), ranks may hold
        gathers and headers no peer matched: another unit gathered at the same point, or
        more of them. Through the store (a collective would queue behind them) every rank
        learns which units each has in flight and how many headers each sent, then sends
        what it lacks (zeros, into scratch memory), so every exchange issued anywhere
        completes and none is left to match a later one; what arrives is discarded with the
        pass."""
        check = self.gather_check
        if self.world.world_size == 1 or not check.headers or check.deferred:
            return
        flying = [u for u in self.units if u.param_store.state is ParamState.GATHERING]
        masks = dict(zip(self.world.global_ranks(),
                         self.world.agree(sum(1 << u.index for u in flying))))
        group = [masks[r] for r in self.comm.global_ranks()]  # those this rank gathers with
        extra: list[Handle] = []
        for unit in self.units:
            if any(m >> unit.index & 1 for m in group) and unit not in flying:
                extra.append(self._gather_zeros(unit))
        headers = self.gather_check.match_headers()
        for handle in extra + headers:
            handle.wait()
        for unit in flying:
            unit.param_store.finish_unshard()

    def _gather_zeros(self, unit: Unit) -> Handle:
        store = unit.param_store
        rows = torch.empty(store.layout.padded_numel, dtype=store.full.dtype,
                           device=self.comm.device)
        mine = torch.zeros(store.layout.shard_numel, dtype=store.full.dtype,
                           device=self.comm.device)
        gather = self.comm.all_gather_int8 if store.policy.int8_gathers else self.comm.all_gather
        return gather(rows, mine, async_op=True, channel=unit.index)

    def _match_peers_launches(self) -> None:
        """After a backward cut short by an exception (on every rank), ranks may have
        launched different numbers of reductions: which units completed before the exception
        depends on each rank's data when ranks run different modules. Every rank launches, in
        the common order, up to the furthest rank's count, so each reduction issued anywhere is
        matched and completes; the sums are discarded with the pass."""
        if self.comm.world_size == 1:
            return
        if not self._callback_queued:  # nothing arrived here before the exception
            self._begin_backward()
        # Through the store: a collective would queue behind the unmatched reductions.
        furthest = self.world.agree_max(self._cursor)
        while self._cursor < furthest:
            unit = self._launch_order[self._cursor]
            self._cursor += 1
            if not unit.trains:
                continue
            unit.grad_store.launch_reduce(self.comm)
            self._launched.append(unit)

    def _agree_on_used(self) -> None:
        """One small all-reduce: a parameter no rank produced a gradient for since the last
        step is left alone by the optimizer, as torch skips a parameter whose grad is None."""
        flags = from_host([u for unit in self.units for u in unit.used], torch.float32,
                          self.units[0].grad_store.device)
        used = self.world.all_reduce_max_to_host(flags)
        offset = 0
        for unit in self.units:
            unit.stepped = [bool(u) for u in used[offset : offset + len(unit.params)]]
            offset += len(unit.params)

    def _finish(self, unit: Unit) -> None:
        unit.grad_store.finish_reduce()
        unit.prepare_master_grad()
        self._resting.append(unit)
        self._rest_grads(keep=1 if unit.grad_in_flight else 0)

    def _rest_grads(self, keep: int) -> None:
        while len(self._resting) > keep:
            self._resting.pop(0).rest_master_grad()
