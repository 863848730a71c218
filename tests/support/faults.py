"""A fault injector for the engine's steps: named points of a step made to fail on demand.

``disk_full`` makes one of ``os``'s write functions refuse with ENOSPC from its k-th call on,
as a filesystem that fills up does (it stays full until the block ends): ``pwrite`` is the
activation writer's (``core/activations.py``), ``pwritev`` the disk tier's write-back
(``offload/disk.py``). Deterministic, unlike a real small tmpfs, whose first failing write
depends on sizes and timing (tests/integration/test_step_faults.py uses one too).

``inject`` raises ``InjectedFault`` at a named point of an engine's step (``POINTS``): the
forward of a unit, its recomputation, its backward, its reduction, the clip, the optimizer
step (before any update, or after the inner optimizer updated: a step cut short), saving and
loading a checkpointed module's input.

``checkpoint_write_fault`` cuts the checkpoint writer's shard file short on the ranks it
fires on.

``census`` counts what a failed step must not leave behind: the files under a folder and the
process's open descriptors.

``HungryMLP`` runs out of memory above a batch size, as the batch-size finders of Lightning
and Accelerate expect on the CPU.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.models import MLP

WRITERS = ("pwrite", "pwritev")
"""The write functions that can be made to fail: the activation writer's, the disk tier's."""


@dataclass
class Injected:
    """What an injection did: how many calls it saw, how many it refused."""

    calls: int = 0
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@contextlib.contextmanager
def disk_full(function: str = "pwrite", after: int = 0) -> Iterator[Injected]:
    """``os.<function>`` raises ``OSError(ENOSPC)`` from call ``after + 1`` on (0: at once)
    until the block ends; calls before go through. Patched on the ``os`` module, so the
    writer threads see it too."""
    if function not in WRITERS:
        raise ValueError(f"disk_full: {function!r} is not one of {WRITERS}")
    real: Callable[..., Any] = getattr(os, function)
    seen = Injected()

    def failing(*args: Any, **kwargs: Any) -> Any:
        with seen._lock:
            seen.calls += 1
            refuse = seen.calls > after
            seen.refused += refuse
        if refuse:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    setattr(os, function, failing)
    try:
        yield seen
    finally:
        setattr(os, function, real)


class InjectedFault(RuntimeError):
    """Raised by ``inject`` at its point."""


POINTS = ("forward", "recompute", "backward", "reduce", "clip", "optimizer_step",
          "optimizer_step_after", "activation_save", "activation_load")
"""Where ``inject`` can raise. ``optimizer_step_after`` leaves the optimizer stepped and the
rest of the step not: the engine must refuse to train until a checkpoint is loaded."""


@contextlib.contextmanager
def inject(engine: Any, point: str, module: str = "blocks.1.0", unit: int = 0,
           fire: bool = True) -> Iterator[Injected]:
    """Raise ``InjectedFault`` the first time the step reaches ``point`` inside the block:
    the forward or recomputation of ``module`` (by name), the backward (a gradient arriving)
    or the reduction of ``engine.units[unit]``; ``fire=False`` (a rank the fault spares) only
    counts. Everything patched is put back when the block ends."""
    if point not in POINTS:
        raise ValueError(f"inject: {point!r} is not one of {POINTS}")
    seen = Injected()

    def trip(*_: Any, **__: Any) -> None:
        seen.calls += 1
        if fire and not seen.refused:
            seen.refused += 1
            where = {"forward": module, "recompute": module}.get(point, f"unit {unit}")
            raise InjectedFault(f"injected fault: {point} of {where}" if point in _OF_UNIT
                                else f"injected fault: {point}")

    target = engine.units[unit]
    undo = _install(engine, point, target, dict(engine.module.named_modules())[module], trip)
    try:
        yield seen
    finally:
        undo()


_OF_UNIT = ("forward", "recompute", "backward", "reduce")


def _install(engine: Any, point: str, target: Any, module: Any,
             trip: Callable[..., None]) -> Callable[[], None]:
    """Put ``trip`` at ``point``; what undoes it."""
    runtime = engine.runtime
    if point in ("forward", "recompute"):
        def pre_forward(*_: Any) -> None:
            if runtime.recomputing() == (point == "recompute"):
                trip()
        return module.register_forward_pre_hook(pre_forward).remove
    if point == "backward":
        return _wrap(runtime, "on_grad", lambda unit, *_: unit is target and trip())
    if point == "reduce":
        return _wrap(target.grad_store, "launch_reduce", lambda *_: trip())
    if point == "clip":
        return _wrap(engine.optimizer, "clip_grad_norm_", lambda *_: trip())
    if point in ("optimizer_step", "optimizer_step_after"):
        inner = engine.optimizer.parts[0].inner
        hook = (inner.register_step_pre_hook if point == "optimizer_step"
                else inner.register_step_post_hook)
        return hook(lambda *_: trip()).remove
    inputs = engine.activations.inputs
    name = "_pack" if point == "activation_save" else "_unpack"
    return _wrap(inputs, name, lambda *_: trip())


def _wrap(owner: Any, name: str, before: Callable[..., Any]) -> Callable[[], None]:
    """``owner.name`` runs ``before`` with its arguments first (an instance attribute,
    looked up at each call); what restores it."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    return lambda: owner.__dict__.pop(name, None)


