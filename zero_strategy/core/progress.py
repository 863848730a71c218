"""How far the step has come: reduced gradients, unscaled, clipped, the update, a failure.

The runtime moves it once, when a synchronised backward has ended (``reduce``); the engine's
step (``engine/step.py``) moves it the rest of the way. The two values that ride with a phase
are kept beside it and read only through it: the clipping norm is the step's in CLIPPED alone,
the reason in CUT_SHORT alone.

    NOT_REDUCED --reduce--> REDUCED --unscale (fp16)--> UNSCALED --clip_norm--> CLIPPED
        REDUCED / UNSCALED / CLIPPED --update--> UPDATING --updated--> UPDATED --done--> NOT_REDUCED
    a forward, backward or step that raised before the update --fail--> FAILED
    an update cut short --cut_short--> CUT_SHORT --reload (a checkpoint)--> NOT_REDUCED
    zero_grad (forget): every phase but UPDATING / UPDATED --> NOT_REDUCED (CUT_SHORT stays)
"""

from __future__ import annotations

import enum

import torch

from .states import Moves, StateMachine


class StepPhase(enum.Enum):
    NOT_REDUCED = "not-reduced"
    """No reduced gradient waits for a step (local ones may accumulate under ``no_sync``)."""
    REDUCED = "reduced"
    """A synchronised backward has ended: every unit's gradients are reduced (still times the
    fp16 loss scale, where there is one)."""
    UNSCALED = "unscaled"
    """fp16: the reduced gradients are divided by the loss scale (with the disk tier the
    division waits in each unit for the next read of its gradient, the step's, and every
    read makes it first: nothing reads a gradient still scaled)."""
    CLIPPED = "clipped"
    """``clip_grad_norm_`` computed the global norm (``StepProgress.norm``): the step reads
    whether the gradients are finite from it instead of another collective."""
    UPDATING = "updating"
    """An inner optimizer's update began: an error now leaves some shards stepped."""
    UPDATED = "updated"
    """Every rank's update went through: the masters are the new step's; the gradients are
    being forgotten and the compute copies refreshed."""
    FAILED = "failed"
    """A forward, backward or step raised on this rank before anything was updated; its error
    is in the store for the peers' timeouts. ``zero_grad()`` forgets the pass."""
    CUT_SHORT = "cut-short"
    """An update was cut short (here or on a peer): weights and optimizer states are no
    longer one step's (``StepProgress.reason`` says why); only a checkpoint loads them."""


_P = StepPhase
_WITH_GRADS = (_P.REDUCED, _P.UNSCALED, _P.CLIPPED)
_BEFORE_UPDATE = (_P.NOT_REDUCED, *_WITH_GRADS, _P.FAILED)
_CALLS = {"step": "step", "clip_norm": "clip_grad_norm_", "clip_value": "clip_grad_value_",
          "read_norm": "get_global_grad_norm"}
"""The engine call behind each move that reads the reduced gradients."""


class StepProgress(StateMachine):
    """The step's phase, moved by ``_to`` alone, and the values that ride with it."""

    MOVES: Moves = {
        # Another synchronised backward before the step adds to reduced gradients; after an
        # unscale or a clip it would mix scaled (or unclipped) gradients into them.
        "reduce": {_P.NOT_REDUCED: _P.REDUCED, _P.REDUCED: _P.REDUCED},
        # Once per step: the later calls (a clip, then the step) find them divided already.
        "unscale": {_P.REDUCED: _P.UNSCALED, _P.UNSCALED: _P.UNSCALED, _P.CLIPPED: _P.CLIPPED},
        # From REDUCED without a loss scale (nothing to divide); a second clip's norm wins.
        "clip_norm": {s: _P.CLIPPED for s in _WITH_GRADS},
        # Checks alone: what these calls read holds from each, and they move nothing.
        "clip_value": {s: s for s in _WITH_GRADS},
        "read_norm": {s: s for s in _WITH_GRADS},
        "step": {s: s for s in _WITH_GRADS},
        # Once per inner optimizer (each one's last pre-hook).
        "update": {**{s: _P.UPDATING for s in _WITH_GRADS}, _P.UPDATING: _P.UPDATING},
        # From the phases before it too: a rank that owns nothing of an inner optimizer
        # steps none of them, but its masters are the new step's once every rank agreed.
        "updated": {s: _P.UPDATED for s in (*_WITH_GRADS, _P.UPDATING)},
        "done": {_P.UPDATED: _P.NOT_REDUCED},
        "fail": {s: _P.FAILED for s in _BEFORE_UPDATE},
        # From the phases before the update too: a peer's update was cut short, or the disk
        # tier could not write this rank's values back.
        "cut_short": {s: _P.CUT_SHORT for s in (*_WITH_GRADS, _P.UPDATING, _P.UPDATED)},
        "forget": {**{s: _P.NOT_REDUCED for s in _BEFORE_UPDATE}, _P.CUT_SHORT: _P.CUT_SHORT},
        "reload": {_P.NOT_REDUCED: _P.NOT_REDUCED, _P.CUT_SHORT: _P.NOT_REDUCED},
    }

    def __init__(self) -> None:
        self._state = StepPhase.NOT_REDUCED
        self._norm: torch.Tensor | None = None
        self._reason = ""

    def _owner(self) -> str:
        return "the engine's step"

    def _hint(self, op: str) -> str:
        if self._state is StepPhase.FAILED:
            return ("A forward, backward or step raised on this rank: engine.zero_grad() "
                    "forgets that pass first")
        if op == "reduce" and self._state in (StepPhase.UNSCALED, StepPhase.CLIPPED):
            return ("The gradients were already unscaled or clipped for a step: call "
                    "engine.step() or engine.zero_grad() before the next backward")
        if self._state is StepPhase.NOT_REDUCED and op in _CALLS:
            return (f"engine.{_CALLS[op]}() needs reduced gradients: call engine.backward(loss) "
                    "outside no_sync() first (the last micro-batch of an accumulation window "
                    "must synchronise)")
        return ""

    @property
    def phase(self) -> StepPhase:
        return self._state

    def to(self, op: str) -> StepPhase:
        """Move as ``op`` does; the phase it started from."""
        return self._to(op)

    @property
    def grads_pending(self) -> bool:
        """Reduced gradients wait for ``step()``."""
        return self._state in _WITH_GRADS

    @property
    def reported(self) -> bool:
        """This rank's error is in the store for its peers (``zero_grad()`` takes it back)."""
        return self._state in (StepPhase.FAILED, StepPhase.CUT_SHORT)

    def clipped(self, norm: torch.Tensor) -> None:
        self._to("clip_norm")
        self._norm = norm

    @property
    def norm(self) -> torch.Tensor | None:
        """The global gradient norm this step clipped by; None before a clip."""
        return self._norm if self._state is StepPhase.CLIPPED else None

    def cut_short(self, reason: str) -> None:
        self._to("cut_short")
        self._reason = reason

    @property
    def reason(self) -> str | None:
        """Why training is refused until a checkpoint loads; None while it is not."""
        return self._reason if self._state is StepPhase.CUT_SHORT else None

