"""When a pass is done with a stage-3 unit whose own gradients do not say so: a unit with
frozen parameters, and a routed block (``routed.py``) one of whose experts got no token.

A unit whose parameters all train is done with once all their gradients arrived: the node
that reads a weight in backward is the one that produces its gradient. A frozen parameter
never produces one, so its last read gives no signal of its own; nor does an expert that
received no token on this rank, whose gradients never arrive here. But a unit is done with
once the gradient of every input of its forward that requires one has been computed:
autograd computes an input's gradient only after every node between it and the loss has
run, and among nodes that are ready it runs first the ones recorded last (each node of the
unit's forward was recorded after the input it reads), accumulating a parameter's gradient
before anything else. So by then every gradient the unit gets in this pass has arrived, and
every read of its parameters is behind (what FSDP2 and DeepSpeed's ZeRO-3 free a module on).
A unit with frozen parameters is therefore freed once its trainable parameters' gradients
have arrived and its inputs' have been computed; a routed block is reduced then too,
whatever its idle experts did not send (they count as zeros, as under DDP), instead of at
the end of backward with every reduction after it in the launch order held back behind it.

And a forward that can build no graph through the unit (no input, no parameter of it and no
output requiring grad, no unit inside it hooked for backward) leaves nothing for backward:
the unit is free at once, as under ``torch.no_grad()``. Without these, a fine-tune that
freezes most of the model kept every frozen unit it ran whole until the end of backward: a
head-only fine-tune held the whole model per rank (issue 58).

What this cannot see is a parameter read in the unit's forward on a path to none of its
inputs (``W @ p`` with ``p`` a trainable tensor from elsewhere, added to the output): freed
when the input gradients are done, a frozen such weight would read as the placeholder's NaN
in backward, which the step's non-finite check reports, and a routed block's gradient
arriving after its reduction is refused by name. A unit that shows it (an output requiring
grad where no input or parameter of it does) stays whole to the end of backward; one whose
inputs need no gradient (nothing before it trains) is not watched: its frozen parameters
stay whole, and a routed block waits, to the end of backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from .units import Unit


@dataclass
class _Call:
    unit: Unit
    graph: bool
    """An input or a parameter of the unit requires grad: autograd may record through it."""
    hooked_before: int
    """``InputGrads.hooked`` when the call began."""


class InputGrads:
    """Per pass: for each unit watched (frozen parameters, a routed block), the input
    gradients still to come, and the forwards in progress (a stack: units nest)."""

    def __init__(self) -> None:
        self._due: dict[int, int] = {}
        self._calls: list[_Call] = []
        self._handles: list[RemovableHandle] = []
        """The input hooks of this pass, removed when it ends: an input may be a leaf that
        outlives it (a parameter, an embedding passed in), whose hooks torch keeps."""
        self.hooked = 0
        """Outputs hooked for backward so far (by the runtime): a unit inside another hooked
        its output when this moved during the outer one's forward."""

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._due.clear()
        self._calls.clear()

    def enter(self, unit: Unit, inputs: Any, done: Callable[[Unit], None],
              routed: bool = False) -> None:
        """A forward of ``unit`` begins with ``inputs`` (grad enabled): hook the gradient of
        each input that requires one when the unit has a frozen parameter or is ``routed``;
        ``done(unit)`` runs when the last of them is computed."""
        trainable = sum(1 for p in unit.params if p.requires_grad)
        grads = {id(t): t for t in tree_flatten(inputs)[0]
                 if isinstance(t, torch.Tensor) and t.requires_grad}
        self._calls.append(_Call(unit, bool(grads) or trainable > 0, self.hooked))
        if (trainable == len(unit.params) and not routed) or not grads:
            return
        self._due[unit.index] = self._due.get(unit.index, 0) + len(grads)

        def arrived(grad: torch.Tensor) -> None:
            left = self._due.get(unit.index, 0) - 1
            self._due[unit.index] = left
            if left == 0:
                done(unit)

        self._handles += [t.register_hook(arrived) for t in grads.values()]

    def leave(self, unit: Unit, hooked: bool) -> bool:
        """The forward of ``unit`` ended, its output ``hooked`` for backward or not: whether
        it recorded nothing a backward could read the unit's parameters for."""
        call = next((self._calls.pop(k) for k in range(len(self._calls) - 1, -1, -1)
                     if self._calls[k].unit is unit), None)
        if hooked:
            self.hooked += 1
            return False
        # None: entered before a reset, nothing known
        return call is not None and not call.graph and self.hooked == call.hooked_before

    def inputs_pending(self, unit: Unit) -> bool:
        """Input gradients of ``unit`` this pass has still to compute."""
        return self._due.get(unit.index, 0) > 0

    def untracked(self, unit: Unit) -> bool:
        """A unit whose forwards hooked no input: nothing but its own gradients tells when
        backward is done with it (see the module docstring)."""
        return unit.index not in self._due
