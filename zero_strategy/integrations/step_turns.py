"""Several optimizers stepped one by one, one engine step: what the Fabric and Accelerate
adapters share when a model is trained by ``[muon, adamw]``.

The engine steps every part of its optimizer at once (one ZeRO step: reduced gradients, every
part's update, one parameter all-gather). A framework loop steps them one by one::

    fabric.backward(loss)       # or accelerator.backward(loss)
    muon.step(); adamw.step()   # each a separate call the adapter receives

``StepTurns`` turns that into one engine step: the first ``.step()`` of any part after a
backward runs ``engine.step()`` for all of them; every other part's ``.step()`` before the
next backward is then a no-op that takes its turn. A part stepped twice without a backward in
between is an error, as a second ``engine.step()`` without reduced gradients is.
"""

from __future__ import annotations

import torch

from ..engine import ZeroEngine


class StepTurns:
    """Which of ``engine``'s optimizers have had their ``.step()`` since the last backward.

    Adapters call ``backward()`` when they run a backward and ``step(optimizer)`` for a
    part's (or the combined optimizer's) ``.step()``.
    """

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self._waiting: set[int] = set()
        """Parts the last engine step updated whose own ``.step()`` has not come yet."""
        self._stepped: set[int] = set()
        """Parts whose ``.step()`` came since the last backward."""
        self._result = True
        """What the last engine step returned (False: skipped for non-finite gradients)."""

    def covers(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is the engine's optimizer or one of its parts."""
        return optimizer is self.engine.user_optimizer or any(
            optimizer is part for part in self.engine.user_optimizers)

    def backward(self) -> None:
        """A backward starts: turns left from the previous step expire."""
        self._waiting.clear()
        self._stepped.clear()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` for a part (or the combined optimizer, i.e. every part).

        Returns the engine step's result: False when it was skipped (non-finite gradients
        on some rank), for the part that ran it and for the parts that take their turn.
        """
        ids = self._part_ids(optimizer)
        # Reduced gradients pending: a synchronising backward ran since the engine's last
        # step (its zero_grad clears them), so this is the first .step() of a new step.
        if self.engine.grads_pending:
            self._result = self.engine.step()
            self._waiting = set(self._all_ids()) - ids
            self._stepped = set(ids)
            return self._result
        if ids <= self._waiting:
            self._waiting -= ids
            self._stepped |= ids
            return self._result
        again = ids & self._stepped
        if again and len(self.engine.user_optimizers) > 1:
            raise RuntimeError(self._twice_message(again))
        return self.engine.step()  # raises the engine's "needs reduced gradients"

    def _all_ids(self) -> list[int]:
        return [id(part) for part in self.engine.user_optimizers]

    def _part_ids(self, optimizer: torch.optim.Optimizer) -> set[int]:
        if optimizer is self.engine.user_optimizer:
            return set(self._all_ids())
        if any(optimizer is part for part in self.engine.user_optimizers):
            return {id(optimizer)}
        names = [type(part).__name__ for part in self.engine.user_optimizers]
        raise ValueError(
            f"{type(optimizer).__name__} is not an optimizer of this ZeRO model (its "
            f"optimizers: {names}): step the optimizers it was set up with")

    def _twice_message(self, again: set[int]) -> str:
        parts = self.engine.user_optimizers
        named = [f"optimizer {k} ({type(p).__name__})" for k, p in enumerate(parts)
                 if id(p) in again]
        verb = "was" if len(named) == 1 else "were"
        return (
            f"{' and '.join(named)} {verb} stepped twice without a backward in between: the "
            f"first .step() of any of this model's {len(parts)} optimizers after a backward "
            "steps all of them (one ZeRO step), each other one's .step() only takes its turn; "
            "run a backward before stepping again"
        )