@contextlib.contextmanager
def checkpoint_write_fault(fire: bool = True) -> Iterator[Injected]:
    """The checkpoint writer's shard file (``checkpoint.write._save_tensors``) is cut short
    where ``fire``: a first MiB of it lands, then ``InjectedFault``, as a disk that fills
    while a checkpoint is written; ``fire=False`` (a rank the fault spares) only counts."""
    from zero_strategy.checkpoint import write

    real, seen = write._save_tensors, Injected()

    def failing(tensors: dict[str, Any], path: Any) -> dict[str, Any]:
        seen.calls += 1
        if not fire:
            return real(tensors, path)
        seen.refused += 1
        path.write_bytes(b"\0" * (1 << 20))  # the part that fit
        raise InjectedFault(f"injected fault: checkpoint_write of {path.name}")

    write._save_tensors = failing
    try:
        yield seen
    finally:
        write._save_tensors = real


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def files_under(folder: str | None) -> list[str]:
    """Every file and folder below ``folder`` (relative paths), sorted."""
    if folder is None or not os.path.isdir(folder):
        return []
    out = []
    for root, dirs, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in dirs + files]
    return sorted(out)


def census(folder: str | None) -> dict[str, Any]:
    """What a failed step must give back: the files under ``folder``, open descriptors."""
    return {"files": files_under(folder), "fds": open_descriptors()}


# ------------------------------------------------------------------ shared checks
def assert_activation_fault_recovered(r: dict[str, Any], module: str, nbytes: int) -> None:
    """A step whose activation write met a full disk: named, released, recovered."""
    assert r["raised"] == "DiskFullError" and r["is_disk_full"], r
    assert r["errno"] == errno.ENOSPC
    message = r["message"]
    # the folder, what was being written, the bytes, and what to do
    # the folder is under the world's own TMPDIR (tests/support/harness.py)
    assert re.search(r"offload_dir='[^']*/zs-stepfault-", message), message
    assert f"activation input of module {module!r}" in message, message
    assert f"{nbytes} bytes needed" in message and "engine.zero_grad()" in message, message
    assert r["refused"] >= 1
    # nothing the failed step took is kept: files under the folder, descriptors
    assert r["census_after"] == r["census_before"], (r["census_before"], r["census_after"])
    assert r["census_end"] == r["census_before"]
    # the next steps are the reference's, which never ran the failed step
    assert r["losses"] == r["ref_losses"]
    assert r["same"] == {"weights": True, "optimizer": True}
    assert r["left"] == []


def assert_tier_fault_handled(r: dict[str, Any]) -> None:
    """A step whose disk-tier write-back met a full disk: named; then recovered, or refused
    until the checkpoint was loaded; the next steps the reference's either way."""
    assert r["calls_in_a_step"] > 0
    assert r["raised"] == "DiskFullError" and r["is_disk_full"] and r["errno"] == errno.ENOSPC, r
    assert re.search(r"offload_dir='[^']*/zs-tierfault-", r["message"]), r["message"]
    assert "could not write back" in r["message"] and " bytes)" in r["message"], r["message"]
    if r["refused"] is not None:  # an optimizer step cut short: reload, never train on
        assert "reload the last checkpoint" in r["refused"], r["refused"]
        assert "refuses to train" in r["message"], r["message"]
    assert r["census_after"] == r["census_before"], (r["census_before"], r["census_after"])
    assert r["census_end"] == r["census_before"]
    assert r["losses"] == r["ref_losses"]
    assert r["same"] == {"weights": True, "optimizer": True}
    assert r["left"] == []


def assert_one_rank_tier_fault_agreed(failed: dict[str, Any], peer: dict[str, Any]) -> None:
    """Only rank 0's disk tier failed: rank 0 as ``assert_tier_fault_handled``; rank 1 raised
    ``PeerCutShort`` naming rank 0 wherever rank 0's error stopped the step (nothing where it
    stepped and only a later write-back failed), and refused exactly when rank 0 refused;
    both then train on as the reference."""
    assert_tier_fault_handled(failed)
    if failed["stepped"]:
        assert peer["raised"] is None and peer["stepped"], peer
    else:
        assert peer["raised"] == "PeerCutShort" and "rank(s) [0]" in peer["message"], peer
    assert (peer["refused"] is None) == (failed["refused"] is None), (failed, peer)
    if peer["refused"] is not None:
        assert "reload the last checkpoint" in peer["refused"], peer["refused"]
    assert peer["census_after"] == peer["census_before"]
    assert peer["losses"] == peer["ref_losses"]
    assert peer["same"] == {"weights": True, "optimizer": True}
    assert peer["left"] == []


