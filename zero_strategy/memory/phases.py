"""How far each phase of a training job may raise one rank's memory: the ZeRO formula per
phase (``engine.phase_bounds()``; ``tests/integration/test_phase_memory.py`` holds every
entry point and freezing pattern to it).

A phase's bound is on its growth: the peak resident memory while it runs, above what the
rank held when it began. Each term is read off what the engine allocates (the units' layouts,
the precision's dtypes, the optimizer's states per parameter), not fitted to a measurement:

- **load** (building the engine on a model, ``from_pretrained`` streamed into the shards):
  what rests per rank afterwards (each unit's parameter shard, a separate master shard, the
  full gradient buffers of stages 0-1, the unmanaged tensors whole: buffers and frozen
  parameters no optimizer holds) plus the loader's window: one unit built at a time (its
  parameters materialised, their flat copy, and the pool block its gathers keep: three times
  the largest unit), one source tensor read in place (the largest parameter, fp32) and the
  index scratch of a converted range (``LOADER_SCRATCH``, docs/pretrained.md). A model loaded
  whole first (``Model.from_pretrained``, a PEFT model) holds itself instead of the streamed
  window, beside the flat copy and pool block of the unit being built.
- **forward**: the gathered units in flight (the unit running, every unit of a module
  around it: the root unit, held from its forward to the end of backward, among them; and
  the ``prefetch_units`` prefetched), plus the activations.
- **backward**: the same, plus the gradient buffers: an inner unit's full-size local
  gradient for each reduction in flight (``MAX_INFLIGHT_REDUCTIONS``) and the one
  accumulating, a reduced slice of a second pass, the receive scratch of each reduction in
  flight (host tensors under gloo: N - 2 slices,
  ``Communicator.reduce_scatter_scratch_slices``; none on two ranks, which is why a 3-rank
  MoE backward once measured 57 MiB over a bound without it), the full-size gradient of
  every trainable unit whose module encloses other units (its parameters' gradients arrive
  throughout the backward of what it encloses, so it is reduced only at its end: Qwen3-MoE's
  ``model`` unit, every layer's attention and router), the gradient autograd makes of one
  parameter before the hook adds it into the unit's buffer (the largest trainable
  parameter), and the reduced shards, born here: those of every unit holding a trainable
  parameter (a unit's shard covers its frozen parameters too), in the master's dtype as well
  where that differs from the reduction's. A routed block (``core/routed.py``) is reduced
  once its module's backward ends, whatever experts idle on the rank did not send
  (``Runtime._post_backward``); the first trainable one can have an input that needs no
  gradient (nothing before it trains), and with an expert idle it is reduced only at the end
  of backward: its full-size gradient, held beside the window (``routed_held``).
- **step**: the optimizer's states for the trainable elements of this rank's shard (and the
  ``step`` count per piece), created at the first step, and the update's scratch (torch's
  multi-tensor update computes its denominator into one new list over them; the per-tensor
  one two temporaries of a piece).
- **save** (streamed, ``checkpoint/save_hub.py``): twice the bucket, or the largest tensor.

Activations come from the caller: ``zero_strategy.estimate_activations`` for the shipped
families (its ``peak_bytes``: saved for backward plus backward's largest transient), a
measurement otherwise. ``SLACK_BYTES`` is added to every phase (see there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..checkpoint.export import DEFAULT_BUCKET_BYTES
from ..core.grads import adopts_autograd_gradient
from ..core.routed import routed_blocks
from ..core.runtime import MAX_INFLIGHT_REDUCTIONS

if TYPE_CHECKING:
    from ..core.flat import Piece
    from ..core.units import Unit
    from ..engine_view import EngineView

PHASES = ("load", "forward", "backward", "step", "save")
LOADER_SCRATCH = 12 << 20
"""The streamed loader's index scratch: 2^17 target elements at a time (docs/pretrained.md)."""
SOURCE_BYTES = 4
"""Bytes per element of a source tensor as a folder stores it (fp32 at most, for the
floating weights of the families loaded)."""
STEP_BYTES = 4
"""The ``step`` count torch's Adam family (and others) keep per parameter, a float32 scalar:
one per piece of a shard the inner optimizer steps."""
SLACK_BYTES = 24 << 20
"""What no term counts, per phase: memory the process itself takes while a phase runs and
keeps in its heap. Python objects of a step (autograd's nodes and saved-variable records,
the hooks' closures, a Trainer's logs: thousands of objects of a few hundred bytes, under 2
MiB); allocations under glibc's mmap threshold (64 KiB as the measurements run,
``MALLOC_MMAP_THRESHOLD_``) come from its heap arenas, one per thread that allocates (the
main thread, autograd's and gloo's), each of which keeps what it freed, up to the largest
small-tensor working set of a phase (the biases, LayerNorm weights and persistent
parameters of a unit, their gradients, the loss's per-token scalars: a few MiB each); the
interpreter's own (imports a phase triggers: transformers' lazy modules, a Trainer's first
save); and the resident-size granularity of each mapping (a page, and the 2 MiB pages
the kernel may hand a large anonymous mapping). None of these grows with the model: 24 MiB
is a tenth of the smallest model the bounds are checked on
(tests/integration/test_phase_memory.py, 241 MiB), so no whole copy of anything that does
can hide in it."""


