"""States asserted at every transition, for every object with a life cycle.

An object that has one (a parameter store, the runtime's pass, the step) keeps one enum value
in ``_state`` and a table, ``MOVES``: for each operation, the states it may start from and the
state it leads to from each. ``_to(op)`` is the only code that changes ``_state``; it refuses
an operation from a state the table does not list, with an error naming the object, the
state it was in and the states the operation starts from. An operation that is rightly a
no-op from some state lists it, leading back to itself, so a wrong state is never skipped in
silence. ``expect(op)`` is the same check alone, for callers that must refuse before they
change anything else (FSDP2 asserts its parameters' states the same way).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar


class TransitionError(RuntimeError):
    """An operation was asked of an object in a state the operation does not start from."""

    def __init__(self, owner: str, op: str, state: enum.Enum, allowed: list[enum.Enum],
                 hint: str = "") -> None:
        self.owner, self.op, self.state, self.allowed = owner, op, state, allowed
        starts = ", ".join(repr(s.value) for s in allowed)
        message = (f"{owner}: {op} from state {state.value!r} is refused; {op} starts only "
                   f"from {starts}")
        super().__init__(f"{message}. {hint}" if hint else message)


Moves = Mapping[str, Mapping[Any, Any]]
"""For each operation: {state it may start from: state it leads to}."""


class StateMachine:
    """An object moved through one enum of states by ``_to`` alone."""

    MOVES: ClassVar[Moves]
    _state: Any

    def _owner(self) -> str:
        """The object as errors name it."""
        return type(self).__name__

    def _hint(self, op: str) -> str:
        """What to do instead, where the object knows (appended to its refusals)."""
        return ""

    @property
    def state(self) -> Any:
        return self._state

    def expect(self, op: str, hint: str = "") -> None:
        """Refuse ``op`` from the current state, before the caller changes anything."""
        if self._state not in self.MOVES[op]:
            raise self._refusal(op, hint)

    def _to(self, op: str) -> Any:
        """Move as ``op`` does from the current state (refused where it does not start from
        it); the state it started from, for operations whose work depends on it."""
        source = self._state
        target = self.MOVES[op].get(source)
        if target is None:
            raise self._refusal(op)
        self._state = target
        return source

    def _refusal(self, op: str, hint: str = "") -> TransitionError:
        return TransitionError(self._owner(), op, self._state, list(self.MOVES[op]),
                               hint or self._hint(op))


def every(states: type[enum.Enum], target: Any | None = None) -> dict[Any, Any]:
    """A table row for an operation allowed from every state: to ``target``, or (None) back
    to the state it started from."""
    return {s: s if target is None else target for s in states}