def assert_mixed_refusal(name: str, results: list[dict[str, Any]]) -> None:
    """Disk tier, N=2 (``mixed_cut_disk``): rank 1 raised before its update; rank 0 raised
    after its own (``mixed_cut_*``) or stepped and raised ``PeerCutShort`` naming rank 1
    (``mixed_stepped_*``). Both refuse until the reload, then train as the reference."""
    first = ("PeerCutShort: rank(s) [1]" if name.startswith("mixed_stepped")
             else "InjectedFault: injected fault: optimizer_step_after")
    for rank, r in enumerate(results):
        raised = first if rank == 0 else "InjectedFault: injected fault: optimizer_step"
        assert r["raised"] is not None and r["raised"].startswith(raised), (rank, r["raised"])
        assert r["refused"] is not None and "reload the last checkpoint" in r["refused"], r
        assert r["losses"] == r["ref_losses"]
        assert r["same"] == {"weights": True, "optimizer": True}


def assert_peer_names_failed_rank(failed: dict[str, Any], peer: dict[str, Any]) -> None:
    assert failed["raised"] == "DiskFullError", failed
    assert peer["raised"] in ("CollectiveTimeout", "CollectiveError"), peer
    assert "rank 0 failed: DiskFullError in backward" in peer["message"], peer["message"]
    assert "offload_dir=" in peer["message"]


def assert_point_fault_handled(r: dict[str, Any], point: str) -> None:
    """``inject(point)``: the injected error; the same files and descriptors after as before;
    refused until the reload exactly where the optimizer had begun updating; the next steps
    the reference's."""
    assert r["raised"] is not None and r["raised"].startswith(f"injected fault: {point}"), r
    assert r["calls"] == 1
    if point == "optimizer_step_after":
        assert r["refused"] is not None and "reload the last checkpoint" in r["refused"], r
    else:
        assert r["refused"] is None, r["refused"]
    assert r["census_after"] == r["census_before"], (r["census_before"], r["census_after"])
    assert r["losses"] == r["ref_losses"]
    assert r["same"] == {"weights": True, "optimizer": True}
    assert r["left"] == []


# ------------------------------------------------------------------ out of memory
LIMIT = 8
"""Rows a ``HungryMLP`` batch may hold before it runs out of memory."""
OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate {} bytes."
"""A CPU allocation failure's words: what Lightning's ``is_oom_error`` and Accelerate's
``should_reduce_batch_size`` recognise (a ``RuntimeError`` with this one argument)."""


class _FailInBackward(torch.autograd.Function):
    """Identity forward; a backward that runs out of memory for a batch above LIMIT."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        ctx.rows = h.shape[0]
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.rows > LIMIT:
            raise RuntimeError(OOM.format(ctx.rows * 2**30))
        return grad


class HungryMLP(MLP):
    """``MLP`` that runs out of memory above LIMIT rows, in ``where``: "forward" (before any
    layer) or "backward" (after the gradients, and under ZeRO the reductions, of the last
    blocks ran, before the first block's)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward" and x.shape[0] > LIMIT:
            raise RuntimeError(OOM.format(x.shape[0] * 2**30))
        h = torch.relu(self.inp(x))
        for i, block in enumerate(self.blocks):
            h = h + block(h)
            if i == 0 and self.where == "backward":
                h = _FailInBackward.apply(h)
        return self.out(self.norm(h))


def assert_checkpoint_write_fault_handled(ranks: list[dict[str, Any]]) -> None:
    """Rank 0's shard file cut short while writing tag "b": every rank raised naming rank 0
    and the injected fault; "a" is still ``latest`` with the same tensors; "b" is refused
    (nothing of it published, no temporary folder left); training went on bit for bit as a
    reference that never tried the save; the next save of "b" holds the engine's weights."""
    for rank, r in enumerate(ranks):
        assert r["raised"] is not None, r
        assert "failed while writing on rank 0 (rank 0: InjectedFault: injected fault: " \
            "checkpoint_write" in r["raised"], r["raised"]
        assert "nothing was published" in r["raised"], r["raised"]
        assert r["refused"] == (1 if rank == 0 else 0) and r["calls"] >= r["refused"]
        assert r["entries"] == ["a", "latest"] and r["latest"] == "a", r  # no .tmp-b left
        assert r["a_intact"], "the previous checkpoint changed"
        assert r["b_refused"] is not None and r["b_refused"].startswith("CheckpointError")
        assert r["losses"] == r["ref_losses"]
        assert r["same"] == {"weights": True, "optimizer": True}
        assert r["b_saved"]

