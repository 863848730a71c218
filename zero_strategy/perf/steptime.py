"""How long a step takes across a link, from the bytes it sends (``traffic.py``), the link's
rate, and what the step computes.

A step is the forward and backward (``compute_s``, every rank computing at once), the
collectives (``link_s``: the bytes leaving the busiest node over the link's rate, each way),
the int8 codec's passes over the data where quantized (``codec_s``), and the optimizer step
on the rank's share of the model (``optimizer_s``). Communication launched while compute
runs can hide behind it; how much does is the schedule's (``OVERLAP``). The codec runs on
the cores a chunk at a time while other chunks are on the wire, so it hides in the wire time
that compute leaves idle, ``max(0, link - compute)``::

    step = optimizer + compute + link + codec - overlap * min(compute, link)
           - min(codec, max(0, link - compute))
    floor = optimizer + max(compute, link)

``floor`` is the overlapped floor: every byte on the wire while the cores compute, and
the optimizer step, between the last reduction and the next gather, hiding nothing.

Left out: the link's latency (each collective is taken at the link's rate; a schedule of
many small blocking round trips pays more, as ``check_gather_order="blocking"`` does), traffic
inside a node (taken as free: shared memory, NVLink), compute slowed by the communication's
own CPU work, and the step's small collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .traffic import (
    INT8_BYTES,
    Collective,
    Layout,
    ModelUnits,
    Options,
    node_bytes,
    step_collectives,
)

OVERLAP = {
    "stage0": 0.2,
    "stages12": 0.15,
    "stage3": 0.2,
    "stage3_blocking": 0.0,
}
"""The share of min(compute, link) a schedule hides, as the engine runs today: the middle of
the fits on the cluster bench's cells (docs/performance/cluster-2026-11-29.md, the throughput
regime of bench/compare.py, steps timed back to back; per cell, stages 1-2 -0.56 to 0.26,
stage 3 -0.18 to 0.37). The fits scatter, and go below 0 where compute is the longer part:
on the bench's 2 shared cores the communication's own CPU work slows compute, which the
model leaves out, and single runs vary by 10-30%. stage 0: the gradients' all-reduce
launched as buckets fill in backward (DDP's schedule; not refitted); stages 1-2:
reduce-scatters launched in backward, and the parameters' all-gather after the step waited
for bucket by bucket in the next forward; stage 3: the prefetch of the next units,
reductions launched as units complete, the gather-order check's headers beside the gathers
(no round trip of their own); ``check_gather_order="blocking"``: none, each gather waits
for a round trip behind the previous gather's bytes."""


@dataclass(frozen=True)
class Rates:
    """What the prediction is made from: measured (``bench/cluster_bench.py`` does) or given."""

    link_bytes_per_s: float
    """Each way, between a node and the others (1 Gbit/s Ethernet: about 117e6 of payload)."""
    compute_s: float
    """Forward and backward of one micro-batch on one rank, every rank computing at once."""
    optimizer_s: float = 0.0
    """The optimizer step over the whole model on one rank (scaled to the rank's share)."""
    codec_s: float = 0.0
    """One int8 encode, or one decode, over as many elements as the model has."""

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0:
            raise ValueError(f"link_bytes_per_s must be > 0, got {self.link_bytes_per_s}")
        for name in ("compute_s", "optimizer_s", "codec_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class StepPrediction:
    link_bytes: float
    """Bytes leaving the busiest node per step (the same arrive)."""
    link_s: float
    compute_s: float
    codec_s: float
    optimizer_s: float
    hidden_s: float
    step_s: float
    floor_s: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def schedule(options: Options, check_gather_order: bool | str = True) -> str:
    """The ``OVERLAP`` key of a configuration (``check_gather_order`` as ``ZeroConfig``
    takes it)."""
    if options.stage == 0:
        return "stage0"
    if options.stage in (1, 2):
        return "stages12"
    return "stage3_blocking" if check_gather_order == "blocking" else "stage3"


def codec_passes(collectives: Sequence[Collective], layout: Layout, numel: int) -> float:
    """Passes of the int8 codec (an encode or a decode, each over the whole model's
    elements: ``Rates.codec_s``) one rank makes per step: a gather encodes this rank's
    shard and decodes the whole buffer, every rank's piece included (all compute with the
    same values); a reduce-scatter encodes the pieces it sends and decodes those received."""
    total = 0.0
    for c in collectives:
        if c.element_bytes != INT8_BYTES or not numel:
            continue
        g = layout.size(c.group)
        per_element = (1 / g + 1) if c.kind == "all_gather" else 2 * (g - 1) / g
        total += per_element * c.numel
    return total / numel if numel else 0.0


def predict(units: ModelUnits, options: Options, layout: Layout, rates: Rates,
            check_gather_order: bool | str = True,
            overlap: float | None = None) -> StepPrediction:
    """One step of the engine on ``units`` under ``options`` across ``layout``'s links."""
    if overlap is None:
        overlap = OVERLAP[schedule(options, check_gather_order)]
    share = layout.shards if options.stage >= 1 else 1
    return time_step(step_collectives(units, options, layout), layout, rates, units.numel,
                     share, overlap)


def time_step(collectives: Sequence[Collective], layout: Layout, rates: Rates, numel: int,
              share: int, overlap: float) -> StepPrediction:
    """One step of any schedule of ``collectives`` over a model of ``numel`` elements whose
    optimizer steps a 1/``share`` of it, hiding ``overlap`` of min(compute, link)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be within [0, 1], got {overlap}")
    nbytes = node_bytes(collectives, layout)
    link = nbytes / rates.link_bytes_per_s
    codec = rates.codec_s * codec_passes(collectives, layout, numel)
    optimizer = rates.optimizer_s / share
    # Where the link is the longer, the cores wait on the wire for link - compute: the
    # codec's passes fill that wait (chunks coded while others are sent). Without this term
    # the memory regime's int8 step (link-bound, 2 x 1 at 1 Gbit/s) was predicted 1.39x its
    # measurement; compute-bound steps are unchanged by it.
    hidden = overlap * min(rates.compute_s, link) + min(codec, max(0.0, link - rates.compute_s))
    step = optimizer + rates.compute_s + link + codec - hidden
    floor = optimizer + max(rates.compute_s, link)
    return StepPrediction(nbytes, link, rates.compute_s, codec, optimizer, hidden, step, floor)
