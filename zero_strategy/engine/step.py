"""The training step over an engine's parts: forward and backward, unscaling, clipping, the
non-finite check, the optimizer step, forgetting gradients, and following what the user
changed between steps (parameters added to the optimizer, parameters unfrozen)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.profiler import record_function

from ..core.flat import FROZEN_GROUP
from ..core.progress import StepPhase
from ..core.units import NamedParams, Unit, build_units
from ..optim.combined import parts as optimizer_parts
from .parts import EngineParts
from .setup import managed_parameters, signature


def forward(parts: EngineParts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    parts.check_trainable("forward")
    parts.runtime.expect("forward")  # before parameters are adopted below
    _follow_trainability(parts)
    parts.runtime.begin_forward()
    try:
        if parts.plan.broadcast_buffers and parts._buffers:
            with torch.no_grad(), record_function("zero::broadcast_buffers"):
                parts.comm.broadcast_coalesced(parts._buffers)
        args, kwargs = parts.plan.policy.cast_inputs(args, kwargs)
        with record_function("zero::forward"), parts.activations.forward_pass(), \
                parts.forward_context():
            output = parts.module(*args, **kwargs)
        parts.runtime.end_forward()
    except BaseException as e:
        # The pass is abandoned (zero_grad() resets the runtime): what it saved for a
        # backward that will not come goes now, not when the caller drops the traceback.
        parts.activations.release_failed()
        _failed(parts, "forward", e)
        raise
    return output


def backward(parts: EngineParts, loss: torch.Tensor, **kwargs: Any) -> None:
    parts.check_trainable("backward")
    parts.runtime.expect("backward")
    parts.progress.expect("reduce")  # not after an unscale, a clip or a failure
    parts.hooks.ensure_grad_hooks(parts.units, parts.runtime)  # unfrozen since the forward
    # Which units reduce, agreed by every rank before any does (no_sync reduces none).
    parts.runtime.follow_trainability(agree=parts.runtime.sync)
    if parts.scaler is not None:
        loss = loss.float() * parts.scaler.scale
    with record_function("zero::backward"):
        try:
            loss.backward(**kwargs)
        except BaseException as e:
            parts.activations.release_failed()  # every file the failed pass still holds
            _failed(parts, "backward", e)  # zero_grad() then matches the peers' reductions
            raise


def _failed(parts: EngineParts, where: str, error: BaseException) -> None:
    parts.runtime.failed_in(where)
    _report(parts, where, error)
    parts.progress.to("fail")


def _unscale(parts: EngineParts) -> None:
    """fp16: divide the reduced gradients by the loss scale, once per step (the disk tier
    defers the division to the step's read of each gradient)."""
    if parts.scaler is None:
        return  # no loss scale: reduced gradients are the true ones
    if parts.progress.to("unscale") is not StepPhase.REDUCED:
        return  # divided already (listed in StepProgress.MOVES)
    parts.optimizer.unscale_grads(1.0 / parts.scaler.scale)


def _expect_reduced(parts: EngineParts, call: str, op: str) -> None:
    """Refuse ``call`` (it reads the reduced gradients) before it changes anything: from a
    hook inside the engine's own pass (some units not reduced yet), after a pass that raised,
    or before a synchronised backward."""
    parts.runtime.expect(call)
    parts.progress.expect(op)


def clip_grad_norm_(parts: EngineParts, max_norm: float, norm_type: float) -> torch.Tensor:
    _expect_reduced(parts, "clip_grad_norm_", "clip_norm")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    _unscale(parts)
    with record_function("zero::clip_grad_norm"):
        norm = parts.optimizer.clip_grad_norm_(max_norm, norm_type)
    parts.progress.clipped(norm)  # step() reads finiteness from it instead of a collective
    return norm


def clip_grad_value_(parts: EngineParts, clip_value: float) -> None:
    _expect_reduced(parts, "clip_grad_value_", "clip_value")
    if not clip_value > 0:
        raise ValueError(f"clip_value must be > 0, got {clip_value!r}")
    _unscale(parts)
    with record_function("zero::clip_grad_value"):
        for g in parts.optimizer.master_grads():
            g.clamp_(-clip_value, clip_value)


def grad_norm(parts: EngineParts, norm_type: float) -> torch.Tensor:
    _expect_reduced(parts, "get_global_grad_norm", "read_norm")
    _unscale(parts)
    return parts.optimizer.grad_norm(norm_type)


def _nonfinite(parts: EngineParts) -> bool:
    """Whether any rank holds an inf/NaN gradient: the clipping norm when this step
    computed one (already global, no extra collective), else one scalar all-reduce over a
    flag built on the device (a single host sync per step)."""
    if parts.config.nonfinite_grads == "off" and parts.scaler is None:
        return False
    norm = parts.progress.norm
    if norm is not None:
        return not bool(torch.isfinite(norm))
    local = parts.optimizer.nonfinite_local(parts.device)
    return bool(parts.comm.all_reduce_max_to_host(local.reshape(1))[0])


def step(parts: EngineParts) -> bool:
    """The optimizer step, or a skip on every rank (see ``ZeroEngine.step``)."""
    parts.check_trainable("step")
    _expect_reduced(parts, "step", "step")
    _agree_before_update(parts)
    _refuse_stray_grads(parts)
    parts.runtime.settle()  # fp32 masters are views of compute copies a gather may write
    _unscale(parts)
    nonfinite = _nonfinite(parts)
    if parts.scaler is not None:
        parts.scaler.update(nonfinite)
    if nonfinite:
        parts.skipped_steps += 1
        zero_grad(parts)
        _report_nonfinite(parts)
    else:
        _update(parts)
    # torch's LR schedulers warn unless the optimizer they wrap was stepped; the engine
    # steps its inner copy (or skips), so record the call on the user's object.
    user = [parts.user_optimizer, *optimizer_parts(parts.user_optimizer)]
    for opt in {id(o): o for o in user}.values():
        opt._opt_called = True  # type: ignore[attr-defined]
    return not nonfinite


def _update(parts: EngineParts) -> None:
    """The optimizer step and what follows it. An exception before any inner optimizer
    updated anything (a step pre-hook, a read of the gradients) leaves the state as it was:
    ``zero_grad()`` and go on. One after (an inner step of several, the disk tier's
    write-back of a unit stepped, the propagation to the compute copies) leaves some of it
    updated and the rest not: the engine refuses to train until a checkpoint is loaded,
    rather than go on from a state no run ever had. With a disk tier the ranks agree on
    that (``_agree_after_update``): one rank cut short leaves every rank refusing."""
    progress = parts.progress
    inner = [part.inner for part in parts.optimizer.parts]
    # The last pre-hook: once it ran, every other one passed and the update began (a post
    # hook could run after another that raised, past an update already made).
    def began(*_: Any) -> None:
        progress.to("update")

    hooks = [opt.register_step_pre_hook(began) for opt in inner]
    error: BaseException | None = None
    reload: list[int] = []
    try:
        parts.optimizer.step()
    except BaseException as e:  # noqa: BLE001 - decided below, with the peers
        error = e
    finally:
        for hook in hooks:
            hook.remove()
    try:
        if error is None and parts.tier is not None and parts.tier.failed is not None:
            error = parts.tier.failed
        began = progress.phase is StepPhase.UPDATING
        reload = _agree_after_update(parts, error, began)
        if error is not None:
            raise error
        if reload:
            raise PeerCutShort(
                f"rank(s) {reload} raised in the optimizer step at global step "
                f"{parts.global_step} (their error says what) after this rank's update: the "
                "ranks' shards are no longer one step's")
        parts.global_step += 1
        progress.to("updated")  # from here on the masters are the new step's
        _forget_grads(parts)
        refresh_compute_copies(parts)
        progress.to("done")
    except BaseException as e:
        _report(parts, "the optimizer step", e)
        updated = progress.phase in (StepPhase.UPDATING, StepPhase.UPDATED)
        if not (updated or reload) and (parts.tier is None or parts.tier.failed is None):
            progress.to("fail")
            raise  # nothing was updated
        error = _refuse_until_reload(parts, e)
        if error is e:
            raise
        raise error from e


class PeerCutShort(RuntimeError):
    """Another rank's optimizer step was cut short (this rank's went through)."""


def _agree_before_update(parts: EngineParts) -> None:
    """Disk tier: a write-back of this pass failed on some rank (nothing is updated yet):
    every rank raises, each can ``zero_grad()`` and go on. Alone, the rank would raise and
    its peers go on into the step's collectives, and wait there for it."""
    if parts.tier is None:  # every rank has one or none (agreed when the engine was built)
        return
    failed = parts.tier.failed
    ranks = [r for r, v in enumerate(parts.comm.agree(int(failed is not None))) if v]
    if failed is not None:
        raise failed
    if ranks:
        raise PeerCutShort(
            f"rank(s) {ranks} could not write back this pass's values to the disk tier "
            "(their error names the directory and the bytes): nothing was updated on any "
            "rank; engine.zero_grad() and go on")


def _agree_after_update(parts: EngineParts, error: BaseException | None,
                        began: bool) -> list[int]:
    """Disk tier: whether the ranks' states are still one step's. Each says 0 (stepped),
    1 (raised before updating anything) or 2 (cut short after an update, or a write-back
    of the step failed). All 0: go on; all 1: each raises its own error, recoverable; any
    other mix leaves some shards stepped and others not: every rank must refuse until a
    reload (alone, the ranks that stepped would go on into collectives the others never
    issue, or train on a state no run had). The ranks that raised, where all must refuse."""
    if parts.tier is None:  # every rank has one or none (agreed when the engine was built)
        return []
    cut = error is not None and (began or parts.tier.failed is not None)
    said = parts.comm.agree(0 if error is None else 2 if cut else 1)
    if set(said) in ({0}, {1}):
        return []
    return [r for r, v in enumerate(said) if v]


def _report(parts: EngineParts, phase: str, error: BaseException) -> None:
    """Peers still in this pass wait for collectives this rank will not issue now: their
    timeout names this rank and its error (``Communicator.report_failure``)."""
    parts.comm.report_failure(
        f"{type(error).__name__} in {phase} at step {parts.global_step}: {error}")


def _refuse_until_reload(parts: EngineParts, error: BaseException) -> BaseException:
    """Mark the engine as needing a reload; the error to raise, saying so."""
    parts.progress.cut_short(f"{type(error).__name__} during the optimizer step after global "
                             f"step {parts.global_step} left it cut short")
    if parts.tier is not None:
        parts.tier.recover()
    hint = ("The optimizer step was cut short (some units updated, others not): the engine "
            "refuses to train until the last checkpoint is reloaded "
            "(engine.load_checkpoint(directory))")
    if isinstance(error, OSError) and error.errno is not None:
        return type(error)(error.errno, f"{error.strerror}. {hint}", error.filename)
    if hasattr(error, "add_note"):  # Python 3.11+: the type stays, for the caller's handlers
        error.add_note(hint)
        return error
    return RuntimeError(f"{type(error).__name__}: {error}. {hint}")


def _report_nonfinite(parts: EngineParts) -> None:
    scale = f" (fp16 loss scale now {parts.scaler.scale:g})" if parts.scaler else ""
    message = (f"non-finite gradients at global step {parts.global_step} on at least one "
               f"rank: step skipped on every rank{scale}; {parts.skipped_steps} skipped so far")
    if parts.config.nonfinite_grads == "error":
        raise FloatingPointError(
            message.replace("step skipped", "nothing was updated")
            + " (ZeroConfig(nonfinite_grads='skip') skips such steps instead)")
    # 4: the warning points at the user's engine.step(), two frames above this module
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def refresh_compute_copies(parts: EngineParts) -> None:
    with record_function("zero::update_params"):
        for unit in reversed(parts.units):
            unit.param_store.after_step(parts.shards)
        if not parts.plan.overlap_param_gather:
            parts.runtime.settle()


def zero_grad(parts: EngineParts) -> None:
    # Refused, before anything changes, from a hook inside a pass running now (its backward
    # would go on over freed parameters) or inside the optimizer's update.
    parts.runtime.expect("reset")
    parts.progress.expect("forget")
    if parts.progress.reported:  # the failed pass is over here: its report goes
        parts.comm.clear_failure()
    if parts.tier is not None and parts.tier.failed is not None:
        parts.tier.recover()  # a failed write-back's memory is kept and written again later
    _forget_grads(parts)
    parts.progress.to("forget")


def _forget_grads(parts: EngineParts) -> None:
    parts.runtime.reset()
    for unit in parts.units:
        unit.zero_grad()
        for p in unit.params:
            p.grad = None


def _refuse_stray_grads(parts: EngineParts) -> None:
    """A managed parameter with a ``.grad`` got it outside the engine's hooks (unfrozen
    after the forward): stepping without it would silently ignore it."""
    stray = [parts.param_names[id(p)] for u in parts.units for p in u.params
             if p.grad is not None]
    if stray:
        raise RuntimeError(
            f"parameters {stray[:5]} hold a .grad that did not go through the engine's "
            "reduction (given by hand, or produced by a backward not run through "
            "engine.backward() after they were unfrozen); stepping would ignore it. Run "
            "backward through engine.backward(), and set .grad to None before step()")


# ------------------------------------------------------------------ trainability
def _follow_trainability(parts: EngineParts) -> None:
    """Before a forward: take over parameters the user added to the optimizer
    (``add_param_group``). Gradient hooks for unfrozen parameters are added in
    ``backward()``, the one place every gradient passes."""
    current = signature(parts.user_optimizer)
    if current != parts._optimizer_signature:
        _adopt_new_parameters(parts)
        parts._optimizer_signature = current


def _adopt_new_parameters(parts: EngineParts) -> None:
    managed, group_of = managed_parameters(parts.module, parts.user_optimizer, strict=False,
                                           frozen_too=parts.plan.shards_params)
    new = [(n, p) for n, p in managed if id(p) not in parts.param_names]
    moved = _moved_from_frozen(parts, group_of)
    joining = new + [(n, p) for _, named in moved for n, p in named]
    parts.optimizer.check_adoptable({n: group_of[id(p)] for n, p in joining})
    if not joining:
        return
    if parts.progress.grads_pending or any(u.used.count(True) for u in parts.units):
        raise RuntimeError(
            f"parameters {[n for n, _ in joining][:5]} were added to the optimizer in the "
            "middle of a step (gradients are pending): add param groups between "
            "engine.step() and the next forward")
    stale = [n for n, p in joining if p.grad is not None]
    if stale:
        raise RuntimeError(f"parameters {stale[:5]} added to the optimizer already hold a "
                           ".grad from before; set it to None first (optimizer.zero_grad())")
    parts.runtime.settle()
    parts.runtime.reshard_all()
    for unit, named in moved:  # sharded already: they join the optimizer where they are
        unit.relabel({n: group_of[id(p)] for n, p in named})
        parts.optimizer.add_units([unit], only={n for n, _ in named})
    if new:
        _take_over(parts, new, group_of)


def _moved_from_frozen(parts: EngineParts, group_of: dict[int, int]
                       ) -> list[tuple[Unit, NamedParams]]:
    """Frozen parameters the engine shards in no group (stage 3) that the user has since
    added to a param group, by unit."""
    out = []
    for unit in parts.units:
        named = [(slot.name, p) for slot, p in zip(unit.layout.slots, unit.params)
                 if slot.group == FROZEN_GROUP and group_of.get(id(p), FROZEN_GROUP)
                 != FROZEN_GROUP]
        if named:
            out.append((unit, named))
    return out


def _take_over(parts: EngineParts, new: NamedParams, group_of: dict[int, int]) -> None:
    units = build_units(parts.module, new, group_of, parts.plan, parts.unit_comms(),
                        parts.placement, first_index=len(parts.units), scaler=parts.scaler)
    parts.units.extend(units)
    for name, p in new:
        parts.param_names[id(p)] = name
        parts.original_dtypes[id(p)] = p.dtype
    parts.num_params += sum(p.numel() for _, p in new)
    parts.optimizer.add_units(units)
    parts.hooks.install(units, parts.runtime)
    parts.access.add_units(units)
    parts._buffers = [b for b in parts.module.buffers() if b is not None]