@dataclass(frozen=True)
class PhaseBounds:
    """Per phase, the bound on a rank's memory growth (bytes, ``SLACK_BYTES`` included), and
    the terms it adds up."""

    load: int
    forward: int
    backward: int
    step: int
    save: int
    terms: dict[str, int] = field(default_factory=dict)

    def of(self, phase: str) -> int:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return int(getattr(self, phase))

    def as_dict(self) -> dict[str, int]:
        return {**{p: self.of(p) for p in PHASES}, **{f"term_{k}": v for k, v in
                                                      self.terms.items()}}


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _trainable_pieces(unit: Unit, rank: int) -> list[Piece]:
    """The pieces of this rank's optimizer shard that belong to trainable parameters."""
    trains = {slot.name for slot, p in zip(unit.layout.slots, unit.params) if p.requires_grad}
    return [piece for piece in unit.layout.pieces(rank) if piece.slot.name in trains]


def _trainable_here(unit: Unit, rank: int) -> int:
    """Elements of this rank's optimizer shard that belong to trainable parameters."""
    return sum(piece.numel for piece in _trainable_pieces(unit, rank))


def phase_bounds(engine: EngineView, *, activation_bytes: int, loaded_whole: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PhaseBounds:
    """Each phase's bound for ``engine`` as it is now (its units, which parameters train,
    its precision); ``activation_bytes``: the activations' peak for the batch trained on;
    ``loaded_whole``: the model was loaded whole before the engine sharded it."""
    if not isinstance(activation_bytes, int) or activation_bytes < 0:
        raise ValueError(f"activation_bytes must be an int >= 0, got {activation_bytes!r}")
    policy = engine.plan.policy
    p, g, m = _size(policy.compute_dtype), _size(policy.reduce_dtype), _size(policy.master_dtype)
    units = engine.units
    rank = engine.shards.rank if engine.plan.optimizer_shards > 1 else 0
    terms = _resting(engine, p, m)
    largest_param = max((s.numel for u in units for s in u.layout.slots), default=0)
    largest_unit = max((u.layout.padded_numel for u in units), default=0)
    if loaded_whole:  # the model itself, and a unit's flat copy and pool block beside it
        terms["whole_model"] = sum(s.numel for u in units for s in u.layout.slots) * SOURCE_BYTES
        terms["loader_window"] = 2 * largest_unit * max(p, m)
    else:
        terms["loader_window"] = (3 * largest_unit * max(p, m) + largest_param * SOURCE_BYTES
                                  + LOADER_SCRATCH)
    terms["gathered"] = _gathered(engine, p)
    terms["activations"] = activation_bytes
    terms.update(_gradient_terms(engine, g, m))
    here = [_trainable_here(u, rank) for u in units]
    states = engine.optimizer.states_per_param()
    pieces = sum(len(_trainable_pieces(u, rank)) for u in units)
    terms["optimizer_states"] = sum(here) * states * m + pieces * STEP_BYTES
    largest_piece = max((piece.numel for u in units for piece in u.layout.pieces(rank)),
                        default=0)
    terms["step_scratch"] = (sum(here) + largest_piece) * m if sum(here) else 0
    largest_tensor = largest_param * m
    terms["save_buckets"] = 2 * max(bucket_bytes, largest_tensor)
    t = terms
    load = (t["params_at_rest"] + t["masters_at_rest"] + t["full_gradients"] + t["unmanaged"]
            + t["loader_window"] + t.get("whole_model", 0))
    forward = t["gathered"] + t["activations"]
    backward = (forward + t["gradient_buffers"] + t["reduce_scratch"]
                + t["enclosing_gradients"] + t["autograd_gradient"] + t["routed_held"]
                + t["gradient_shards"])
    step = t["optimizer_states"] + t["step_scratch"]
    return PhaseBounds(load=load + SLACK_BYTES, forward=forward + SLACK_BYTES,
                       backward=backward + SLACK_BYTES, step=step + SLACK_BYTES,
                       save=t["save_buckets"] + SLACK_BYTES, terms=dict(terms))


def _gradient_terms(engine: EngineView, g: int, m: int) -> dict[str, int]:
    """What backward allocates for gradients beyond the forward's terms (module docstring)."""
    units = engine.units
    trainable = [u for u in units if any(q.requires_grad for q in u.params)]
    # A unit enclosing others holds its gradient through their backward, outside the
    # window of inner units reduced one after another.
    enclosing = [u for u in trainable if any(_encloses(u, v) for v in units if v is not u)]
    widest = max((u.layout.padded_numel for u in trainable if u not in enclosing), default=0)
    slice_ = max((u.layout.shard_numel for u in trainable), default=0)
    in_flight = MAX_INFLIGHT_REDUCTIONS + 1
    # A unit of one unpadded parameter adopts autograd's gradient as its buffer
    # (``ShardedGrads.accumulate``); any other adds it in, both alive for that moment.
    adds_in = [u for u in trainable if not adopts_autograd_gradient(u.layout)]
    routed = routed_blocks(engine.module)
    sharded_grads = engine.plan.stage >= 2
    shards = sum(u.layout.shard_numel for u in trainable) if sharded_grads else 0
    return {
        "gradient_buffers": (in_flight * widest + slice_) * g,
        "reduce_scratch": in_flight * engine.shards.reduce_scatter_scratch_slices * slice_ * g,
        "enclosing_gradients": sum(u.layout.padded_numel for u in enclosing) * g,
        "autograd_gradient": max((s.numel for u in adds_in
                                  for s, q in zip(u.layout.slots, u.params)
                                  if q.requires_grad), default=0) * g,
        "routed_held": max((u.layout.padded_numel for u in trainable
                            if u.module is not None and id(u.module) in routed),
                           default=0) * g,
        "gradient_shards": shards * (g + (m if m != g else 0)),
    }


def _resting(engine: EngineView, p: int, m: int) -> dict[str, int]:
    """What a rank holds once the engine is built, by kind."""
    params = masters = full_grads = 0
    for u in engine.units:
        kept = u.layout.shard_numel if u.param_store.gathers else u.layout.padded_numel
        params += kept * p
        # A master apart from the compute copy (mixed precision, an offloaded optimizer on a
        # GPU), as the placement chose it for every unit
        if u.param_store.held_tensors()["master"]:
            optimizer_numel = (u.layout.shard_numel if engine.plan.optimizer_shards > 1
                               else u.layout.padded_numel)
            masters += optimizer_numel * m
        if engine.plan.stage < 2:  # full-size buffers from the start
            full_grads += u.layout.padded_numel * _size(engine.plan.policy.reduce_dtype)
    unmanaged = sum(t.numel() * t.element_size() for t in engine.unmanaged_state().values())
    return {"params_at_rest": params, "masters_at_rest": masters, "full_gradients": full_grads,
            "unmanaged": unmanaged}


def _gathered(engine: EngineView, p: int) -> int:
    """Gathered compute copies alive at once: a unit stays whole while its module runs, so
    while any unit runs, every unit of a module around it is whole too (the root unit, held
    from its forward to the end of backward, and any unit of an enclosing module: GPT-2's
    ``transformer`` unit, made of what its blocks leave below ``unit_numel``); plus, with
    prefetch, the ``prefetch_units`` units ahead, or at the end of forward the forward's last
    ones kept whole for backward (bounded by the largest as many)."""
    gathering = [u for u in engine.units if u.param_store.gathers]
    if not gathering:
        return 0

    chains = [sum(v.layout.padded_numel for v in gathering if v is u or _encloses(v, u))
              for u in gathering]
    ahead = engine.plan.units_ahead
    # The root unit is whole from its forward to the end of backward: never one ahead.
    prefetched = sum(sorted((u.layout.padded_numel for u in gathering if u.name),
                            reverse=True)[:ahead])
    return (max(chains) + prefetched) * p


def _encloses(outer: Unit, inner: Unit) -> bool:
    """``outer``'s module contains ``inner``'s (the root unit's contains every other)."""
    return outer.name == "" or inner.name.startswith(outer.name + ".")
