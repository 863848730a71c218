"""``EngineParts``: what one engine is made of, declared in one place.

``setup.build`` creates every collaborator onto it in order; ``step.py`` and ``state.py`` are
functions over it; ``ZeroEngine`` is its public face. They share this class rather than the
facade so that none of them imports ``ZeroEngine`` (no cycle), and every part stays a plain
attribute: the forward and backward read them with no property or call in between. The parts
the layers below the engine read are declared in ``engine_view.ViewParts``, inherited here;
this class adds the rest. Every part is assigned by ``setup.py``; the few moved later are
listed in ``MOVED_BY`` with the modules that move them, and no other module assigns any
(tests/quick/test_import_graph.py reads every assignment in the package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.units import UnitComms
from ..engine_view import ViewParts

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    import torch

    from ..core.access import ParamAccess
    from ..core.buffers import BufferPool
    from ..core.generation import GenerationMode
    from ..core.hooks import HookSet, ModulePatches
    from ..core.params import Placement
    from ..core.progress import StepProgress
    from ..optim.state import UserOptimizerPatch

MOVED_BY: dict[str, tuple[str, ...]] = {
    # The counters: a step moves them, a checkpoint's load restores them.
    "global_step": ("engine/step.py", "checkpoint/read.py"),
    "skipped_steps": ("engine/step.py", "checkpoint/read.py"),
    # Parameters added to the optimizer (or unfrozen) after construction are adopted.
    "num_params": ("engine/step.py",),
    "param_names": ("engine/step.py",),
    "original_dtypes": ("engine/step.py",),
    "_optimizer_signature": ("engine/step.py",),
    "_buffers": ("engine/step.py",),
    # close(): the module is a plain nn.Module again.
    "_closed": ("engine/state.py",),
    "units": ("engine/state.py",),
}
"""The parts assigned after ``setup.build``, and the only modules that assign them (an
item's assignment, ``parts.param_names[id(p)] = name``, counts). ``progress`` is never
reassigned: it moves through its own table (``core/progress.py``)."""


class EngineParts(ViewParts):
    """The collaborators of one engine and the counters its steps move (those the layers
    below read: ``ViewParts``)."""

    device: torch.device
    forward_context: Callable[[], AbstractContextManager[Any]]
    """What the module's forward runs inside: autocast under the "-autocast" precisions."""
    pool: BufferPool
    placement: Placement
    optimizer_patches: list[UserOptimizerPatch]
    hooks: HookSet
    access: ParamAccess
    patches: ModulePatches
    generation_mode: GenerationMode | None
    """Stage 3: holds units for a ``generate()`` call (None where nothing is gathered)."""
    progress: StepProgress
    """The step's phase (reduced, unscaled, clipped, updating, failed, cut short...): moved
    by the runtime at the end of a synchronised backward, by step.py, and by
    ``ZeroEngine.load_checkpoint`` (a reload ends a step cut short)."""
    _closed: bool
    _buffers: list[torch.Tensor]
    """The module's buffers, broadcast from rank 0 before each forward."""
    _optimizer_signature: tuple[int, ...]
    """The user's optimizer's parameters when last adopted: a change adopts the new ones."""

    def check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine was closed; the module is a plain "
                               "nn.Module again (build a new ZeroEngine to keep training)")

    def check_trainable(self, what: str) -> None:
        self.check_open(what)
        reason = self.progress.reason
        if reason is not None:
            raise RuntimeError(
                f"engine.{what}(): {reason}; the weights and optimizer states are "
                "no longer those of one step, so the engine will not train on them: reload "
                "the last checkpoint (engine.load_checkpoint(directory)) first")

    def unit_comms(self) -> UnitComms:
        return UnitComms(shards=self.shards, world=self.comm, replicas=self.replicas)
