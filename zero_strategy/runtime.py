"""What happens during forward and backward: gathers, prefetches, frees and reductions.

The runtime is driven by the hooks in ``hooks.py``. It never asks for the stage: a replicated
param store makes gather/free no-ops, and the grad store the plan chose decides what a
reduction is. Collectives are issued in the same order on every rank because every rank runs
the same modules in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

from .collectives import Communicator
from .hooks import queue_end_of_backward, register_pre_backward
from .units import Unit

# Reductions in flight at once. Each holds a unit's full-size local gradient buffer until it
# completes, so the window bounds stage 2/3's transient gradient memory to a few units while
# still overlapping communication with the rest of backward.
MAX_INFLIGHT_REDUCTIONS = 2


class Runtime:
    def __init__(self, units: list[Unit], comm: Communicator, root: torch.nn.Module,
                 prefetch: bool) -> None:
        self.units = units
        self.comm = comm
        self.prefetch = prefetch
        self.root_unit = next((u for u in units if u.module is root), None)
        self.sync = True
        self.grads_pending_step = False
        """True once a synchronised backward has finished and its gradients are reduced."""
        self._order: list[Unit] = []
        self._previous_order: list[Unit] = []
        self._in_order: set[int] = set()
        self._callback_queued = False
        self._launched: list[Unit] = []

    # ---------------------------------------------------------------- forward
    def begin_forward(self) -> None:
        if self._order:
            self._previous_order = self._order
        self._order, self._in_order = [], set()

    def pre_forward(self, unit: Unit) -> None:
        with record_function("zero::gather"):
            if unit.index not in self._in_order:
                self._in_order.add(unit.index)
                self._order.append(unit)
            unit.param_store.start_unshard(self.comm)
            if self.prefetch:
                self._prefetch_after(unit, self._previous_order)
            unit.param_store.finish_unshard()

    def post_forward(self, unit: Unit, output: Any) -> None:
        hooked = torch.is_grad_enabled() and register_pre_backward(
            output, lambda: self.pre_backward(unit)
        )
        if not torch.is_grad_enabled() and unit is self.root_unit:
            self.reshard_all()  # inference: nothing will need the parameters again
        elif unit is not self.root_unit and (hooked or not torch.is_grad_enabled()):
            # Only free what a pre-backward hook can bring back; an output we cannot hook
            # keeps its unit gathered until the end of backward.
            with record_function("zero::free"):
                unit.param_store.reshard()

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        for i, u in enumerate(order[:-1]):
            if u is unit:
                order[i + 1].param_store.start_unshard(self.comm)
                return

    # ---------------------------------------------------------------- backward
    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self.end_backward)

    def pre_backward(self, unit: Unit) -> None:
        self._ensure_callback()
        with record_function("zero::gather_for_backward"):
            unit.param_store.start_unshard(self.comm)
            if self.prefetch:
                self._prefetch_after(unit, self._order[::-1])
            unit.param_store.finish_unshard()

    def on_grad(self, unit: Unit, index: int, param: torch.Tensor) -> None:
        self._ensure_callback()
        grad = param.grad
        assert grad is not None
        unit.grad_store.accumulate(index, grad)
        param.grad = None  # the store holds it now; a full-size .grad would defeat sharding
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._complete(unit)

    def _complete(self, unit: Unit) -> None:
        unit.ready = 0
        unit.reduced_this_pass = True
        if self.sync:
            with record_function("zero::reduce"):
                unit.grad_store.launch_reduce(self.comm)
            self._launched.append(unit)
            while len(self._launched) > MAX_INFLIGHT_REDUCTIONS:
                self._finish(self._launched.pop(0))
        # Every use of the unit's parameters is behind us once all their gradients arrived.
        unit.param_store.reshard()

    def end_backward(self) -> None:
        """Reduce what unused parameters left pending, wait for every reduction, free."""
        with record_function("zero::end_backward"):
            for unit in self.units:
                if not unit.reduced_this_pass:
                    self._complete(unit)
                unit.reduced_this_pass = False
            for unit in self._launched:
                self._finish(unit)
            self._launched = []
            self.reshard_all()
            self._callback_queued = False

    def _finish(self, unit: Unit) -> None:
        unit.grad_store.finish_reduce(self.comm.world_size)
        unit.prepare_master_grad()
        self.grads_pending_step = True

    # ---------------------------------------------------------------- step
    def reshard_all(self) -> None:
        for unit in self.units:
            unit.param_store.reshard()
